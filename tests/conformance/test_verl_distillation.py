"""On-policy distillation against verl 0.9.1's own code: the per-token estimate of its supervised distillation
loss (``verl.trainer.ppo.core_algos.kl_penalty`` on student and teacher log-probs, then ``loss_max_clamp``,
``trainer/distillation/losses.py:256-258, 379-405``) against ``kernels.loss.opd_estimate`` under the mapped
knobs; and the mapping of ``distillation.*`` (``from_verl``)."""

from __future__ import annotations

import pytest
import torch

from replay_lib.bundle.schema import RecomputeConfig
from replay_lib.errors import UnsupportedFrameworkConfig
from replay_lib.frameworks.verl import from_verl
from replay_lib.kernels.loss import LossKnobs, opd_estimate

from .conftest import import_verl

core_algos, _ = import_verl()


def _distill(**loss) -> dict:
    return {"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"rollout": {"n": 4}},
            "distillation": {"enabled": True, "distillation_loss": loss}}


@pytest.mark.parametrize("mode", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
@pytest.mark.parametrize("clamp", [None, 2.0])
def test_the_distillation_estimate_matches_verls_kl_penalty(mode, clamp):
    g = torch.Generator().manual_seed(3)
    student = -torch.rand(257, generator=g, dtype=torch.float32) * 6
    teacher = -torch.rand(257, generator=g, dtype=torch.float32) * 6
    student[:3] = torch.tensor([-30.0, -0.1, -25.0])  # |r| beyond verl's ±20 input clamp
    teacher[:3] = torch.tensor([-0.1, -30.0, -0.2])
    want = core_algos.kl_penalty(logprob=student, ref_logprob=teacher, kl_penalty=mode)
    if clamp is not None:
        want = want.clamp(min=-clamp, max=clamp)
    cfg = from_verl(_distill(loss_mode=mode, loss_max_clamp=clamp, distillation_loss_coef=0.5))
    assert (cfg.opd_placement, cfg.opd_coef, cfg.opd_clamp) == ("loss", 0.5, clamp)
    got = opd_estimate(student, teacher, LossKnobs.of(cfg), torch.float32)
    assert torch.allclose(got, want, rtol=2e-6, atol=2e-6), (got - want).abs().max()


@pytest.mark.parametrize("loss, key, why", [
    ({"loss_mode": "forward_kl_topk"}, "loss_mode", "teacher's top-k token ids and log-probs"),
    ({"use_policy_gradient": True}, "use_policy_gradient", "a second policy loss"),
    ({"use_task_rewards": False}, "use_task_rewards", "the policy term is dropped"),
])
def test_what_a_bundle_cannot_hold_is_refused_by_name(loss, key, why):
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_verl(_distill(**loss))
    assert f"distillation.distillation_loss.{key}=" in str(err.value) and why in str(err.value)


def test_distillation_off_maps_nothing():
    cfg = from_verl({"algorithm": {"adv_estimator": "grpo"}, "distillation": {"enabled": False}})
    assert not LossKnobs.of(cfg).opd_loss and isinstance(cfg, RecomputeConfig)
