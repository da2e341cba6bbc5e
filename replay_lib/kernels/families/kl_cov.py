"""KL-Cov (verl ``compute_policy_loss_kl_cov``, core_algos.py:1848-1925 in 0.9.1): ``pg = −A·r`` (no clip, no clamp
of the log-ratio), plus ``ppo_kl_coef·|log r|`` on the tokens of the top ``kl_cov_ratio`` by the covariance
``(A − Ā)·(logp − mean logp)`` — the means and the top-k over each **micro-batch's** loss tokens, ``k =
max(1, int(n·kl_cov_ratio))`` (the bundle's ``micro_batch_id`` partition). ``ppo_kl`` is the mean ``|log r|``.

Per-sample terms (``sample_terms``): each sample's micro-batch's ``Ā``, ``mean logp`` and the k-th largest
covariance's midpoint with the next (the threshold a token's must exceed). A token within rounding of the threshold may be selected or not
by a legitimate producer (``edge_gap``; its ``ppo_kl_coef·|log r|`` is then open: ``edge_open``).

``advantages``: ``raw`` (verl) as above; ``prescaled`` — SkyRL's ``compute_policy_loss_kl_cov``
(``skyrl/backends/skyrl_train/utils/ppo_utils.py:1001-1053`` @ a9564572eb8e) is handed the advantages already
divided by the loss reduction's normalizer (``apply_loss_reduction_to_advantages_minibatch``, :1152-1220) and sums
its terms (``reduce_loss``, :1145-1149): the covariance ranks ``w_i·A`` (``w_i`` the sample's aggregation weight),
and the penalty ``ppo_kl_coef·|log r|`` enters the loss unnormalized — ``ppo_kl_coef·|log r| / w_i`` per token in
the raw advantages' frame the replay aggregates (× ``w_i`` there). verl's is normalized with the surrogate."""

from __future__ import annotations

import torch

from . import CHOICES, PolicyFamily, register
from ._common import micro_batch_tokens

SCALINGS = ("raw", "prescaled")


def sample_terms(log_probs, old_log_probs, rollout_log_probs, loss_mask, lengths, knobs, dtype=torch.float32, *,
                 advantages=None, weights=None) -> dict:
    if advantages is None:
        raise ValueError("kl_cov needs the advantages for its covariance")
    if knobs.micro_batch is None:
        raise ValueError("kl_cov needs each sample's micro_batch_id")
    n = lengths.numel()
    per_mb, mb_of_sample = micro_batch_tokens(lengths, loss_mask, knobs.micro_batch)
    seg = torch.repeat_interleave(torch.arange(n), lengths.to(torch.int64))
    adv_all = advantages[: seg.numel()]  # a tensor (the lazy GRPO returns of --chain materialized by the slice)
    w = weights.to(dtype) if knobs.param("advantages") == "prescaled" else torch.ones(n, dtype=dtype)
    k_mb = len(per_mb)
    mean_a = torch.zeros(k_mb, dtype=dtype)
    mean_l = torch.zeros(k_mb, dtype=dtype)
    threshold = torch.full((k_mb,), float("inf"), dtype=dtype)
    scale = torch.zeros(k_mb, dtype=dtype)
    ratio = float(knobs.param("kl_cov_ratio"))
    for b, at in enumerate(per_mb):
        count = int(at.numel())
        if count == 0:
            continue
        a, l_ = adv_all[at].to(dtype) * w[seg[at]], log_probs[at].to(dtype)
        mean_a[b], mean_l[b] = a.mean(), l_.mean()
        cov = (a - mean_a[b]) * (l_ - mean_l[b])
        top = max(1, int(count * ratio))
        # the midpoint between the k-th and the (k+1)-th largest covariance: the selection's edge (a token is at
        # it only when those two lie within rounding of each other)
        values = torch.topk(cov, min(top + 1, count)).values
        threshold[b] = (values[top - 1] + values[top]) / 2 if count > top else float("-inf")
        # a covariance's rounding scale: its two factors' magnitudes
        scale[b] = ((a.abs() + mean_a[b].abs()) * (l_.abs() + mean_l[b].abs())).max()
    return {"klcov_mean_adv": mean_a[mb_of_sample], "klcov_mean_logp": mean_l[mb_of_sample],
            "klcov_threshold": threshold[mb_of_sample], "klcov_scale": scale[mb_of_sample], "klcov_weight": w}


def token_terms(log_probs, old_log_probs, advantages, knobs, *, seg=None, sample_terms=None,
                rollout_log_probs=None, ref_log_probs=None, dtype=torch.float32) -> dict:
    logp = log_probs.to(dtype)
    lr = logp - old_log_probs.to(dtype)
    adv = advantages.to(dtype)
    ratio = lr.exp()
    w = sample_terms["klcov_weight"][seg]
    cov = (adv * w - sample_terms["klcov_mean_adv"][seg]) * (logp - sample_terms["klcov_mean_logp"][seg])
    threshold = sample_terms["klcov_threshold"][seg]
    selected = cov > threshold
    coef = float(knobs.param("ppo_kl_coef"))
    penalty = coef * lr.abs()
    if knobs.param("advantages") == "prescaled":  # SkyRL sums the penalty: unnormalized in the replay's frame
        penalty = penalty / w
    pg = -adv * ratio + penalty * selected.to(dtype)
    gap = (cov - threshold).abs() / sample_terms["klcov_scale"][seg].clamp_min(1e-30)
    return {"pg": pg, "clip": selected.to(dtype), "ppo_kl": lr.abs(), "ratio": ratio, "log_ratio": lr,
            "klcov_selected": selected.to(dtype), "edge_gap": gap, "edge_open": penalty,
            "pg_err": (adv * ratio).abs() * (lr.abs() + 1.0) + penalty}


CHOICES.update({("kl_cov", "advantages"): SCALINGS})
register(PolicyFamily(
    name="kl_cov", defaults={"kl_cov_ratio": 0.0002, "ppo_kl_coef": 1.0, "advantages": "raw"},
    token_terms=token_terms, sample_terms=sample_terms, metrics=("ppo_kl",),
    weights=lambda knobs: knobs.param("advantages") == "prescaled",
    formula="pg = −A·r + ppo_kl_coef·|log r|·1[cov(A, logp) in the micro-batch's top kl_cov_ratio]"))
