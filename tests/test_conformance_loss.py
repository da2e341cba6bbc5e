"""Conformance of the loss-side knobs (SPEC §4.2) with each framework's own formula.

Every reference below is written here, from reading the framework's code at the commit named, on the padded
``[batch, max_len]`` layout the frameworks use (never on our concatenated token axis, never with
``replay_lib.kernels``), in float64 so that the comparison is of formulas, not of rounding. The step is
random but fixed: six samples of 1–9 tokens, a loss mask with holes (one sample fully masked), log-ratios
wide enough to clip on both sides and to hit the dual-clip bound, train/rollout log-ratios wide enough to
truncate and to mask.

Framework commits read:

* verl ``volcengine/verl@b178a3c`` — ``verl/trainer/ppo/core_algos.py`` and ``rollout_corr_helper.py``
* slime ``THUDM/slime@624b824`` — ``slime/backends/megatron_utils/loss.py``, ``slime/utils/ppo_utils.py``
* TRL ``huggingface/trl@f2cd577`` — ``trl/trainer/grpo_trainer.py``
* SkyRL ``NovaSky-AI/SkyRL@a956457`` — ``skyrl/backends/skyrl_train/utils/ppo_utils.py``
* NeMo-RL ``NVIDIA-NeMo/RL@7ea279a`` — ``nemo_rl/algorithms/loss/loss_functions.py``, ``nemo_rl/algorithms/utils.py``
* OpenRLHF ``OpenRLHF/OpenRLHF@3c3be62`` — ``openrlhf/models/loss.py``
"""

from __future__ import annotations

import pytest
import torch

from replay_lib.kernels.loss import LossKnobs, policy_loss_fields, value_loss_fields
from replay_lib.bundle.schema import RecomputeConfig

LENGTHS = [5, 9, 1, 7, 3, 8]
EPS_LOW, EPS_HIGH = 0.2, 0.28


def _step():
    g = torch.Generator().manual_seed(13)
    b, t = len(LENGTHS), max(LENGTHS)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        valid[i, :n] = True
    mask = (torch.rand(b, t, generator=g) > 0.2) & valid
    mask[2] = False  # a fully masked sample
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.6
    rollout = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.5
    ref = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4
    ref[1, 3] = logp[1, 3] - 25.0  # beyond the ±20 input clamp
    ref[3, 0] = logp[3, 0] + 14.0  # k3 beyond the ±10 output clamp
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).clone()
    adv[4] = -adv[4].abs()  # a negative group: dual-clip has work ...
    logp[4, :2] = old[4, :2] + 1.5  # ... on two tokens with ratio e^1.5 = 4.5 > c = 3
    mask[4, :2] = True
    values = torch.randn(b, t, generator=g, dtype=torch.float64)
    old_values = values + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    returns = values + torch.randn(b, t, generator=g, dtype=torch.float64)
    zero = ~valid  # padding: garbage the frameworks mask out
    for x in (old, logp, rollout, ref, adv, values, old_values, returns):
        x[zero] = 7.0
    return dict(mask=mask.to(torch.float64), valid=valid, old=old, logp=logp, rollout=rollout, ref=ref, adv=adv,
                values=values, old_values=old_values, returns=returns)


S = _step()
M = S["mask"]
TOKENS = int(M.sum())  # the step's loss tokens (one rank, one micro-batch: the "global" count here)


def flat(x: torch.Tensor) -> torch.Tensor:
    """Padded ``[B, T]`` → our concatenated token axis."""
    return x[S["valid"]]


def ours(**config) -> dict[str, float]:
    cfg = RecomputeConfig(eps_clip=EPS_LOW, eps_clip_high=EPS_HIGH, **config)
    out = policy_loss_fields(flat(S["logp"]), flat(S["old"]), flat(S["adv"]), None, flat(M), torch.tensor(LENGTHS),
                             eps_clip=EPS_LOW, eps_clip_high=EPS_HIGH, entropy_coef=0.0, dtype=torch.float64,
                             knobs=LossKnobs.of(cfg), rollout_log_probs=flat(S["rollout"]), ref_log_probs=flat(S["ref"]))
    return {k: float(v) for k, v in out.items()}


def masked_sum(x, m):
    return (x * m).sum()


def masked_mean(x, m):
    return (x * m).sum() / m.sum()


def vanilla_surrogate(ratio, adv, c=None):
    """verl compute_policy_loss_vanilla (core_algos.py:1160): pg_losses1 = −A·ratio, pg_losses2 = −A·clamp,
    clip_pg_losses1 = max; dual-clip (:1229) pg_losses3 = −A·c, where(A < 0, min(pg_losses3, ·), ·)."""
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH)
    pg = torch.maximum(l1, l2)
    if c is None:
        return pg, (l2 > l1).to(ratio.dtype), None
    l3 = -adv * c
    lower = (pg > l3).to(ratio.dtype) * (adv < 0).to(ratio.dtype)
    return torch.where(adv < 0, torch.minimum(l3, pg), pg), (l2 > l1).to(ratio.dtype), lower


# ------------------------------------------------------------------------------------------------ verl


@pytest.mark.parametrize("mode,verl_mode", [("token_mean", "token-mean"), ("seq_mean_token_mean", "seq-mean-token-mean"),
                                            ("seq_mean_token_sum", "seq-mean-token-sum"),
                                            ("seq_mean_token_sum_norm", "seq-mean-token-sum-norm")])
def test_verl_agg_loss_modes_with_dual_clip(mode, verl_mode):
    """verl ``agg_loss`` (core_algos.py:1025-1081): token-mean ``masked_sum / batch_num_tokens · dp_size``
    (:1058); seq-mean-token-mean ``Σ_i (Σ_t x·m / (n_i + 1e-8)) / global_batch_size · dp_size`` over the
    sequences with a loss token; seq-mean-token-sum ``Σ_i Σ_t x·m / global_batch_size · dp_size``;
    seq-mean-token-sum-norm ``Σ_i Σ_t x·m / loss_scale_factor`` (:1076, no dp_size). The loss of
    compute_policy_loss_vanilla (:1160), whose ratio is ``exp(clamp(logp − old, ±20))`` (:1212) and whose
    dual-clip c = 3 is always on (:1229); its metrics ``pg_clipfrac``, ``pg_clipfrac_lower`` (:1231) and
    ``ppo_kl`` are masked means over the micro-batch's tokens."""
    dp, seqs, horizon = 4, 6, 12  # global counts: the bundle records them (loss_seq_count, loss_horizon)
    global_tokens = 3 * TOKENS
    lr = (S["logp"] - S["old"]).clamp(-20.0, 20.0)
    pg, clip, lower = vanilla_surrogate(lr.exp(), S["adv"], c=3.0)
    n = M.sum(-1)
    if verl_mode == "token-mean":
        loss = masked_sum(pg, M) / global_tokens * dp
    elif verl_mode == "seq-mean-token-mean":
        loss = ((pg * M).sum(-1) / (n + 1e-8) * (n > 0)).sum() / seqs * dp
    elif verl_mode == "seq-mean-token-sum":
        loss = ((pg * M).sum(-1) * (n > 0)).sum() / seqs * dp
    else:
        loss = (pg * M).sum(-1).sum() / (seqs * horizon)
    scale = 1.0 if verl_mode == "seq-mean-token-sum-norm" else float(dp)
    # one recorded T: the global one for a token-mean loss, else the micro-batch's for the token-mean metrics
    got = ours(loss_agg_mode=mode, metric_agg_mode="token_mean",
               loss_token_count=global_tokens if mode == "token_mean" else TOKENS,
               loss_seq_count=seqs if mode != "token_mean" else None, loss_horizon=horizon, eps_clip_c=3.0,
               log_ratio_clamp=20.0, loss_scale=scale)
    assert got["pg_loss"] == pytest.approx(float(loss), rel=1e-7 if mode == "seq_mean_token_mean" else 1e-12)
    if mode != "token_mean":  # the metrics: the micro-batch's own token mean (metric_agg_mode, T = its tokens)
        assert got["pg_clipfrac"] == pytest.approx(float(masked_mean(clip, M)), rel=1e-12)
        assert got["pg_clipfrac_lower"] == pytest.approx(float(masked_mean(lower, M)), rel=1e-12)
        assert got["ppo_kl"] == pytest.approx(float(masked_mean(-lr, M)), rel=1e-12)
        assert got["pg_clipfrac_lower"] > 0 and got["pg_clipfrac"] > 0


def test_verl_gspo_sequence_ratio():
    """verl ``compute_policy_loss_gspo`` (core_algos.py:1254): ``s_i = exp(Σ_t Δ·m / clamp(n_i, 1))``
    (the log clamped at max 10, :1298 — never reached here), clipped with clip_ratio_low/high, aggregated
    seq-mean-token-mean; ``ppo_kl`` the token log-ratio's masked mean."""
    lr = S["logp"] - S["old"]
    seq = (lr * M).sum(-1) / M.sum(-1).clamp(min=1)
    assert float(seq.max()) < 10
    ratio = seq.exp()[:, None].expand_as(lr)
    pg, clip, _ = vanilla_surrogate(ratio, S["adv"])
    n = M.sum(-1)
    seqs = int((n > 0).sum())
    loss = ((pg * M).sum(-1) / (n + 1e-8) * (n > 0)).sum() / seqs
    got = ours(importance_level="sequence", loss_agg_mode="seq_mean_token_mean", loss_seq_count=seqs,
               metric_agg_mode="token_mean", loss_token_count=TOKENS)
    assert got["pg_loss"] == pytest.approx(float(loss), rel=1e-7)
    assert got["pg_clipfrac"] == pytest.approx(float(masked_mean(clip, M)), rel=1e-12)
    assert got["ppo_kl"] == pytest.approx(float(masked_mean(-lr, M)), rel=1e-12)


@pytest.mark.parametrize("kind", ["k1", "k2", "low_var_kl"])
def test_verl_kl_loss(kind):
    """verl ``kl_penalty_forward`` (core_algos.py:1867): k1 ``logprob − ref``; k2/mse ``0.5·(logprob − ref)²``;
    low_var_kl/k3 ``kl = clamp(ref − logprob, ±20)`` (:1893), ``exp(kl) − kl − 1`` clamped to ±10 (:1896);
    the actor adds ``kl_loss_coef · agg_loss(kl)`` with the loss mode (token-mean here)."""
    d = S["logp"] - S["ref"]
    if kind == "k1":
        kl = d
    elif kind == "k2":
        kl = 0.5 * d.square()
    else:
        r = (S["ref"] - S["logp"]).clamp(-20, 20)
        kl = (r.exp() - r - 1).clamp(-10, 10)
    clamps = dict(kl_loss_input_clamp=20.0, kl_loss_output_clamp=10.0) if kind == "low_var_kl" else {}
    got = ours(use_kl_loss=True, kl_loss_coef=0.001, kl_loss_type=kind, loss_agg_mode="token_mean",
               loss_token_count=TOKENS, **clamps)
    assert got["kl_loss"] == pytest.approx(float(masked_sum(kl, M) / TOKENS), rel=1e-12)
    assert got["loss"] == pytest.approx(got["pg_loss"] + 0.001 * got["kl_loss"], rel=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_verl_rollout_correction_weights(level):
    """verl ``compute_rollout_correction_weights`` (rollout_corr_helper.py:481): log ratio ``old − rollout``
    per token or summed per sequence (:580), clamped to ±SAFETY_BOUND = 20 (:75), exp, truncated at
    ``clamp(max=rollout_is_threshold)`` (:562); compute_policy_loss_vanilla multiplies ``pg_losses`` by it
    after dual-clip."""
    d = S["old"] - S["rollout"]
    if level == "sequence":
        d = (d * M).sum(-1, keepdim=True).expand_as(d)
    w = d.clamp(-20, 20).exp().clamp(max=2.0)
    pg, _, _ = vanilla_surrogate(S["logp"].sub(S["old"]).exp(), S["adv"], c=3.0)
    loss = masked_sum(pg * w, M) / TOKENS
    got = ours(is_level=level, is_high=2.0, is_log_clamp=20.0, eps_clip_c=3.0, loss_agg_mode="token_mean",
               loss_token_count=TOKENS)
    assert got["pg_loss"] == pytest.approx(float(loss), rel=1e-12)


def test_verl_value_loss():
    """verl ``compute_value_loss`` (core_algos.py:1799): ``vpredclipped = clip_by_value(vpreds, values ± ε)``
    (:1832), ``0.5 · agg_loss(max((v − R)², (vclip − R)²))``, ``vf_clipfrac = masked_mean(gt(vf2, vf1))``
    (:1837)."""
    v, old, ret = S["values"], S["old_values"], S["returns"]
    clipped = torch.minimum(torch.maximum(v, old - 0.2), old + 0.2)
    vf1, vf2 = (v - ret) ** 2, (clipped - ret) ** 2
    vf_loss = 0.5 * masked_sum(torch.maximum(vf1, vf2), M) / TOKENS
    clipfrac = masked_mean((vf2 > vf1).to(torch.float64), M)
    knobs = LossKnobs.of(RecomputeConfig(value_clip=0.2, loss_agg_mode="token_mean", loss_token_count=TOKENS))
    got = value_loss_fields(flat(v), flat(old), flat(ret), flat(M), torch.tensor(LENGTHS), knobs, dtype=torch.float64)
    assert float(got["vf_loss"]) == pytest.approx(float(vf_loss), rel=1e-12)
    assert float(got["vf_clipfrac"]) == pytest.approx(float(clipfrac), rel=1e-12)


# ----------------------------------------------------------------------------------------------- slime


def _sum_of_sample_mean(x):
    """slime ``get_sum_of_sample_mean`` (CP = 1): ``Σ_i Σ_t x·m / clamp(Σ_t m, 1)``."""
    return ((x * M).sum(-1) / M.sum(-1).clamp(min=1)).sum()


def test_slime_dual_clip_tis_icepop_and_kl_loss():
    """slime ``compute_policy_loss`` (utils/ppo_utils.py:125; dual-clip ``pg_losses3 = −eps_clip_c·A``, :142);
    ``vanilla_tis_function`` (megatron_utils/loss.py:884: ``clamp(exp(old − rollout), tis_clip_low, tis_clip)``,
    :897) and ``icepop_function`` (:908: the ratio kept inside [tis_clip_low, tis_clip], else 0, :921), each
    multiplying pg; ``kl_loss = sum_of_sample_mean(compute_approx_kl(logp, ref, k3))`` (:1128), slime's k3
    with no input clamp and no output clamp (utils/ppo_utils.py:12, the ±10 clamp only for low_var_kl, :49)."""
    ppo_kl = S["old"] - S["logp"]
    pg, clip, _ = vanilla_surrogate((-ppo_kl).exp(), S["adv"], c=3.0)
    tis = (S["old"] - S["rollout"]).exp()
    w_tis = tis.clamp(min=0.5, max=2.0)
    w_ice = torch.where((tis >= 0.5) & (tis <= 2.0), tis, torch.zeros_like(tis))
    r = -(S["logp"] - S["ref"])
    k3 = r.exp() - 1 - r
    got_tis = ours(eps_clip_c=3.0, use_tis=True, tis_clip=2.0, tis_clip_low=0.5, use_kl_loss=True, kl_loss_coef=0.01,
                   kl_loss_type="k3")
    assert got_tis["pg_loss"] == pytest.approx(float(_sum_of_sample_mean(pg * w_tis)), rel=1e-12)
    assert got_tis["kl_loss"] == pytest.approx(float(_sum_of_sample_mean(k3)), rel=1e-12)
    assert got_tis["loss"] == pytest.approx(got_tis["pg_loss"] + 0.01 * got_tis["kl_loss"], rel=1e-12)
    assert got_tis["pg_clipfrac"] == pytest.approx(float(_sum_of_sample_mean(clip)), rel=1e-12)
    got_ice = ours(eps_clip_c=3.0, is_level="token", is_mode="mask", is_low=0.5, is_high=2.0)
    assert got_ice["pg_loss"] == pytest.approx(float(_sum_of_sample_mean(pg * w_ice)), rel=1e-12)
    assert got_ice["pg_loss"] != got_tis["pg_loss"]


# ------------------------------------------------------------------------------------------------- TRL


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_trl_loss_types(loss_type):
    """TRL ``GRPOTrainer._compute_loss`` (grpo_trainer.py:2991): ``coef_1 = exp(logp − old)``, ``coef_2 =
    clamp(coef_1, 1 − ε_low, 1 + ε_high)``, two-sided clipping ``coef_1 = clamp(coef_1, max=delta)`` (:3087),
    ``−min(coef_1·A, coef_2·A)`` (:3091), ``+ β·k3`` per token (:3072, :3121); then grpo ``mean_i(Σ_t x·m /
    clamp(n_i, 1))`` (:3125); bnpo ``Σ x·m / clamp(Σ m, 1)``; dr_grpo ``Σ x·m / (B·max_completion_length)``
    (:3135); dapo ``Σ x·m / (num_items_in_batch / num_processes)`` (:3140), num_items_in_batch the gathered
    token count (:2427). The mapping: grpo → seq_mean_token_mean (N = B); bnpo → token_mean (T = the
    micro-batch's tokens); dr_grpo → seq_mean_token_sum_norm (N = B, L = max_completion_length); dapo →
    token_mean with T = num_items_in_batch and loss_scale = num_processes; delta → eps_clip_c; β·k3 → the KL
    loss with coefficient β (TRL's k3: ``exp(ref − logp) − (ref − logp) − 1``, no clamps)."""
    b, max_len, procs, delta, beta = len(LENGTHS), 16, 2, 4.0, 0.04
    items = 2 * TOKENS
    coef_1 = (S["logp"] - S["old"]).exp()
    coef_2 = coef_1.clamp(1 - EPS_LOW, 1 + EPS_HIGH)
    coef_1 = coef_1.clamp(max=delta)
    per_token = -torch.minimum(coef_1 * S["adv"], coef_2 * S["adv"])
    d = S["ref"] - S["logp"]
    per_token = per_token + beta * (d.exp() - d - 1)
    if loss_type == "grpo":
        loss, knobs = ((per_token * M).sum(-1) / M.sum(-1).clamp(min=1.0)).mean(), dict(
            loss_agg_mode="seq_mean_token_mean", loss_seq_count=b)
    elif loss_type == "bnpo":
        loss, knobs = masked_sum(per_token, M) / M.sum(), dict(loss_agg_mode="token_mean", loss_token_count=TOKENS)
    elif loss_type == "dr_grpo":
        loss, knobs = masked_sum(per_token, M) / (b * max_len), dict(
            loss_agg_mode="seq_mean_token_sum_norm", loss_seq_count=b, loss_horizon=max_len)
    else:
        loss, knobs = masked_sum(per_token, M) / (items / procs), dict(
            loss_agg_mode="token_mean", loss_token_count=items, loss_scale=float(procs))
    got = ours(eps_clip_c=delta, use_kl_loss=True, kl_loss_coef=beta, kl_loss_type="k3", **knobs)
    assert got["loss"] == pytest.approx(float(loss), rel=1e-12)


def test_trl_sequence_importance_sampling():
    """TRL ``importance_sampling_level='sequence'`` (grpo_trainer.py:3058): ``log w_i = Σ_t Δ·m / clamp(n_i, 1)``,
    one ratio per sequence, clipped like a token's; with loss_type grpo (:3125)."""
    lr = S["logp"] - S["old"]
    coef_1 = ((lr * M).sum(-1) / M.sum(-1).clamp(min=1.0)).exp()[:, None]
    coef_2 = coef_1.clamp(1 - EPS_LOW, 1 + EPS_HIGH)
    per_token = -torch.minimum(coef_1 * S["adv"], coef_2 * S["adv"])
    loss = ((per_token * M).sum(-1) / M.sum(-1).clamp(min=1.0)).mean()
    got = ours(importance_level="sequence", loss_agg_mode="seq_mean_token_mean", loss_seq_count=len(LENGTHS))
    assert got["pg_loss"] == pytest.approx(float(loss), rel=1e-12)


# ----------------------------------------------------------------------------------------------- SkyRL


def test_skyrl_token_mean_dual_clip_and_k3():
    """SkyRL ``ppo_policy_loss`` (ppo_utils.py:557): ``ratio = exp(logp − old)`` (clipped at ±20 in log space),
    ``−min(ratio·A, clamp(ratio)·A)``, dual_clip ``pg_losses3 = −A·clip_ratio_c`` (:574), summed by
    ``reduce_loss`` (:1145) over advantages pre-divided by the mini-batch token count for ``token_mean``
    (``apply_loss_reduction_to_advantages_minibatch``, :1181) — equal to a token mean because the surrogate is
    positively homogeneous in A. ``compute_approx_kl`` k3 (:88): ``clamp(ref − logp, ±20)``, ``exp − · − 1``,
    clamped to ±10 (:118)."""
    a = S["adv"] / M.sum().clamp(min=1)
    ratio = (S["logp"] - S["old"]).clamp(-20, 20).exp()
    loss = -torch.minimum(ratio * a, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * a)
    loss = torch.where(a < 0, torch.minimum(-a * 3.0, loss), loss)
    r = (S["ref"] - S["logp"]).clamp(-20, 20)
    kl = (r.exp() - r - 1).clamp(-10, 10)
    got = ours(eps_clip_c=3.0, log_ratio_clamp=20.0, loss_agg_mode="token_mean", loss_token_count=TOKENS,
               use_kl_loss=True, kl_loss_coef=0.001, kl_loss_type="k3", kl_loss_input_clamp=20.0,
               kl_loss_output_clamp=10.0)
    assert got["pg_loss"] == pytest.approx(float(masked_sum(loss, M)), rel=1e-12)
    assert got["kl_loss"] == pytest.approx(float(masked_sum(kl, M) / TOKENS), rel=1e-12)


def test_skyrl_critic_loss():
    """SkyRL ``ppo_critic_loss`` (ppo_utils.py:156): ``v_old + clamp(v − v_old, ±ε)``, ``max(surr1, surr2)``,
    ``0.5 · masked_mean(·, dim=-1).mean()`` (a mean of per-sequence means: seq_mean_token_mean with N = B),
    clipfrac ``surr1 > surr2`` (:168, the clipped square larger)."""
    v, old, ret = S["values"], S["old_values"], S["returns"]
    live = M.sum(-1) > 0
    m = M[live]
    surr1 = (old + (v - old).clamp(-0.3, 0.3) - ret)[live] ** 2
    surr2 = (v - ret)[live] ** 2
    loss = 0.5 * ((torch.maximum(surr1, surr2) * m).sum(-1) / m.sum(-1)).mean()
    knobs = LossKnobs.of(RecomputeConfig(value_clip=0.3, loss_agg_mode="seq_mean_token_mean",
                                         loss_seq_count=int(live.sum()), metric_agg_mode="token_mean",
                                         loss_token_count=TOKENS))
    got = value_loss_fields(flat(v), flat(old), flat(ret), flat(M), torch.tensor(LENGTHS), knobs, dtype=torch.float64)
    assert float(got["vf_loss"]) == pytest.approx(float(loss), rel=1e-12)
    assert float(got["vf_clipfrac"]) == pytest.approx(float(((surr1 > surr2) * m).sum() / m.sum()), rel=1e-12)


# --------------------------------------------------------------------------------------------- NeMo-RL


@pytest.mark.parametrize("tis_type", ["tis", "icepop"])
def test_nemo_rl_clipped_pg_with_kl_and_truncated_is(tis_type):
    """NeMo-RL ``ClippedPGLossFn.__call__`` (loss/loss_functions.py:374): ``max(−A·ratio, −A·clamp(ratio))``,
    dual-clip ``loss3 = −A·ratio_clip_c`` under ``A < 0`` (:558); actor IS weights ``exp(prev − generation)``
    truncated (``tis``: clamp to [min, max], :612) or masked (``icepop``: kept inside [min, max], :618); the
    KL term ``β·calculate_kl(curr, ref, k3, input_clamp 20, output_clamp 10)`` (utils.py:42: ``logr = ref −
    logp`` clamped (:81), ``exp(logr) − 1 − logr``, output clamp (:98)), each a masked mean over the
    global valid tokens (:508): token_mean with T = global_valid_toks."""
    ratio = (S["logp"] - S["old"]).exp()
    pg, _, _ = vanilla_surrogate(ratio, S["adv"], c=3.0)
    w = (S["old"] - S["rollout"]).exp()
    w = w.clamp(min=0.5, max=2.0) if tis_type == "tis" else torch.where((w >= 0.5) & (w <= 2.0), w, w * 0)
    logr = (S["ref"] - S["logp"]).clamp(-20, 20)
    kl = (logr.exp() - 1 - logr).clamp(-10, 10)
    global_toks = 5 * TOKENS
    actor, kl_loss = masked_sum(pg * w, M) / global_toks, masked_sum(kl, M) / global_toks
    got = ours(eps_clip_c=3.0, is_level="token", is_mode="truncate" if tis_type == "tis" else "mask", is_low=0.5,
               is_high=2.0, use_kl_loss=True, kl_loss_coef=0.01, kl_loss_type="k3", kl_loss_input_clamp=20.0,
               kl_loss_output_clamp=10.0, loss_agg_mode="token_mean", loss_token_count=global_toks)
    assert got["pg_loss"] == pytest.approx(float(actor), rel=1e-12)
    assert got["loss"] == pytest.approx(float(actor + 0.01 * kl_loss), rel=1e-12)


# -------------------------------------------------------------------------------------------- OpenRLHF


@pytest.mark.parametrize("correction", ["tis", "icepop"])
def test_openrlhf_policy_loss_token_level(correction):
    """OpenRLHF ``PolicyLoss.forward`` (models/loss.py:155): ``ratio = exp(clamp(logp − old, ±20))``;
    dual-clip ``clip2 = max(min(surr1, surr2), dual_clip·A)`` for ``A < 0`` (:191); vLLM IS correction on
    ``exp(old − rollout)``: icepop keeps it inside [low, high] (:203), tis clamps it (:216); ``aggregate_loss``
    token level ``Σ x·m / batch_num_tokens · dp_size`` (:32)."""
    ratio = (S["logp"] - S["old"]).clamp(-20, 20).exp()
    surr1, surr2 = ratio * S["adv"], ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * S["adv"]
    clip1 = torch.minimum(surr1, surr2)
    loss = -torch.where(S["adv"] < 0, torch.maximum(clip1, 3.0 * S["adv"]), clip1)
    vis = (S["old"] - S["rollout"]).exp()
    vis = vis * ((vis >= 0.5) & (vis <= 2.0)) if correction == "icepop" else vis.clamp(min=0.5, max=2.0)
    batch_tokens, dp = 4 * TOKENS, 4
    expected = masked_sum(vis * loss, M) / batch_tokens * dp
    got = ours(eps_clip_c=3.0, log_ratio_clamp=20.0, is_level="token", is_low=0.5, is_high=2.0,
               is_mode="mask" if correction == "icepop" else "truncate", loss_agg_mode="token_mean",
               loss_token_count=batch_tokens, loss_scale=float(dp))
    assert got["pg_loss"] == pytest.approx(float(expected), rel=1e-12)


def test_openrlhf_value_loss_sample_level():
    """OpenRLHF ``ValueLoss`` (models/loss.py:233): ``v_old + clamp(v − v_old, ±ε)``, ``max`` of the squares,
    ``aggregate_loss`` sample level ``Σ_i (Σ_t x·m / (n_i + 1e-8)) / global_batch_size · dp_size`` (:11),
    ``0.5·`` (:269)."""
    v, old, ret = S["values"], S["old_values"], S["returns"]
    surr1 = (old + (v - old).clamp(-0.2, 0.2) - ret) ** 2
    surr2 = (v - ret) ** 2
    n = M.sum(-1)
    seq = (torch.maximum(surr1, surr2) * M).sum(-1) / (n + 1e-8)
    global_batch, dp = 10, 2
    expected = 0.5 * (seq * (n > 0)).sum() / global_batch * dp
    knobs = LossKnobs.of(RecomputeConfig(value_clip=0.2, loss_agg_mode="seq_mean_token_mean",
                                         loss_seq_count=global_batch, loss_scale=float(dp)))
    got = value_loss_fields(flat(v), flat(old), flat(ret), flat(M), torch.tensor(LENGTHS), knobs, dtype=torch.float64)
    assert float(got["vf_loss"]) == pytest.approx(float(expected), rel=1e-7)
