"""prime-rl's IcePop loss (``policy_loss="icepop"``, prime-rl #3526): the kernel against values derived by hand
(the inclusive band on r = exp(logp − rollout), tested in log space; a dropped extreme ratio an exact 0, never
0·inf = NaN), a legitimate float32 / bf16 producer replaying clean with dropped tokens in the step
(``producers.loss_families_b``), and its typical bug — the ratio taken to the old log-probs — named at
loss.policy."""

from __future__ import annotations

import json
import math

import pytest
import torch

from replay_lib.bundle import BundleReader

from producers.inputs import Size
from producers.loss_families_b import produce_family_bundle

SIZE = Size(samples=16, tokens=256, group_size=4)


def _terms(logp, rollout, adv, params=(), dtype=torch.float64):
    from replay_lib.kernels.loss import LossKnobs, policy_token_terms

    k = LossKnobs(policy_loss="icepop", policy_loss_params=tuple(sorted(params)))
    t = lambda v: torch.tensor(v, dtype=dtype)  # noqa: E731
    return policy_token_terms(t(logp), t(rollout), t(adv), k, seg=torch.zeros(len(logp), dtype=torch.long),
                              sample_terms={}, rollout_log_probs=t(rollout), dtype=dtype)


def test_icepop_by_hand_inclusive_band_in_log_space():
    # log r = log 0.1, log 0.2 (the lower edge: kept), 0, log 5 (the upper edge: kept), log 6, 1000 (dropped)
    lrs = [math.log(0.1), math.log(0.2), 0.0, math.log(5.0), math.log(6.0), 1000.0]
    rollout = [0.0] * 6
    adv = [1.0, -2.0, 0.5, 1.0, 1.0, 3.0]
    t = _terms(lrs, rollout, adv, params=[("adv_tau", 2.0)])
    # pg = −keep·adv_tau·A·r: 0, −2·(−2)·0.2, −2·0.5·1, −2·1·5, 0, 0
    assert t["pg"].tolist() == pytest.approx([0.0, 0.8, -1.0, -10.0, 0.0, 0.0], rel=1e-12, abs=0)
    assert t["clip"].tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert not bool(torch.isnan(t["pg"]).any())


def test_a_dropped_overflowing_ratio_is_an_exact_zero_in_float32():
    """exp(100) overflows float32: keep·exp(log r) would be 0·inf = NaN there; the guard gives 0."""
    naive = torch.tensor(0.0) * torch.exp(torch.tensor(100.0, dtype=torch.float32))
    assert math.isnan(float(naive))
    t = _terms([100.0, 0.1], [0.0, 0.0], [1.0, 1.0], dtype=torch.float32)
    assert t["pg"].tolist() == [0.0, pytest.approx(-math.exp(0.1), rel=1e-6)]


def test_icepop_parameters_are_checked_by_name():
    from replay_lib.kernels.families import check_params

    assert check_params("icepop", {"ratio_low": 0.5}) is None
    assert check_params("icepop", {"ratio_lo": 0.5}) == (
        "policy_loss_params.ratio_lo", "0.5: not a parameter of policy_loss 'icepop' (its parameters: adv_tau, "
                                       "ratio_high, ratio_low)")


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_a_producer_with_dropped_tokens_replays_clean(tmp_path, cli, precision):
    path = produce_family_bundle(tmp_path / "b", "icepop", 3, SIZE, precision=precision)
    expected = json.load(open(path / "expected.json"))["loss.policy"]
    reader = BundleReader(path)
    tokens = sum(sum(reader.sample_mask(i)) for i in range(len(reader.index.samples)))
    assert expected["pg_clipfrac"] * tokens >= 3 - 1e-3  # the extreme and the two moderate tokens are dropped
    code, out, err = cli("replay", path, "--format", "json")
    report = json.loads(out)
    loss = next(s for s in report["stages"] if s["stage"] == "loss.policy")
    assert (code, err, loss["status"], loss["compared"]) == (0, "", "pass", 4), loss
    grad = next(s for s in report["stages"] if s["stage"] == "loss.grad")  # the autograd gradient, recomputed
    assert grad["status"] == "pass", grad


def test_the_ratio_to_the_old_log_probs_is_named(tmp_path, cli):
    path = produce_family_bundle(tmp_path / "b", "icepop", 5, SIZE, bug="icepop_old_anchor")
    code, out, err = cli("replay", path, "--format", "json")
    report = json.loads(out)
    assert (code, report["first_divergent_stage"]) == (1, "loss.policy"), report["stages"]
    assert report["explanations"][0]["hypothesis"] == "loss.icepop_old_anchor", report["explanations"]


def test_icepop_gradient_by_hand_and_against_autograd():
    """∂pg/∂logp = −keep·adv_tau·A·r per token (kernels.grad_icepop): by hand, and against torch.autograd of the
    loss written here (the band on log r, a dropped ratio replaced before exp)."""
    from replay_lib.kernels.grad import GradInputs, grad_log_probs
    from replay_lib.kernels.loss import LossKnobs

    f64 = torch.float64
    lr = torch.tensor([math.log(0.1), math.log(0.2), 0.3, math.log(5.0), 800.0], dtype=f64)
    rollout = torch.tensor([-1.0, 0.0, -0.5, 0.0, -1.0], dtype=f64)  # the edges exact: logp − 0 = log 0.2, log 5
    adv = torch.tensor([1.0, -2.0, 0.5, 1.0, 3.0], dtype=f64)
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0], dtype=f64)
    knobs = LossKnobs(policy_loss="icepop", policy_loss_params=(("adv_tau", 2.0),), loss_agg_mode="token_sum")
    gi = GradInputs(log_probs=rollout + lr, old_log_probs=rollout, advantages=adv, mask=mask,
                    lengths=torch.tensor([5]), rollout_log_probs=rollout)
    g = grad_log_probs(gi, knobs)
    assert g.grad.tolist() == pytest.approx([0.0, 2 * 2 * 0.2, -2 * 0.5 * math.exp(0.3), -2 * 5.0, 0.0], rel=1e-12)
    x = (rollout + lr).clone().requires_grad_(True)
    d = x - rollout
    keep = (d.detach() >= math.log(0.2)) & (d.detach() <= math.log(5.0))
    loss = (-(2.0 * adv) * torch.exp(torch.where(keep, d, torch.zeros_like(d))) * keep * mask).sum()
    loss.backward()
    assert g.grad.tolist() == pytest.approx(x.grad.tolist(), rel=1e-12)


def test_the_example_trainer_with_icepop_replays_clean_and_its_bug_fails_loss_policy(tmp_path):
    """``examples/grpo_trainer.py --loss icepop``: clean over its steps; ``--family-bug`` (the ratio to the old
    log-probs) diverges at loss.policy."""
    from test_loss_trainer import STEPS, first_divergences, train

    flags = ("--loss", "icepop", "--loss-agg", "token_mean")
    (tmp_path / "clean").mkdir()
    (tmp_path / "bug").mkdir()
    assert first_divergences(train(tmp_path / "clean", *flags)) == dict.fromkeys(STEPS)
    found = first_divergences(train(tmp_path / "bug", *flags, "--family-bug"))
    hits = [d for d in found.values() if d is not None]
    assert hits and all(stage == "loss.policy" for stage, _, _ in hits), found
