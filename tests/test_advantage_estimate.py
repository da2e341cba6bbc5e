"""advantage.estimate knobs of SPEC §4.2, one hand-derived test each: per-token rewards and their discounted returns
(``kl_in_reward="token_returns"``, REINFORCE++, ``gamma``), GAE (``gamma``, ``lam``, payloads ``values`` and
``returns``), whitening (``normalize_advantages``, ``advantage_whiten_stats``), REINFORCE++-baseline — on the kernels
and through the real bundle writer, reader and runner, with an independent float32 producer
(``tests/producers/advantage.py``) for the clean bundles and a wrong formula for the failing ones. Then the bad
input of the advantage side: one-line errors, exit 3 (unknown names, gamma/lam outside [0, 1], GAE without values)
and exit 4 by name (estimators known but not recomputed)."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from producers import advantage as producer
from replay_lib.kernels import discounted_returns, gae_advantages, last_loss_token, token_rewards, whiten, whiten_stats
from replay_lib.judge.report import report_to_text
from replay_lib.run.runner import replay
from replay_lib.run.validate import validate
from replay_lib.errors import BundleError, UnsupportedError

F64 = torch.float64


# ------------------------------------------------------------------------------------------- kernels


def test_token_rewards_put_the_score_on_the_last_loss_token_and_the_kl_on_every_one():
    # lengths [3, 2], masks [1, 1, 0 | 1, 1], scores [1, 2], kl [.1 .2 .3 | .4 .5], kl_coef 0.5:
    # sample 0: last loss token is t=1: [−0.05, 1 − 0.1, 0 (masked)]; sample 1: [−0.2, 2 − 0.25]
    lengths, mask = torch.tensor([3, 2]), torch.tensor([1, 1, 0, 1, 1])
    kl = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5], dtype=F64)
    assert last_loss_token(mask, lengths).tolist() == [1, 4]
    got = token_rewards(torch.tensor([1.0, 2.0], dtype=F64), mask, lengths, kl, 0.5, dtype=F64)
    assert got.tolist() == pytest.approx([-0.05, 0.9, 0.0, -0.2, 1.75], rel=1e-15)
    # a sample without loss tokens keeps its score on its last token, then the mask zeroes it
    assert last_loss_token(torch.tensor([0, 0]), torch.tensor([2])).tolist() == [1]


def test_discounted_returns_run_backwards_with_gamma():
    # [−0.05, 0.9, 0 | −0.2, 1.75], γ = 0.9: sample 0: G2 = 0, G1 = 0.9, G0 = −0.05 + 0.81 = 0.76;
    # sample 1: G1 = 1.75, G0 = −0.2 + 1.575 = 1.375
    r = torch.tensor([-0.05, 0.9, 0.0, -0.2, 1.75], dtype=F64)
    got = discounted_returns(r, torch.tensor([3, 2]), 0.9, dtype=F64)
    assert got.tolist() == pytest.approx([0.76, 0.9, 0.0, 1.375, 1.75], rel=1e-14)
    # γ = 1: plain reverse cumulative sums
    assert discounted_returns(r, torch.tensor([3, 2]), 1.0, dtype=F64).tolist() == pytest.approx(
        [0.85, 0.9, 0.0, 1.55, 1.75], rel=1e-14)


def test_gae_skips_tokens_off_the_loss_mask():
    # rewards [−0.05, 0.9, 0], values [0.5, 0.4, 0.3], mask [1, 1, 0], γ = 0.9, λ = 0.8:
    # t2 masked: A2 carries 0 and V_next stays 0; t1: δ = 0.9 + 0 − 0.4 = 0.5, A1 = 0.5;
    # t0: δ = −0.05 + 0.9·0.4 − 0.5 = −0.19, A0 = −0.19 + 0.72·0.5 = 0.17; returns A + V = [0.67, 0.9, 0.3]
    adv, ret = gae_advantages(torch.tensor([-0.05, 0.9, 0.0], dtype=F64), torch.tensor([0.5, 0.4, 0.3], dtype=F64),
                              torch.tensor([1, 1, 0]), torch.tensor([3]), 0.9, 0.8, dtype=F64)
    assert adv.tolist() == pytest.approx([0.17, 0.5, 0.0], rel=1e-14, abs=1e-15)
    assert ret.tolist() == pytest.approx([0.67, 0.9, 0.3], rel=1e-14)


def test_whitening_over_loss_tokens_and_with_recorded_stats():
    # [1, 2, 3 | 4 masked]: mean 6/(3 + 1e-8) ≈ 2 (verl's masked mean adds 1e-8 to the count), Bessel var
    # ((1 + 0 + 1)/3)·3/2 ≈ 1, divisor √(1 + 1e-8): (A − 2)/√(1 + 1e-8) ≈ [−1, 0, 1, 2]·(1 − 5e-9)
    a, m = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64), torch.tensor([1, 1, 1, 0])
    mean, divisor = whiten_stats(a, m, dtype=F64)
    assert float(mean) == 6 / (3 + 1e-8) and float(divisor) == pytest.approx(math.sqrt(1 + 1e-8), rel=1e-8)
    # (the 1e-8 terms move each value by ~1e-8; a biased variance would scale them by √1.5)
    assert whiten(a, m, dtype=F64).tolist() == pytest.approx([-1.0, 0.0, 1.0, 2.0], abs=3e-8)
    # the producer's global statistics of a larger batch: (A − 1.5)/0.5
    assert whiten(a, m, dtype=F64, stats=(1.5, 0.5)).tolist() == [-1.0, 1.0, 3.0, 5.0]


# ------------------------------------------------------------------------- through the real replay


def make_inputs(seed=0, samples=12, group=4, max_len=9):
    gen = np.random.default_rng(seed)
    lengths = gen.integers(3, max_len, size=samples).tolist()
    raw = gen.integers(0, 5, size=samples).astype(np.float64) / 4
    groups = [i // group for i in range(samples)]
    masks = [[1] * (n - 1) + [int(gen.integers(0, 2))] for n in lengths]
    total = sum(lengths)
    old = (-gen.random(total) * 2).astype(np.float32)
    ref = (old + gen.normal(0, 0.1, total)).astype(np.float32)
    kl = (old - ref).astype(np.float32)  # k1, as advantage.kl recomputes it
    values = gen.normal(0, 0.5, total).astype(np.float32)
    return dict(raw=raw, groups=groups, lengths=lengths, masks=masks, old=old, ref=ref, kl=kl, values=values)


def estimate(inp, estimator, *, kl_in_reward=None, kl_coef=0.0, gamma=1.0, lam=1.0, whitened=False,
             baseline_bug=False, stride_bug=False):
    """The float32 producer's rewards, advantages (and returns) for one configuration (see the frameworks'
    formulas in tests/producers/advantage.py)."""
    raw, groups, lengths, masks = inp["raw"], inp["groups"], inp["lengths"], inp["masks"]
    score = raw
    if kl_in_reward == "sequence" and kl_coef:
        score = producer.kl_scores(raw, inp["kl"], masks, lengths, kl_coef)
    if estimator in ("rloo",):
        rewards = producer.group_post_process(score, groups, std=False, baseline="leave_one_out")
    elif estimator == "reinforce_plus_plus_baseline":
        rewards = producer.group_post_process(score, groups, std=False)
    elif estimator in ("reinforce_plus_plus", "gae"):
        rewards = np.asarray(score, dtype=np.float32)
    else:
        rewards = producer.group_post_process(score, groups, std=True)
    kl = inp["kl"] if kl_in_reward == "token_returns" else None
    rows = producer.per_token_rewards(rewards, masks, lengths, kl, kl_coef)
    returns = None
    if estimator == "gae":
        adv, returns = producer.gae(rows, inp["values"], masks, lengths, gamma, lam)
    elif estimator == "reinforce_plus_plus" or kl_in_reward == "token_returns":
        adv = producer.returns(rows, 1.0 if baseline_bug else gamma)
    else:
        adv = np.repeat(rewards, lengths)
    stats = None
    if whitened or estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        if stride_bug:  # whitened over every token, the masked ones too
            adv, _, _ = producer.whiten(adv, [[1] * n for n in lengths])
        else:
            adv, mean, divisor = producer.whiten(adv, masks)
            stats = (mean, divisor)
    return rewards, adv, returns, stats


CASES = {
    "reinforce_plus_plus": dict(estimator="reinforce_plus_plus", gamma=0.95),
    "reinforce_plus_plus_kl": dict(estimator="reinforce_plus_plus", kl_in_reward="token_returns", kl_coef=0.05),
    "reinforce_plus_plus_baseline": dict(estimator="reinforce_plus_plus_baseline"),
    "grpo_token_returns": dict(estimator="grpo", kl_in_reward="token_returns", kl_coef=0.01),
    "grpo_sequence_kl": dict(estimator="grpo", kl_in_reward="sequence", kl_coef=0.1),
    "grpo_whitened": dict(estimator="grpo", whitened=True),
    "rloo_whitened": dict(estimator="rloo", whitened=True),
    "gae": dict(estimator="gae", gamma=0.99, lam=0.95),
    "gae_kl_whitened": dict(estimator="gae", gamma=1.0, lam=0.9, kl_in_reward="token_returns", kl_coef=0.02,
                            whitened=True),
}


def case_bundle(tmp_path, name, case, inp=None, **bug):
    inp = inp or make_inputs()
    rewards, adv, returns, _ = estimate(inp, **dict(case, **bug))
    config = dict(advantage_estimator=case["estimator"], gamma=case.get("gamma", 1.0), lam=case.get("lam", 1.0),
                  kl_in_reward=case.get("kl_in_reward"), kl_coef=case.get("kl_coef", 0.0),
                  normalize_advantages=case.get("whitened", False), grpo_std_normalization=True,
                  singleton_group="zero")
    return producer.write(tmp_path / name, raw=inp["raw"], groups=inp["groups"], lengths=inp["lengths"],
                          masks=inp["masks"], rewards=rewards, advantages=adv, returns_=returns,
                          values=inp["values"] if case["estimator"] == "gae" else None,
                          kl=inp["kl"] if config["kl_coef"] else None,
                          old_log_probs=inp["old"], ref_log_probs=inp["ref"], **config)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_float32_producer_of_each_estimator_replays_clean(tmp_path, name):
    report = replay(case_bundle(tmp_path, "b", CASES[name]))
    assert report.passed, report_to_text(report)
    estimate_stage = report.stage("advantage.estimate")
    per_token = name != "grpo_sequence_kl"  # (a broadcast: every token compared, as V1)
    gae = CASES[name]["estimator"] == "gae"
    said = " loss token(s) compared and their returns (" if gae else \
        " loss token(s) compared (" if per_token else " token(s) compared"
    assert said in estimate_stage.reason, estimate_stage.reason
    if CASES[name]["estimator"] == "gae":  # the returns payload is compared too, and not counted as tokens
        assert any(f.name == "returns" for f in report_fields(tmp_path / "b"))
        assert estimate_stage.reason.startswith(
            f"{estimate_stage.compared // 2} loss token(s) compared and their returns ("), estimate_stage.reason


def report_fields(path):
    from replay_lib.bundle import open_bundle
    from replay_lib.stages import REGISTRY, StageContext
    from replay_lib.bundle.schema import StageId
    reader = open_bundle(path).shards[0]
    ctx = StageContext(reader=reader, indices=list(range(len(reader.index.samples))), partial=False)
    REGISTRY[StageId.ADVANTAGE_ESTIMATE].run(ctx)
    return ctx.fields["advantage.estimate"]


@pytest.mark.parametrize("name,bug", [
    ("reinforce_plus_plus", dict(baseline_bug=True)),    # γ = 1 where the bundle declares 0.95
    ("reinforce_plus_plus_baseline", dict(stride_bug=True)),  # whitened over masked tokens too
    ("gae", dict(lam=1.0)),                               # λ = 1 where the bundle declares 0.95
    ("grpo_token_returns", dict(kl_coef=0.0)),            # the KL penalty left out of the per-token rewards
])
def test_a_producer_with_a_wrong_formula_diverges_at_advantage_estimate(tmp_path, name, bug):
    report = replay(case_bundle(tmp_path, "b", CASES[name], **bug))
    assert report.first_divergent_stage == "advantage.estimate", report_to_text(report)


def test_gae_returns_are_compared(tmp_path):
    inp = make_inputs()
    rewards, adv, returns, _ = estimate(inp, "gae", gamma=0.99, lam=0.95)
    returns = returns.copy()
    returns[0] += 0.01  # an advantage right, its return off by 0.01
    path = producer.write(tmp_path / "b", raw=inp["raw"], groups=inp["groups"], lengths=inp["lengths"],
                          masks=inp["masks"], rewards=rewards, advantages=adv, returns_=returns, values=inp["values"],
                          advantage_estimator="gae", gamma=0.99, lam=0.95)
    report = replay(path)
    d = report.first_divergence
    assert (report.first_divergent_stage, d.field, d.sample_id, d.token_offset) == ("advantage.estimate", "returns",
                                                                                   "s-0", 0)
    assert d.abs_error == pytest.approx(0.01, rel=1e-4)


def test_recorded_whitening_stats_replace_the_shards_own(tmp_path):
    # one shard of a larger batch: whitened with the batch's mean 0.1 and divisor 2.0, not this shard's
    inp = make_inputs()
    rewards, _, _, _ = estimate(inp, "grpo")
    adv = ((np.repeat(rewards, inp["lengths"]) - np.float32(0.1)) / np.float32(2.0)).astype(np.float32)
    common = dict(raw=inp["raw"], groups=inp["groups"], lengths=inp["lengths"], masks=inp["masks"], rewards=rewards,
                  advantages=adv, grpo_std_normalization=True, normalize_advantages=True)
    assert replay(producer.write(tmp_path / "stats", whiten_stats=(0.1, 2.0), **common)).passed
    own = replay(producer.write(tmp_path / "own", **common))
    assert own.first_divergent_stage == "advantage.estimate"


def test_a_partial_selection_whitens_with_the_shards_statistics(tmp_path):
    path = case_bundle(tmp_path, "b", CASES["grpo_whitened"])
    from replay_lib.bundle.selection import Selection
    report = replay(path, selection=Selection(groups=("g-1",)))
    assert report.passed, report_to_text(report)
    inp = make_inputs()  # group 1 is samples 4..7: only their loss tokens are compared
    assert report.stage("advantage.estimate").compared == sum(sum(m) for m in inp["masks"][4:8])


# ---------------------------------------------------------------------------------------- bad input


def bad_bundle(tmp_path, name="b", **config):
    inp = make_inputs(samples=4, group=2)
    rewards, adv, returns, _ = estimate(inp, "grpo")
    return producer.write(tmp_path / name, raw=inp["raw"], groups=inp["groups"], lengths=inp["lengths"],
                          masks=inp["masks"], rewards=rewards, advantages=adv, grpo_std_normalization=True, **config)


@pytest.mark.parametrize("config,message", [
    (dict(advantage_estimator="grpo2"), "$.config.advantage_estimator='grpo2': expected one of grpo, dr_grpo, rloo, "
                                        "reinforce_plus_plus, reinforce_plus_plus_baseline, gae, opo, gpg, grpo_passk, maxrl, remax, gdpo"),
    (dict(group_baseline="median"), "$.config.group_baseline='median': expected one of mean, leave_one_out"),
    (dict(std_zero="nan"), "$.config.std_zero='nan': expected one of eps, skip"),
    (dict(singleton_group="one"), "$.config.singleton_group='one': expected null or one of nan, zero, raw"),
    (dict(kl_in_reward="token"), "$.config.kl_in_reward='token': expected null or one of sequence, token_returns"),
    (dict(gamma=1.5), "$.config.gamma=1.5: expected a number in [0, 1]"),
    (dict(lam=-0.1), "$.config.lam=-0.1: expected a number in [0, 1]"),
    (dict(advantage_estimator="gae"),
     "$.config.advantage_estimator='gae' needs the per-token critic values: payloads/values.safetensors is missing"),
])
def test_bad_advantage_knobs_are_invalid_bundles(tmp_path, config, message):
    path = bad_bundle(tmp_path, **config)
    with pytest.raises(BundleError) as exc:
        replay(path)
    assert str(exc.value) == f"{path / 'index.json'}: {message}"
    if config != dict(advantage_estimator="gae"):  # validate names the same knob (gae: the missing payload first)
        with pytest.raises(BundleError, match=message.replace("$", r"\$").replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[").replace("]", r"\]")):
            validate(path)


@pytest.mark.parametrize("estimator", ["dppo", "decoupled_ppo"])
def test_out_of_reach_families_refuse_by_name(tmp_path, estimator):
    path = bad_bundle(tmp_path, advantage_estimator=estimator)
    with pytest.raises(UnsupportedError, match=f"advantage_estimator='{estimator}'"):
        replay(path)
    assert any(estimator in r for r in validate(path).replay_refusals)


def test_bad_input_in_a_real_process_is_one_line_exit_3(tmp_path):
    path = bad_bundle(tmp_path, gamma=2.0)
    for verb in ("replay", "validate"):
        proc = subprocess.run([sys.executable, "-m", "replay_lib", verb, str(path)], capture_output=True, text=True,
                              timeout=120)
        assert (proc.returncode, proc.stdout) == (3, ""), proc.stderr
        assert proc.stderr == f"trajectory-replay: error: {path / 'index.json'}: $.config.gamma=2.0: expected a number in [0, 1]\n"


def test_context_parallel_size_is_provenance_for_the_advantage_side(tmp_path):
    # SPEC §4.2: a bundle holds whole trajectories (the capture joins the CP shards), so rank.cp = 2 changes nothing
    # for reward.raw … advantage.estimate (a loss.policy stage still refuses it: tests/test_cli_replay.py)
    inp = make_inputs()
    rewards, adv, _, _ = estimate(inp, "grpo", whitened=True)
    path = producer.write(tmp_path / "cp", raw=inp["raw"], groups=inp["groups"], lengths=inp["lengths"],
                          masks=inp["masks"], rewards=rewards, advantages=adv, grpo_std_normalization=True,
                          normalize_advantages=True, rank={"cp": 2})
    report = replay(path)
    assert report.passed and len([s for s in report.stages if s.status == "pass"]) == 5, report_to_text(report)


def test_whitening_equal_advantages_is_a_hazard_not_a_failure(tmp_path):
    # REINFORCE++ on rewards that are all 0.3 with γ = 1: every loss token's return is 0.3, the variance is 0 up to
    # rounding and the whitened values are a float32 producer's rounding over √(1e-8) = 1e-4
    inp = make_inputs()
    inp["raw"] = np.full(len(inp["raw"]), 0.3)
    rewards, adv, _, _ = estimate(inp, "reinforce_plus_plus")
    path = producer.write(tmp_path / "b", raw=inp["raw"], groups=inp["groups"], lengths=inp["lengths"],
                          masks=inp["masks"], rewards=rewards, advantages=adv, advantage_estimator="reinforce_plus_plus")
    report = replay(path)
    assert report.passed, report_to_text(report)
    [hazard] = [h for h in report.hazards if h.stage == "advantage.estimate"]
    assert hazard.kind == "whiten_zero_std" and hazard.message.startswith(
        f"whitening over {sum(sum(m) for m in inp['masks'])} loss token(s) whose advantages are equal up to rounding")
    assert "hazard: advantage.estimate whiten_zero_std" in report_to_text(report)


def test_kl_penalty_type_is_the_rollout_kls_estimator(tmp_path):
    # verl: algorithm.kl_penalty (here k1: kl = old − ref) for the reward's KL, actor.kl_loss_type (k3) for the loss
    inp = make_inputs()
    rewards, adv, _, _ = estimate(inp, "grpo", kl_in_reward="sequence", kl_coef=0.1)
    common = dict(raw=inp["raw"], groups=inp["groups"], lengths=inp["lengths"], masks=inp["masks"], rewards=rewards,
                  advantages=adv, kl=inp["kl"], old_log_probs=inp["old"], ref_log_probs=inp["ref"],
                  grpo_std_normalization=True, singleton_group="zero", kl_in_reward="sequence", kl_coef=0.1,
                  kl_loss_type="k3")
    report = replay(producer.write(tmp_path / "k1", kl_penalty_type="k1", **common))
    assert report.passed, report_to_text(report)
    assert report.stage("advantage.kl").reason.endswith("compared (k1, kl_coef=0.1)")
    # without it the recorded k1 values are judged as k3 (exp(−r) − 1 + r ≈ r²/2, not r): a divergence at advantage.kl
    assert replay(producer.write(tmp_path / "k3", **common)).first_divergent_stage == "advantage.kl"


def test_estimators_that_pass_the_score_through_need_no_groups(tmp_path):
    # REINFORCE++ and GAE never group: samples without a group_index replay clean; GRPO still names them
    inp = make_inputs()
    rewards, adv, returns, _ = estimate(inp, "gae", gamma=0.99, lam=0.95)
    common = dict(raw=inp["raw"], groups=[None] * len(inp["raw"]), lengths=inp["lengths"], masks=inp["masks"],
                  rewards=rewards, values=inp["values"])
    clean = replay(producer.write(tmp_path / "gae", advantages=adv, returns_=returns, advantage_estimator="gae",
                                  gamma=0.99, lam=0.95, **common))
    assert clean.passed, report_to_text(clean)
    grpo = replay(producer.write(tmp_path / "grpo", advantages=np.repeat(rewards, inp["lengths"]), **common))
    assert grpo.stage("reward.post_process").reason == (
        "sample has no group_index; its semantic group is unknown (never inferred from a batch)")


@pytest.mark.parametrize("name,formula", [
    ("grpo_sequence_kl", "A = the sample's normalized reward, broadcast over its"),
    ("reinforce_plus_plus", "A_t = Σ_k≥t γ^(k−t)·r_k, r_k = mask_k·(1[k = last loss token]·reward), γ = 0.95 "
                            "(reward recorded); then whitened over the loss tokens"),
    ("grpo_token_returns", "A_t = Σ_k≥t γ^(k−t)·r_k, r_k = mask_k·(1[k = last loss token]·reward − kl_coef·kl_k), "
                           "γ = 1 (reward recorded)"),
    ("gae_kl_whitened", "A_t = Σ_k≥t (γλ)^(k−t)·δ_k, δ_k = r_k + γ·V_k+1 − V_k, r_k = mask_k·(1[k = last loss "
                        "token]·reward − kl_coef·kl_k), γ = 1, λ = 0.9 (reward recorded); then whitened over the "
                        "loss tokens"),
])
def test_the_why_line_of_an_advantage_token_follows_the_estimator(tmp_path, name, formula):
    """The inputs of an advantage token (the TUI's why strip) by the bundle's estimator: it once said "the
    sample's normalized reward, broadcast" for GAE and the discounted returns too, beside a different value."""
    from replay_lib.bundle import open_bundle
    from replay_lib.explain.inputs import element_inputs
    from replay_lib.stages import StageContext

    inp = make_inputs()
    reader = open_bundle(case_bundle(tmp_path, "b", CASES[name], inp)).shards[0]
    ctx = StageContext(reader=reader, indices=list(range(len(reader.index.samples))), partial=False)
    why = element_inputs(ctx, "advantage", 0, 1)
    assert why.formula.startswith(formula), why.formula
    names = [k for k, _ in why.items]
    assert names[:3] == ["reward", "group", "mask"]
    if "kl_coef·kl_k" in formula:  # the token's KL (the recorded payload) and the coefficient
        assert names[-2:] == ["kl", "kl_coef"] and dict(why.items)["kl_coef"] == f"{CASES[name]['kl_coef']:g}"
        assert float(dict(why.items)["kl"]) == pytest.approx(float(inp["kl"][1]), rel=1e-6)
    if CASES[name]["estimator"] == "gae":
        assert float(dict(why.items)["V"]) == pytest.approx(float(inp["values"][1]), rel=1e-6)
