"""Format-2.0.0 bundles written field by field from the original tool's documented schema (Relax
``relax/utils/replay/schema.py`` @ 78973a59: ``manifest_to_dict``, ``index_to_dict``; ``bundle.py``: ``json.dump(indent=2,
sort_keys=True, ensure_ascii=False)`` + newline, ``COMPLETE`` / ``COMPLETE.<rank>`` with ``expected_ranks``), never with
our writer: only the original's keys, its two sentinels, Python's json (a non-finite float is a bare ``NaN``).

The PR #65 rollout mapped to 2.0: 2.0 records no raw reward, only each sample's post-processed reward, the one
advantage estimation consumes. The reward function's post-processing normalized each semantic group
([−1, 1, −1, 1]); the streamed trainer's advantages came from rewards normalized over the physical batch of 4
([−5.5, −3.5, 3.5, 5.5]). With no reward stage left to recompute the normalization, the first stage that sees the
wrong value is advantage.estimate (1.x pins the same bug one stage earlier, at reward.post_process).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

GROUPS = [0, 0, 1, 1]
LENGTHS = [3, 2, 4, 3]
GROUP_REWARDS = [-1.0, 1.0, -1.0, 1.0]  # r − mean(semantic group) of raw [1, 3, 10, 12]
BATCH_REWARDS = [-5.5, -3.5, 3.5, 5.5]  # r − mean(physical batch of 4): the PR #65 bug
K3_AT_QUARTER = math.exp(-0.25) - 1 + 0.25  # old − ref = 0.25 for every token


def dump(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def contract(stage: str, capability: str = "recompute") -> dict:
    return {"stage": stage, "version": "v2", "capability": capability, "implementation": "reuse",
            "inputs": [], "expected_outputs": []}


def write_v2_bundle(path: Path, *, kind: str = "rollout", rewards=None, advantages_from=GROUP_REWARDS,
                    stages=None, expected=None, rank: int = 0, bundle_id: str | None = None) -> Path:
    """A 2.0.0 bundle. ``rewards``: each sample's recorded reward (a float or a per-token list; default
    ``GROUP_REWARDS``); ``advantages_from``: the per-sample rewards the producer's advantages were broadcast from
    (or a flat per-token list)."""
    rewards = list(GROUP_REWARDS) if rewards is None else rewards
    total = sum(LENGTHS)
    (path / "payloads").mkdir(parents=True)
    if len(advantages_from) == total:
        advantages = torch.tensor(advantages_from, dtype=torch.float32)
    else:
        advantages = torch.repeat_interleave(torch.tensor(advantages_from), torch.tensor(LENGTHS))
    if kind == "rollout":
        tensors = {"old_log_probs": torch.full((total,), -0.5), "ref_log_probs": torch.full((total,), -0.75),
                   "kl": torch.full((total,), K3_AT_QUARTER), "advantages": advantages}
        stages = ["advantage.kl", "advantage.estimate"] if stages is None else stages
        expected = {} if expected is None else expected
        anchor = {"actor_step_id": None, "rollout_id": 120}
        config = {"advantage_estimator": "grpo", "kl_loss_type": "k3", "kl_coef": 0.1, "eps_clip": 0.2,
                  "eps_clip_high": 0.2, "entropy_coef": 0.0}
    else:
        tensors = {"log_probs": torch.full((total,), 0.5), "old_log_probs": torch.zeros(total),
                   "entropy": torch.full((total,), 0.5), "advantages": advantages}
        stages = ["sample", "loss.policy"] if stages is None else stages
        pg_loss = 2 * math.exp(0.5) - 2.4  # A=+1: ratio e^0.5 clipped to 1.2; A=−1: e^0.5; sum of sample means
        expected = {"loss.policy": {"loss": pg_loss, "pg_loss": pg_loss, "entropy_loss": 2.0, "pg_clipfrac": 2.0,
                                    "ppo_kl": -2.0}} if expected is None else expected
        anchor = {"actor_step_id": {"rollout_id": 120, "step_id": 0}, "rollout_id": None}
        config = {"advantage_estimator": "grpo", "kl_loss_type": "k1", "kl_coef": 0.0, "eps_clip": 0.2,
                  "eps_clip_high": 0.2, "entropy_coef": 0.0}
    bundle_id = bundle_id or f"v2-{kind}"
    payloads = {}
    for name, tensor in tensors.items():
        file = path / "payloads" / f"{name}.pt"
        torch.save(tensor, file)
        data = file.read_bytes()
        payloads[name] = {"name": name, "dtype": str(tensor.dtype), "shape": list(tensor.shape),
                          "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    contracts = {s: contract(s) for s in stages}
    contracts["loss.value"] = contract("loss.value", "unsupported")
    manifest = {"format_version": "2.0.0", "bundle_id": bundle_id,
                "producer": {"commit": "78973a5", "dirty_patch_digest": "", "torch_version": "2.5.1+cu124"},
                "stage_contracts": contracts, "payloads": payloads,
                "comparison_policy": {"exact_fields": [], "tolerances": {}}, "redaction": {}}
    samples = [{"sample_id": f"s-{i}", "group_index": g, "response_length": n, "total_length": n + 5,
                "loss_mask": [1] * n, "reward": rw, "label_hash": "", "micro_batch_id": f"mb-{i // 2:04d}"}
               for i, (g, n, rw) in enumerate(zip(GROUPS, LENGTHS, rewards))]
    index = {"bundle_id": bundle_id,
             "identity": {**anchor, "rollout_partition_ids": ["rp-120-0"], "consumer_batch_ids": ["cb-0", "cb-1"],
                          "micro_batch_ids": ["mb-0000", "mb-0001"], "semantic_group_ids": ["0", "1"],
                          "weight_lineage": {"rollout_weight": None, "actor_weight": None},
                          "rank": {"dp": 1, "tp": 1, "pp": 1, "cp": 1}},
             "samples": samples, "config": config}
    blobs = {"manifest.json": dump(manifest), "index.json": dump(index), "expected.json": dump(expected)}
    for name, blob in blobs.items():
        (path / name).write_bytes(blob)
    metadata = {name: hashlib.sha256(blob).hexdigest() for name, blob in blobs.items()}
    (path / f"COMPLETE.{rank}").write_bytes(dump({**anchor, "payloads": {n: p["sha256"] for n, p in payloads.items()},
                                                   "metadata": metadata, "expected_ranks": [rank]}))
    (path / "COMPLETE").write_bytes(dump({"ranks": [rank], "metadata": metadata, "expected_ranks": [rank]}))
    return path
