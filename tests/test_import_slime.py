"""``trajectory-replay import slime``: slime's ``--save-debug-train-data`` dump (format_version 2) and its rollout
dump → a verified rollout-level bundle.

The fixtures are built from the field lists of slime's own writers, read at THUDM/slime @ 624b824a898a:
``slime/observability/train_data_utils.py:112-188`` (``_build_dump_payload``: ``format_version`` 2, ``rollout_id``,
``rank``, ``samples`` sorted by ``rollout_position``, ``dp_shards`` with ``partition`` and
``micro_batch_indices``, the whole-batch ``raw_reward``), ``slime/ray/rollout.py:657-700,785-815`` (the per-sample
columns: ``tokens``, ``response_lengths``, ``rewards``, ``truncated``, ``rollout_ids``, ``loss_masks``,
``rollout_mask_sums``, ``total_lengths``), ``slime/utils/data.py:318,326-327`` (``local_raw_reward``),
``slime/backends/megatron_utils/loss.py:743-767`` (``kl`` zeros at ``kl_coef == 0``, ``advantages`` = ``returns`` =
the normalized reward broadcast, ``slime/utils/ppo_utils.py:361-368``) and
``slime/observability/rollout_data_utils.py:140-153`` + ``slime/utils/types.py:93-232`` (the rollout dump:
``{"rollout_id", "samples": [Sample.to_dict()]}``).

slime's normalization is written here from ``slime/ray/rollout.py:612-631`` (``_post_process_rewards``): reshape by
``n_samples_per_prompt`` only when the batch holds exactly ``n · rollout_batch_size`` samples, else the whole
batch is one row (slime#2230); mean, then ``/ (torch.std + 1e-6)``, in float32.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replay_lib.bundle import BundleReader
from replay_lib.cli import main

RESPONSE = [3, 2, 4, 1, 2, 3, 3, 2, 1, 4, 2, 3, 2, 2, 3, 1]  # response lengths by rollout position
PROMPT = 4


def slime_post_process(raw: list[float], n: int, rollout_batch_size: int) -> list[float]:
    """slime/ray/rollout.py:612-631, GRPO with std normalization (the defaults)."""
    r = torch.tensor(raw, dtype=torch.float)
    r = r.reshape(-1, n) if r.shape[-1] == n * rollout_batch_size else r.view(-1, r.shape[-1])
    r = r - r.mean(dim=-1, keepdim=True)
    r = r / (r.std(dim=-1, keepdim=True) + 1e-6)
    return r.flatten().tolist()


def write_dumps(tmp: Path, raw: list[float], groups: list[int], *, n: int = 4, rollout_batch_size: int = 4,
                dp: int = 1, rollout_id: int = 7) -> tuple[Path, Path]:
    """A train dump and a rollout dump of one rollout, as slime's writers lay them out."""
    count = len(raw)
    rewards = slime_post_process(raw, n, rollout_batch_size)
    gen = torch.Generator().manual_seed(2230)
    rollout_samples, train = [], []
    for pos in range(count):
        R = RESPONSE[pos]
        tokens = torch.arange(PROMPT + R, dtype=torch.long) + 100 * groups[pos]
        rollout_lp = -torch.rand(R, generator=gen)
        rollout_samples.append({  # Sample.to_dict() (slime/utils/types.py:222-227)
            "group_index": groups[pos], "index": pos, "rollout_id": None, "prompt": f"prompt {groups[pos]}",
            "tokens": tokens.tolist(), "multimodal_inputs": None, "multimodal_train_inputs": None,
            "multimodal_train_input_id": None, "apply_chat_template_kwargs": {}, "response": "r" * R,
            "response_length": R, "label": "x", "reward": raw[pos], "loss_mask": None, "weight_versions": ["3"],
            "rollout_log_probs": rollout_lp.tolist(), "rollout_top_p_token_ids": None,
            "rollout_top_p_token_offsets": None, "rollout_routed_experts": None, "remove_sample": False,
            "teacher_log_probs": None, "status": "completed", "metadata": {}, "generate_function_path": None,
            "custom_rm_path": None, "train_metadata": None, "session_id": None, "non_generation_time": 0.0,
            "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                          "completion_token_num": 0},
            "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": 0},
        })
        mask = torch.ones(R, dtype=torch.int)
        if pos == 5:
            mask[0] = 0
        log_probs = rollout_lp + 0.01 * torch.rand(R, generator=gen)
        kl = torch.zeros(R, dtype=torch.float32)  # kl_coef == 0 (loss.py:743-746)
        adv = torch.ones_like(kl) * rewards[pos]  # ppo_utils.py:361-368
        train.append({
            "data_parallel_rank": pos % dp, "sample_index": pos, "rollout_position": pos, "tokens": tokens,
            "response_lengths": R, "rewards": rewards[pos], "truncated": 0, "rollout_ids": pos,
            "loss_masks": mask, "rollout_mask_sums": torch.tensor(float(mask.sum())), "total_lengths": PROMPT + R,
            "local_raw_reward": raw[pos], "rollout_log_probs": rollout_lp.to(torch.float32),
            "log_probs": log_probs.to(torch.float32), "ref_log_probs": (log_probs - 0.02).to(torch.float32),
            "kl": kl, "advantages": adv, "returns": adv.clone(),
        })
    shards = []
    for r in range(dp):
        part = [p for p in range(count) if p % dp == r]
        half = (len(part) + 1) // 2
        shards.append({"rank": r, "data_parallel_rank": r, "sample_indices": part, "partition": part,
                       "micro_batch_indices": [list(range(half)), list(range(half, len(part)))],
                       "num_microbatches": [2], "global_batch_sizes": [count]})
    train_path, rollout_path = tmp / f"train_{rollout_id}_0.pt", tmp / f"rollout_{rollout_id}.pt"
    torch.save({"format_version": 2, "rollout_id": rollout_id, "rank": 0, "samples": train, "dp_shards": shards,
                "raw_reward": list(raw)}, train_path)
    torch.save({"rollout_id": rollout_id, "samples": rollout_samples}, rollout_path)
    return train_path, rollout_path


# 12 samples in three full groups of 4, but rollout_batch_size 4: 12 != 16, so slime normalizes the whole batch.
RAW_2230 = [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
GROUPS_2230 = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay_lib", *args], capture_output=True, text=True, timeout=120)


def test_slime_2230_dump_imports_and_first_divergence_is_reward_post_process(tmp_path, capsys):
    """The import in a real process, then validate (exit 0) and replay (exit 1 at reward.post_process).

    Hand arithmetic. slime's whole-batch row: 8 ones and 4 zeros, mean 2/3, Σ(r − m)² = 4·4/9 + 8·1/9 = 8/3, the
    unbiased std √(8/3 / 11) = √(8/33) = 0.4923660; s-0 (r = 0): −(2/3)/(0.4923660 + 1e-6) = −1.3540037. By
    semantic group: g-0 = [0, 0, 1, 1] has mean 1/2 and std √((4·1/4)/3) = √(1/3) = 0.5773503, so s-0 is
    −0.5/(0.5773503 + 1e-6) = −0.8660239; g-2's four equal rewards give 0 where slime wrote
    (1/3)/(0.4923660 + 1e-6) = 0.6770018."""
    train, rollout = write_dumps(tmp_path, RAW_2230, GROUPS_2230)
    out = tmp_path / "slime-7"
    proc = cli("import", "slime", str(train), "--rollout-dump", str(rollout), "-o", str(out),
               "--n-samples-per-prompt", "4")
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out} (bundle slime-7: 12 sample(s) in 3 group(s), 30 token(s))" in proc.stdout
    assert "loss.policy          inspect-only — not in slime's train dump" in proc.stdout
    assert main(["validate", str(out)]) == 0
    capsys.readouterr()
    assert main(["replay", str(out), "--format", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["first_divergent_stage"] == "reward.post_process"
    first = report["first_divergence"]
    assert (first["sample_id"], first["group_index"], first["field"]) == ("s-0", 0, "reward")
    assert first["expected"] == pytest.approx(-1.3540037, abs=1e-6)
    assert first["actual"] == pytest.approx(-0.8660239, abs=1e-6)
    stages = {s["stage"]: s for s in report["stages"]}
    assert stages["reward.post_process"]["mismatches"] == 12  # every sample: the batch mean is no group's mean
    # teacher forcing: the stages that consumed slime's (wrong) rewards faithfully pass
    assert stages["advantage.estimate"]["status"] == "pass"
    assert stages["advantage.kl"]["status"] == "pass"
    assert stages["reward.raw"]["status"] == "pass"
    assert stages["loss.policy"]["status"] == "skipped"
    index = json.loads((out / "index.json").read_text())
    g2 = [s for s in index["samples"] if s["group_index"] == 2]
    assert [s["reward"] for s in g2] == pytest.approx([0.6770018] * 4, abs=1e-6)


def test_full_batch_replays_clean_with_micro_batches_and_masks(tmp_path, capsys):
    """16 samples = 4 groups × n=4 = n · rollout_batch_size: slime reshapes by n, the semantic groups, so every
    recomputed stage passes. Two DP shards: each rank's data-iterator micro-batches become ``dp<r>-mb-<k>``."""
    raw = [0.0, 1.0, 1.0, 0.5, 2.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0]
    groups = [i // 4 for i in range(16)]
    train, rollout = write_dumps(tmp_path, raw, groups, dp=2)
    out = tmp_path / "b"
    args = {"n_samples_per_prompt": 4, "rollout_batch_size": 4, "advantage_estimator": "grpo"}
    (tmp_path / "args.json").write_text(json.dumps(args))
    assert main(["import", "slime", str(train), "--rollout-dump", str(rollout), "-o", str(out),
                 "--config", str(tmp_path / "args.json")]) == 0
    capsys.readouterr()
    index = json.loads((out / "index.json").read_text())
    by_id = {s["sample_id"]: s for s in index["samples"]}
    # rank 0 holds positions 0, 2, …, 14 (8 samples): micro-batch 0 = its first 4, micro-batch 1 the rest
    assert by_id["s-0"]["micro_batch_id"] == "dp0-mb-0000" and by_id["s-8"]["micro_batch_id"] == "dp0-mb-0001"
    assert by_id["s-1"]["micro_batch_id"] == "dp1-mb-0000" and by_id["s-15"]["micro_batch_id"] == "dp1-mb-0001"
    reader = BundleReader(out)  # format 1.3.0: the masks are the packed payload loss_mask
    assert reader.sample_mask(index["samples"].index(by_id["s-5"])) == [0, 1, 1]
    assert index["identity"]["rank"]["dp"] == 2 and index["config"]["n_samples_per_prompt"] == 4
    assert main(["replay", str(out), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {s["stage"]: s["status"] for s in report["stages"]} == {
        "sample": "pass", "reward.raw": "pass", "reward.post_process": "pass", "advantage.kl": "pass",
        "advantage.estimate": "pass", "logprob.mismatch": "pass", "loss.policy": "skipped", "loss.value": "skipped"}


def test_without_rollout_dump_groups_are_not_guessed(tmp_path, capsys):
    """The train dump alone has no group ids: reward.post_process is inspect-only with the reason, the raw rewards
    come from its whole-batch ``raw_reward`` (by rollout position), and the rest still replays."""
    train, _ = write_dumps(tmp_path, RAW_2230, GROUPS_2230)
    out = tmp_path / "b"
    assert main(["import", "slime", str(train), "-o", str(out), "--format", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stages"]["reward.post_process"] == {
        "capability": "inspect-only",
        "reason": "no group ids: slime's train dump has none; pass --rollout-dump (groups are never inferred "
                  "from positions)"}
    assert result["groups"] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage_contracts"]["reward.post_process"]["inputs"] == [
        result["stages"]["reward.post_process"]["reason"]]
    index = json.loads((out / "index.json").read_text())
    assert [s["raw_reward"] for s in index["samples"]] == RAW_2230
    assert all(s["group_index"] is None for s in index["samples"])
    assert main(["replay", str(out)]) == 0


def test_n_samples_per_prompt_inferred_from_rollout_groups_is_said(tmp_path, capsys):
    """No --config and no flag: n is the most common group size in the rollout dump (groups 4, 4, 3 → 4), said
    in a note; the group of three then fails reward.post_process by name."""
    raw, groups = RAW_2230[:11], GROUPS_2230[:11]
    train, rollout = write_dumps(tmp_path, raw, groups)
    out = tmp_path / "b"
    assert main(["import", "slime", str(train), "--rollout-dump", str(rollout), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert ("note: n_samples_per_prompt=4: the most common group size in rollout_7.pt (pass --n-samples-per-prompt "
            "or --config to set it)") in text
    assert main(["replay", str(out), "--format", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    stage = next(s for s in report["stages"] if s["stage"] == "reward.post_process")
    assert stage["reason"] == "group g-2 has 3 sample(s), n_samples_per_prompt=4"


def test_ppo_without_critic_values_keeps_advantage_estimate_inspect_only(tmp_path, capsys):
    """--advantage-estimator ppo is GAE over the critic's values (slime/backends/megatron_utils/loss.py:769-781):
    a dump without them cannot feed advantage.estimate, which is then inspect-only with the reason, and the
    bundle still validates."""
    train, rollout = write_dumps(tmp_path, RAW_2230, GROUPS_2230)
    (tmp_path / "args.json").write_text(json.dumps(["--advantage-estimator", "ppo", "--n-samples-per-prompt", "4"]))
    assert main(["import", "slime", str(train), "--rollout-dump", str(rollout), "-o", str(tmp_path / "b"),
                 "--config", str(tmp_path / "args.json"), "--format", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stages"]["advantage.estimate"] == {
        "capability": "inspect-only",
        "reason": "GAE (--advantage-estimator ppo) needs the critic's values; the train dump has none"}
    assert main(["validate", str(tmp_path / "b")]) == 0


def test_a_written_bundle_that_does_not_validate_is_removed(tmp_path, capsys, monkeypatch):
    """The import reads its bundle back as validate does; should that fail (here: a validate that refuses
    everything), the published directory is removed and the error is one line (exit 3)."""
    import replay_lib.run.validate
    from replay_lib.errors import BundleError

    def refuse(path, **_):
        raise BundleError(f"{path}/index.json: refused by the test")

    monkeypatch.setattr(replay_lib.run.validate, "validate", refuse)
    train, rollout = write_dumps(tmp_path, RAW_2230, GROUPS_2230)
    code, err = _import_error(capsys, train, "--rollout-dump", rollout, "-o", tmp_path / "out")
    assert (code, err) == (3, "trajectory-replay: error: the bundle written from the slime dump does not validate, "
                              f"so it was removed: {tmp_path / 'out'}/index.json: refused by the test")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([train.name, rollout.name])


def _import_error(capsys, *args) -> tuple[int, str]:
    code = main(["import", "slime", *map(str, args)])
    return code, capsys.readouterr().err.strip()


def _rewrite(path: Path, change) -> None:
    obj = torch.load(path, weights_only=True)
    change(obj)
    torch.save(obj, path)


@pytest.mark.parametrize("change, key, message", [
    (lambda d: d.update(format_version=1), "format_version",
     "1, expected 2 (--save-debug-train-data of slime/observability/train_data_utils.py:181-188)"),
    (lambda d: d["samples"][3].pop("advantages"), "samples[3].advantages", "missing"),
    (lambda d: d["samples"][2].update(log_probs=d["samples"][2]["log_probs"][:-1]), "samples[2].log_probs",
     "3 value(s), expected 4"),
    (lambda d: d["samples"][0].update(loss_masks=[1, 1]), "samples[0].loss_masks", "2 value(s), expected 3"),
    (lambda d: d["samples"][1].update(total_lengths=1), "samples[1].response_lengths",
     "2 is not within [0, total_lengths=1]"),
    (lambda d: d["samples"][4].update(rollout_position=0), "samples[].rollout_position", "0 appears twice"),
    (lambda d: d["dp_shards"][0]["micro_batch_indices"].append([99]), "dp_shards[0].micro_batch_indices[2]",
     "index 99 outside partition (length 12)"),
])
def test_malformed_train_dump_is_one_line_naming_the_key_and_writes_nothing(tmp_path, capsys, change, key, message):
    train, rollout = write_dumps(tmp_path, RAW_2230, GROUPS_2230)
    _rewrite(train, change)
    code, err = _import_error(capsys, train, "--rollout-dump", rollout, "-o", tmp_path / "out")
    assert code == 3
    assert err == f"trajectory-replay: error: {train}: slime train dump {key}: {message}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([train.name, rollout.name])  # nothing partial


def test_rollout_dump_of_another_rollout_or_length_is_refused(tmp_path, capsys):
    train, rollout = write_dumps(tmp_path, RAW_2230, GROUPS_2230)
    _rewrite(rollout, lambda d: d.update(rollout_id=8))
    code, err = _import_error(capsys, train, "--rollout-dump", rollout, "-o", tmp_path / "out")
    assert (code, err) == (3, f"trajectory-replay: error: {rollout}: slime rollout dump rollout_id: 8, but the "
                              "train dump is of rollout 7")
    _rewrite(rollout, lambda d: (d.update(rollout_id=7), d["samples"][6].update(response_length=9)))
    code, err = _import_error(capsys, train, "--rollout-dump", rollout, "-o", tmp_path / "out")
    assert (code, err) == (3, f"trajectory-replay: error: {rollout}: slime rollout dump samples[6].response_length: "
                              "9, but the train dump's sample at this position has response_lengths=3")


def test_dict_rewards_need_the_reward_key(tmp_path, capsys):
    train, rollout = write_dumps(tmp_path, RAW_2230, GROUPS_2230)
    _rewrite(rollout, lambda d: [s.update(reward={"acc": s["reward"], "fmt": 1.0}) for s in d["samples"]])
    code, err = _import_error(capsys, train, "--rollout-dump", rollout, "-o", tmp_path / "out")
    assert (code, err) == (3, f"trajectory-replay: error: {rollout}: slime rollout dump samples[0].reward: a dict "
                              "of ['acc', 'fmt']; pass --reward-key")
    assert main(["import", "slime", str(train), "--rollout-dump", str(rollout), "-o", str(tmp_path / "out"),
                 "--reward-key", "acc", "--n-samples-per-prompt", "4"]) == 0
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert [s["raw_reward"] for s in index["samples"]] == RAW_2230


def test_a_dump_that_needs_unpickling_is_refused_with_how_to_convert_it(tmp_path, capsys):
    """slime reloads its dumps with weights_only=False (rollout_data_utils.py:125); this tool never does."""
    train, rollout = write_dumps(tmp_path, RAW_2230, GROUPS_2230)
    obj = torch.load(train, weights_only=True)
    obj["args"] = argparse.Namespace(eps_clip=0.2)  # an arbitrary object in the pickle
    torch.save(obj, train)
    code, err = _import_error(capsys, train, "--rollout-dump", rollout, "-o", tmp_path / "out")
    assert code == 3
    assert err == (f"trajectory-replay: error: {train}: slime train dump holds objects that only a full unpickle "
                   "can rebuild (argparse.Namespace); this tool never unpickles. Convert it where you trust the file: "
                   "d = torch.load(PATH, weights_only=False), then torch.save of the same dict with its values as "
                   "tensors, lists, numbers and strings")
    assert not (tmp_path / "out").exists()
    (tmp_path / "garbage.pt").write_bytes(b"not a pt")  # neither a zip nor a pickle of objects
    code, err = _import_error(capsys, tmp_path / "garbage.pt", "-o", tmp_path / "out")
    assert (code, err) == (3, f"trajectory-replay: error: {tmp_path / 'garbage.pt'}: slime train dump is not a "
                              "readable torch.save file (Unsupported operand 110)")


def test_existing_output_is_refused(tmp_path, capsys):
    train, rollout = write_dumps(tmp_path, RAW_2230, GROUPS_2230)
    (tmp_path / "out").mkdir()
    code, err = _import_error(capsys, train, "--rollout-dump", rollout, "-o", tmp_path / "out")
    assert (code, err) == (2, f"trajectory-replay: error: {tmp_path / 'out'}: bundle already exists; refusing to "
                              "overwrite")
