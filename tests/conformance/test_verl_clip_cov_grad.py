"""Clip-Cov's gradient (loss.grad, SPEC §4.3) against verl 0.9.1's own ``compute_policy_loss_clip_cov``
(core_algos.py:1744-1845) as the producer: verl's function called per micro-batch on a float32 log-prob leaf, each
micro-batch's loss backpropagated with ``torch.autograd`` — the leaf's gradient is the recorded
``grad_log_probs``, verl's ``corr`` (its random draw, taken from the call as test_verl_clip_cov.py takes it) the
recorded ``clip_cov_mask``. The bundle mapped by ``from_verl`` replays clean at loss.grad; a producer whose
gradient is wrong while its loss value is right is named at loss.grad with loss.policy passing:

* ``clamp``: PPO's clip as a straight-through clamp (``r + (clamp(r) − r).detach()``): the clipped tokens keep
  the unclipped slope −A·r;
* ``corr``: the draw applied so that its value is 0 but its gradient is not (``x·corr + (x − sg(x))·(1 − corr)``):
  the selected tokens keep their surrogate's slope."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
import torch

from replay_lib.frameworks import from_verl

from .conftest import import_verl
from .test_verl import GROUPS, N, _advantages, _step
from .test_verl_clip_cov import CONFIGS, clip_cov_actor_config
from .test_verl_family_grads import write_step_bundle

core_algos, _ = import_verl()


class _LeakyCorr(torch.Tensor):
    """verl's ``corr`` whose product keeps its value and leaks the gradient of the dropped terms (a bug)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.mul):
            plain = [a.as_subclass(torch.Tensor) if isinstance(a, _LeakyCorr) else a for a in args]
            corr = next(p for a, p in zip(args, plain) if isinstance(a, _LeakyCorr))
            x = next(p for a, p in zip(args, plain) if not isinstance(a, _LeakyCorr))
            return x * corr + (x - x.detach()) * (1 - corr)
        out = super().__torch_function__(func, types, args, kwargs)
        return out.as_subclass(torch.Tensor) if isinstance(out, _LeakyCorr) and func is not torch.Tensor.__setitem__ \
            else out


def verl_clip_cov_grad(actor: dict, micro, old, logp, adv, mask, seed: int, bug: str = ""
                       ) -> tuple[float, torch.Tensor, torch.Tensor]:
    """``(pg_loss, ∂pg_loss/∂log_prob [B, L], selected [B, L] bool)``: verl's Clip-Cov per micro-batch, each
    micro-batch's loss backpropagated; ``selected`` its ``corr == 0``. ``bug``: ``"clamp"`` or ``"corr"`` (module
    doc), the loss value unchanged."""
    cfg = clip_cov_actor_config(actor, actor["policy_loss"], mask)
    fn = core_algos.get_policy_loss_fn("clip_cov")
    x = logp.clone().requires_grad_(True)
    selected = torch.zeros_like(mask, dtype=torch.bool)
    total = 0.0
    torch.manual_seed(seed)
    ones_like, clamp = torch.ones_like, torch.clamp
    for rows in micro:
        a = adv[rows]
        made = []

        def capture(t, *args, **kwargs):  # verl's corr: the ones_like of the advantages it was handed
            out = ones_like(t, *args, **kwargs)
            if t is a:
                out = out.as_subclass(_LeakyCorr) if bug == "corr" else out
                made.append(out)
            return out

        def straight_through(t, *args, **kwargs):
            return t + (clamp(t, *args, **kwargs) - t).detach()

        torch.ones_like = capture
        if bug == "clamp":
            torch.clamp = straight_through
        try:
            loss, _ = fn(old_log_prob=old[rows], log_prob=x[rows], advantages=a, response_mask=mask[rows].bool(),
                         loss_agg_mode=actor["loss_agg_mode"], config=cfg)
        finally:
            torch.ones_like, torch.clamp = ones_like, clamp
        assert len(made) == 1
        selected[rows] = made[0].as_subclass(torch.Tensor) == 0
        loss.backward()
        total += loss.item()
    return total, x.grad.detach().clone(), selected


def write_clip_cov_grad_bundle(path, name: str, seed: int, bug: str = "", tis: bool = False,
                               edge: str = "") -> str:
    """``tis``: the bundle declares a token-level truncated importance weight (``is_high`` 2) with rollout
    log-probs equal to the old ones: every weight is exactly 1, verl's loss and gradient the same. ``edge``
    (token-mean configs): the first loss token with A > 0 of sample 1 gets the ratio 1 + ε_high to float32 rounding
    (``"verl"``: verl's gradient there as it is; ``"flip"``: the other branch's, 0 ↔ −A·r/Σmask)."""
    actor, micro = CONFIGS[name]
    lengths, valid, mask, old, logp, scores = _step(seed, torch.float32)
    adv, normalized = _advantages("grpo", {}, scores, lengths, mask, valid.shape[1])
    if edge:
        j = int(torch.nonzero(mask[1] * (adv[1] > 0))[0])
        logp = logp.clone()
        logp[1, j] = old[1, j] + math.log1p(actor.get("clip_ratio_high", 0.2))
    pg_loss, grad, selected = verl_clip_cov_grad(actor, micro, old, logp, adv, mask, seed, bug)
    if edge == "flip":
        r = math.exp(float(logp[1, j]) - float(old[1, j]))
        grad[1, j] = 0.0 if float(grad[1, j]) != 0.0 else -float(adv[1, j]) * r / float(mask.sum())
    assert int(selected.sum()) >= 1
    verl = {"algorithm": {"adv_estimator": "grpo"},
            "actor_rollout_ref": {"rollout": {"n": N}, "actor": {"ppo_mini_batch_size": GROUPS, **actor}}}
    cfg = msgspec.structs.replace(from_verl(verl, version="0.9.1"), loss_token_count=int(mask.sum()))
    if tis:
        cfg = msgspec.structs.replace(cfg, is_level="token", is_mode="truncate", is_high=2.0)
    payloads = {"log_probs": logp, "old_log_probs": old, "advantages": adv, "grad_log_probs": grad,
                "clip_cov_mask": selected.to(torch.int8)}
    if tis:
        payloads["rollout_log_probs"] = old
    return write_step_bundle(path, name, cfg, micro, lengths, valid, mask, scores, normalized, pg_loss, payloads)


def _replay(cli, bundle) -> tuple[int, str, dict, dict]:
    code, out, err = cli("replay", bundle, "--format", "json")
    report = json.loads(out)
    return code, err, report, {s["stage"]: s for s in report["stages"]}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [7, 8, 9])
def test_verl_clip_cov_gradient_replays_clean(tmp_path, cli, name, seed):
    bundle = write_clip_cov_grad_bundle(tmp_path / "b", name, seed)
    code, err, report, stages = _replay(cli, bundle)
    assert (code, err) == (0, ""), stages.get("loss.grad")
    assert (stages["loss.policy"]["status"], stages["loss.grad"]["status"]) == ("pass", "pass")
    assert stages["loss.grad"]["compared"] == sum(s["response_length"] for s in json.load(
        open(f"{bundle}/index.json"))["samples"])


@pytest.mark.parametrize("bug", ["clamp", "corr"])
def test_a_clip_cov_gradient_bug_is_named_at_loss_grad_with_the_loss_passing(tmp_path, cli, bug):
    bundle = write_clip_cov_grad_bundle(tmp_path / "b", "clip-cov-wide", 7, bug=bug)
    code, err, report, stages = _replay(cli, bundle)
    assert (code, err) == (1, "")
    assert (stages["loss.policy"]["status"], stages["loss.grad"]["status"]) == ("pass", "fail")
    assert report["first_divergent_stage"] == "loss.grad"
    first = report["first_divergence"]
    assert first["field"] == "grad_log_probs" and first["sample_id"].startswith("s-")


def test_a_clip_cov_gradient_bug_under_an_importance_weight_is_explained_without_a_crash(tmp_path, cli):
    """The explanations of a failing loss.grad recompute the family's terms (the weight-not-detached hypothesis):
    Clip-Cov's draw is handed to them too — one report, exit 1, nothing on stderr."""
    bundle = write_clip_cov_grad_bundle(tmp_path / "b", "clip-cov-wide", 7, bug="corr", tis=True)
    code, err, report, stages = _replay(cli, bundle)
    assert (code, err) == (1, ""), err
    assert (stages["loss.policy"]["status"], stages["loss.grad"]["status"]) == ("pass", "fail")
    assert report["first_divergent_stage"] == "loss.grad"


@pytest.mark.parametrize("edge", ["verl", "flip"])
def test_a_ratio_at_the_clip_edge_admits_either_gradient(tmp_path, cli, edge):
    """Sample 1's first loss token with A > 0 at r = 1.2 to float32 rounding: PPO's clip there may go either way in
    a legitimate producer (the loss value is continuous, its gradient −A·r or 0 is not): verl's gradient and the
    other branch's both pass, the sample named in loss.grad's mask_boundary hazard."""
    bundle = write_clip_cov_grad_bundle(tmp_path / "b", "clip-cov", 7, edge=edge)
    code, err, report, stages = _replay(cli, bundle)
    assert (code, err) == (0, ""), stages["loss.grad"]
    hazards = [h["sample_id"] for h in report["hazards"] if h["stage"] == "loss.grad" and h["kind"] == "mask_boundary"]
    assert hazards == ["s-1"], report["hazards"]
