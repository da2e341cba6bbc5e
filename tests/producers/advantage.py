"""An independent float32 producer of the advantage side (SPEC §4.2), for the error-model tests of the new
formulas: each framework's formula written again here in float32 NumPy — per group and per sample loops,
NumPy's pairwise ``sum``/``mean``/``std`` — never with ``replay_lib.kernels``.

* group post-processing: mean or leave-one-out baseline (NeMo-RL's ``(Σ r − r_i)/(n − 1)`` and its
  ``E[r²] − b²`` leave-one-out variance, ``nan_to_num(0)``), std + eps (biased or unbiased), the zero-std
  ``skip`` rule, the singleton rules; the score minus ``kl_coef·Σ kl`` (verl ``use_kl_in_reward``);
* per-token rewards on the last loss token and their discounted returns (OpenRLHF ``get_cumulative_returns``);
* GAE (verl ``compute_gae_advantage_return``'s loop, observation tokens skipped);
* whitening (verl ``masked_whiten``: ``(A − mean)·rsqrt(var + 1e-8)``, Bessel-corrected).

:func:`write` builds a rollout bundle from these values with the real BundleWriter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, AdvantageWhitenStats, BundleIndex, ComparisonPolicy, Identity,
                               Manifest, ProducerInfo, RecomputeConfig, SampleRecord, StageId, stage_contracts)

F32 = np.float32
ROLLOUT_STAGES = (StageId.SAMPLE, StageId.REWARD_RAW, StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_KL,
                  StageId.ADVANTAGE_ESTIMATE)


def group_post_process(raw, groups, *, std: bool, eps: float = 1e-6, unbiased: bool = True, baseline: str = "mean",
                       std_zero: str = "eps", singleton: Optional[str] = None) -> np.ndarray:
    """The normalized reward of each sample, group by group in float32."""
    r = np.asarray(raw, dtype=F32)
    groups = np.asarray(groups)
    out = np.zeros_like(r)
    for g in np.unique(groups):
        idx = np.nonzero(groups == g)[0]
        x = r[idx]
        n = idx.size
        if n == 1 and singleton is not None:
            out[idx] = {"nan": F32(np.nan), "zero": F32(0.0),
                        "raw": x[0] / F32(1.0 + eps) if std else x[0]}[singleton]
            continue
        if baseline == "leave_one_out":
            total = x.sum(dtype=F32)
            b = (total - x) / F32(n - 1)
            centered = x - b
            if std:
                sq = ((x * x).sum(dtype=F32) - x * x) / F32(n - 1)
                m = n - 1
                with np.errstate(divide="ignore", invalid="ignore"):
                    var = (sq - b * b) * (F32(m) / F32(m - 1) if unbiased else F32(1.0))
                    s = np.nan_to_num(np.sqrt(var), nan=0.0).astype(F32)
        else:
            centered = x - x.mean(dtype=F32)
            if std:
                s = np.full(n, x.std(dtype=F32, ddof=1 if unbiased else 0), dtype=F32)
        if std:
            with np.errstate(divide="ignore", invalid="ignore"):
                divided = centered / (s + F32(eps))
            centered = np.where(s > 0, divided, centered) if std_zero == "skip" else divided
        out[idx] = centered
    return out


def split(values, lengths) -> list[np.ndarray]:
    flat = np.asarray(values, dtype=F32)
    ends = np.cumsum(lengths)
    return np.split(flat, ends[:-1]) if len(lengths) else []


def kl_scores(raw, kl, masks, lengths, kl_coef: float) -> np.ndarray:
    """verl ``use_kl_in_reward`` for an outcome score: ``r − kl_coef·Σ_t kl_t·mask_t`` per sample."""
    out = []
    for r, k, m in zip(np.asarray(raw, dtype=F32), split(kl, lengths), masks):
        out.append(r - F32(kl_coef) * (k * np.asarray(m, dtype=F32)).sum(dtype=F32))
    return np.asarray(out, dtype=F32)


def per_token_rewards(scores, masks, lengths, kl=None, kl_coef: float = 0.0) -> list[np.ndarray]:
    """OpenRLHF ``compute_reward`` then the action mask: the score on the last loss token, ``−kl_coef·kl`` on
    every token."""
    kls = split(kl, lengths) if kl is not None else [np.zeros(n, dtype=F32) for n in lengths]
    out = []
    for g, k, m in zip(np.asarray(scores, dtype=F32), kls, masks):
        m = np.asarray(m, dtype=F32)
        row = -F32(kl_coef) * k
        hits = np.nonzero(m)[0]
        last = hits[-1] if hits.size else len(m) - 1
        if len(m):
            row[last] += g
        out.append((row * m).astype(F32))
    return out


def returns(rows: Sequence[np.ndarray], gamma: float) -> np.ndarray:
    """OpenRLHF ``get_cumulative_returns``: ``G_t = r_t + γ·G_{t+1}`` backwards in float32, per sample."""
    out = []
    for row in rows:
        g = np.zeros_like(row)
        running = F32(0.0)
        for t in range(len(row) - 1, -1, -1):
            running = F32(row[t] + F32(gamma) * running)
            g[t] = running
        out.append(g)
    return np.concatenate(out) if out else np.zeros(0, dtype=F32)


def gae(rows: Sequence[np.ndarray], values, masks, lengths, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """verl ``compute_gae_advantage_return`` before its whitening, one sample at a time in float32."""
    adv_out, ret_out = [], []
    for row, v, m in zip(rows, split(values, lengths), masks):
        m = np.asarray(m, dtype=F32)
        adv = np.zeros_like(row)
        next_value, last = F32(0.0), F32(0.0)
        for t in range(len(row) - 1, -1, -1):
            delta = F32(row[t] + F32(gamma) * next_value - v[t])
            candidate = F32(delta + F32(gamma * lam) * last)
            next_value = F32(v[t] * m[t] + (F32(1) - m[t]) * next_value)
            last = F32(candidate * m[t] + (F32(1) - m[t]) * last)
            adv[t] = last
        adv_out.append(adv)
        ret_out.append(adv + v)
    return np.concatenate(adv_out), np.concatenate(ret_out)


def whiten(values, masks) -> tuple[np.ndarray, float, float]:
    """verl ``masked_whiten``: ``((A − mean)·rsqrt(var + 1e-8), mean, sqrt(var + 1e-8))`` over the loss tokens."""
    a = np.asarray(values, dtype=F32)
    m = np.concatenate([np.asarray(x, dtype=F32) for x in masks])
    count = m.sum(dtype=F32)
    mean = (a * m).sum(dtype=F32) / count
    var = (((a - mean) ** 2) * m).sum(dtype=F32) / count * (count / (count - F32(1)))
    rstd = F32(1.0) / np.sqrt(var + F32(1e-8), dtype=F32)
    return ((a - mean) * rstd).astype(F32), float(mean), float(np.sqrt(var + F32(1e-8), dtype=F32))


def write(path: Path, *, raw, groups, lengths, rewards, advantages, masks=None, kl=None, values=None,
          returns_=None, old_log_probs=None, ref_log_probs=None, policy: ComparisonPolicy = ComparisonPolicy(),
          whiten_stats: Optional[tuple[float, float]] = None, rank: Optional[dict] = None, **config) -> Path:
    """A rollout bundle (sample → advantage.estimate) with these recorded values, written by BundleWriter."""
    total = int(sum(lengths))
    masks = masks if masks is not None else [[1] * n for n in lengths]
    cfg = dict(n_samples_per_prompt=0, kl_coef=0.0)
    cfg.update(config)
    if whiten_stats is not None:
        cfg["advantage_whiten_stats"] = AdvantageWhitenStats(mean=whiten_stats[0], std=whiten_stats[1])
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=None if g is None else int(g), response_length=int(n), total_length=int(n) + 4,
                            loss_mask=[int(x) for x in m], raw_reward=float(r))
               for i, (g, n, m, r) in enumerate(zip(groups, lengths, masks, raw))]
    index = BundleIndex(bundle_id=path.name, identity=Identity(rollout_id=0, rank=rank or {}), samples=samples,
                        config=RecomputeConfig(**cfg))
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=path.name,
                        producer=ProducerInfo(commit="advantage-producer", torch_version=torch.__version__),
                        stage_contracts=stage_contracts(ROLLOUT_STAGES), payloads={}, comparison_policy=policy,
                        redaction={})
    expected = {"reward.raw": {"raw_rewards": [float(r) for r in raw]},
                "reward.post_process": {"rewards": [None if x != x else float(x) for x in np.asarray(rewards)]}}

    def tensor(x):
        return torch.as_tensor(np.asarray(x, dtype=F32).copy())

    zeros = np.zeros(total, dtype=F32)
    payloads = {"old_log_probs": tensor(zeros if old_log_probs is None else old_log_probs),
                "kl": tensor(zeros if kl is None else kl), "advantages": tensor(advantages)}
    if ref_log_probs is not None:
        payloads["ref_log_probs"] = tensor(ref_log_probs)
    if values is not None:
        payloads["values"] = tensor(values)
    if returns_ is not None:
        payloads["returns"] = tensor(returns_)
    writer = BundleWriter(path, manifest, index, expected)
    for name, t in payloads.items():
        writer.write_payload(name, t)
    return writer.finalize(ranks=[0])
