"""Write the sample dumps of ``examples/dumps/`` that ``trajectory-replay import slime`` and ``import nemo-rl`` read,
so the README's import commands can be tried as written. Small (8 samples each) and deterministic (seeded; the
same bytes on every run), laid out as each framework's own writer lays them out — the formats the importers
document (``replay_lib/importers/slime.py``, ``replay_lib/importers/nemo_rl.py``):

* ``slime/train_7_0.pt``: ``--save-debug-train-data`` of rollout 7, rank 0, ``format_version`` 2
  (``slime/observability/train_data_utils.py:112-188`` at THUDM/slime 624b824a898a): per sample the columns of
  the rank's rollout data (``tokens``, ``response_lengths``, ``rewards`` normalized, ``loss_masks``,
  ``log_probs``, ``ref_log_probs``, ``kl``, ``advantages``, ``returns``, ...) and its ``rollout_position``; one
  data-parallel shard whose two micro-batches hold 4 samples each; ``raw_reward`` in rollout order.
  ``slime/rollout_7.pt``: ``--save-debug-rollout-data`` (``rollout_data_utils.py:140-153``), each
  ``Sample.to_dict()`` with its ``group_index`` and raw ``reward``. ``slime/args.json``: the slime arguments of
  the run (GRPO, 4 samples per prompt, 2 prompts per rollout).
* ``nemo-rl/train_data_step3.jsonl``: NeMo-RL's GRPO training data of step 3 (``nemo_rl/algorithms/grpo.py:
  3632-3653`` at NVIDIA-NeMo/RL 7ea279abfbeb), one JSON object per sample, each value a batch of one
  (``nemo_rl/utils/logger.py:1071-1096``), token arrays padded over the whole sequence, prompt included.
  ``nemo-rl/grpo_math.yaml``: the ``grpo:`` section of the run's master config.

The rewards are normalized here with each framework's own formula, written from its code (not from
``replay_lib``): slime's GRPO (``slime/ray/rollout.py:612-631``: the batch reshaped by ``n_samples_per_prompt``,
``(r − mean) / (std + 1e-6)``) and NeMo-RL's leave-one-out baseline with std normalization
(``nemo_rl/algorithms/utils.py:104-198``, ``advantage_estimator.py:82-98``). So the imported bundles replay
clean: every stage the dump feeds passes.

    python scripts/make_sample_dumps.py [--out examples/dumps]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
N = 4  # samples per prompt
PROMPTS = ([11, 12, 13, 14], [21, 22, 23])  # two prompts' token ids
RESPONSE_LENGTHS = [3, 5, 2, 4, 4, 1, 3, 6]
RAW = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.5]  # the reward function's scores


def slime_grpo(raw: list[float]) -> list[float]:
    """slime/ray/rollout.py:612-631 (GRPO, std normalization on): the rewards reshaped to [-1, n], centred, then
    divided by (std + 1e-6)."""
    r = torch.tensor(raw, dtype=torch.float32).reshape(-1, N)
    r = r - r.mean(dim=-1, keepdim=True)
    r = r / (r.std(dim=-1, keepdim=True) + 1e-6)
    return r.flatten().tolist()


def nemo_leave_one_out(raw: list[float]) -> list[float]:
    """nemo_rl/algorithms/utils.py:104-198 (leave-one-out baseline, all samples valid) then
    advantage_estimator.py:88-98 (÷ (std + 1e-6) where the std is > 0)."""
    r = torch.tensor(raw, dtype=torch.float32).reshape(-1, N)
    out = []
    for row in r:
        others = 1 - torch.eye(N)
        baseline = others @ row / (N - 1)
        square = others @ row.pow(2) / (N - 1)
        std = ((square - baseline.square()) * ((N - 1) / (N - 2))).sqrt().nan_to_num(0)
        a = row - baseline
        out += torch.where(std > 0, a / (std + 1e-6), a).tolist()
    return out


def write_slime(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    rewards = slime_grpo(RAW)
    gen = torch.Generator().manual_seed(7)
    rollout_samples, train = [], []
    for pos, length in enumerate(RESPONSE_LENGTHS):
        group = pos // N
        prompt = PROMPTS[group]
        response = [40 + int(t) for t in torch.randint(0, 20, (length,), generator=gen)]
        tokens = torch.tensor(prompt + response, dtype=torch.long)
        rollout_lp = (-torch.rand(length, generator=gen)).to(torch.float32)
        rollout_samples.append({  # Sample.to_dict() (slime/utils/types.py:222-227)
            "group_index": group, "index": pos, "rollout_id": None, "prompt": f"sample prompt {group}",
            "tokens": tokens.tolist(), "multimodal_inputs": None, "multimodal_train_inputs": None,
            "multimodal_train_input_id": None, "apply_chat_template_kwargs": {}, "response": f"response {pos}",
            "response_length": length, "label": "1", "reward": RAW[pos], "loss_mask": None, "weight_versions": ["7"],
            "rollout_log_probs": rollout_lp.tolist(), "rollout_top_p_token_ids": None,
            "rollout_top_p_token_offsets": None, "rollout_routed_experts": None, "remove_sample": False,
            "teacher_log_probs": None, "status": "completed", "metadata": {}, "generate_function_path": None,
            "custom_rm_path": None, "train_metadata": None, "session_id": None, "non_generation_time": 0.0,
            "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                          "completion_token_num": 0},
            "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": 0},
        })
        mask = torch.ones(length, dtype=torch.int)
        if length >= 4:  # a multi-turn sample: its 2nd token is a tool's output, out of the loss
            mask[1] = 0
        log_probs = (rollout_lp + 0.01 * torch.rand(length, generator=gen)).to(torch.float32)
        kl = torch.zeros(length, dtype=torch.float32)  # kl_coef == 0 (slime/backends/megatron_utils/loss.py:743-746)
        advantages = torch.full((length,), rewards[pos], dtype=torch.float32)  # GRPO: broadcast (ppo_utils.py:361-368)
        train.append({
            "data_parallel_rank": 0, "sample_index": pos, "rollout_position": pos, "tokens": tokens,
            "response_lengths": length, "rewards": rewards[pos], "truncated": 0, "rollout_ids": pos,
            "loss_masks": mask, "rollout_mask_sums": torch.tensor(float(mask.sum())),
            "total_lengths": len(prompt) + length, "local_raw_reward": RAW[pos], "rollout_log_probs": rollout_lp,
            "log_probs": log_probs, "ref_log_probs": (log_probs - 0.02).to(torch.float32), "kl": kl,
            "advantages": advantages, "returns": advantages.clone(),
        })
    part = list(range(len(RAW)))
    shards = [{"rank": 0, "data_parallel_rank": 0, "sample_indices": part, "partition": part,
               "micro_batch_indices": [part[:4], part[4:]], "num_microbatches": [2],
               "global_batch_sizes": [len(part)]}]
    paths = [out / "train_7_0.pt", out / "rollout_7.pt", out / "args.json"]
    torch.save({"format_version": 2, "rollout_id": 7, "rank": 0, "samples": train, "dp_shards": shards,
                "raw_reward": list(RAW)}, paths[0])
    torch.save({"rollout_id": 7, "samples": rollout_samples}, paths[1])
    paths[2].write_text(json.dumps({"advantage_estimator": "grpo", "n_samples_per_prompt": N,
                                    "rollout_batch_size": len(PROMPTS), "global_batch_size": len(RAW)},
                                   indent=2) + "\n")
    return paths


def write_nemo_rl(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    advantages = nemo_leave_one_out(RAW)
    gen = torch.Generator().manual_seed(3)
    row = max(len(PROMPTS[i // N]) + n for i, n in enumerate(RESPONSE_LENGTHS))
    lines = []
    for i, length in enumerate(RESPONSE_LENGTHS):
        prompt = PROMPTS[i // N]
        total = len(prompt) + length
        response = [40 + int(t) for t in torch.randint(0, 20, (length,), generator=gen)]
        tokens = prompt + response + [0] * (row - total)
        mask = [0] * len(prompt) + [1] * length + [0] * (row - total)
        generation = [round(-float(x), 6) for x in torch.rand(row, generator=gen)]
        previous = [round(x - 0.01, 6) for x in generation]
        lines.append(json.dumps({
            "content": [[{"role": "user", "content": f"sample prompt {i // N}"},
                         {"role": "assistant", "content": f"response {i}"}]],
            "rewards": [RAW[i]], "input_lengths": [total], "token_ids": [tokens], "token_loss_mask": [mask],
            "sample_loss_mask": [1.0], "advantages": [[advantages[i]] * row],
            "generation_logprobs": [generation], "prev_logprobs": [previous], "idx": i,
        }))
    paths = [out / "train_data_step3.jsonl", out / "grpo_math.yaml"]
    paths[0].write_text("\n".join(lines) + "\n")
    paths[1].write_text("grpo:\n  num_generations_per_prompt: 4\n  normalize_rewards: true\n"
                        "  use_leave_one_out_baseline: true\n")
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "examples" / "dumps", help="default examples/dumps")
    args = p.parse_args(argv)
    for path in write_slime(args.out / "slime") + write_nemo_rl(args.out / "nemo-rl"):
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
