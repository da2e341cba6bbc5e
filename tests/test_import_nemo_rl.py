"""``trajectory-replay import nemo-rl``: NeMo-RL's ``train_data_step<N>.jsonl`` → a verified rollout-level bundle.

The fixture is written from the writer's field list, read at NVIDIA-NeMo/RL @ 7ea279abfbeb:
``nemo_rl/algorithms/grpo.py:3632-3653`` (``content``, ``rewards``, ``input_lengths``, ``token_ids``,
``token_loss_mask``, ``sample_loss_mask``, ``advantages``, ``generation_logprobs``, ``prev_logprobs``) and
``nemo_rl/utils/logger.py:1071-1096`` (one JSON object per sample: every value a batch of one, plus ``idx``).
Token arrays are padded rows over prompt + response (``batched_message_log_to_flat_message``).

NeMo-RL's GRPO advantage is written here from ``nemo_rl/algorithms/utils.py:104-198``
(``calculate_baseline_and_std_per_prompt``: per prompt, the leave-one-out mean of the other rewards and the
Bessel-corrected std of the other rewards; a prompt with ≤ 1 valid sample gets baseline = reward) and
``nemo_rl/algorithms/advantage_estimator.py:82-98`` (``(r − b) / (std + 1e-6)`` only where ``std > 0``, expanded
over the whole row), in float32.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replay_lib.bundle import BundleReader
from replay_lib.cli import main

PROMPTS = {0: [11, 12, 13], 1: [21, 22, 23, 24, 25], 2: [11, 12, 14]}  # g-0 and g-2 share a prefix, not a prompt
PAD = 0
ROW = 12


def nemo_grpo_advantages(prompt_of: list[int], rewards: list[float], leave_one_out: bool = True) -> list[float]:
    """utils.py:104-198 with valid_mask all ones, then adv.py:88-96."""
    r = torch.tensor(rewards, dtype=torch.float32)
    adv = torch.zeros_like(r)
    for p in sorted(set(prompt_of)):
        idx = torch.tensor([i for i, q in enumerate(prompt_of) if q == p])
        k = len(idx)
        if k <= 1:
            continue  # baseline = reward: advantage 0
        others = 1 - torch.eye(k) if leave_one_out else torch.ones(k, k)
        num_valid = k - int(leave_one_out)
        baseline = others @ r[idx] / num_valid
        square = others @ r[idx].pow(2) / num_valid
        std = ((square - baseline.square()) * (num_valid / (num_valid - 1))).sqrt().nan_to_num(0)
        a = r[idx] - baseline
        a = torch.where(std > 0, a / (std + 1e-6), a)
        adv[idx] = a
    return adv.tolist()


def write_jsonl(path: Path, prompt_of: list[int], rewards: list[float], responses: list[int],
                sample_mask: list[float] | None = None, leave_one_out: bool = True) -> list[float]:
    """One line per sample, as grpo.py:3632-3653 + logger.py:1089-1096 write them; returns the advantages."""
    adv = nemo_grpo_advantages(prompt_of, rewards, leave_one_out)
    gen = torch.Generator().manual_seed(4243)
    lines = []
    for i, (p, R) in enumerate(zip(prompt_of, responses)):
        prompt = PROMPTS[p]
        L = len(prompt) + R
        tokens = prompt + [100 + i + t for t in range(R)] + [PAD] * (ROW - L)
        mask = [0] * len(prompt) + [1] * R + [0] * (ROW - L)
        gen_lp = (-torch.rand(ROW, generator=gen)).tolist()
        prev_lp = [x - 0.01 for x in gen_lp]
        lines.append(json.dumps({
            "content": [[{"role": "user", "content": f"q{p}"}, {"role": "assistant", "content": "a"}]],
            "rewards": [rewards[i]], "input_lengths": [L], "token_ids": [tokens], "token_loss_mask": [mask],
            "sample_loss_mask": [1.0 if sample_mask is None else sample_mask[i]], "advantages": [[adv[i]] * ROW],
            "generation_logprobs": [gen_lp], "prev_logprobs": [prev_lp], "idx": i,
        }))
    path.write_text("\n".join(lines) + "\n")
    return adv


PROMPT_OF = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
RESPONSES = [3, 4, 2, 5, 1, 2, 3, 4, 2, 2, 3, 1]


def test_leave_one_out_reference_by_hand():
    """The fixture's reference, checked by hand. g-0 = [1, 0, 0, 1]: for s-0 the others are [0, 0, 1], baseline
    1/3, their squares' mean 1/3, variance (1/3 − 1/9)·3/2 = 1/3, std 0.5773503, so (1 − 1/3)/(0.5773503 + 1e-6)
    = 1.1546985; s-1 (r = 0): others [0, 1, 1], baseline 2/3, the same std: −1.1546985. g-1 = four 1s: std 0,
    left centred: 0. g-2 = [0, 0, 0, 1]: s-8's others [0, 0, 1]: (0 − 1/3)/(0.5773503 + 1e-6) = −0.5773493; s-11's
    others [0, 0, 0] have std 0: 1 − 0 = 1 undivided."""
    adv = nemo_grpo_advantages(PROMPT_OF, REWARDS)
    assert adv[:2] == pytest.approx([1.1546985, -1.1546985], abs=1e-6)
    assert adv[4:8] == [0.0] * 4
    assert adv[8] == pytest.approx(-0.5773493, abs=1e-6) and adv[11] == 1.0


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay_lib", *args], capture_output=True, text=True, timeout=120)


def test_import_groups_by_prompt_tokens_and_replays_the_leave_one_out_step(tmp_path, capsys):
    """The import in a real process, then validate and replay. Groups come from prompt-token equality (g-0 and g-2 share the
    prefix [11, 12] but differ at the third token); the response is everything from the first loss-bearing
    token to input_lengths; the stages without inputs are inspect-only with the reason."""
    data = tmp_path / "train_data_step3.jsonl"
    adv = write_jsonl(data, PROMPT_OF, REWARDS, RESPONSES, sample_mask=[1.0] * 11 + [0.0])
    out = tmp_path / "nemo-3"
    proc = cli("import", "nemo-rl", str(data), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out} (bundle nemo-3: 12 sample(s) in 3 group(s), 32 token(s))" in proc.stdout
    assert ("advantage.kl         inspect-only — not in NeMo-RL's train_data jsonl: no reference_policy_logprobs "
            "(nemo_rl/algorithms/grpo.py:3632-3653); its KL term is in the loss") in proc.stdout
    assert "note: n_samples_per_prompt=4: the most common group size in train_data_step3.jsonl" in proc.stdout
    index = json.loads((out / "index.json").read_text())
    assert [s["group_index"] for s in index["samples"]] == PROMPT_OF
    assert [s["response_length"] for s in index["samples"]] == RESPONSES
    assert BundleReader(out).sample_mask(11) == [0]  # sample_loss_mask 0 masks its tokens (packed: format 1.3.0)
    assert index["samples"][0]["total_length"] == 3 + 3 and index["identity"]["rollout_id"] == 3
    assert [s["reward"] for s in index["samples"]] == pytest.approx(adv, abs=0)
    cfg = index["config"]
    assert (cfg["group_baseline"], cfg["std_zero"], cfg["singleton_group"], cfg["kl_loss_coef"]) == (
        "leave_one_out", "skip", "zero", 0.01)
    advantages = BundleReader(out).payload("advantages")  # format 1.3.0: a safetensors payload
    assert advantages.shape == (32,) and advantages[:3].tolist() == [pytest.approx(adv[0], abs=0)] * 3
    assert main(["validate", str(out)]) == 0
    capsys.readouterr()
    assert main(["replay", str(out), "--format", "json"]) == 0
    statuses = {s["stage"]: s["status"] for s in json.loads(capsys.readouterr().out)["stages"]}
    assert statuses == {"sample": "pass", "reward.raw": "pass", "reward.post_process": "pass",
                        "advantage.kl": "skipped", "advantage.estimate": "pass", "logprob.mismatch": "pass",
                        "loss.policy": "skipped",
                        "loss.value": "skipped"}


def test_a_run_without_the_leave_one_out_baseline_diverges_at_reward_post_process(tmp_path, capsys):
    """A run with grpo.use_leave_one_out_baseline=false (the mean and the group's Bessel std, utils.py:149-196)
    replayed under NeMo-RL's defaults (leave-one-out): the first divergence is reward.post_process, s-0 of
    g-0 = [1, 0, 0, 1] recorded as (1 − 1/2)/(√(1/3) + 1e-6) = 0.8660239 where leave-one-out gives 1.1546985.
    With --config saying so, the same dump replays clean."""
    data = tmp_path / "train_data_step1.jsonl"
    write_jsonl(data, PROMPT_OF, REWARDS, RESPONSES, leave_one_out=False)
    assert main(["import", "nemo-rl", str(data), "-o", str(tmp_path / "b"), "--n-samples-per-prompt", "4"]) == 0
    capsys.readouterr()
    assert main(["replay", str(tmp_path / "b"), "--format", "json"]) == 1
    first = json.loads(capsys.readouterr().out)["first_divergence"]
    assert (first["stage"], first["sample_id"], first["field"]) == ("reward.post_process", "s-0", "reward")
    assert first["expected"] == pytest.approx(0.8660239, abs=1e-6)
    assert first["actual"] == pytest.approx(1.1546985, abs=1e-6)
    (tmp_path / "cfg.json").write_text(json.dumps({"grpo": {"num_generations_per_prompt": 4,
                                                            "use_leave_one_out_baseline": False}}))
    assert main(["import", "nemo-rl", str(data), "-o", str(tmp_path / "c"),
                 "--config", str(tmp_path / "cfg.json")]) == 0
    assert main(["replay", str(tmp_path / "c")]) == 0


@pytest.mark.parametrize("edit, key, message", [
    (lambda r: r.pop("token_ids"), "line 2.token_ids", "missing"),
    (lambda r: r.update(prev_logprobs=[r["prev_logprobs"][0][:4]]), "line 2.prev_logprobs",
     "4 value(s), shorter than input_lengths=7"),
    (lambda r: r.update(token_loss_mask=[[0] * ROW]), "line 2.token_loss_mask",
     "no loss-bearing token: the prompt cannot be told from the response (groups come from prompt-token "
     "equality)"),
    (lambda r: r.update(rewards=[1.0, 2.0]), "line 2.rewards", "a list of 2 values, expected one"),
    (lambda r: r.update(advantages=[[0.0] * ROW, [0.0] * ROW]), "line 2.advantages", "a batch of 2 rows, expected one"),
    (lambda r: r.update(idx=0), "line 2.idx", "0 repeats line 1's"),
    (lambda r: r.update(input_lengths=[-2]), "line 2.input_lengths", "-2, expected at least 1"),
    (lambda r: r["prev_logprobs"][0].__setitem__(4, float("-inf")), "line 2.prev_logprobs[3:7]",
     "holds a NaN or an infinity"),
    (lambda r: r.update(token_ids=[[1.5] * ROW]), "line 2.token_ids",
     "expected a tensor or a list of integers, got list"),
    (lambda r: r.update(prev_logprobs=[[None] * ROW]), "line 2.prev_logprobs",
     "expected a tensor or a list of numbers, got list"),
])
def test_malformed_line_is_one_line_naming_it_and_writes_nothing(tmp_path, capsys, edit, key, message):
    data = tmp_path / "train_data_step1.jsonl"
    write_jsonl(data, PROMPT_OF, REWARDS, RESPONSES)
    lines = data.read_text().splitlines()
    rec = json.loads(lines[1])
    edit(rec)
    lines[1] = json.dumps(rec)
    data.write_text("\n".join(lines) + "\n")
    assert main(["import", "nemo-rl", str(data), "-o", str(tmp_path / "out")]) == 3
    assert capsys.readouterr().err.strip() == f"trajectory-replay: error: {data}: NeMo-RL train data {key}: {message}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [data.name]


def test_padding_beyond_the_response_may_hold_anything(tmp_path, capsys):
    """Only the response span [first loss token, input_lengths) is read: a −inf in the padding is not an error."""
    data = tmp_path / "train_data_step1.jsonl"
    write_jsonl(data, PROMPT_OF, REWARDS, RESPONSES)
    lines = data.read_text().splitlines()
    rec = json.loads(lines[0])
    rec["prev_logprobs"][0][-1] = float("-inf")  # ROW − 1 = 11 ≥ input_lengths 6
    lines[0] = json.dumps(rec)
    data.write_text("\n".join(lines) + "\n")
    assert main(["import", "nemo-rl", str(data), "-o", str(tmp_path / "out")]) == 0


def test_not_json_and_empty_files(tmp_path, capsys):
    data = tmp_path / "train_data_step1.jsonl"
    data.write_text('{"idx": 0,\n')
    assert main(["import", "nemo-rl", str(data), "-o", str(tmp_path / "out")]) == 3
    assert capsys.readouterr().err.strip() == (f"trajectory-replay: error: {data}: NeMo-RL train data line 1: not "
                                               "JSON (Expecting property name enclosed in double quotes at column 11)")
    data.write_text("\n\n")
    assert main(["import", "nemo-rl", str(data), "-o", str(tmp_path / "out")]) == 3
    assert capsys.readouterr().err.strip() == (f"trajectory-replay: error: {data}: NeMo-RL train data : no records "
                                               "(expected one JSON object per line)")
