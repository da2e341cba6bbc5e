"""Train–inference mismatch producers (stage ``logprob.mismatch``): a trainer's float32 ``old_log_probs`` and an
inference engine's ``rollout_log_probs`` that differ the way real engines do, written with their own numpy/torch
code, never with ``replay_lib.kernels``.

* ``exact``: the engine returns the trainer's values bit for bit (true on-policy);
* ``one_bad``: as ``exact`` but one token ``(sample, token)`` moved by ``ulps`` float32 steps (numpy nextafter);
* ``fp8_lattice``: the engine's values are the trainer's moved by whole multiples of 0.125 (an FP8 rollout's
  quantization lattice, miles#2722), on every loss token;
* ``flat``: every token moved by one constant (0.271, miles#1678);
* ``first_token``: only each sample's first generated token differs (prefill vs decode);
* ``bf16``: the engine's values are the trainer's rounded to bfloat16 (round to nearest even, numpy bit
  arithmetic).

The recorded metrics (``expected.json $.logprob.mismatch``) are computed by verl's own functions
(``verl.utils.debug.metrics.calculate_debug_metrics``, ``verl.trainer.ppo.rollout_corr_helper.
compute_offpolicy_metrics``) on the padded float32 batch, as the trainer logs them.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, Identity, Manifest, ProducerInfo,
                                      RecomputeConfig, SampleRecord, StageId, stage_contracts)

KINDS = ("exact", "one_bad", "fp8_lattice", "flat", "first_token", "bf16")


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 → the nearest bfloat16 value (ties to even), by the bits."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def make_logprobs(seed: int, samples: int, tokens: int, kind: str, *, bad: tuple[int, int] = (2, 5), ulps: int = 1
                  ) -> dict:
    rng = np.random.Generator(np.random.PCG64(seed))
    lengths = rng.integers(tokens // 2, tokens + 1, samples)
    lengths[0] = tokens
    total = int(lengths.sum())
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    old = (-rng.exponential(1.0, total)).astype(np.float32)
    mask = (rng.random(total) > 0.1).astype(np.int64)
    mask[offsets] = 1  # every first token is a loss token
    rollout = old.copy()
    if kind == "one_bad":
        at = offsets[bad[0]] + bad[1]
        mask[at] = 1
        v = rollout[at]
        for _ in range(ulps):
            v = np.nextafter(v, np.float32(0.0), dtype=np.float32)
        rollout[at] = v
    elif kind == "fp8_lattice":
        k = rng.integers(-3, 4, total)
        k[k == 0] = 1
        rollout = (old.astype(np.float64) + 0.125 * k).astype(np.float32)
    elif kind == "flat":
        rollout = (old.astype(np.float64) + 0.271).astype(np.float32)
    elif kind == "first_token":
        rollout[offsets] = (old[offsets].astype(np.float64) - rng.uniform(0.01, 0.1, samples)).astype(np.float32)
    elif kind == "bf16":
        rollout = _bf16_round(old)
    elif kind != "exact":
        raise ValueError(f"unknown kind {kind!r}")
    return dict(lengths=lengths, offsets=offsets, old=old, rollout=rollout, mask=mask)


def verl_metrics(data: dict) -> dict[str, float]:
    """verl's own debug and off-policy metrics on the padded float32 batch."""
    from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics
    from verl.utils.debug.metrics import calculate_debug_metrics

    lengths, offsets = data["lengths"], data["offsets"]
    n, width = len(lengths), int(lengths.max())
    pad = lambda x, fill: torch.stack([torch.nn.functional.pad(torch.from_numpy(x[o:o + L]), (0, width - L), value=fill)
                                       for o, L in zip(offsets, lengths)])
    old, rollout = pad(data["old"], 0.0), pad(data["rollout"], 0.0)
    mask = pad(data["mask"].astype(np.float32), 0.0)
    batch = {"rollout_log_probs": rollout, "old_log_probs": old, "response_mask": mask,
             "responses": torch.zeros(n, width, dtype=torch.int64)}
    out = {k: float(v) for k, v in calculate_debug_metrics(SimpleNamespace(batch=batch)).items()
           if k != "training/rollout_probs_diff_valid" and "pearson" not in k}
    out.update({f"rollout_corr/{k}": float(v) for k, v in compute_offpolicy_metrics(old, rollout, mask).items()})
    return out


def produce_mismatch_bundle(path: str | Path, data: dict, *, config: Optional[RecomputeConfig] = None,
                            expected: Optional[dict] = None, log_probs: Optional[np.ndarray] = None,
                            policy_versions: Optional[np.ndarray] = None, bundle_id: str = "mismatch") -> Path:
    lengths, offsets, mask = data["lengths"], data["offsets"], data["mask"]
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=i // 2, response_length=int(n), total_length=int(n) + 8,
                            loss_mask=mask[o:o + n].tolist(), raw_reward=0.0, reward=0.0)
               for i, (n, o) in enumerate(zip(lengths.tolist(), offsets.tolist()))]
    index = BundleIndex(bundle_id=bundle_id, identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0)),
                        samples=samples, config=config or RecomputeConfig())
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=bundle_id,
                        producer=ProducerInfo(commit="tests.producers.mismatch", torch_version=torch.__version__),
                        stage_contracts=stage_contracts((StageId.SAMPLE,)), payloads={}, redaction={})
    writer = BundleWriter(path, manifest, index, {"logprob.mismatch": expected} if expected else {})
    writer.write_payload("old_log_probs", torch.from_numpy(data["old"]))
    writer.write_payload("rollout_log_probs", torch.from_numpy(data["rollout"]))
    if log_probs is not None:
        writer.write_payload("log_probs", torch.from_numpy(log_probs))
    if policy_versions is not None:
        writer.write_payload("policy_versions", torch.from_numpy(policy_versions.astype(np.int64)))
    return writer.finalize(ranks=[0])


__all__ = ["KINDS", "make_logprobs", "produce_mismatch_bundle", "verl_metrics"]
