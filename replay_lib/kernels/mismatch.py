"""Train–inference mismatch (stage ``logprob.mismatch``, SPEC §4.3): the engine's log-probs of the sampled tokens
(``rollout_log_probs``) against the trainer's (``old_log_probs``, and the first minibatch's ``log_probs``).

* :func:`ulp_distance` — how many representable numbers lie between two log-probs, on the lattice of the
  stored dtype (float32 unless one side is float64; bf16/fp16 values are exact float32 values and are
  counted on the float32 lattice).
* :func:`difference_summary` — the bitwise comparison on loss tokens: count, max |Δ|, max ulp, first (sample,
  token).
* :func:`mismatch_metrics` — the mismatch metrics the frameworks log, recomputed in float64 from the same
  payloads. Each formula follows the framework's own code (the file is cited at each metric); names are the
  frameworks' metric keys, so ``expected.json $.logprob.mismatch`` holds them as the trainer logged them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

# verl rollout_corr_helper.py SAFETY_BOUND (the clamp of a log-ratio before exp in its chi² metrics)
SAFETY_BOUND = 20.0
# verl_F.masked_mean's denominator term (verl/utils/torch_functional.py masked_mean: Σ x·m / (Σ m + 1e-8))
VERL_MASKED_MEAN_EPS = 1e-8

# The metric keys this engine recomputes, by framework (SPEC §4.3 lists the formula of each).
VERL_DEBUG = ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean",
              "training/rollout_probs_diff_std")
VERL_ROLLOUT_CORR = tuple(f"rollout_corr/{k}" for k in (
    "kl", "k3_kl", "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
    "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq"))
NEMO_RL = ("token_mult_prob_error", "gen_kl_error", "policy_kl_error")
TRL = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
       "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
       "sampling/importance_sampling_ratio/max")
METRICS = VERL_DEBUG + VERL_ROLLOUT_CORR + NEMO_RL + TRL


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """int64 keys in the order of the floats (``+0`` and ``−0`` the same key): adjacent floats differ by 1."""
    if x.dtype == torch.float64:
        bits = x.view(torch.int64)
        mag = bits & 0x7FFFFFFFFFFFFFFF
    else:
        bits = x.to(torch.float32).view(torch.int32).to(torch.int64)
        mag = bits & 0x7FFFFFFF
    return torch.where(bits < 0, -mag, mag)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 ``|key(a) − key(b)|``: the number of float steps from ``a`` to ``b`` on the float32 lattice
    (the float64 one when either is float64); ``inf`` where either is NaN or exactly one is infinite."""
    wide = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    a, b = a.to(wide), b.to(wide)
    d = (_ordered(a) - _ordered(b)).abs().to(torch.float64)
    odd = torch.isnan(a) | torch.isnan(b) | (torch.isinf(a) != torch.isinf(b)) | (torch.isinf(a) & (a != b))
    return d.masked_fill_(odd, math.inf)


@dataclass
class DifferenceSummary:
    """``a`` vs ``b`` on the loss tokens, bit for bit."""

    compared: int
    count: int
    max_abs: float
    max_ulp: float
    first: Optional[int]  # the first differing token's index on the (selected) token axis, None when none

    def as_dict(self, sample_of) -> dict:
        out = {"compared": self.compared, "count": self.count, "max_abs_diff": self.max_abs, "max_ulp": self.max_ulp}
        if self.first is not None:
            sample, token = sample_of(self.first)
            out.update(first_sample=sample, first_token=token)
        return out


def differing(a: torch.Tensor, b: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """bool per token: ``on`` and ``a``, ``b`` not the same float (NaN never equals anything; ``+0 == −0``)."""
    wide = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    return on & (a.to(wide) != b.to(wide))


def difference_summary(a: torch.Tensor, b: torch.Tensor, on: torch.Tensor) -> DifferenceSummary:
    diff = differing(a, b, on)
    count = int(diff.sum())
    if not count:
        return DifferenceSummary(compared=int(on.sum()), count=0, max_abs=0.0, max_ulp=0.0, first=None)
    idx = diff.nonzero().reshape(-1)
    da, db = a[idx], b[idx]
    absd = (da.to(torch.float64) - db.to(torch.float64)).abs()
    max_abs = float(absd.max()) if not torch.isnan(absd).any() else math.nan
    return DifferenceSummary(compared=int(on.sum()), count=count, max_abs=max_abs,
                             max_ulp=float(ulp_distance(da, db).max()), first=int(idx[0]))


def _kl(logprobs: torch.Tensor, reference: torch.Tensor, kind: str) -> torch.Tensor:
    """NeMo-RL ``calculate_kl(logprobs, logprobs_reference, kl_type)`` (nemo_rl/algorithms/utils.py): k1
    ``lp − ref``; k2 ``(ref − lp)²/2``; k3 ``exp(ref − lp) − (ref − lp) − 1``."""
    if kind == "k1":
        return logprobs - reference
    log_ratio = reference - logprobs
    if kind == "k2":
        return 0.5 * log_ratio * log_ratio
    return torch.expm1(log_ratio) - log_ratio


def mismatch_metrics(rollout: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, seg: torch.Tensor, n: int, *,
                     kl_type: str = "k3", is_level: Optional[str] = None, is_mode: str = "truncate",
                     is_low: Optional[float] = None, is_high: Optional[float] = None) -> dict[str, float]:
    """Every metric of :data:`METRICS` in float64 over the loss tokens (``mask`` > 0) of ``n`` samples
    (``seg``: each token's sample). ``kl_type``: NeMo-RL's ``reference_policy_kl_type`` (the estimator of its
    gen/policy KL errors). ``is_*``: the bundle's importance-correction knobs (TRL's ratio statistics are
    those of its corrected weight: ``vllm_importance_sampling_mode``, its clip bounds)."""
    f64 = torch.float64
    lr, lo = rollout.to(f64), old.to(f64)
    m = (mask > 0).to(f64)
    on = m > 0
    tokens = float(m.sum())
    out: dict[str, float] = {}

    def tmean(x: torch.Tensor) -> float:  # a global masked mean (NeMo-RL/verl masked_mean over every token)
        return float((x * m).sum() / tokens) if tokens else math.nan

    def seqsum(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n, dtype=f64).index_add_(0, seg, x * m)

    # verl verl/utils/debug/metrics.py:112-121 calculate_debug_metrics: |exp(old) − exp(rollout)| on the response
    # mask, max / mean / std (torch.std: Bessel's correction)
    if tokens:
        pd = (lo[on].exp() - lr[on].exp()).abs()
        out["training/rollout_probs_diff_max"] = float(pd.max())
        out["training/rollout_probs_diff_mean"] = float(pd.mean())
        out["training/rollout_probs_diff_std"] = float(pd.std()) if pd.numel() > 1 else math.nan
    else:  # metrics.py:103-110: no valid token
        out.update({k: math.nan for k in VERL_DEBUG})

    # verl verl/trainer/ppo/rollout_corr_helper.py:904-1010 compute_offpolicy_metrics (verl_F.masked_mean: the
    # denominator + 1e-8; per sequence along the token axis, then a plain mean over every sequence)
    # (verl's mask is float32: Σ m + 1e-8 rounds back to Σ m for any count ≥ 1, so the epsilon only keeps a
    # fully masked sequence's 0/0 at 0)
    denom = tokens if tokens else VERL_MASKED_MEAN_EPS
    count = seqsum(torch.ones_like(m))
    count = torch.where(count > 0, count, torch.full_like(count, VERL_MASKED_MEAN_EPS))
    mean_old = seqsum(lo) / count
    mean_roll = seqsum(lr) / count
    out["rollout_corr/training_ppl"] = float(torch.exp(-mean_old).mean())
    out["rollout_corr/training_log_ppl"] = float((-mean_old).mean())
    log_ratio = lo - lr
    out["rollout_corr/kl"] = float(((lr - lo) * m).sum() / denom)
    out["rollout_corr/k3_kl"] = float(((torch.exp(log_ratio) - log_ratio - 1) * m).sum() / denom)
    out["rollout_corr/rollout_ppl"] = float(torch.exp(-mean_roll).mean())
    out["rollout_corr/rollout_log_ppl"] = float((-mean_roll).mean())
    log_ppl_diff = mean_roll - mean_old
    out["rollout_corr/log_ppl_diff"] = float(log_ppl_diff.mean())
    out["rollout_corr/log_ppl_abs_diff"] = float(log_ppl_diff.abs().mean())
    out["rollout_corr/log_ppl_diff_max"] = float(log_ppl_diff.max()) if n else math.nan
    out["rollout_corr/log_ppl_diff_min"] = float(log_ppl_diff.min()) if n else math.nan
    out["rollout_corr/ppl_ratio"] = float(torch.exp(log_ppl_diff).mean())
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    out["rollout_corr/chi2_token"] = float((rho * rho * m).sum() / denom) - 1.0
    seq = seqsum(log_ratio).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    out["rollout_corr/chi2_seq"] = float(torch.exp(2.0 * seq).mean()) - 1.0

    # NeMo-RL nemo_rl/algorithms/loss_functions.py ClippedPGLossFn (clipped_pg_diagnostic_metrics):
    # token_mult_prob_error = masked_mean(exp(|gen − prev|·mask)); gen_kl_error = masked_mean(calculate_kl(gen,
    # prev)); policy_kl_error = masked_mean(calculate_kl(prev, gen)) — the global token mean, no epsilon
    out["token_mult_prob_error"] = tmean(torch.exp((lr - lo).abs() * m))
    out["gen_kl_error"] = tmean(_kl(lr, lo, kl_type))
    out["policy_kl_error"] = tmean(_kl(lo, lr, kl_type))

    # TRL trl/trainer/grpo_trainer.py:2660-2705 (the corrected ratio) and :2860-2896 (its statistics): the
    # difference (old − sampling)·mask, NaN → 0; per token, or summed per sequence; truncate = clamp, mask = 0
    # outside [min, max]; statistics over the masked tokens (token modes) or every sequence (sequence modes)
    delta = (lo - lr).abs()[on]
    delta = delta[~torch.isnan(delta)]
    out["sampling/sampling_logp_difference/mean"] = float(delta.mean()) if delta.numel() else 0.0
    out["sampling/sampling_logp_difference/max"] = float(delta.max()) if delta.numel() else 0.0
    diff = torch.nan_to_num((lo - lr) * m, nan=0.0)
    if is_level == "sequence":
        ratio = torch.exp(torch.zeros(n, dtype=f64).index_add_(0, seg, diff))
    else:
        ratio = torch.exp(diff)[on]
    if is_mode == "mask":
        low = -math.inf if is_low is None else is_low
        high = math.inf if is_high is None else is_high
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    elif is_low is not None or is_high is not None:
        ratio = ratio.clamp(min=is_low, max=is_high)
    if ratio.numel():
        out["sampling/importance_sampling_ratio/min"] = float(ratio.min())
        out["sampling/importance_sampling_ratio/mean"] = float(ratio.mean())
        out["sampling/importance_sampling_ratio/max"] = float(ratio.max())
    else:
        out.update({k: 0.0 for k in TRL[2:]})
    return out


def metric_condition(rollout: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> float:
    """A magnitude every metric's float32 rounding error is proportional to: the masked mean of
    ``(1 + |Δ|)·exp(|Δ|)·(1 + |lp|)`` (each term is an exp, a difference or a product of those, of log-probs
    of that size), at least 1."""
    lr, lo = rollout.to(torch.float64), old.to(torch.float64)
    on = mask > 0
    if not bool(on.any()):
        return 1.0
    d = (lo - lr)[on].abs().clamp(max=SAFETY_BOUND)
    size = torch.maximum(lo[on].abs(), lr[on].abs())
    c = ((1 + d) * d.exp() * (1 + size))
    c = c[torch.isfinite(c)]
    return max(float(c.mean()) if c.numel() else 1.0, 1.0)


__all__ = ["METRICS", "DifferenceSummary", "difference_summary", "differing", "metric_condition",
           "mismatch_metrics", "ulp_distance"]
