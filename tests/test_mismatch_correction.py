"""The rollout correction's batch normalization and anchor, by hand: ``importance_weight`` divided by the recorded
factor, verl's factor recomputed (``kernels.mismatch.is_batch_norm_factor``), the schema's checks of the new knobs."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from replay_lib.bundle.loss_knobs import LossKnobs
from replay_lib.bundle.schema import RecomputeConfig
from replay_lib.kernels.loss import importance_weight
from replay_lib.kernels.mismatch import is_batch_norm_factor


def _knobs(**kw) -> LossKnobs:
    return LossKnobs.of(RecomputeConfig(**kw))


def test_weight_divided_by_the_recorded_factor():
    log_w = torch.tensor([math.log(0.5), 0.0, math.log(3.0)], dtype=torch.float64)
    tis = _knobs(is_level="token", is_high=2.0, is_batch_normalize=True, is_batch_norm_factor=1.25)
    assert importance_weight(log_w, tis).tolist() == [0.5 / 1.25, 1.0 / 1.25, 2.0 / 1.25]
    icepop = _knobs(is_level="token", is_mode="mask", is_low=0.6, is_high=2.0, is_batch_normalize=True,
                    is_batch_norm_factor=0.5)
    assert importance_weight(log_w, icepop).tolist() == [0.0, 2.0, 0.0]
    # the factor without is_batch_normalize is not applied; normalize without a factor: is_norm None (required)
    assert _knobs(is_level="token", is_batch_norm_factor=2.0).is_norm is None
    assert _knobs(is_level="token", is_batch_normalize=True).is_norm is None


def test_factor_by_hand():
    # two samples of 2 and 3 loss tokens and an empty one; d = old − rollout
    old = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -1.0], dtype=torch.float64)
    rollout = torch.tensor([-math.log(0.5), -math.log(3.0), 0.0, -math.log(1.5), 7.0, 0.0], dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    seg = torch.tensor([0, 0, 1, 1, 1, 2])
    mask[5] = 0.0  # sample 2 has no loss token
    tis = _knobs(is_level="token", is_high=2.0, is_batch_normalize=True, is_batch_norm_factor=1.0)
    # token weights 0.5, min(3, 2) = 2, 1, 1.5 over 4 loss tokens (the masked token's value never enters)
    assert is_batch_norm_factor(rollout, old, mask, seg, 3, tis) == pytest.approx((0.5 + 2.0 + 1.0 + 1.5) / 4,
                                                                                  rel=1e-15)
    seq = _knobs(is_level="sequence", is_high=2.0, is_batch_normalize=True, is_batch_norm_factor=1.0)
    # sample weights exp(log 0.5 + log 3) = 1.5 and exp(0 + log 1.5) = 1.5, the empty sample left out
    assert is_batch_norm_factor(rollout, old, mask, seg, 3, seq) == pytest.approx(1.5, rel=1e-15)
    # every weight masked to 0: the mean is not above 1e-8 and verl keeps the weights (factor 1)
    none = _knobs(is_level="token", is_mode="mask", is_low=5.0, is_high=6.0, is_batch_normalize=True,
                  is_batch_norm_factor=1.0)
    assert is_batch_norm_factor(rollout, old, mask, seg, 3, none) == 1.0


@pytest.mark.parametrize("kw, message", [
    (dict(is_batch_norm_factor=0.0), "is_batch_norm_factor: expected a finite divisor > 0, got 0.0"),
    (dict(is_batch_norm_factor=math.inf), "is_batch_norm_factor: expected a finite divisor > 0, got inf"),
    (dict(rollout_correction_anchor="rollout"), "rollout_correction_anchor: expected one of old, current, got "
                                                "'rollout'"),
])
def test_schema_checks_the_new_knobs(kw, message):
    with pytest.raises(ValueError) as err:
        RecomputeConfig(**kw)
    assert str(err.value) == message


def test_unset_knobs_are_not_written():
    assert b"is_batch_normalize" not in msgspec.json.encode(RecomputeConfig())
    assert b"rollout_correction_anchor" not in msgspec.json.encode(RecomputeConfig())
