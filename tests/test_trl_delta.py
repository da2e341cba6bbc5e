"""TRL ``delta`` below ``1 + epsilon_high`` (two-sided clipping): the mapped knobs give TRL's per-token loss, from a
reference written from TRL 1.16's ``GRPOTrainer._compute_loss`` (``trl/trainer/grpo_trainer.py:3112-3120``:
``coef_2 = clamp(coef_1, 1 − ε_low, 1 + ε_high)``, then ``coef_1 = clamp(coef_1, max=delta)``, the per-token loss
``−min(coef_1·A, coef_2·A)``)."""

from __future__ import annotations

import pytest
import torch

from replay_lib.bundle.loss_knobs import LossKnobs
from replay_lib.errors import UnsupportedFrameworkConfig
from replay_lib.frameworks import from_trl
from replay_lib.kernels.loss import policy_token_terms

F64 = torch.float64


def trl_per_token_loss(ratio, adv, eps_low, eps_high, delta):
    coef_2 = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    coef_1 = torch.clamp(ratio, max=delta)
    return -torch.min(coef_1 * adv, coef_2 * adv)


@pytest.mark.parametrize("delta, eps_high", [(1.1, 0.2), (1.25, 0.28), (1.5, 0.2), (1.2, 0.2)])
def test_delta_maps_to_trls_per_token_loss_in_every_region(delta, eps_high):
    cfg = from_trl({"loss_type": "dapo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": eps_high, "delta": delta})
    # ratios across every edge (below 1 − ε_low, between, past δ, past 1 + ε_high), each with A of both signs
    r = torch.tensor([0.5, 0.79, 0.9, 1.0, 1.05, 1.15, 1.19, 1.22, 1.27, 1.4, 1.6, 3.0], dtype=F64)
    r = torch.cat([r, r])
    adv = torch.cat([torch.full((12,), 0.7, dtype=F64), torch.full((12,), -1.3, dtype=F64)])
    old = torch.full_like(r, -1.0)
    knobs = LossKnobs.of(cfg)
    t = policy_token_terms(old + torch.log(r), old, adv, knobs, dtype=F64)
    assert torch.allclose(t["pg"], trl_per_token_loss(r, adv, 0.2, eps_high, delta), rtol=1e-14, atol=0)
    if delta < 1 + eps_high:
        assert (knobs.eps_clip_high, knobs.eps_clip_c) == (pytest.approx(delta - 1), 1 + eps_high)
        # not vacuous: the old mapping (dual-clip at δ, ε_high unchanged) differs on A > 0 past δ
        old_knobs = LossKnobs.of(cfg.__class__(**{**{f: getattr(cfg, f) for f in cfg.__struct_fields__},
                                                  "eps_clip_high": eps_high, "eps_clip_c": delta}))
        wrong = policy_token_terms(old + torch.log(r), old, adv, old_knobs, dtype=F64)["pg"]
        assert not torch.allclose(wrong, trl_per_token_loss(r, adv, 0.2, eps_high, delta))
    else:
        assert (knobs.eps_clip_high, knobs.eps_clip_c) == (eps_high, delta)


def test_delta_at_or_below_one_is_refused():
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_trl({"loss_type": "dapo", "beta": 0.0, "delta": 1.0})
    assert (str(err.value), err.value.exit_code) == (
        "TRL config: delta=1.0: at or below 1 the cap clips the ratio below the unclipped 1 on both sides (TRL "
        "recommends delta > 1 + epsilon); not recomputed", 4)
