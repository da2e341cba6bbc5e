"""Each policy-loss family's per-token slope ``∂pg_t/∂logp_t`` for loss.grad (SPEC §4.3), from the columns its
``token_terms`` returns in float64 (the same decisions loss.policy takes), with the family's stop-gradients:

* ``cispo``: ``−sg(clip(r))·A`` (the clipped ratio a constant: verl core_algos.py:2095, TRL grpo_trainer.py:3110);
* ``sapo``: ``−A·∂f/∂r·r·[|Δ| ≤ clamp]`` with ``f = σ(τ(r − 1))·4/τ``: ``∂f/∂r = 4σ(1 − σ)``;
* ``geo_mean``: the sample's loss ``−Ā·R``, ``R = exp(Σ Δ'·m/(n + 1e-8))``: per token ``−Ā·R·∂Δ'/∂Δ/(n + 1e-8)``
  (spread over the sample's tokens as each token's ``pg`` is ``−Ā·R/n``: the sample's sum is what is
  differentiated, so the column here is ``∂S_i/∂logp_u``); ``∂Δ'/∂Δ`` is 1 on the unclipped side of the sign-aware
  clip and 0 where it is clipped (``A > 0``: ``Δ > ε_high``; ``A < 0``: ``Δ < −ε_low``; ``A = 0``: 0);
* ``dppo_tv`` / ``dppo_kl``: ``−A·sg(min(r, c))·valid``;
* ``dro``: ``−A + β·Δ``; ``gpg``: ``−A``; ``cross_entropy``: ``−1``; ``importance_sampling``: ``−A·r``;
* ``kl_cov``: ``−A·r + ppo_kl_coef·sign(Δ)·selected`` (the selection a 0/1 decision);
* ``vespo``: ``−sg(φ(w))·A`` (``get_gamma_weights`` runs under ``no_grad``, TRL grpo_trainer.py:2970);
* ``ipo``: ``−keep·adv_tau·A·r + 2·kl_tau·log r`` (``r = exp(logp − rollout)``);
* ``rollout_is``: ``−sg(r·1[in range])·A``;
* ``dppo_mu``: ``−A·r·keep·[|logp − μ| ≤ 20]``;
* ``clip_cov``: ``−A·r·(1 − clip)·(1 − selected)`` — ``max(pg1, pg2)·corr`` with ``corr`` a constant (verl
  core_algos.py:1808-1829, SkyRL ppo_utils.py:938-999): a selected token's term is 0 (no gradient), PPO's clipped
  branch 0, the unclipped −A·r; the covariance only decides (no gradient of its own). SkyRL's ``prescaled``
  advantages ``w_i·A`` differ by the aggregation weight alone (the clip's side is that of ``A``'s sign).

Each function returns ``(slope, err, open)``: ``err`` the slope's rounding scale per token in units of the
producer's unit roundoff (its condition: the exponent's ``|Δ|``, the sample's exponent for a per-sample ratio,
DRO's and IPO's sums of terms), ``open`` the slope's magnitude had the family's own 0/1 decision at that token
gone the other way (``edge_gap`` marks the tokens at an edge; ``None`` for a family without one).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

# The rounding constant of a few products (error_model.C_TOKEN; kernels may not import judge)
_C = 8.0

Slope = Callable[..., tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]
SLOPES: dict[str, Slope] = {}


def _slope(name: str):
    def deco(fn):
        SLOPES[name] = fn
        return fn
    return deco


def _inside(x: torch.Tensor, bound: Optional[float]) -> torch.Tensor:
    return torch.ones_like(x) if bound is None else (x.abs() <= bound).to(x.dtype)


@_slope("cispo")
def cispo(t, logp, old, adv, rollout, knobs):
    g = -t["cispo_weight"] * adv
    return g, g.abs() * (_C + t["log_ratio"].abs()), None


@_slope("sapo")
def sapo(t, logp, old, adv, rollout, knobs):
    tau, ratio = t["sapo_tau"], t["ratio"]
    # σ and σ(1 − σ) = q/(1 + q)², q = e^{−|z|}: no cancellation at either tail (and one formula: the same bits
    # at any run's length, which torch.sigmoid's vectorized tail does not promise)
    z = tau * (ratio - 1.0)
    q = torch.exp(-z.abs())
    sig = torch.where(z >= 0, 1.0 / (1.0 + q), q / (1.0 + q))
    raw = logp - old
    inside = _inside(raw, knobs.log_ratio_clamp)
    g = -adv * 4.0 * (q / ((1.0 + q) * (1.0 + q))) * ratio * inside
    # d log(σ(1 − σ)·r)/d log r = 1 + τ·r·(1 − 2σ); and σ's backward σ·(1 − σ) takes 1 − σ of a rounded σ: a
    # relative error u·σ/(1 − σ) = u·e^{τ(r−1)}, |g| times it is 4|A|·r·σ² (finite where 1 − σ underflows)
    err = g.abs() * (_C + (1.0 + tau * ratio) * (t["log_ratio"].abs() + 1.0)) + \
        _C * 4.0 * (adv * ratio).abs() * sig * sig * inside
    return g, err, None


@_slope("geo_mean")
def geo_mean(t, logp, old, adv, rollout, knobs, *, sample_terms, seg, mask):
    lr = logp - old
    free = torch.where(adv > 0, lr <= knobs.eps_clip_high, torch.where(adv < 0, lr >= -knobs.eps_clip,
                                                                       torch.zeros_like(lr, dtype=torch.bool)))
    free = free.to(lr.dtype)
    n = sample_terms["gm_count"][seg]
    ratio = t["ratio"]
    share = -sample_terms["gm_advantage"][seg] * ratio / (n + 1e-8)
    g = share * free
    # Ā and the exponent are the sample's float32 sums of n terms, each within n·u of its magnitude: Ā by
    # n·Σ|A|·m/(n + 1e-8) (through R/(n + 1e-8)), the exponent by n·mean|Δ| (through |g|); the exponent's own
    # rounding |g|·(8 + |log R|)
    abs_adv = _sample_sum(adv.abs() * mask, seg)[seg] / (n + 1e-8)
    err = (g.abs() * (_C + t["log_ratio"].abs() + n * sample_terms["gm_abs_log_ratio"][seg])
           + n * abs_adv * ratio / (n + 1e-8)) * free
    return g, err, share.abs()


def _sample_sum(x: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    size = int(seg.max()) + 1 if seg.numel() else 0
    return torch.zeros(size, dtype=x.dtype).index_add_(0, seg, x)


def _dppo(t, logp, old, adv, rollout, knobs):
    c = float(knobs.param("trunc"))
    valid = t["dppo_valid"]
    full = -adv * t["ratio"].clamp(max=c)
    return full * valid, full.abs() * valid * (_C + t["log_ratio"].abs()), full.abs()


SLOPES["dppo_tv"] = SLOPES["dppo_kl"] = _dppo


@_slope("dro")
def dro(t, logp, old, adv, rollout, knobs):
    beta = float(knobs.param("beta"))
    lr = logp - old
    return -adv + beta * lr, adv.abs() + _C * beta * (lr.abs() + logp.abs() + old.abs()), None


@_slope("gpg")
def gpg(t, logp, old, adv, rollout, knobs):
    return -adv, adv.abs(), None


@_slope("cross_entropy")
def cross_entropy(t, logp, old, adv, rollout, knobs):
    one = torch.ones_like(logp)
    return -one, one, None


@_slope("importance_sampling")
def importance_sampling(t, logp, old, adv, rollout, knobs):
    g = -adv * t["ratio"]
    return g, g.abs() * (_C + t["log_ratio"].abs()), None


@_slope("kl_cov")
def kl_cov(t, logp, old, adv, rollout, knobs):
    coef = float(knobs.param("ppo_kl_coef"))
    lr = t["log_ratio"]
    sel = t["klcov_selected"]
    base = -adv * t["ratio"]
    g = base + coef * torch.sign(lr) * sel
    return g, base.abs() * (_C + lr.abs()) + _C * coef * sel, torch.full_like(g, coef)


@_slope("vespo")
def vespo(t, logp, old, adv, rollout, knobs, *, sample_terms, seg, mask):
    g = -t["phi"] * adv
    nonneg = adv >= 0
    k = torch.where(nonneg, float(knobs.param("k_pos")), float(knobs.param("k_neg"))).to(g.dtype)
    lam = torch.where(nonneg, float(knobs.param("lambda_pos")), float(knobs.param("lambda_neg"))).to(g.dtype)
    # log w is a sample's float32 sum of its n clamped log-ratios (≤ n·u·Σ|lr|), through ∂log φ/∂log w = k − λ·w
    n = _sample_sum(mask, seg)[seg]
    cond = (k.abs() + lam.clamp(min=1e-4) * t["log_w"].exp()) * n * sample_terms["vespo_abs_lr"][seg]
    return g, g.abs() * (_C + cond), None


@_slope("ipo")
def ipo(t, logp, old, adv, rollout, knobs):
    kl_tau = float(knobs.param("kl_tau"))
    surrogate = -float(knobs.param("adv_tau")) * adv * t["ratio"]
    lr = t["log_ratio"]
    g = t["ipo_keep"] * surrogate + 2.0 * kl_tau * lr
    err = t["ipo_keep"] * surrogate.abs() * (_C + lr.abs()) + _C * kl_tau * (lr.abs() + logp.abs() +
                                                                                 rollout.abs())
    return g, err, surrogate.abs()


@_slope("rollout_is")
def rollout_is(t, logp, old, adv, rollout, knobs):
    g = -t["rollout_ratio"] * adv
    return g, g.abs() * (_C + t["log_ratio"].abs()), (t["ratio"] * adv).abs()


@_slope("dppo_mu")
def dppo_mu(t, logp, old, adv, rollout, knobs):
    full = -adv * t["ratio"]
    raw = logp - (rollout if knobs.param("anchor") == "rollout" else old)
    keep = 1.0 - t["clip"]
    inside = _inside(raw, 20.0)
    return full * keep * inside, (full * keep * inside).abs() * (_C + t["log_ratio"].abs()), (full * inside).abs()


@_slope("clip_cov")
def clip_cov(t, logp, old, adv, rollout, knobs):
    full = -adv * t["ratio"]
    g = full * (1.0 - t["clipcov_ppo_clip"]) * (1.0 - t["clipcov_selected"])
    # the other side of a decision at its edge (PPO's clip, the rule at a recorded token): 0 or the unclipped slope
    return g, g.abs() * (_C + t["log_ratio"].abs()), full.abs()


# the slopes that read the family's per-sample terms (keyword arguments sample_terms, seg, mask)
SAMPLE_SLOPES = ("geo_mean", "vespo")
