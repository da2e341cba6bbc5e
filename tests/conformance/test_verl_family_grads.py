"""verl 0.9.1's own registered policy losses as the gradient producer (loss.grad, SPEC §4.3): each family's loss
(``core_algos.get_policy_loss_fn``: cispo, sapo, geo_mean, dppo_tv, dppo_kl, dro, gpg, kl_cov) called per
micro-batch as test_verl_families drives it, on a float32 log-prob leaf, each micro-batch's loss backpropagated:
the leaf's gradient is the recorded ``grad_log_probs`` — verl's own stop-gradients (CISPO's
``clipped_ratio.detach()``, DPPO's ``truncated_ratio.detach()``, GMPO's sign-aware ``torch.min``) — and the bundle
mapped by ``from_verl`` replays clean at loss.grad; a gradient taken with verl's detach removed is named there."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, ComparisonPolicy, Identity, Manifest,
                                      SampleRecord, StageId, Tolerance, stage_contracts)
from replay_lib.demo import producer
from replay_lib.frameworks import from_verl

from test_grad import _stages, fails_at_loss_grad_alone

from .test_verl import B, N, STAGES, _ActorConfig, _advantages, _step
from .test_verl_families import CONFIGS, core_algos, verl_actor_config, verl_config


def verl_step_grad(actor: dict, micro, old, logp, adv, mask, undetach: bool = False
                   ) -> tuple[float, torch.Tensor]:
    """``(pg_loss, ∂pg_loss/∂log_prob [B, L])``: verl's loss function per micro-batch, each backpropagated.
    ``undetach``: ``Tensor.detach`` made the identity while verl runs (a loss whose stop-gradients are missing:
    the same value, another gradient)."""
    cfg = verl_actor_config(actor, mask)
    mask_b = mask.bool()
    core_algos.ActorConfig = _ActorConfig  # noqa: cispo's and sapo's isinstance checks read the same attributes
    fn = core_algos.get_policy_loss_fn(actor["policy_loss"]["loss_mode"])
    x = logp.clone().requires_grad_(True)
    total = 0.0
    real = torch.Tensor.detach
    try:
        if undetach:
            torch.Tensor.detach = lambda self: self * 1.0
        for rows in micro:
            loss, _ = fn(old_log_prob=old[rows], log_prob=x[rows], advantages=adv[rows], response_mask=mask_b[rows],
                         loss_agg_mode=actor["loss_agg_mode"], config=cfg)
            loss.backward()
            total += loss.item()
    finally:
        torch.Tensor.detach = real
    return total, x.grad.detach().clone()


def write_grad_bundle(path, name: str, seed: int, undetach: bool = False) -> str:
    actor, micro = CONFIGS[name]
    lengths, valid, mask, old, logp, scores = _step(seed, torch.float32)
    adv, normalized = _advantages("grpo", {}, scores, lengths, mask, valid.shape[1])
    pg_loss, grad = verl_step_grad(actor, micro, old, logp, adv, mask, undetach)
    cfg = msgspec.structs.replace(from_verl(verl_config(name), version="0.9.1"), loss_token_count=int(mask.sum()))
    return write_step_bundle(path, name, cfg, micro, lengths, valid, mask, scores, normalized, pg_loss,
                             {"log_probs": logp, "old_log_probs": old, "advantages": adv, "grad_log_probs": grad})


def write_step_bundle(path, name: str, cfg, micro, lengths, valid, mask, scores, normalized, pg_loss,
                      payloads: dict) -> str:
    """The step bundle of verl's loss and its gradient: the samples in their micro-batches, the normalized
    rewards and loss as expected fields, ``loss.grad`` declared, ``payloads`` (name → padded ``[B, T]``) at the
    valid tokens."""
    mb_of = {i: f"mb-{k}" for k, rows in enumerate(micro) for i in rows}
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=i // N, response_length=int(lengths[i]),
                            total_length=int(lengths[i]) + 7, loss_mask=[int(v) for v in mask[i, :lengths[i]]],
                            raw_reward=float(scores[i]), micro_batch_id=mb_of[i]) for i in range(B)]
    bundle_id = f"verl-grad-{name}"
    index = BundleIndex(bundle_id=bundle_id, identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0),
                                                               micro_batch_ids=sorted(set(mb_of.values()))),
                        samples=samples, config=cfg)
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=bundle_id, producer=producer(),
                        stage_contracts=stage_contracts((*STAGES, StageId.LOSS_GRAD)), payloads={},
                        comparison_policy=ComparisonPolicy(tolerances={"loss.grad": Tolerance(atol=0.0, rtol=1e-6)}),
                        redaction={})
    expected = {"reward.post_process": {"rewards": [float(v) for v in normalized]},
                "loss.policy": {"pg_loss": pg_loss, "loss": pg_loss}}
    writer = BundleWriter(path, manifest, index, expected)
    for pname, values in payloads.items():
        writer.write_payload(pname, values[valid])
    return writer.finalize(ranks=[0])


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [7, 8])
def test_verl_family_gradient_replays_clean(tmp_path, cli, name, seed):
    bundle = write_grad_bundle(tmp_path / "b", name, seed)
    code, out, err = cli("replay", bundle, "--format", "json")
    stages = _stages(json.loads(out))
    assert (code, err) == (0, ""), stages.get("loss.grad")
    assert (stages["loss.policy"]["status"], stages["loss.grad"]["status"]) == ("pass", "pass")
    assert stages["loss.grad"]["compared"] == sum(s["response_length"] for s in json.load(
        open(f"{bundle}/index.json"))["samples"])


# the families whose verl loss detaches a factor (core_algos.py: cispo :2080, dppo_tv :1429, dppo_kl :1510)
DETACHED = ["cispo-token-mean", "dppo-tv", "dppo-kl-seq-sum"]


@pytest.mark.parametrize("name", DETACHED)
def test_verl_family_without_its_stop_gradient_is_named_at_loss_grad(tmp_path, cli, name):
    fails_at_loss_grad_alone(cli, write_grad_bundle(tmp_path / "b", name, 7, undetach=True))
