"""The float64 truth of a bundle's expected values, and the condition of each one: what a legitimate producer
may differ from it by.

The truth is the SPEC §4 formula evaluated in float64 on the *recorded* values (raw rewards from the float64
JSON, payloads upcast), so it is what every correct producer approximates. A producer is legitimate when
``|expected − truth| ≤ C · u · cond`` element by element, with ``u`` its unit roundoff and ``cond`` the
formula's condition (Σ|terms| of a reduction, ``exp(−r) + 1 + |r|`` for k3, the group's spread for a
normalized reward): "within a few ulp" of an answer measured on the scale of the terms that made it, which
is all floating point promises. :func:`noise_ratios` returns ``|expected − truth| / (u · cond)``.
"""

from __future__ import annotations

import numpy as np

from .base import PER_SAMPLE_NAMES, STD_EPS

U32 = 2.0 ** -24
UBF16 = 2.0 ** -8


def _segments(lengths: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(lengths.size), lengths)


def rewards(raw: np.ndarray, bounds, std: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(truth, cond)`` of the normalized rewards. A float32 producer rounds each raw reward and the group
    mean (error ~u·max|r|, for every member), which the division by ``std + eps`` magnifies, and the std it
    divides by carries the same relative error: ``cond = (|r| + max|r|)·(1 + |g|)/(std + eps) + |g|``."""
    truth = np.empty_like(raw)
    cond = np.empty_like(raw)
    for a, b in bounds:
        r = raw[a:b]
        centered = r - np.mean(r)
        scale = np.abs(r) + np.max(np.abs(r))
        if std:
            denom = np.std(r, ddof=1) + STD_EPS
            g = centered / denom
            truth[a:b] = g
            cond[a:b] = scale * (1 + np.abs(g)) / denom + np.abs(g)
        else:
            truth[a:b] = centered
            cond[a:b] = scale
    return truth, cond


def kl(old: np.ndarray, ref: np.ndarray, kl_type: str) -> tuple[np.ndarray, np.ndarray]:
    """``(truth, cond)`` per token with ``r = old − ref``; the cond of k3 is the sum of its terms' magnitudes
    (``exp(−r) + 1 + |r|``), of k1 and k2 the value's own magnitude (one rounded subtraction)."""
    r = old.astype(np.float64) - ref.astype(np.float64)
    if kl_type == "k1":
        return r, np.abs(r)
    if kl_type == "k2":
        return r * r / 2, r * r
    e = np.exp(-r)
    value = e - 1 + r
    if kl_type == "low_var_kl":
        value = np.clip(value, -10, 10)
    return value, e + 1 + np.abs(r)


def _token_terms(log_probs, old_log_probs, advantages, entropy, eps_clip: float, eps_clip_high: float):
    """float64 per-token surrogate, clip indicator, log-ratio and entropy, and where a ratio lies within 8u
    of a clip bound (a legitimate rounding may put it on either side)."""
    logp, old = log_probs.astype(np.float64), old_log_probs.astype(np.float64)
    adv, ent = advantages.astype(np.float64), entropy.astype(np.float64)
    ppo_kl = old - logp
    ratio = np.exp(-ppo_kl)
    low, high = 1 - eps_clip, 1 + eps_clip_high
    pg1 = -ratio * adv
    pg2 = -np.clip(ratio, low, high) * adv
    terms = {"pg": np.maximum(pg1, pg2), "clip": (pg2 > pg1).astype(np.float64), "kl": ppo_kl, "ent": ent}
    near = (np.abs(ratio - low) <= 8 * U32 * ratio) | (np.abs(ratio - high) <= 8 * U32 * ratio)
    return terms, near.astype(np.float64)


def sample_sums(log_probs, old_log_probs, advantages, entropy, mask, lengths, *, eps_clip: float,
                eps_clip_high: float) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(truth, cond)`` of the per-sample loss terms (``pg_sum`` … ``mask_count``): per sample ``Σ_t x·mask``
    and, as its cond, ``Σ_t |x|·mask``; a clip count may differ by the tokens near a clip bound."""
    terms, near = _token_terms(log_probs, old_log_probs, advantages, entropy, eps_clip, eps_clip_high)
    m = mask.astype(np.float64)
    terms["mask"] = np.ones_like(m)
    seg = _segments(lengths)

    def per_sample(x: np.ndarray) -> np.ndarray:
        return np.bincount(seg, weights=x * m, minlength=lengths.size)

    truth = {PER_SAMPLE_NAMES[k]: per_sample(x) for k, x in terms.items()}
    cond = {PER_SAMPLE_NAMES[k]: per_sample(np.abs(x)) for k, x in terms.items()}
    cond["clip_count"] += per_sample(near) / U32
    return truth, cond


def loss(log_probs, old_log_probs, advantages, entropy, mask, lengths, *, eps_clip: float, eps_clip_high: float,
         entropy_coef: float) -> tuple[dict[str, float], dict[str, float]]:
    """``(truth, cond)`` of the five loss.policy scalars (sum of per-sample masked means). ``cond`` of a field
    is the same sum taken of ``|x|`` (what its reductions and per-token roundings can each be off by a
    fraction ``u`` of); the clip fraction adds the tokens whose ratio lies within 8u of a clip bound, each
    worth ``1/n_i`` (so divided by ``u`` here)."""
    terms, near = _token_terms(log_probs, old_log_probs, advantages, entropy, eps_clip, eps_clip_high)
    m = mask.astype(np.float64)
    seg = _segments(lengths)
    counts = np.maximum(np.bincount(seg, weights=m, minlength=lengths.size), 1.0)

    def sample_mean_sum(x: np.ndarray) -> float:
        return float(np.sum(np.bincount(seg, weights=x * m, minlength=lengths.size) / counts))

    truth = {k: sample_mean_sum(x) for k, x in terms.items()}
    cond = {k: sample_mean_sum(np.abs(x)) for k, x in terms.items()}
    cond["clip"] += sample_mean_sum(near) / U32
    out = {"loss": truth["pg"] - entropy_coef * truth["ent"], "pg_loss": truth["pg"], "entropy_loss": truth["ent"],
           "pg_clipfrac": truth["clip"], "ppo_kl": truth["kl"]}
    out_cond = {"loss": cond["pg"] + abs(entropy_coef) * cond["ent"], "pg_loss": cond["pg"],
                "entropy_loss": cond["ent"], "pg_clipfrac": cond["clip"], "ppo_kl": cond["kl"]}
    return out, out_cond


def noise_ratios(expected, truth, cond, u: float) -> np.ndarray:
    """``|expected − truth| / (u · cond)`` element by element (a value's own float32 rounding included: the
    cond of an exactly representable zero is 0, and so must its error be)."""
    expected = np.asarray(expected, dtype=np.float64)
    truth = np.asarray(truth, dtype=np.float64)
    cond = np.asarray(cond, dtype=np.float64) + np.abs(truth)
    err = np.abs(expected - truth)
    ratio = np.full_like(err, np.inf)
    scaled = cond > 0
    ratio[scaled] = err[scaled] / (u * cond[scaled])
    ratio[err == 0] = 0.0
    return ratio
