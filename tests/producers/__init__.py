"""Independent reference producers: the legitimate trainers the replay's error model is measured against.

Each family (one module each) computes every expected value of a bundle — the normalized rewards, the ``kl``
and ``advantages`` payloads, the five loss.policy scalars — with its own code and numerics, never with
``replay_lib.kernels``: a replay that only ever checks its own kernels against themselves cannot tell a
fidelity bug from floating-point noise.

=================  ==================================================================================
``torch_sum``      eager float32 PyTorch, one ``torch.sum`` per sample, a Python sum over them (slime)
``float64``        float64 everywhere, each output rounded once to float32 (this project's capture)
``megatron``       micro-batches + a 4-rank ring all-reduce, CUDA-like ``exp2(x·log2e)`` (slime/Megatron)
``bf16_bfloat16``  bf16 log-probs and entropy stored as bfloat16 payloads, KL computed in bf16
``bf16_float32``   the same values stored as float32 payloads
``gpu_tree_256``   per-block stride-halving trees (256 elements) then a tree over blocks (CUDA kernels)
``gpu_tree_1024``  the same with blocks of 1024
``numpy``          float32 NumPy: ``np.sum``'s pairwise summation, NumPy's SIMD ``np.exp``
``stored_bf16``    ``torch_sum`` on float32 values whose capture keeps bfloat16 copies of the per-token payloads
=================  ==================================================================================

Use :func:`produce` (writes a bundle with the real :class:`~replay_lib.bundle.BundleWriter`) or
:func:`produce_parts` (the bundle's parts in memory). ``bug=`` injects one of :data:`producers.bugs.BUGS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import msgspec
import numpy as np
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (
    FORMAT_VERSION,
    ActorStepId,
    BundleIndex,
    ComparisonPolicy,
    Identity,
    Manifest,
    ProducerInfo,
    RecomputeConfig,
    SampleRecord,
    StageId,
    WeightLineage,
    stage_contracts,
)

from .base import Config, Family, LossInputs, Plan, per_sample_terms, shifted_mask
from .bf16 import BF16
from .bugs import BUGS, bug_config, plan_for
from .float64 import Float64
from .gpu_tree import GPUTree
from .inputs import REWARD_KINDS, Inputs, Size, make_inputs
from .megatron import Megatron
from .numpy_pairwise import NumpyPairwise
from .stored_bf16 import StoredBF16
from .torch_sum import TorchSum

__all__ = ["BUGS", "CONFIGS", "FAMILIES", "REWARD_KINDS", "Config", "Family", "Parts", "Size", "bug_config", "family",
           "make_inputs", "produce", "produce_parts", "write_parts"]

FAMILIES: dict[str, Callable[[], Family]] = {
    "torch_sum": TorchSum,
    "float64": Float64,
    "megatron": Megatron,
    "bf16_bfloat16": lambda: BF16("bfloat16"),
    "bf16_float32": lambda: BF16("float32"),
    "gpu_tree_256": lambda: GPUTree(256),
    "gpu_tree_1024": lambda: GPUTree(1024),
    "numpy": NumpyPairwise,
    "stored_bf16": StoredBF16,
}

# Every reward kind with std normalization on and off, every KL type and KL off, entropy in and out of the
# loss: the configs the clean tests and the benchmark rotate through.
CONFIGS = (
    Config(rewards="binary", std_normalization=True, kl_type="k3", kl_coef=0.05),
    Config(rewards="rm", std_normalization=True, kl_type="low_var_kl", kl_coef=0.05, entropy_coef=0.01),
    Config(rewards="partial", std_normalization=True, kl_type="k2", kl_coef=0.05),
    Config(rewards="rm", std_normalization=False, kl_type="k1", kl_coef=0.05, entropy_coef=0.01),
    Config(rewards="binary", std_normalization=False, kl_coef=0.0, entropy_coef=0.01),
    Config(rewards="rm", std_normalization=True, kl_type="k3", kl_coef=0.1),
)

STAGES = (StageId.SAMPLE, StageId.REWARD_RAW, StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_KL,
          StageId.ADVANTAGE_ESTIMATE, StageId.LOSS_POLICY)


def family(name: str) -> Family:
    try:
        return FAMILIES[name]()
    except KeyError:
        raise ValueError(f"unknown producer family {name!r} (expected one of {', '.join(FAMILIES)})") from None


@dataclass
class Parts:
    """A bundle in memory, with what made it: the (prepared) inputs, the family and its plan."""

    manifest: Manifest
    index: BundleIndex
    expected: dict
    payloads: dict[str, torch.Tensor]
    inputs: Inputs
    family: Family
    config: Config
    plan: Plan
    rewards: np.ndarray  # the family's normalized rewards before they were recorded


class _DeclaredPrecision(ComparisonPolicy, kw_only=True, frozen=True):
    """A comparison policy carrying ``producer_precision`` for a reader whose schema does not know the field
    yet (it lists it as an unknown field and ignores it); once the schema has it, it is used directly."""

    producer_precision: dict = {}


def comparison_policy(precision: Optional[dict]) -> ComparisonPolicy:
    if precision is None:
        return ComparisonPolicy()
    if "producer_precision" in ComparisonPolicy.__struct_fields__:
        return msgspec.convert({"producer_precision": precision}, ComparisonPolicy)
    return _DeclaredPrecision(producer_precision=dict(precision))


def _bounds(inputs: Inputs, plan: Plan) -> list[tuple[int, int]]:
    """The sample ranges the producer normalizes over: the semantic groups, or PR #65's physical batches."""
    if plan.normalize_batch is None:
        return inputs.group_bounds
    n, b = inputs.raw_rewards.size, plan.normalize_batch
    return [(a, min(a + b, n)) for a in range(0, n, b)]


def produce_parts(name_or_family, seed: int, size: Size, config: Config = Config(), *, bug: Optional[str] = None,
                  per_sample: bool = False, bundle_id: Optional[str] = None) -> Parts:
    """The bundle a ``family`` producer writes for one step of ``size`` drawn from ``seed``; ``bug`` injects
    one bug class (the config must allow it: :func:`producers.bugs.bug_config`); ``per_sample`` adds the
    SPEC §4 per-sample loss terms (``expected.json $.loss.policy.per_sample``) as the family reduces them."""
    fam = family(name_or_family) if isinstance(name_or_family, str) else name_or_family
    plan = plan_for(config, bug, size.group_size)
    inputs = fam.prepare(make_inputs(seed, size, config.rewards))
    rewards = fam.normalize(inputs.raw_rewards, _bounds(inputs, plan), config.std_normalization, plan.ddof)
    total = int(inputs.lengths.sum())
    if config.kl_coef != 0:
        kl = fam.kl(inputs.old_log_probs, inputs.ref_log_probs, plan.kl_type)
    else:
        kl = np.zeros(total, dtype=np.float32)
    adv_recorded, adv_consumed = fam.advantages(plan.advantage_sign * rewards, inputs.lengths)
    loss_inputs = LossInputs(log_probs=inputs.log_probs, old_log_probs=inputs.old_log_probs,
                             advantages=adv_consumed, entropy=inputs.entropy,
                             mask=shifted_mask(inputs.mask, inputs.lengths, plan.mask_shift), lengths=inputs.lengths)
    loss = fam.loss(loss_inputs, eps_clip=plan.eps_clip, eps_clip_high=plan.eps_clip_high,
                    entropy_coef=config.entropy_coef, agg=plan.loss_agg)
    if per_sample:
        sums = fam.sample_sums(loss_inputs, eps_clip=plan.eps_clip, eps_clip_high=plan.eps_clip_high)
        loss = dict(loss, per_sample=per_sample_terms(sums))
    bundle_id = bundle_id or f"{fam.name}-{size}-s{seed}" + (f"-{bug}" if bug else "")
    recorded = fam.recorded(rewards)
    payloads = {"old_log_probs": fam.payload(inputs.old_log_probs), "log_probs": fam.payload(inputs.log_probs),
                "entropy": fam.payload(inputs.entropy), "kl": fam.payload(kl),
                "advantages": torch.from_numpy(np.ascontiguousarray(adv_recorded, dtype=np.float32))}
    if config.kl_coef != 0:
        payloads["ref_log_probs"] = fam.payload(inputs.ref_log_probs)
    expected = {"reward.raw": {"raw_rewards": inputs.raw_rewards.tolist()},
                "reward.post_process": {"rewards": recorded.tolist()},
                "loss.policy": loss}
    return Parts(manifest=_manifest(fam, bundle_id), index=_index(fam, bundle_id, inputs, recorded, size, config),
                 expected=expected, payloads=payloads, inputs=inputs, family=fam, config=config, plan=plan,
                 rewards=rewards)


def _manifest(fam: Family, bundle_id: str) -> Manifest:
    return Manifest(format_version=FORMAT_VERSION, bundle_id=bundle_id,
                    producer=ProducerInfo(commit=f"tests.producers.{fam.name}", dirty_patch_digest=None,
                                          torch_version=torch.__version__),
                    stage_contracts=stage_contracts(STAGES), payloads={},
                    comparison_policy=comparison_policy(fam.precision), redaction={})


def _index(fam: Family, bundle_id: str, inputs: Inputs, rewards: np.ndarray, size: Size, config: Config) -> BundleIndex:
    lengths = inputs.lengths.tolist()
    offsets = inputs.offsets.tolist()
    mask = inputs.mask.tolist()
    raw = inputs.raw_rewards.tolist()
    reward = rewards.tolist()
    groups = inputs.groups.tolist()
    micro = fam.micro_batches(len(lengths))
    samples = [
        SampleRecord(sample_id=f"s-{i}", group_index=groups[i], response_length=n, total_length=n + 64,
                     loss_mask=mask[o:o + n], raw_reward=raw[i], reward=reward[i], micro_batch_id=f"mb-{micro[i]:04d}")
        for i, (n, o) in enumerate(zip(lengths, offsets))
    ]
    identity = Identity(
        actor_step_id=ActorStepId(rollout_id=7, step_id=0), rollout_partition_ids=["rp-0"],
        consumer_batch_ids=["cb-0"], micro_batch_ids=[f"mb-{m:04d}" for m in sorted(set(micro))],
        semantic_group_ids=sorted(set(groups)), normalization_cohort_ids=["nc-0"],
        weight_lineage=WeightLineage(rollout_weight=3, actor_weight=3),
        rank={"dp": int(fam.options.get("ranks", 1)), "tp": 1, "pp": 1, "cp": 1},
    )
    cfg = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=size.group_size,
                          grpo_std_normalization=config.std_normalization, kl_loss_type=config.kl_type,
                          kl_coef=config.kl_coef, eps_clip=config.eps_clip, eps_clip_high=config.eps_clip_high,
                          entropy_coef=config.entropy_coef)
    return BundleIndex(bundle_id=bundle_id, identity=identity, samples=samples, config=cfg)


def write_parts(parts: Parts, path: str | Path) -> Path:
    """Write ``parts`` as one verified bundle at ``path`` (which must not exist)."""
    writer = BundleWriter(path, parts.manifest, parts.index, parts.expected)
    for name, tensor in parts.payloads.items():
        writer.write_payload(name, tensor)
    return writer.finalize(ranks=[0])


def produce(path: str | Path, name_or_family, seed: int, size: Size, config: Config = Config(), *,
            bug: Optional[str] = None, per_sample: bool = False) -> Path:
    """Write the bundle of :func:`produce_parts` at ``path`` and return it."""
    return write_parts(produce_parts(name_or_family, seed, size, config, bug=bug, per_sample=per_sample), path)
