"""Gradient replay of the policy-loss families (stage ``loss.grad``, SPEC §4.3): each family's analytic
∂L/∂logp (``kernels.families.grad``) against hand-derived values per branch, and the recorded ``grad_log_probs``
of an independent producer (``producers.grad_families``: ``torch.autograd`` on losses it writes itself) — clean
for every family and knob, and one gradient bug per family named at ``loss.grad`` while ``loss.policy`` passes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from producers import Size
from producers.grad_families import CONFIGS, FAMILY_GRAD_BUGS, FamilyGradConfig, produce_family_grad_bundle
from replay_lib.bundle.loss_knobs import LossKnobs
from replay_lib.kernels.grad import GradInputs, grad_log_probs
from test_grad import _stages, fails_at_loss_grad_alone, replays_clean_at_every_token, runs_give_the_one_pass_gradient

SIZE = Size(samples=16, tokens=96, group_size=4)
F64 = torch.float64


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def _gi(d, adv, *, lengths=None, mask=None, rollout=None, teacher=None, entropy=None) -> GradInputs:
    """Tokens with ``logp − old = d`` (old = −1); ``rollout`` / ``teacher`` as log-probs."""
    d = _t(d)
    old = torch.full_like(d, -1.0)
    return GradInputs(log_probs=old + d, old_log_probs=old, advantages=_t(adv),
                      mask=_t(mask if mask is not None else [1.0] * len(d)),
                      lengths=torch.tensor(lengths or [1] * len(d)),
                      rollout_log_probs=None if rollout is None else _t(rollout),
                      teacher_log_probs=None if teacher is None else _t(teacher),
                      entropy=None if entropy is None else _t(entropy))


def _knobs(family: str, **kw) -> LossKnobs:
    """token_sum, loss_scale 1: g = ∂S/∂logp itself."""
    params = tuple(sorted(kw.pop("params", {}).items()))
    return LossKnobs(policy_loss=family, policy_loss_params=params, loss_agg_mode="token_sum", **kw)


def _grad(gi, knobs) -> list[float]:
    return grad_log_probs(gi, knobs).grad.tolist()


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_cispo_the_clipped_ratio_is_a_constant_weight():
    """−sg(clip(r))·A: r = 1.1 inside (A = 2), 1.5 above 1 + 0.28 (A = 1), 0.5 below 1 − 0.2 (A = −1); the
    absolute cap (TRL) min(r, 1.2)."""
    g = _grad(_gi([math.log(1.1), math.log(1.5), math.log(0.5)], [2.0, 1.0, -1.0]),
              _knobs("cispo", eps_clip=0.2, eps_clip_high=0.28))
    assert g == pytest.approx([-2.2, -1.28, 0.8], rel=1e-12)
    g = _grad(_gi([math.log(1.1), math.log(1.5)], [1.0, -1.0]),
              _knobs("cispo", eps_clip_high=1.2, params={"cap": "absolute"}))
    assert g == pytest.approx([-1.1, 1.2], rel=1e-12)


def test_sapo_the_soft_gates_derivative():
    """∂(−σ(τ(r−1))·4/τ·A)/∂logp = −A·4σ(1−σ)·r: τ_pos = 1 at r = 1.5, A = 1; τ_neg = 1.05 at r = 0.8, A = −1."""
    s1, s2 = sig(0.5), sig(1.05 * -0.2)
    g = _grad(_gi([math.log(1.5), math.log(0.8)], [1.0, -1.0]), _knobs("sapo"))
    assert g == pytest.approx([-4 * s1 * (1 - s1) * 1.5, 4 * s2 * (1 - s2) * 0.8], rel=1e-12)


def test_geo_mean_the_sign_aware_clip_has_no_gradient_where_it_clips():
    """GMPO, ε = 0.2 both sides, the sample's loss −Ā·R with Ā = ΣA/(n + 1e-8), R = exp(ΣΔ'/(n + 1e-8)): sample 0
    (A = 1): Δ = (0.05, 0.3, −0.3) → Δ' = (0.05, 0.2, −0.3): the clipped token 1 has no gradient, the others
    −Ā·R/(n + 1e-8); sample 1 (A = −1): Δ = (0.3, −0.3) → (0.3, −0.2): the first −Ā·R/(2 + 1e-8), the clipped 0."""
    knobs = _knobs("geo_mean", eps_clip=0.2, eps_clip_high=0.2)
    g = _grad(_gi([0.05, 0.3, -0.3, 0.3, -0.3], [1.0] * 3 + [-1.0] * 2, lengths=[3, 2]), knobs)
    n0, n1 = 3 + 1e-8, 2 + 1e-8
    g0 = -(3 / n0) * math.exp(-0.05 / n0) / n0
    g1 = (2 / n1) * math.exp(0.1 / n1) / n1
    assert g == pytest.approx([g0, 0.0, g0, g1, 0.0], rel=1e-12)


def test_dppo_tv_the_truncated_ratio_is_a_constant_and_the_mask_drops():
    """−A·sg(min(r, 1.2))·valid, p_old = e^{−1}: r = 1.1, A = 1 (p − p_old = 0.037 ≤ 0.05: valid); r = 1.5, A = 1
    (0.184 > 0.05: dropped); r = 1.5, A = −1 (≥ −0.05: valid, truncated at 1.2)."""
    knobs = _knobs("dppo_tv", eps_clip=0.05, eps_clip_high=0.05, params={"trunc": 1.2})
    g = _grad(_gi([math.log(1.1), math.log(1.5), math.log(1.5)], [1.0, 1.0, -1.0]), knobs)
    assert g == pytest.approx([-1.1, 0.0, 1.2], rel=1e-12)


def test_dro_gpg_cross_entropy_and_importance_sampling():
    """DRO −A + β·Δ (β = 0.5, Δ = 0.2, A = 1); GPG −A; cross-entropy −1; importance sampling −A·r."""
    gi = _gi([0.2, -0.4], [1.0, -2.0])
    assert _grad(gi, _knobs("dro", params={"beta": 0.5})) == pytest.approx([-0.9, 2.0 - 0.2], rel=1e-12)
    assert _grad(gi, _knobs("gpg")) == [-1.0, 2.0]
    assert _grad(gi, _knobs("cross_entropy")) == [-1.0, -1.0]
    assert _grad(gi, _knobs("importance_sampling")) == pytest.approx([-math.exp(0.2), 2 * math.exp(-0.4)],
                                                                     rel=1e-12)


def test_kl_cov_the_selected_tokens_penalty_slope():
    """One micro-batch of 4 tokens, kl_cov_ratio ¼ (k = 1), coef 2: A = (2, 0, 0, −2), logp − mean logp = (0.2,
    −0.1, −0.1, 0): only token 0's covariance (0.4) is selected: g_0 = −2·e^{0.3} + 2·sign(0.3); the others −A·r."""
    knobs = _knobs("kl_cov", micro_batch=(0,), params={"kl_cov_ratio": 0.25, "ppo_kl_coef": 2.0})
    g = _grad(_gi([0.3, 0.0, 0.0, 0.1], [2.0, 0.0, 0.0, -2.0], lengths=[4]), knobs)
    assert g == pytest.approx([-2 * math.exp(0.3) + 2.0, 0.0, 0.0, 2 * math.exp(0.1)], rel=1e-12)


def test_vespo_phi_is_a_constant_of_the_gradient():
    """−φ(w)·A with log w = Σ Δ = 0.3 and (k, λ) = (2, 3) for A ≥ 0: φ = e^{3 + 2·0.3 − 3·e^{0.3}}."""
    phi = math.exp(3 + 2 * 0.3 - 3 * math.exp(0.3))
    g = _grad(_gi([0.1, 0.2], [1.0, 1.0], lengths=[2]), _knobs("vespo"))
    assert g == pytest.approx([-phi, -phi], rel=1e-12)


def test_ipo_the_kept_surrogate_and_the_squared_log_ratio():
    """r = exp(logp − rollout): token 0 kept (|e^{−1} − e^{−1.1}| = 0.035 ≤ 0.1): −A·r + 2·kl_tau·0.1; token 1
    dropped (|e^{−0.5} − e^{−1}| = 0.24): 2·kl_tau·0.5 only."""
    knobs = _knobs("ipo", params={"ipo_threshold": 0.1, "adv_tau": 1.0, "kl_tau": 0.01})
    g = _grad(_gi([0.0, 0.5], [1.0, 1.0], rollout=[-1.1, -1.0]), knobs)
    assert g == pytest.approx([-math.exp(0.1) + 0.002, 0.01], rel=1e-12)


def test_rollout_is_and_dppo_mu_their_ratio_to_the_rollout():
    """rollout_is: −sg(r·1[0.8 < r < 1.28])·A (r = e^{0.1} kept, e^{0.5} out: 0); dppo_mu (tv, δ = 0.05): −A·r·keep
    (A > 0 with p − p_μ = 0.035 kept, 0.24 dropped; A < 0 with p − p_μ = 0.24 kept)."""
    gi = _gi([0.0, 0.5, 0.5], [1.0, 1.0, -1.0], rollout=[-1.1, -1.0, -1.0])
    assert _grad(gi, _knobs("rollout_is", eps_clip=0.2, eps_clip_high=0.28)) == \
        pytest.approx([-math.exp(0.1), 0.0, 0.0], rel=1e-12)
    knobs = _knobs("dppo_mu", eps_clip=0.05, eps_clip_high=0.05, params={"divergence": "tv", "anchor": "rollout"})
    assert _grad(gi, knobs) == pytest.approx([-math.exp(0.1), 0.0, math.exp(0.5)], rel=1e-12)


def test_opsm_entropy_mask_and_is_keep_zero_the_dropped_tokens():
    """OPSM (δ = 0): sample 0 (A = −1, mean(old − logp) = 0.1 > 0) dropped, sample 1 (A = 1) kept: −A·r; the
    entropy mask (top ½: the 0.5-quantile of the entropies 1, 4, 2, 3 is 2.5) keeps the tokens of entropy 4 and 3;
    is_keep's token mask [0.8, 1.25] drops the token whose old/rollout ratio is 1.5."""
    r = math.exp(-0.1)
    g = _grad(_gi([-0.1, -0.1], [-1.0, 1.0], lengths=[1, 1]), LossKnobs(opsm_delta=0.0, loss_agg_mode="token_sum"))
    assert g == pytest.approx([0.0, -r], rel=1e-12)
    knobs = _knobs("gpg", top_entropy_quantile=0.5)
    g = _grad(_gi([0.0] * 4, [1.0] * 4, entropy=[1.0, 4.0, 2.0, 3.0]), knobs)
    assert g == [0.0, -1.0, 0.0, -1.0]
    knobs = LossKnobs(is_keep=(("token", 0.8, 1.25),), loss_agg_mode="token_sum")
    g = _grad(_gi([0.0, 0.0], [1.0, 1.0], rollout=[-1.0 - math.log(1.5), -1.0 - math.log(1.1)]), knobs)
    assert g == pytest.approx([0.0, -1.0], rel=1e-12)


def test_the_distillation_term_adds_its_estimates_slope():
    """opd_placement="loss", k3 of x = logp − teacher = ln 2: ∂ = 1 − e^{−x} = ½, × opd_coef 0.5 (GPG with A = 0:
    no policy part); clamped at opd_clamp 0.1 (k3(ln 2) = 0.193 beyond it): no slope."""
    gi = _gi([0.0], [0.0], teacher=[-1.0 - math.log(2.0)])
    assert _grad(gi, _knobs("gpg", opd_placement="loss", opd_kl_type="k3", opd_coef=0.5)) == \
        pytest.approx([0.25], rel=1e-12)
    assert _grad(gi, _knobs("gpg", opd_placement="loss", opd_kl_type="k3", opd_coef=0.5, opd_clamp=0.1)) == [0.0]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_an_autograd_family_producer_replays_clean(tmp_path, cli, config, seed):
    path = produce_family_grad_bundle(tmp_path / "b", seed, SIZE, config)
    replays_clean_at_every_token(cli, path)


BUGGED = [c for c in CONFIGS if str(c) != "cispo-ent"]


@pytest.mark.parametrize("config", BUGGED, ids=str)
def test_each_family_gradient_bug_is_named_at_loss_grad_with_the_loss_passing(tmp_path, cli, config):
    bug = FAMILY_GRAD_BUGS["opd" if config.opd else config.family]
    path = produce_family_grad_bundle(tmp_path / "b", 3, SIZE, config, bug=bug)
    report = fails_at_loss_grad_alone(cli, path)
    first = report["first_divergence"]
    assert first["field"] == "grad_log_probs" and first["sample_id"].startswith("s-")


def test_a_family_mask_decision_at_its_edge_admits_either_gradient(tmp_path, cli, monkeypatch):
    """rollout_is: the first loss token's ratio to the rollout is 1 + eps_clip_high to float32 rounding (kept or
    dropped by a legitimate producer's rounding): its gradient 0 or −A·r·W both pass, the sample named in a
    mask_boundary hazard of loss.grad."""
    import numpy as np

    import producers.grad_families as producer

    config = FamilyGradConfig("rollout_is", edge=True)
    real = producer.family_grad_step

    for kept in (True, False):
        def step(logp, old, adv, roll, ent, teacher, mask, *rest, **kw):
            fields, grad = real(logp, old, adv, roll, ent, teacher, mask, *rest, **kw)
            t = int(np.flatnonzero(mask.numpy())[0])
            w = float(config.dp) / float(mask.sum())
            grad[t] = -float(adv[t]) * math.exp(float(logp[t]) - float(roll[t])) * w if kept else 0.0
            return fields, grad

        monkeypatch.setattr(producer, "family_grad_step", step)
        path = producer.produce_family_grad_bundle(tmp_path / f"b{kept}", 0, SIZE, config)
        code, out, _ = cli("replay", path, "--format", "json")
        report = json.loads(out)
        assert code == 0, _stages(report)["loss.grad"]
        hazards = [h["sample_id"] for h in report["hazards"]
                   if h["stage"] == "loss.grad" and h["kind"] == "mask_boundary"]
        assert hazards[:1] == ["s-0"], report["hazards"]


def test_a_ratio_weighted_kl_term_with_a_family_is_refused_by_name():
    """loss.grad derives the ratio-weighted KL term (TRL's use_bias_correction_kl) for the clipped surrogate only:
    with another family the stage is refused, naming the knob (exit 4 through the runner's refusals)."""
    from replay_lib.bundle.schema import RecomputeConfig
    from replay_lib.stages.grad import LOSS_GRAD

    cfg = RecomputeConfig(policy_loss="gpg", use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1",
                          kl_loss_ratio_weighted=True)
    assert LOSS_GRAD.refuse(cfg) == [("kl_loss_ratio_weighted", "True: the ratio-weighted KL term's gradient is "
                                                                "derived for policy_loss 'ppo' only, not 'gpg'")]
    assert LOSS_GRAD.refuse(RecomputeConfig(policy_loss="gpg")) == []


def test_a_sequence_keep_mask_zeroes_its_samples_gradient():
    """is_keep's geometric mask [0.9, 1.1] over exp(mean(old − rollout)): sample 0's is e^{0.2} (dropped: every
    token's gradient 0), sample 1's e^{0.05} (kept: −A·r); the outlier mask [0.5, 2] drops sample 2 whose one
    token's ratio is e^{1}."""
    knobs = LossKnobs(is_keep=(("outlier", 0.5, 2.0), ("geometric", 0.9, 1.1)), loss_agg_mode="token_sum")
    old = -1.0
    rollout = [old - 0.2, old - 0.2, old - 0.05, old - 1.0]
    g = _grad(_gi([0.1, 0.1, 0.1, 0.1], [1.0] * 4, lengths=[2, 1, 1], rollout=rollout), knobs)
    assert g == pytest.approx([0.0, 0.0, -math.exp(0.1), 0.0], rel=1e-12)


def test_the_branch_names_the_familys_slope_its_decision_and_a_dropped_token():
    """The why strip's branch per token: the family's slope, its own decision taken (DPPO's trust region), a
    token a keep mask dropped, a token outside the loss mask."""
    from replay_lib.kernels.grad import BRANCHES, FAMILY_DECIDED, FAMILY_SLOPE, KEEP_DROPPED, MASKED

    knobs = _knobs("dppo_tv", eps_clip=0.05, eps_clip_high=0.05, params={"trunc": 1.2}, opsm_delta=0.0)
    gi = _gi([math.log(1.1), math.log(1.5), -0.1, 0.0], [1.0, 1.0, -1.0, 1.0], lengths=[1, 1, 1, 1],
             mask=[1, 1, 1, 0])
    g = grad_log_probs(gi, knobs)
    assert g.terms.branch.tolist() == [FAMILY_SLOPE, FAMILY_DECIDED, KEEP_DROPPED, MASKED]
    assert BRANCHES[KEEP_DROPPED] == "dropped by OPSM, the entropy mask, is_keep or a MIS rejection (∂ = 0)"
    assert g.grad.tolist() == pytest.approx([-1.1, 0.0, 0.0, 0.0], rel=1e-12)


def test_an_is_keep_decision_at_its_edge_reaches_its_token_or_its_sample():
    """keep_edges: the token mask's decision at its bound (old − rollout = ln 1.25) reaches that token only; the
    outlier mask's (ln 2) every token of its sample; a token far from every bound none."""
    from replay_lib.stages.grad import keep_edges

    rollout = [-1.0 - math.log(1.25), -1.0 - 0.1, -1.0 - 0.1, -1.0 - math.log(2.0), -1.0]
    gi = _gi([0.0] * 5, [1.0] * 5, lengths=[2, 3], rollout=rollout)
    token = LossKnobs(is_keep=(("token", 0.8, 1.25),))
    assert keep_edges(gi, token, 2.0 ** -24).tolist() == [True, False, False, False, False]
    outlier = LossKnobs(is_keep=(("outlier", 0.5, 2.0),))
    assert keep_edges(gi, outlier, 2.0 ** -24).tolist() == [False, False, True, True, True]


@pytest.mark.parametrize("config", [FamilyGradConfig("geo_mean", eps_clip=0.1, eps_clip_high=0.1),
                                    FamilyGradConfig("vespo", spread=0.02)], ids=str)
def test_long_samples_sums_stay_within_the_bound(tmp_path, cli, config):
    """Samples of up to 1024 tokens: GMPO's Ā and exponent and VESPO's log w are float32 sums over the sample
    (n·u of their magnitudes), which the bound admits."""
    path = produce_family_grad_bundle(tmp_path / "b", 0, Size(samples=8, tokens=1024, group_size=4), config)
    code, out, err = cli("replay", path, "--format", "json")
    stages = _stages(json.loads(out))
    assert (code, err, stages["loss.grad"]["status"]) == (0, "", "pass"), stages["loss.grad"]


def test_the_why_strip_adds_the_distillation_terms_share(tmp_path):
    """A gradient token under opd_placement="loss": the why strip's formula adds the distillation term's part,
    the parts summing to the analytic value."""
    from replay_lib.bundle import BundleReader
    from replay_lib.explain.inputs import element_inputs
    from replay_lib.stages import StageContext
    from replay_lib.stages.grad import recompute_gradient

    path = produce_family_grad_bundle(tmp_path / "b", 0, Size(4, 16, 2), FamilyGradConfig("gpg", opd="k3"))
    ctx = StageContext(reader=BundleReader(path), indices=list(range(4)), partial=False)
    _, _, g = recompute_gradient(ctx)
    t = int(ctx.offsets[1]) + 2
    formula = element_inputs(ctx, "grad_log_probs", 1, 2).formula
    assert formula.startswith("∂L/∂logp = W_pg·∂pg/∂logp + W_kl·∂kl/∂logp + opd_coef·W_pg·∂opd/∂logp = "), formula
    assert float(g.pg[t]) + float(g.kl[t]) + float(g.opd[t]) == pytest.approx(float(g.grad[t]), rel=1e-15)
    assert float(g.opd[t]) != 0.0


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.family in ("geo_mean", "kl_cov", "vespo")
                                    or c.top_entropy_quantile < 1 or c.opsm_delta is not None], ids=str)
def test_runs_of_whole_samples_give_the_one_pass_family_gradient(tmp_path, monkeypatch, config):
    """``stages.grad`` computes a run of whole samples at a time, the per-sample terms taken over the whole step
    once (KL-Cov's micro-batch statistics, the entropy mask's thresholds, OPSM's and GMPO's sample sums): with runs
    of ~40 tokens the gradient and its bound are the one-run values bit for bit."""
    runs_give_the_one_pass_gradient(produce_family_grad_bundle(tmp_path / "b", 2, SIZE, config), SIZE.samples,
                                    monkeypatch)


def _clip_cov_gi(d, adv, selected, lengths) -> GradInputs:
    gi = _gi(d, adv, lengths=lengths)
    from dataclasses import replace

    return replace(gi, family_tokens={"clip_cov_mask": torch.tensor(selected, dtype=torch.int8)})


def _clip_cov_knobs(lb: float, **kw) -> LossKnobs:
    params = {"clip_cov_ratio": 0.25, "clip_cov_lb": lb, "clip_cov_ub": 5.0, **kw.pop("params", {})}
    return LossKnobs(policy_loss="clip_cov", policy_loss_params=tuple(sorted(params.items())),
                     micro_batch=(0,) * len(kw.pop("lengths")), **{"loss_agg_mode": "token_sum", **kw})


def test_clip_cov_a_selected_token_and_the_clipped_branch_have_no_gradient():
    """verl's ``max(pg1, pg2)·corr``, ``corr`` a constant: one micro-batch, A = (2, 1, −1, −2) (mean 0), Δ = (0.1,
    ln 1.5, 0.05, −0.1) (mean 0.1137): covariances (−0.027, 0.29, 0.064, 0.43). Token 0 unclipped: −A·r = −2e^{0.1};
    token 1 clipped by PPO (r = 1.5 > 1.2, A > 0): 0; token 2 unclipped: e^{0.05}; token 3 recorded in the mask and
    allowed (cov in (0.01, 5), not clipped): its term is 0, no gradient. The why strip names token 3 the family's
    decision, token 1 PPO's clipped branch."""
    from replay_lib.kernels.grad import CLIPPED, FAMILY_DECIDED, FAMILY_SLOPE

    gi = _clip_cov_gi([0.1, math.log(1.5), 0.05, -0.1], [2.0, 1.0, -1.0, -2.0], [0, 0, 0, 1], [4])
    g = grad_log_probs(gi, _clip_cov_knobs(0.01, lengths=[4]))
    assert g.grad.tolist() == pytest.approx([-2 * math.exp(0.1), 0.0, math.exp(0.05), 0.0], rel=1e-12)
    assert g.terms.branch.tolist() == [FAMILY_SLOPE, CLIPPED, FAMILY_SLOPE, FAMILY_DECIDED]
    # a recorded token the rule does not allow (token 0: its covariance −0.027 is below the bound) keeps its slope
    gi = _clip_cov_gi([0.1, math.log(1.5), 0.05, -0.1], [2.0, 1.0, -1.0, -2.0], [1, 0, 0, 0], [4])
    assert _grad(gi, _clip_cov_knobs(0.01, lengths=[4])) == \
        pytest.approx([-2 * math.exp(0.1), 0.0, math.exp(0.05), 2 * math.exp(-0.1)], rel=1e-12)


def test_clip_cov_prescaled_advantages_take_the_covariance_of_the_weighted_advantages():
    """SkyRL's ``advantages="prescaled"`` under sum_of_sample_means (w = 1, ½ for samples of 1 and 2 tokens),
    A = (2, 2, −1), Δ = (0.1, 0.1, −0.1), token 1 recorded, clip_cov_lb 0.05: raw covariance of token 1
    (2 − 1)·(0.1 − 0.0333) = 0.067 is inside the bounds (selected: 0); the prescaled one (1 − 0.833)·0.0667 = 0.011
    is not (kept: −A·r·w = −2e^{0.1}·½). The other tokens −A·r·w either way."""
    gi = _clip_cov_gi([0.1, 0.1, -0.1], [2.0, 2.0, -1.0], [0, 1, 0], [1, 2])
    raw = _clip_cov_knobs(0.05, lengths=[1, 2], loss_agg_mode="sum_of_sample_means")
    pre = _clip_cov_knobs(0.05, lengths=[1, 2], loss_agg_mode="sum_of_sample_means",
                          params={"advantages": "prescaled"})
    r, q = math.exp(0.1), math.exp(-0.1)
    assert _grad(gi, raw) == pytest.approx([-2 * r, 0.0, 0.5 * q], rel=1e-12)
    assert _grad(gi, pre) == pytest.approx([-2 * r, -r, 0.5 * q], rel=1e-12)


def test_clip_cov_decisions_at_their_edge_are_hazards_of_loss_grad():
    """The gradient has an edge the loss value does not: PPO's clip at an unrecorded token (r = 1 + ε_high to
    rounding, A = 1: slope −A·r or 0), and the rule's at a recorded token (its covariance at clip_cov_lb): both
    named in loss.grad's mask_boundary, their tolerance admitting |A·r|; a token far from every edge neither."""
    from replay_lib.stages.grad import gradient_bound

    u = 2.0 ** -24
    d = [math.log(1.2), 0.0, 0.3, -0.3]
    adv = [1.0, 0.0, 1.0, -1.0]
    # the covariance of token 2: (1 − 0.25)·(0.3 − mean Δ) with mean Δ = log(1.2)/4; the bound put on it
    lb = 0.75 * (0.3 - math.log(1.2) / 4)
    gi = _clip_cov_gi(d, adv, [0, 0, 1, 0], [4])
    knobs = _clip_cov_knobs(lb, lengths=[4], eps_clip=0.2, eps_clip_high=0.2)
    g = grad_log_probs(gi, knobs)
    bound, hits = gradient_bound(u, 0.0, 0.0, gi, knobs, g)
    assert hits["mask_boundary"].tolist() == [True, False, True, False]
    assert float(bound[0]) >= 1.2 and float(bound[2]) >= math.exp(0.3)
    assert float(bound[3]) < 1e-5
