"""Gradient replay (stage ``loss.grad``, SPEC §4.3): the analytic ∂L/∂logp of ``kernels.grad`` against
hand-derived values per branch, and the recorded ``grad_log_probs`` of an independent producer
(``producers.grad``: ``torch.autograd`` on a loss it writes itself) — clean under every aggregation mode and loss
knob, and each bug class whose loss value is right named at ``loss.grad`` while ``loss.policy`` passes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from producers import Size
from producers.grad import CONFIGS, GRAD_BUGS, GradConfig, produce_grad_bundle
from replay_lib.bundle.loss_knobs import LossKnobs
from replay_lib.kernels.grad import (CLIPPED, DUAL_CLIPPED, GRAD_FAMILIES, MASKED, RATIO_CLAMPED, UNCLIPPED,
                                     GradInputs, GradTerms, grad_log_probs, register_grad)

SIZE = Size(samples=16, tokens=96, group_size=4)


def _inputs(d, adv, mask=None, lengths=None, ref=None, rollout=None) -> GradInputs:
    """Tokens with ``logp − old = d`` (old = −1), advantages ``adv``; one sample unless ``lengths``."""
    d = torch.tensor(d, dtype=torch.float64)
    old = torch.full_like(d, -1.0)
    return GradInputs(log_probs=old + d, old_log_probs=old, advantages=torch.tensor(adv, dtype=torch.float64),
                      mask=torch.tensor(mask if mask is not None else [1.0] * len(d), dtype=torch.float64),
                      lengths=torch.tensor(lengths or [len(d)]),
                      ref_log_probs=None if ref is None else torch.tensor(ref, dtype=torch.float64),
                      rollout_log_probs=None if rollout is None else torch.tensor(rollout, dtype=torch.float64))


def test_hand_derived_clip_branches():
    """token_mean over T = 5 recorded tokens, × loss_scale 2: g = 2·(−A·r)/5 on the unclipped branch, 0 where the
    clip (or dual-clip's −c·A) is taken, 0 at a loss-mask-0 token."""
    knobs = LossKnobs(eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0, loss_agg_mode="token_mean",
                      loss_token_count=5, loss_scale=2.0)
    # r = 1.1, A = 2 (inside); r = 1.5, A = 1 (clipped high); r = 0.5, A = −1 (clipped low);
    # r = 0.5, A = 1 (below the range, unclipped); r = 4, A = −1 (dual-clip: pg = 4 > 3); r = 2, A = −1 (pg 2 < 3)
    d = [math.log(1.1), math.log(1.5), math.log(0.5), math.log(0.5), math.log(4.0), math.log(2.0), 0.0]
    adv = [2.0, 1.0, -1.0, 1.0, -1.0, -1.0, 5.0]
    g = grad_log_probs(_inputs(d, adv, mask=[1, 1, 1, 1, 1, 1, 0]), knobs)
    expected = [2 * -2 * 1.1 / 5, 0.0, 0.0, 2 * -1 * 0.5 / 5, 0.0, 2 * 1 * 2.0 / 5, 0.0]
    assert g.grad.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert g.terms.branch.tolist() == [UNCLIPPED, CLIPPED, CLIPPED, UNCLIPPED, DUAL_CLIPPED, UNCLIPPED, MASKED]


def test_hand_derived_log_ratio_clamp_and_is_weight():
    """A log-ratio beyond log_ratio_clamp has no gradient (∂clamp = 0); a TIS weight w = exp(old − rollout) = 1.5
    multiplies the slope and is a constant (no gradient of its own); truncated at 1.2 it is 1.2."""
    knobs = LossKnobs(log_ratio_clamp=0.1, is_level="token", is_mode="truncate", is_high=1.2)
    rollout = [-1.0 - math.log(1.5), -1.0 - math.log(1.1), -1.0]
    g = grad_log_probs(_inputs([0.05, 0.05, 0.5], [1.0, 1.0, 1.0], lengths=[1, 1, 1], rollout=rollout), knobs)
    r = math.exp(0.05)
    assert g.grad.tolist() == pytest.approx([-r * 1.2, -r * 1.1, 0.0], rel=1e-12)
    assert g.terms.branch.tolist()[2] == RATIO_CLAMPED


@pytest.mark.parametrize("kind,slope", [("k1", 1.0), ("k2", math.log(2.0)), ("k3", 0.5), ("low_var_kl", 0.5),
                                        ("abs", 1.0)])
def test_hand_derived_kl_term(kind, slope):
    """x = logp − ref = ln 2: ∂k/∂x = 1 (k1), x (k2), 1 − e^{−x} = ½ (k3, low_var_kl), sign(x) (abs); × coef 0.1
    and the KL mode's weight 1/2 (sum_of_sample_means, 2 tokens); the policy part is A = 0."""
    knobs = LossKnobs(kl_loss_coef=0.1, kl_loss_type=kind)
    logp_minus_ref = math.log(2.0)
    gi = _inputs([0.0, 0.0], [0.0, 0.0], ref=[-1.0 - logp_minus_ref] * 2)
    g = grad_log_probs(gi, knobs)
    assert g.grad.tolist() == pytest.approx([0.1 * slope / 2] * 2, rel=1e-12)
    assert g.pg.tolist() == [0.0, 0.0]


def test_hand_derived_kl_clamps_and_ratio_weighting():
    """An input clamp or output clamp that holds zeroes the KL slope; ratio-weighted k1 (k·r): ∂ = r + k·r."""
    clamped = LossKnobs(kl_loss_coef=1.0, kl_loss_type="k1", kl_loss_input_clamp=0.5)
    g = grad_log_probs(_inputs([0.0, 0.0], [0.0, 0.0], lengths=[1, 1], ref=[-1.2, -1.6]), clamped)
    assert g.grad.tolist() == pytest.approx([1.0, 0.0])
    weighted = LossKnobs(kl_loss_coef=1.0, kl_loss_type="k1", kl_loss_ratio_weighted=True)
    r = math.exp(0.1)
    g = grad_log_probs(_inputs([0.1], [0.0], ref=[-1.0 + 0.1 - 0.3]), weighted)
    assert g.grad.tolist() == pytest.approx([r + 0.3 * r], rel=1e-12)


def test_hand_derived_gspo_sequence_ratio():
    """GSPO: d = (0.1, 0.3, x) with the third token masked: s = e^{0.2}; every loss token of the sample gets
    W·(s/n)·Σ_t m_t·(−A_t) = ½·(s/2)·(−1 − 3) = −s (sum_of_sample_means: W = ½), the masked one 0."""
    knobs = LossKnobs(importance_level="sequence", eps_clip_high=0.28)
    g = grad_log_probs(_inputs([0.1, 0.3, 7.0], [1.0, 3.0, 1.0], mask=[1, 1, 0]), knobs)
    s = math.exp(0.2)
    assert g.grad.tolist() == pytest.approx([-s, -s, 0.0], rel=1e-12)


def test_hand_derived_aggregation_weights_and_scales():
    """micro_batch_token_mean: W = 1/(K·T_b) (K = 2 micro-batches of 1 and 3 loss tokens), × loss_scale 3 ×
    grad_scale ½; seq_mean_token_mean: 1/(N·n_i)."""
    knobs = LossKnobs(loss_agg_mode="micro_batch_token_mean", micro_batch=(0, 1, 1), loss_scale=3.0)
    g = grad_log_probs(_inputs([0.0] * 4, [1.0] * 4, lengths=[1, 2, 1]), knobs, grad_scale=0.5)
    assert g.grad.tolist() == pytest.approx([-1.5 / 2, -1.5 / 6, -1.5 / 6, -1.5 / 6], rel=1e-12)
    knobs = LossKnobs(loss_agg_mode="seq_mean_token_mean", loss_seq_count=4)
    g = grad_log_probs(_inputs([0.0] * 3, [1.0] * 3, lengths=[1, 2]), knobs)
    assert g.grad.tolist() == pytest.approx([-1 / 4, -1 / 8, -1 / 8], rel=1e-12)


@pytest.mark.parametrize("mode,expected", [
    ("sum_of_sample_means", [-1, -1 / 2, -1 / 2]), ("seq_mean_token_mean", [-1 / 4, -1 / 8, -1 / 8]),
    ("token_mean", [-1 / 6] * 3), ("seq_mean_token_sum", [-1 / 4] * 3), ("seq_mean_token_sum_norm", [-1 / 20] * 3),
    ("token_sum", [-1.0] * 3), ("micro_batch_token_mean", [-1 / 2, -1 / 4, -1 / 4])])
def test_hand_derived_weight_of_every_aggregation_mode(mode, expected):
    """r = 1, A = 1 (∂pg/∂logp = −1) on samples of 1 and 2 loss tokens: g = −W_i with the recorded N = 4, T = 6,
    L = 5 and the partition {s0}, {s1}."""
    knobs = LossKnobs(loss_agg_mode=mode, loss_seq_count=4, loss_token_count=6, loss_horizon=5, micro_batch=(0, 1))
    g = grad_log_probs(_inputs([0.0] * 3, [1.0] * 3, lengths=[1, 2]), knobs)
    assert g.grad.tolist() == pytest.approx(expected, rel=1e-15)


def test_a_family_adds_its_gradient_with_one_function():
    """``register_grad``: a family's ∂S^pg/∂logp is one function; the KL term, weights and scales stay shared."""
    @register_grad("test_reinforce")
    def reinforce(gi: GradInputs, knobs) -> GradTerms:  # L = −A·logp
        return GradTerms(pg=-gi.advantages * gi.mask, ratio=torch.ones_like(gi.mask))

    try:
        g = grad_log_probs(_inputs([0.5, 0.5], [2.0, 2.0], lengths=[1, 1]),
                           LossKnobs(loss_scale=2.0, policy_loss="test_reinforce"))
        assert g.grad.tolist() == [-4.0, -4.0]
    finally:
        del GRAD_FAMILIES["test_reinforce"]


def _stages(report) -> dict:
    return {s["stage"]: s for s in report["stages"]}


def replays_clean_at_every_token(cli, path) -> None:
    """``replay --format json`` of a gradient bundle: exit 0, loss.policy and loss.grad pass, loss.grad compared
    every response token within its bound (tests/test_grad_families.py too)."""
    code, out, err = cli("replay", path, "--format", "json")
    stages = _stages(json.loads(out))
    assert (code, err) == (0, ""), stages["loss.grad"]
    assert (stages["loss.policy"]["status"], stages["loss.grad"]["status"]) == ("pass", "pass")
    tokens = sum(s["response_length"] for s in json.loads((path / "index.json").read_text())["samples"])
    assert stages["loss.grad"]["compared"] == tokens
    assert stages["loss.grad"]["max_noise_ratio"] < 1.0


def fails_at_loss_grad_alone(cli, path) -> dict:
    """``replay --format json`` of a gradient bundle with a bug: exit 1, loss.policy passing, loss.grad failing and
    the first divergent stage; the report, for the bug's own checks."""
    code, out, err = cli("replay", path, "--format", "json")
    report = json.loads(out)
    stages = _stages(report)
    assert (code, err) == (1, "")
    assert (stages["loss.policy"]["status"], stages["loss.grad"]["status"]) == ("pass", "fail")
    assert report["first_divergent_stage"] == "loss.grad"
    return report


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_an_autograd_producer_replays_clean(tmp_path, cli, config, seed):
    path = produce_grad_bundle(tmp_path / "b", seed, SIZE, config)
    replays_clean_at_every_token(cli, path)


EXPLAINED = {"kl_no_grad": "grad.kl_no_gradient", "is_not_detached": "grad.is_weight_not_detached",
             "ratio_detached": "grad.ratio_detached", "zero_coef_nan": "grad.nonfinite_zero_coefficient",
             "scale_twice": "grad.scaled"}


@pytest.mark.parametrize("bug", GRAD_BUGS)
def test_each_gradient_bug_is_named_at_loss_grad_with_the_loss_passing(tmp_path, cli, bug):
    config = GradConfig(on_policy=bug == "is_not_detached", accumulate=bug == "scale_twice")
    path = produce_grad_bundle(tmp_path / "b", 3, SIZE, config, bug=bug)
    report = fails_at_loss_grad_alone(cli, path)
    first = report["first_divergence"]
    assert first["field"] == "grad_log_probs" and first["sample_id"].startswith("s-")
    assert first["token_offset"] is not None
    hyps = [e["hypothesis"] for e in report["explanations"]]
    assert hyps == [EXPLAINED[bug]], report["explanations"]


# the bugs under the other knobs: GSPO with a sequence weight and a ratio-weighted KL term over micro-batch token
# means, IcePop with a ratio-weighted k2 over per-sequence means, a k1 term over a token mean (on-policy: the
# weight's value is right)
KNOBBED = {"gspo": GradConfig(importance_level="sequence", eps_clip_c=None, is_level="sequence", is_high=4.0,
                              kl_ratio_weighted=True, agg="micro_batch_token_mean", micro_batches=3),
           "icepop": GradConfig(is_mode="mask", is_low=0.5, is_high=1.5, kl_loss_type="k2", kl_ratio_weighted=True,
                                agg="seq_mean_token_mean"),
           "k1": GradConfig(kl_loss_type="k1")}


@pytest.mark.parametrize("bug", [b for b in GRAD_BUGS if b != "zero_coef_nan"])
@pytest.mark.parametrize("knobs", list(KNOBBED))
def test_each_gradient_bug_is_explained_under_the_other_knobs(tmp_path, bug, knobs):
    from dataclasses import replace

    from replay_lib.run.runner import replay

    config = replace(KNOBBED[knobs], on_policy=True, accumulate=bug == "scale_twice")
    report = replay(produce_grad_bundle(tmp_path / "b", 5, SIZE, config, bug=bug))
    status = {s.stage: s.status for s in report.stages}
    assert (status["loss.policy"], status["loss.grad"]) == ("pass", "fail")
    assert [e.hypothesis for e in report.explanations] == [EXPLAINED[bug]]
    assert report.explanations[0].matched == report.explanations[0].of


def test_a_divergence_names_sample_token_expected_and_actual(tmp_path, cli):
    path = produce_grad_bundle(tmp_path / "b", 3, SIZE, GradConfig(), bug="kl_no_grad")
    code, out, err = cli("replay", path)
    assert code == 1
    line = next(x for x in out.splitlines() if "grad_log_probs s-" in x).strip()
    assert line.startswith("grad_log_probs s-0@0: expected=") and " actual=" in line and "abs_err=" in line, out
    assert "the KL term contributes no gradient" in out


def test_scaled_gradient_names_k(tmp_path, cli):
    path = produce_grad_bundle(tmp_path / "b", 4, SIZE, GradConfig(accumulate=True, micro_batches=2),
                               bug="scale_twice")
    code, out, _ = cli("replay", path, "--format", "json")
    detail = json.loads(out)["explanations"][0]["detail"]
    assert "k=0.5 " in detail and "grad_scale 0.5" in detail, detail


def test_a_bad_grad_scale_is_one_line_exit_3(tmp_path, cli):
    path = produce_grad_bundle(tmp_path / "b", 0, SIZE, GradConfig())
    index = path / "index.json"
    raw = json.loads(index.read_text())
    raw["config"]["grad_scale"] = 0.0
    index.write_text(json.dumps(raw))
    code, out, err = cli("validate", path)
    assert code == 3
    assert len(err.strip().splitlines()) == 1 and "grad_scale" in err, err



def test_why_strip_derives_the_tokens_coefficient(tmp_path):
    """``explain.inputs`` for a gradient token: its clip branch, ratio, advantage, detached IS weight, W_pg, W_kl
    and the KL share, the parts adding up to the analytic value; a pg_losses token shows its gradient beside."""
    from replay_lib.bundle import BundleReader
    from replay_lib.explain.inputs import element_inputs
    from replay_lib.kernels.grad import BRANCHES
    from replay_lib.stages import StageContext
    from replay_lib.stages.grad import recompute_gradient

    path = produce_grad_bundle(tmp_path / "b", 0, Size(4, 16, 2), GradConfig())
    ctx = StageContext(reader=BundleReader(path), indices=list(range(4)), partial=False)
    _, _, g = recompute_gradient(ctx)
    t = int(ctx.offsets[1]) + 2
    inputs = element_inputs(ctx, "grad_log_probs", 1, 2)
    labels = [k for k, _ in inputs.items]
    assert labels == ["branch", "ratio r", "A", "mask", "IS weight (detached)", "W_pg", "W_kl", "KL share"]
    assert dict(inputs.items)["branch"] == BRANCHES[int(g.terms.branch[t])]
    share = abs(float(g.kl[t])) / (abs(float(g.pg[t])) + abs(float(g.kl[t])))
    assert dict(inputs.items)["KL share"] == f"{100 * share:.1f}%"
    assert float(g.pg[t]) + float(g.kl[t]) == pytest.approx(float(g.grad[t]), rel=1e-15)
    assert "W = loss_scale 2 × grad_scale 1 × the token_mean weight of s-1" == inputs.note
    beside = dict(element_inputs(ctx, "pg_losses", 1, 2).items)["∂L/∂logp"]
    assert beside.endswith(" analytic") and " recorded, " in beside


def test_the_tui_token_diff_shows_the_gradient_field(tmp_path):
    from replay_lib.bundle import open_bundle
    from replay_tui.model.token_diff import token_diff

    path = produce_grad_bundle(tmp_path / "b", 3, Size(4, 16, 2), GradConfig(), bug="kl_no_grad")
    diff = token_diff(open_bundle(path), "s-0", "grad_log_probs")
    first = json.loads((path / "index.json").read_text())["samples"][0]
    assert (diff.stage, len(diff)) == ("loss.grad", first["response_length"])
    assert diff.mismatches > 0


def test_a_grad_payload_of_the_wrong_length_is_named_by_validate_and_replay(tmp_path, cli, monkeypatch):
    import producers.grad as producer

    real = producer.grad_step
    monkeypatch.setattr(producer, "grad_step", lambda *a, **k: (lambda f, g: (f, g[:-3]))(*real(*a, **k)))
    path = producer.produce_grad_bundle(tmp_path / "b", 0, SIZE, GradConfig())
    code, out, err = cli("validate", path)
    assert code == 3 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "grad_log_probs" in lines[0] and "has none from its token" in lines[0], err
    code, out, err = cli("replay", path)  # replay: the stage fails with the fact (as the sample stage reports it)
    assert (code, err) == (1, "")
    tokens = sum(s["response_length"] for s in json.loads((path / "index.json").read_text())["samples"])
    assert f"[   fail] loss.grad — payload 'grad_log_probs' has {tokens - 3} row(s), Σ response_length is {tokens}" \
        in out, out


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[2]], ids=str)
def test_runs_of_whole_samples_give_the_one_pass_gradient(tmp_path, monkeypatch, config):
    """``stages.grad`` computes a run of whole samples at a time (GRAD_CHUNK tokens): with runs of ~40 tokens the
    gradient and its bound are the one-run values bit for bit (the aggregation weights are the whole step's)."""
    runs_give_the_one_pass_gradient(produce_grad_bundle(tmp_path / "b", 2, SIZE, config), SIZE.samples, monkeypatch)


def runs_give_the_one_pass_gradient(path, samples: int, monkeypatch) -> None:
    """``stages.grad`` over ``path`` in one run and in runs of ~40 tokens (GRAD_CHUNK): the same gradient and bound,
    bit for bit (tests/test_grad_families.py too)."""
    import replay_lib.stages.grad as stage
    from replay_lib.bundle import BundleReader
    from replay_lib.stages import StageContext

    def run():
        ctx = StageContext(reader=BundleReader(path), indices=list(range(samples)), partial=False)
        _, _, g = stage.recompute_gradient(ctx)
        return g.grad, ctx.records[stage.BOUND_RECORD]

    whole = run()
    monkeypatch.setattr(stage, "GRAD_CHUNK", 40)
    runs = run()
    assert torch.equal(whole[0], runs[0]) and torch.equal(whole[1], runs[1])


@pytest.mark.parametrize("branch", ["as_produced", "clipped", "unclipped"])
def test_a_clip_decision_at_its_edge_is_a_hazard_either_way(tmp_path, cli, monkeypatch, branch):
    """The first loss token's ratio is 1 + eps_clip_high to float32 rounding (A > 0, no IS weight, no KL slope):
    a legitimate producer may clip it (gradient 0) or not (−A·r·loss_scale/T): both pass, and the sample is named
    in a clip_boundary hazard of loss.grad."""
    import numpy as np

    import producers.grad as producer

    config = GradConfig(edge=True)
    logp, old, adv, *_ = producer.grad_inputs(0, SIZE, config)
    t = int(np.flatnonzero(producer.make_inputs(0, SIZE, "rm").mask)[0])
    tokens = int(producer.make_inputs(0, SIZE, "rm").mask.sum())
    unclipped = -float(adv[t]) * math.exp(float(logp[t]) - float(old[t])) * config.dp / tokens
    real = producer.grad_step

    def step(*a, **k):
        fields, grad = real(*a, **k)
        if branch != "as_produced":
            grad[t] = 0.0 if branch == "clipped" else unclipped
        return fields, grad

    monkeypatch.setattr(producer, "grad_step", step)
    path = producer.produce_grad_bundle(tmp_path / "b", 0, SIZE, config)
    code, out, err = cli("replay", path, "--format", "json")
    report = json.loads(out)
    assert code == 0, _stages(report)["loss.grad"]
    hazards = [h for h in report["hazards"] if h["stage"] == "loss.grad" and h["kind"] == "clip_boundary"]
    assert [h["sample_id"] for h in hazards][:1] == ["s-0"], report["hazards"]


def test_why_strip_names_a_mis_rejection_and_the_kl_weight(tmp_path):
    """Under slime's MIS rejection the strip gives the token's keep (0 at a rejected token, whose branch is the
    dropped one and whose gradient is 0) and, with the rollout-weighted KL term, its weight exp(logp − rollout)."""
    from replay_lib.bundle import BundleReader
    from replay_lib.explain.inputs import element_inputs
    from replay_lib.kernels.grad import BRANCHES, KEEP_DROPPED
    from replay_lib.stages import StageContext
    from replay_lib.stages.grad import recompute_gradient

    path = produce_grad_bundle(tmp_path / "b", 0, Size(4, 16, 2), KNOB_CONFIGS["mis-kl-rollout"])
    ctx = StageContext(reader=BundleReader(path), indices=list(range(4)), partial=False)
    gi, _, g = recompute_gradient(ctx)
    t = int(torch.nonzero((gi.keep == 0) & (gi.mask > 0))[0])
    i = int(torch.searchsorted(ctx.offsets, t, right=True)) - 1
    items = dict(element_inputs(ctx, "grad_log_probs", i, t - int(ctx.offsets[i])).items)
    assert (items["MIS kept"], items["branch"], float(g.grad[t])) == ("0", BRANCHES[KEEP_DROPPED], 0.0)
    w = math.exp(float(gi.log_probs[t]) - float(gi.rollout_log_probs[t]))
    assert float(items["KL weight w (not detached)"]) == pytest.approx(w, rel=1e-3)


def test_the_diff_viewer_draws_a_loss_tokens_gradient_beside_it():
    """A ``pg_losses`` token diff that carries the tokens' recorded ∂L/∂logp draws it as the last column (the
    first one a narrow pane drops)."""
    from rich.style import Style

    from replay_tui.model.token_diff import FieldDiff
    from replay_tui.widgets.diff_view import DiffView

    diff = FieldDiff(field="pg_losses", stage="loss.policy", kind="token", expected=[0.5, -0.25],
                     actual=[0.5, -0.25], abs_error=[0.0, 0.0], bad=[False, False], mask=[1, 0],
                     grad=torch.tensor([-0.0125, 0.0], dtype=torch.float64))
    view = DiffView()
    view.diff = diff
    view._rows = len(diff)
    view._label_width = 6
    assert view.render_header(80, Style()).text.split() == ["offset", "expected", "actual", "abs", "err", "mask",
                                                            "∂L/∂logp"]
    assert view.render_row(0, 80, Style()).text.split() == ["0", "0.5", "0.5", "0.0", "1", "-0.0125"]
    assert view.render_row(0, 80, Style()).cell_length == 80
    assert "∂L/∂logp" not in view.render_header(50, Style()).text


def _rollout_kl_inputs(x, log_w, **kw) -> GradInputs:
    """One token per sample (sum_of_sample_means: W = 1), A = 0: ``logp − ref = x``, ``logp − rollout = log_w``."""
    n = len(x)
    logp = torch.full((n,), -1.0, dtype=torch.float64)
    return GradInputs(log_probs=logp, old_log_probs=logp.clone(), advantages=torch.zeros(n, dtype=torch.float64),
                      mask=torch.ones(n, dtype=torch.float64), lengths=torch.ones(n, dtype=torch.int64),
                      ref_log_probs=logp - torch.tensor(x, dtype=torch.float64),
                      rollout_log_probs=logp - torch.tensor(log_w, dtype=torch.float64), **kw)


def test_hand_derived_rollout_weighted_kl_term():
    """kl_loss_rollout_weighted (NeMo-RL's on-policy approximation, its weight w = exp(logp − rollout) not
    detached): ∂(w·k)/∂logp = w·(k' + k). k1 at x = ½, w = 2: 2·(1 + ½) = 3; x = 25 beyond the input clamp 20 (k
    clamped, w detached there): 0; x = 6, w = 2: w·k = 12 beyond the output clamp 10: 0; log w = +inf (a
    non-finite weight, 0): 0; w = ½ at x = −1: ½·(1 − 1) = 0. k3 at x = ln 2, w = 1: k' = 1 − ½, k = ln 2 − ½:
    ln 2; k2 at x = −3, w = e^{−1}: e^{−1}·(−3 + 4.5) = 1.5/e. × coef 0.1."""
    k1 = LossKnobs(kl_loss_coef=0.1, kl_loss_type="k1", kl_loss_input_clamp=20.0, kl_loss_output_clamp=10.0,
                   kl_loss_rollout_weighted=True)
    g = grad_log_probs(_rollout_kl_inputs([0.5, 25.0, 6.0, 0.5, -1.0], [math.log(2.0), 0.0, math.log(2.0),
                                                                       math.inf, -math.log(2.0)]), k1)
    assert g.grad.tolist() == pytest.approx([0.3, 0.0, 0.0, 0.0, 0.0], rel=1e-12, abs=1e-15)
    assert g.pg.tolist() == [0.0] * 5
    k3 = LossKnobs(kl_loss_coef=0.1, kl_loss_type="k3", kl_loss_rollout_weighted=True)
    g = grad_log_probs(_rollout_kl_inputs([math.log(2.0)], [0.0]), k3)
    assert g.grad.tolist() == pytest.approx([0.1 * math.log(2.0)], rel=1e-12)
    k2 = LossKnobs(kl_loss_coef=0.1, kl_loss_type="k2", kl_loss_rollout_weighted=True)
    g = grad_log_probs(_rollout_kl_inputs([-3.0], [-1.0]), k2)
    assert g.grad.tolist() == pytest.approx([0.1 * 1.5 / math.e], rel=1e-12)


def test_hand_derived_score_function_kl_term():
    """kl_loss_score_function (NeMo-RL's KL term × exp(logp − sg(logp)), value 1): ∂ = ∂k/∂x + k. k1 at x = ½:
    1.5; beyond the input clamp 20: 0; k3 at x = ln 2: ½ + (ln 2 − ½) = ln 2; k3 at x = −3 (k = e³ − 4 ≈ 16.1)
    beyond the output clamp 10: 0. × coef 0.1. With a weighting of the KL term it is a schema error."""
    from replay_lib.bundle.loss_knobs import check_knobs

    k1 = LossKnobs(kl_loss_coef=0.1, kl_loss_type="k1", kl_loss_input_clamp=20.0, kl_loss_score_function=True)
    g = grad_log_probs(_rollout_kl_inputs([0.5, 25.0], [5.0, 5.0]), k1)  # the rollout is not read
    assert g.grad.tolist() == pytest.approx([0.15, 0.0], rel=1e-12, abs=1e-15)
    k3 = LossKnobs(kl_loss_coef=0.1, kl_loss_type="k3", kl_loss_output_clamp=10.0, kl_loss_score_function=True)
    g = grad_log_probs(_rollout_kl_inputs([math.log(2.0), -3.0], [0.0, 0.0]), k3)
    assert g.grad.tolist() == pytest.approx([0.1 * math.log(2.0), 0.0], rel=1e-12, abs=1e-15)
    both = LossKnobs(kl_loss_coef=0.1, kl_loss_score_function=True, kl_loss_rollout_weighted=True)
    assert check_knobs(both) == ["kl_loss_score_function: expected kl_loss_ratio_weighted and "
                                 "kl_loss_rollout_weighted false with it (one KL weight)"]


def test_hand_derived_mis_rejection_keeps_the_normalizers():
    """slime's MIS rejection (``keep``, 0 at a rejected token) multiplies every term's numerator, the
    normalizers kept: d = 0, A = 1, one sample of three tokens (sum_of_sample_means: W = ⅓), the KL k1 at coef 0.1:
    kept tokens −⅓ + 0.1/3 = −0.3, the rejected one 0. Under GSPO (d = 0.1, 0.3, A = 1, the second rejected) the
    sample ratio s = e^{0.2} still takes the rejected token's log-ratio: both tokens get W·(s/n)·Σ_t keep_t·(−A_t)
    = ½·(s/2)·(−1) = −s/4."""
    knobs = LossKnobs(kl_loss_coef=0.1, kl_loss_type="k1")
    keep = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    gi = _inputs([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], ref=[-1.5] * 3)
    from dataclasses import replace

    g = grad_log_probs(replace(gi, keep=keep), knobs)
    assert g.grad.tolist() == pytest.approx([-0.3, 0.0, -0.3], rel=1e-12)
    assert g.terms.branch.tolist()[1] == 7  # KEEP_DROPPED: the why strip names it
    gspo = LossKnobs(importance_level="sequence", eps_clip_high=0.28)
    g = grad_log_probs(replace(_inputs([0.1, 0.3], [1.0, 1.0]), keep=torch.tensor([1.0, 0.0], dtype=torch.float64)),
                       gspo)
    s = math.exp(0.2)
    assert g.grad.tolist() == pytest.approx([-s / 4, -s / 4], rel=1e-12)


# NeMo-RL's on-policy KL approximation (k1, k2, k3 over a token mean, per-sequence means, GSPO under accumulation)
# and slime's MIS rejection (token bounds; the veto with GSPO and a ratio-weighted KL; with the rollout-weighted KL)
KNOB_CONFIGS = {
    "kl-rollout-k3": GradConfig(kl_loss_type="k3", kl_rollout_weighted=True),
    "kl-rollout-k1-seq": GradConfig(kl_loss_type="k1", kl_rollout_weighted=True, agg="seq_mean_token_mean",
                                    is_level=None),
    "kl-rollout-k2-gspo": GradConfig(kl_loss_type="k2", kl_rollout_weighted=True, importance_level="sequence",
                                     eps_clip_c=None, is_level="sequence", is_high=4.0,
                                     agg="micro_batch_token_mean", micro_batches=3, accumulate=True),
    "mis-token": GradConfig(mis_rs=(("token", 0.7, 1.4),)),
    "mis-veto-gspo": GradConfig(mis_rs=(("token", 0.7, 1.4),), mis_veto=0.5, importance_level="sequence",
                                eps_clip_c=None, is_level=None, kl_ratio_weighted=True, agg="seq_mean_token_mean"),
    "mis-kl-rollout": GradConfig(kl_loss_type="k3", kl_rollout_weighted=True, mis_rs=(("token", 0.7, 1.4),)),
}


@pytest.mark.parametrize("name", list(KNOB_CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_the_rollout_weighted_kl_term_and_mis_rejection_replay_clean(tmp_path, cli, name, seed):
    """The autograd producer under kl_loss_rollout_weighted and mis_rs / mis_veto: loss.grad compares every
    token and passes (these knobs were refused before)."""
    path = produce_grad_bundle(tmp_path / "b", seed, SIZE, KNOB_CONFIGS[name])
    replays_clean_at_every_token(cli, path)


@pytest.mark.parametrize("name, bug, hypotheses", [
    ("kl-rollout-k3", "kl_weight_detached", ["grad.kl_weight_detached"]),
    ("kl-rollout-k1-seq", "kl_weight_detached", ["grad.kl_weight_detached"]),
    ("mis-token", "mis_not_in_backward", []),
    ("mis-veto-gspo", "mis_not_in_backward", []),
])
def test_the_knobs_gradient_bugs_are_named_at_loss_grad_with_the_loss_passing(tmp_path, cli, name, bug, hypotheses):
    """The KL term's weight detached (its value unchanged: NeMo-RL before #2506) and the MIS rejection left out
    of the backward pass (the reported loss rejecting) fail loss.grad alone."""
    path = produce_grad_bundle(tmp_path / "b", 3, SIZE, KNOB_CONFIGS[name], bug=bug)
    report = fails_at_loss_grad_alone(cli, path)
    assert _stages(report)["loss.grad"]["reason"].startswith("gradient mismatch: grad_log_probs in ")
    assert [e["hypothesis"] for e in report["explanations"]] == hypotheses


def test_a_mis_decision_at_its_bound_is_a_hazard_either_way(tmp_path, cli):
    """The first loss token's exp(old − rollout) is mis_rs's high bound 1.4 in float32: its keep decision lies
    within rounding of the bound; the producer's (kept or rejected) passes, its sample named in an rs_boundary
    hazard of loss.grad."""
    config = GradConfig(mis_rs=(("token", 0.7, 1.4),), mis_edge=True)
    path = produce_grad_bundle(tmp_path / "b", 0, SIZE, config)
    code, out, err = cli("replay", path, "--format", "json")
    report = json.loads(out)
    assert (code, err, _stages(report)["loss.grad"]["status"]) == (0, "", "pass"), _stages(report)["loss.grad"]
    hazards = [h["sample_id"] for h in report["hazards"] if h["stage"] == "loss.grad" and h["kind"] == "rs_boundary"]
    assert hazards == ["s-0"], report["hazards"]


def test_mis_rejection_with_a_sample_level_family_slope_is_refused_by_name(tmp_path, cli, bundle_tools):
    """geo_mean's slope is the sample's own sums: under slime's MIS rejection (a per-token numerator mask) it is not
    derived, and loss.grad fails naming the knob and the family, comparing nothing."""
    path = produce_grad_bundle(tmp_path / "b", 0, SIZE, GradConfig(mis_rs=(("token", 0.7, 1.4),), is_level=None))
    bundle_tools.edit_json(path, "index.json", lambda doc: doc["config"].update(
        policy_loss="geo_mean", policy_loss_params={}, eps_clip_c=None, log_ratio_clamp=None))
    code, out, err = cli("replay", path, "--format", "json")
    assert err == "", err
    grad = _stages(json.loads(out))["loss.grad"]
    message = "mis_rs / mis_veto (slime's MIS rejection) with policy_loss 'geo_mean' is not recomputed by loss.grad"
    assert (grad["status"], grad["reason"], grad["compared"]) == ("fail", message, 0), grad
    assert [(d["field"], d["message"]) for d in grad["divergences"]] == [("mis_rs", message)]


def test_grad_values_hand_derived_branches_bound_and_edges():
    """∂(w·½·max(d1², d2²))/∂v with ε = 0.2, v_old = 1, w = ½: inside the clip range d1 (v = 0.95, R = 2: −1.05);
    unclipped (v = 1.5, R = 0: d1² > d2²: 1.5); clipped outside the range (v = 1.5, R = 2 and v = 0.5, R = −1): 0.
    The bound is C_TOKEN·u·(|v| + |R| + |v_old| + ε + |s|)·w off an edge; at the clamp's edge (v = v_old + ε, R = 2:
    the slope −0.8, or 0 had v rounded above) and at the branch's tie (v = 1.5, R = 1.35: d1 = −d2 = 0.15, the
    slopes 0.15 and 0) it admits the other branch's slope."""
    from replay_lib.stages.grad import value_gradient

    u = 2.0 ** -24
    v = torch.tensor([0.95, 1.5, 1.5, 0.5, 1.2, 1.5], dtype=torch.float64)
    r = torch.tensor([2.0, 0.0, 2.0, -1.0, 2.0, 1.35], dtype=torch.float64)
    old = torch.ones_like(v)
    m = torch.ones_like(v)
    grad, bound, edge = value_gradient(v, old, r, m, torch.full_like(v, 0.5), 0.2, u)
    assert grad.tolist()[:5] == pytest.approx([-0.525, 0.75, 0.0, 0.0, -0.4], rel=1e-12)
    assert edge.tolist() == [False, False, False, False, True, True]
    assert bound[0].item() == pytest.approx(8.0 * u * (0.95 + 2.0 + 1.0 + 0.2 + 1.05) * 0.5, rel=1e-12)
    assert bound[2].item() == pytest.approx(8.0 * u * (1.5 + 2.0 + 1.2) * 0.5, rel=1e-12)
    assert bound[4].item() >= 0.4 and bound[5].item() >= 0.075  # the other branch: 0.8·½, 0.15·½
    assert abs(grad[5].item() - 0.0) <= bound[5].item() and abs(grad[5].item() - 0.075) <= bound[5].item()
    unclipped = value_gradient(v, old, r, m, torch.full_like(v, 0.5), None, u)[0]
    assert unclipped.tolist() == pytest.approx((0.5 * (v - r)).tolist(), rel=1e-12)


@pytest.mark.parametrize("recorded", ["inside", "rounded_above"])
def test_grad_values_at_the_value_clips_edge_admit_either_branch(tmp_path, cli, recorded):
    """The first loss token's value is exactly v_old + ε (1.25 = 1 + 0.25) with R = 3 (the clipped branch ties the
    unclipped one): its slope is d = −1.75 inside the range, 0 had the producer's v rounded above it: both pass,
    and the sample is named in a value_clip_boundary hazard of loss.grad; the other tokens (v = v_old = 0: the
    slope −R) are judged at their rounding."""
    import numpy as np

    from producers.inputs import make_inputs

    size = Size(4, 16, 2)
    inputs = make_inputs(0, size, "rm")
    n = int(inputs.lengths.sum())
    config = GradConfig()
    w = config.dp / float(inputs.mask.sum())  # token_mean × loss_scale dp, vf_coef 1
    t = int(np.flatnonzero(inputs.mask)[0])
    values, old = np.zeros(n, np.float32), np.zeros(n, np.float32)
    returns = np.random.Generator(np.random.PCG64(5)).normal(0, 1, n).astype(np.float32)
    values[t], old[t], returns[t] = 1.25, 1.0, 3.0
    grad = ((values - returns) * inputs.mask * w).astype(np.float32)
    if recorded == "rounded_above":
        grad[t] = 0.0
    path = produce_grad_bundle(tmp_path / "b", 0, size, config, value=dict(
        values=values, old_values=old, returns=returns, grad_values=grad, value_clip=0.25))
    code, out, err = cli("replay", path, "--format", "json")
    report = json.loads(out)
    grad_stage = _stages(report)["loss.grad"]
    assert (code, err, grad_stage["status"]) == (0, "", "pass"), grad_stage
    hazards = [h["sample_id"] for h in report["hazards"]
               if h["stage"] == "loss.grad" and h["kind"] == "value_clip_boundary"]
    assert hazards == ["s-0"], report["hazards"]
