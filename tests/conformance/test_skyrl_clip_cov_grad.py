"""Clip-Cov's gradient under SkyRL's pre-scaled advantages (loss.grad, ``advantages="prescaled"``): the
reference written from SkyRL's code (test_skyrl_cov.py: ``compute_policy_loss_clip_cov``, ppo_utils.py:938-999,
the advantages divided by the loss reduction's normalizer, ppo_utils.py:1152-1220, the k3 KL term per micro-batch)
evaluated on a log-prob leaf and each micro-batch's loss backpropagated with ``torch.autograd``: the leaf's
gradient is the recorded ``grad_log_probs``. The bundle mapped by ``from_skyrl`` replays clean at loss.grad, the
covariance taken of the pre-scaled advantages (``sequence_mean`` ranks them in another order than the raw ones)."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, ComparisonPolicy, Identity, Manifest,
                                      SampleRecord, StageId, Tolerance, stage_contracts)
from replay_lib.demo import producer
from replay_lib.frameworks import from_skyrl

from .test_skyrl import B, N, STAGES, _step, approx_kl, grpo, loss_reduction, masked_mean
from .test_skyrl_cov import CONFIGS, clip_cov_loss, skyrl_config, train_step

CLIP_COV = [name for name in CONFIGS if name.startswith("clip-cov")]


def skyrl_clip_cov_grad(algo, micro, logp, old, ref, scaled, loss_mask, seed) -> tuple[torch.Tensor, torch.Tensor]:
    """``(∂loss/∂logp, selected)``: train_step's loss per micro-batch (the policy sum and 0.001 × the KL term's
    mean of sample means × len(mb)/B) on a leaf, each backpropagated; the draw from the same generator."""
    g = torch.Generator().manual_seed(seed)
    x = logp.clone().requires_grad_(True)
    selected = torch.zeros_like(loss_mask, dtype=torch.bool)
    for start in range(0, B, micro):
        sl = slice(start, min(start + micro, B))
        policy, _, sel = clip_cov_loss(x[sl], old[sl], scaled[sl], loss_mask[sl], algo, g)
        selected[sl] = sel
        kl = approx_kl(x[sl], ref[sl], loss_mask[sl], "k3")
        loss = policy + 0.001 * masked_mean(kl, loss_mask[sl], dim=-1).mean() * (sl.stop - sl.start) / B
        loss.backward()
    return x.grad.detach().clone(), selected


def write_clip_cov_grad_bundle(path, name: str, seed: int) -> str:
    algo, micro = CONFIGS[name]
    lengths, response_mask, loss_mask, old, logp, ref, scores = _step(seed, torch.float32)
    index = [i // N for i in range(B)]
    adv, normalized = grpo(scores, response_mask, index)
    scaled = loss_reduction(adv, loss_mask, algo.get("loss_reduction", "token_mean"), micro, None)
    policy, selected = train_step(algo, micro, logp, old, ref, scaled, loss_mask, seed)
    grad, drawn = skyrl_clip_cov_grad(algo, micro, logp, old, ref, scaled, loss_mask, seed)
    assert torch.equal(drawn, selected) and int(selected.sum()) >= 1
    cfg = msgspec.structs.replace(from_skyrl(skyrl_config(name)), loss_token_count=int(loss_mask.sum()),
                                  loss_seq_count=B)
    mb_of = {i: f"mb-{i // micro}" for i in range(B)}
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=index[i], response_length=int(lengths[i]),
                            total_length=int(lengths[i]) + 7, loss_mask=[int(v) for v in loss_mask[i, :lengths[i]]],
                            raw_reward=float(scores[i]), micro_batch_id=mb_of[i]) for i in range(B)]
    bundle_index = BundleIndex(bundle_id=f"skyrl-grad-{name}", samples=samples, config=cfg, identity=Identity(
        actor_step_id=ActorStepId(rollout_id=1, step_id=0), micro_batch_ids=sorted(set(mb_of.values()))))
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=f"skyrl-grad-{name}", producer=producer(),
                        stage_contracts=stage_contracts((*STAGES, StageId.LOSS_GRAD)), payloads={},
                        comparison_policy=ComparisonPolicy(tolerances={"loss.grad": Tolerance(atol=0.0, rtol=1e-6)}),
                        redaction={})
    expected = {"reward.post_process": {"rewards": [float(v) for v in normalized]}, "loss.policy": policy}
    writer = BundleWriter(path, manifest, bundle_index, expected)
    valid = response_mask.bool()
    for pname, values in {"log_probs": logp, "old_log_probs": old, "advantages": adv, "ref_log_probs": ref,
                          "grad_log_probs": grad}.items():
        writer.write_payload(pname, values[valid].to(torch.float32))
    writer.write_payload("clip_cov_mask", selected[valid].to(torch.uint8))
    return writer.finalize(ranks=[0])


@pytest.mark.parametrize("name", CLIP_COV)
@pytest.mark.parametrize("seed", [7, 8])
def test_skyrl_clip_cov_gradient_replays_clean(tmp_path, cli, name, seed):
    bundle = write_clip_cov_grad_bundle(tmp_path / "b", name, seed)
    code, out, err = cli("replay", bundle, "--format", "json")
    stages = {s["stage"]: s for s in json.loads(out)["stages"]}
    assert (code, err) == (0, ""), stages.get("loss.grad")
    assert (stages["loss.policy"]["status"], stages["loss.grad"]["status"]) == ("pass", "pass")
    assert stages["loss.grad"]["compared"] == sum(s["response_length"] for s in json.load(
        open(f"{bundle}/index.json"))["samples"])
