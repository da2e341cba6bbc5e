"""Clip-Cov (verl ``compute_policy_loss_clip_cov``, core_algos.py:1744-1845 in 0.9.1; SkyRL
``compute_policy_loss_clip_cov``, ``skyrl/backends/skyrl_train/utils/ppo_utils.py:938-999`` @ a9564572eb8e): PPO's
clipped surrogate ``max(−A·r, −A·clamp(r, 1 − ε_low, 1 + ε_high))`` (no dual-clip, no clamp of the log-ratio),
multiplied by ``corr``, 0 on a **random** sample (``torch.randperm``) of ``max(1, int(clip_cov_ratio·n))`` of the
micro-batch's ``n`` loss tokens whose covariance ``(A − Ā)·(logp − mean logp)`` (the means over the micro-batch's
loss tokens) lies in ``(clip_cov_lb, clip_cov_ub)`` and whose ratio PPO did not clip; 1 elsewhere.
``pg_clipfrac`` is the mean of ``corr == 0``; ``ppo_kl`` the mean ``−log r``.

The draw cannot be recomputed: the bundle records it as the payload ``clip_cov_mask`` (1 where the producer set
``corr = 0``). The replay zeroes a token where the mask selects it **and** verl's rule allows it (a loss token,
its covariance inside the bounds, its ratio not clipped): a mask that selects any other token diverges at
loss.policy. A selected token whose covariance or ratio lies within rounding of its edge may be either
(``edge_gap``; its whole term is then open: ``edge_open``).

``advantages``: ``raw`` (verl) — the covariance of the advantages as recorded; ``prescaled`` (SkyRL) — SkyRL's
loss function sees the advantages already divided by the loss reduction's normalizer
(``apply_loss_reduction_to_advantages_minibatch``, ppo_utils.py:1152-1220) and sums, so its covariance is taken on
``w_i·A`` (``w_i`` the sample's aggregation weight, ``kernels.loss.agg_weights``) against the same bounds."""

from __future__ import annotations

import torch

from . import CHOICES, PolicyFamily, register
from ._common import INF, micro_batch_tokens, relative_gap

SCALINGS = ("raw", "prescaled")
MASK = "clip_cov_mask"


def covariance_means(advantages, log_probs, loss_mask, lengths, knobs, dtype, weights=None) -> dict:
    """Per sample: its micro-batch's ``Ā`` and ``mean logp`` over the loss tokens (the advantages × ``weights``
    per sample when given), the covariance's rounding scale in that micro-batch, and the weight itself."""
    if knobs.micro_batch is None:
        raise ValueError(f"policy_loss {knobs.policy_loss!r} needs each sample's micro_batch_id")
    n = lengths.numel()
    per_mb, mb_of_sample = micro_batch_tokens(lengths, loss_mask, knobs.micro_batch)
    seg = torch.repeat_interleave(torch.arange(n), lengths.to(torch.int64))
    adv_all = advantages[: seg.numel()]  # a tensor (the lazy GRPO returns of --chain materialized by the slice)
    w = torch.ones(n, dtype=dtype) if weights is None else weights.to(dtype)
    k_mb = len(per_mb)
    mean_a = torch.zeros(k_mb, dtype=dtype)
    mean_l = torch.zeros(k_mb, dtype=dtype)
    scale = torch.zeros(k_mb, dtype=dtype)
    for b, at in enumerate(per_mb):
        if at.numel() == 0:
            continue
        a, l_ = adv_all[at].to(dtype) * w[seg[at]], log_probs[at].to(dtype)
        mean_a[b], mean_l[b] = a.mean(), l_.mean()
        # a covariance's rounding scale: its two factors' magnitudes (each mean's rounding is of its terms' size)
        scale[b] = ((a.abs() + mean_a[b].abs()) * (l_.abs() + mean_l[b].abs())).max()
    return {"cov_mean_adv": mean_a[mb_of_sample], "cov_mean_logp": mean_l[mb_of_sample],
            "cov_scale": scale[mb_of_sample], "cov_weight": w}


def sample_terms(log_probs, old_log_probs, rollout_log_probs, loss_mask, lengths, knobs, dtype=torch.float32, *,
                 advantages=None, tokens=None, weights=None) -> dict:
    if advantages is None:
        raise ValueError("clip_cov needs the advantages for its covariance")
    prescaled = knobs.param("advantages") == "prescaled"
    return covariance_means(advantages, log_probs, loss_mask, lengths, knobs, dtype,
                            weights if prescaled else None)


def token_terms(log_probs, old_log_probs, advantages, knobs, *, seg=None, sample_terms=None,
                rollout_log_probs=None, ref_log_probs=None, dtype=torch.float32, tokens=None) -> dict:
    logp = log_probs.to(dtype)
    lr = logp - old_log_probs.to(dtype)
    adv = advantages.to(dtype)
    ratio = lr.exp()
    low, high = 1.0 - knobs.eps_clip, 1.0 + knobs.eps_clip_high
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(low, high)
    clipped = pg2 > pg1
    surrogate = torch.maximum(pg1, pg2)
    cov = (adv * sample_terms["cov_weight"][seg] - sample_terms["cov_mean_adv"][seg]) * \
        (logp - sample_terms["cov_mean_logp"][seg])
    lb, ub = float(knobs.param("clip_cov_lb")), float(knobs.param("clip_cov_ub"))
    allowed = (cov > lb) & (cov < ub) & ~clipped
    recorded = tokens[MASK] != 0
    selected = recorded & allowed
    pg = surrogate * (~selected).to(dtype)
    # the edges of the rule at a recorded token: the covariance against its bounds, the ratio against PPO's clip
    cov_gap = torch.minimum((cov - lb).abs(), (cov - ub).abs()) / sample_terms["cov_scale"][seg].clamp_min(1e-30)
    ratio_gap = relative_gap(ratio, low, high)
    rule_gap = torch.minimum(cov_gap, ratio_gap)
    gap = torch.where(recorded, rule_gap, torch.full_like(ratio, INF))
    # loss.grad's edges: PPO's clip at every token with A ≠ 0 (its slope −A·r or 0 either side), the rule's at a
    # recorded one (its term dropped or kept)
    grad_gap = torch.where(recorded, rule_gap, torch.where(adv != 0, ratio_gap, torch.full_like(ratio, INF)))
    return {"pg": pg, "clip": selected.to(dtype), "ppo_kl": -lr, "ratio": ratio, "log_ratio": lr,
            "clipcov_selected": selected.to(dtype), "clipcov_recorded": recorded.to(dtype), "edge_gap": gap,
            "edge_open": surrogate.abs(),
            # the rule at every token (the draw's size check, stages/loss_clip_cov.py): allowed, and its edge gap
            "clipcov_allowed": allowed.to(dtype), "clipcov_rule_gap": rule_gap,
            # loss.grad (kernels.families.grad): PPO's clip decision, and the edges of every decision of the slope
            "clipcov_ppo_clip": clipped.to(dtype), "grad_edge_gap": grad_gap}


CHOICES.update({("clip_cov", "advantages"): SCALINGS})
register(PolicyFamily(
    name="clip_cov", defaults={"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0,
                               "advantages": "raw"},
    token_terms=token_terms, sample_terms=sample_terms, payloads=(MASK,),
    weights=lambda knobs: knobs.param("advantages") == "prescaled",
    formula="pg = max(−A·r, −A·clamp(r, 1−ε_low, 1+ε_high))·(1 − 1[clip_cov_mask ∧ lb < cov(A, logp) < ub ∧ "
            "not clipped])",
    source="verl core_algos.py:1744-1845 (0.9.1); SkyRL ppo_utils.py:938-999"))
