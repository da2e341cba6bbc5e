"""SkyRL's DPPO (policy_loss ``dppo_mu``, ``kernels/families/dppo_mu.py``): hand-derived terms."""

from __future__ import annotations

import math

import pytest
import torch

from replay_lib.bundle.loss_knobs import LossKnobs
from replay_lib.kernels.loss import policy_token_terms

F64 = torch.float64
# μ = log 0.5 everywhere; p = 0.6, 0.4, 0.6, 0.5; A = +1, −1, −1, 0
MU = torch.full((4,), math.log(0.5), dtype=F64)
LOGP = torch.log(torch.tensor([0.6, 0.4, 0.6, 0.5], dtype=F64))
ADV = torch.tensor([1.0, -1.0, -1.0, 0.0], dtype=F64)
OLD = torch.full((4,), -3.0, dtype=F64)  # far from μ: a term anchored on old would differ


def knobs(divergence: str, low: float, high: float) -> LossKnobs:
    return LossKnobs(eps_clip=low, eps_clip_high=high, policy_loss="dppo_mu",
                     policy_loss_params=(("anchor", "rollout"), ("divergence", divergence)))


def test_tv_drops_by_the_sign_of_a_against_the_rollout():
    # p − p_μ = 0.1, −0.1, 0.1, 0: A>0 with 0.1 > δ_high 0.05 dropped; A<0 with 0.1 > δ_low 0.08 dropped;
    # A<0 with p > p_μ kept (r = 1.2, pg = −(−1)·1.2); A = 0 kept (pg 0)
    t = policy_token_terms(LOGP, OLD, ADV, knobs("tv", 0.08, 0.05), rollout_log_probs=MU, dtype=F64)
    assert t["clip"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert t["pg"].tolist() == pytest.approx([0.0, 0.0, 1.2, 0.0], abs=1e-15)
    assert t["ratio"].tolist() == pytest.approx([1.2, 0.8, 1.2, 1.0], rel=1e-15)


def test_kl_needs_the_side_and_the_binary_kl():
    # D(0.5 → 0.6) = 0.5·log(0.5/0.6) + 0.5·log(0.5/0.4) = 0.0204; D(0.5 → 0.4) = 0.0204 as well
    d = 0.5 * math.log(0.5 / 0.6) + 0.5 * math.log((0.5 + 1e-8) / (0.4 + 1e-8))
    assert d == pytest.approx(0.0204, abs=1e-4)
    t = policy_token_terms(LOGP, OLD, ADV, knobs("kl", 0.03, 0.01), rollout_log_probs=MU, dtype=F64)
    # token 0: A>0, p>p_μ, D 0.0204 > 0.01 dropped; token 1: A<0, p<p_μ, D < 0.03 kept: pg = −(−1)·0.8
    assert t["clip"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert t["pg"].tolist() == pytest.approx([0.0, 0.8, 1.2, 0.0], rel=1e-12)


def test_anchored_on_the_rollout_it_needs_the_rollout():
    with pytest.raises(ValueError, match="rollout_log_probs is required for dppo_mu"):
        policy_token_terms(LOGP, OLD, ADV, knobs("tv", 0.2, 0.2), dtype=F64)
