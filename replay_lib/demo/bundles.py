"""Demo bundles built by the library itself, and the deterministic synthetic generator shared by the
tests and the benchmarks.

* ``pr65-buggy``  — rollout-level PR #65 bundle: expected rewards normalized against the physical batch;
* ``pr65-fixed``  — the same bundle as the fixed code wrote it;
* ``step-loss``   — step-level loss.policy bundle (logp = 0.5, old = 0: pg_loss ≈ 0.8974426);
* ``cohort-2rank`` — a two-rank cohort of synthetic full bundles;
* ``support-fullvocab`` — sample-support bundle whose trainer scored over the full vocabulary instead of the
  recorded support: the first divergence is ``logprob.support`` (loss.policy still passes);
* ``kl-bug``, ``loss-bug``, ``loose-kl``, ``hazard-clean`` — the hand-made faults the README's screenshots show;
* ``nemo-loo`` — NeMo-RL's leave-one-out GRPO (SPEC §4.2): a zero-std group reported as a hazard beside a group
  normalized with the group mean instead of leave-one-out (a real divergence);
* ``verl-dapo`` — a verl DAPO step (SPEC §4.2: token mean over the all-reduced count × dp, dual-clip,
  clip-higher) whose trainer took each micro-batch's own token count as the denominator.

Every bundle here is the same bytes on every machine (for one torch version): the same arguments give the same
numbers. The shipped demos (and the test suite's bundles) are also *settled*: their replay recomputes the recorded
numbers bit for bit, and so prints the same digits, on every machine. See "Host-independent arithmetic" below.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from ..bundle import BundleWriter
from .catalog import DEMO_NAMES
from ..kernels import (LOSS_CHUNK, STD_EPS, batch_normalize, get_grpo_returns, group_normalize, rollout_kl, segment_ids,
                      segment_sum)
from ..bundle.schema import (
    FORMAT_VERSION,
    ActorStepId,
    BundleIndex,
    ComparisonPolicy,
    Identity,
    Manifest,
    ProducerInfo,
    RecomputeConfig,
    SampleRecord,
    StageContract,
    StageId,
    Tolerance,
    WeightLineage,
    stage_contracts,
)

ROLLOUT_STAGES = (StageId.SAMPLE, StageId.REWARD_RAW, StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_KL,
                  StageId.ADVANTAGE_ESTIMATE)
STEP_STAGES = (StageId.SAMPLE, StageId.LOSS_POLICY)
ALL_STAGES = ROLLOUT_STAGES + (StageId.LOSS_POLICY,)
# ``support-fullvocab``: 8 samples × 24 tokens, top-16 support rows over a 32k vocabulary. Seed 30: its groups'
# reward standard deviations (0.5, 1.5) are exact in float32, so the replay's float32 sqrt (MKL's, not correctly
# rounded on every code path: seed 0's √3.5833334 rounds the other way on its SSE4.2 path) has one answer.
SUPPORT_DEMO = dict(full_vocab_bug=True, samples=8, tokens=24, k=16, vocab_size=32000, seed=30, settle=True,
                    bundle_id="support-fullvocab")


def contracts(stages, declare_value: bool = True) -> dict[StageId, StageContract]:
    """The demos' contracts: reward.post_process is ``reimplemented`` offline, as in the original tool."""
    return stage_contracts(stages, implementations={StageId.REWARD_POST_PROCESS: "reimplemented"},
                           declare_value=declare_value)


def producer() -> ProducerInfo:
    return ProducerInfo(commit="demo", dirty_patch_digest=None, torch_version=torch.__version__)


# ------------------------------------------------------------------------ host-independent arithmetic
#
# torch's float32 exp, log and sqrt come from MKL's vector math, whose code path, and so the last bit of a
# result, depends on the CPU (an AMD host takes another path than an Intel one; MKL_ENABLE_INSTRUCTIONS picks
# one); log1p, randn and linspace come from ATen's SIMD kernels (ATEN_CPU_CAPABILITY picks those). IEEE
# float32 arithmetic (+ − × ÷), torch's reductions and its integer and uniform generators are the same
# everywhere. Hence:
# * a transcendental (or a square root) is evaluated in float64 and rounded once to float32 (:func:`_f32`):
#   a float64 result an ulp off changes that float32 only within 2^-29 ulp of a rounding midpoint;
# * everything else is the kernels' own float32 steps, in their order (what a float32 producer computes);
# * with ``settle=True`` the recorded inputs are nudged by a few ulps until every float32 exp and log the
#   replay evaluates lies within SETTLE_ULP of a float32 (:func:`_settle`). Any float32 libm whose error stays
#   below 1 − SETTLE_ULP ulp returns that float32 (MKL's worst paths measure 0.75 ulp for exp, 0.93 for log),
#   so the replay recomputes the recorded numbers bit for bit and prints the same digits on every host.
#   (A group's reward std is a square root of integer rewards, which no nudge fixes: a demo shown in a
#   snapshot picks rewards whose std is exact, see SUPPORT_DEMO.)

SETTLE_ULP = 0.05
_INF = float("inf")


def _f32(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` evaluated in float64 and rounded once to float32."""
    return fn(x.to(torch.float64)).to(torch.float32)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """float64 ``2^-23·|x|``: at least one ulp of float32 ``x`` and at most two (a step that changes it)."""
    return x.to(torch.float64).abs() * 2.0 ** -23


def _unambiguous(v: torch.Tensor) -> torch.Tensor:
    """float64 ``v`` → bool: ``v`` lies within SETTLE_ULP ulp of the float32 ``f`` nearest to it, so a float32
    libm off by less than 1 − SETTLE_ULP ulp can return nothing else. Tested as
    ``|v − f| ≤ SETTLE_ULP·2^-24·|f|``, which is at most SETTLE_ULP of the spacing on either side of ``f`` (the
    smaller one, below a power of two, included)."""
    f = v.to(torch.float32).to(torch.float64)
    return (v - f).abs() <= (SETTLE_ULP * 2.0 ** -24) * f.abs()


def _exp_is_unambiguous(values: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The replay's float32 ``exp(values − base)`` has one answer on every host."""
    return _unambiguous(torch.exp((values.to(torch.float32) - base.to(torch.float32)).to(torch.float64)))


# Candidate steps tried at once per value (a step passes with probability 2·SETTLE_ULP; a support row's, whose
# member's exp and row's log must both pass, with (2·SETTLE_ULP)²), values per block, rounds after which the
# step doubles, and rounds before a value that never passes (a NaN) is left as it is.
SETTLE_TRIES = 16
SETTLE_ROW_TRIES = 128
SETTLE_BLOCK = 1 << 14
SETTLE_DOUBLING = 4
SETTLE_ROUNDS = 64


def _step_scale(round_: int) -> float:
    """Steps grow after SETTLE_DOUBLING rounds. Near ``exp(0) = 1`` a step of the value moves the exp by a whole
    number of its ulps, and only the curvature (∝ the step) shifts where it lands between two float32s."""
    return float(2 ** (round_ // SETTLE_DOUBLING))


def _first_passing(cand: torch.Tensor, good: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, tries]`` candidates and their verdicts → (whether one passed, the first that did, else the last)."""
    hit = good.any(1)
    last = torch.full_like(hit, cand.shape[1] - 1, dtype=torch.int64)
    pick = torch.where(hit, good.to(torch.uint8).argmax(1), last)
    return hit, cand.gather(1, pick[:, None]).squeeze(1)


def _settle(values: torch.Tensor, base: torch.Tensor, ok=_exp_is_unambiguous) -> torch.Tensor:
    """float32 ``values`` (any shape, ``base`` broadcast to it), each stepped down until ``ok(value, base)``.

    A step is an ulp of the value or of its difference from ``base``, whichever is larger (times
    :func:`_step_scale`), so the float32 difference the replay takes moves with every step; SETTLE_TRIES steps
    are tried at once, and a value usually moves by about ten ulps. No randomness is drawn: the generator's
    sequence is untouched.
    """
    base = base.to(torch.float32).expand_as(values).reshape(-1)
    out = values.to(torch.float32).reshape(-1).clone()
    todo = torch.nonzero(~ok(out, base)).reshape(-1)
    k = torch.arange(1, SETTLE_TRIES + 1, dtype=torch.float64)
    for round_ in range(SETTLE_ROUNDS):
        if not todo.numel():
            break
        left = []
        for idx in todo.split(SETTLE_BLOCK):
            v, b = out[idx], base[idx]
            step = torch.maximum(_ulp(v), _ulp(v - b)) * _step_scale(round_)
            cand = (v.to(torch.float64)[:, None] - step[:, None] * k).to(torch.float32)
            hit, out[idx] = _first_passing(cand, ok(cand, b[:, None]))
            left.append(idx[~hit])
        todo = torch.cat(left)
    return out.reshape(values.shape)


def _rollout_kl(old: torch.Tensor, ref: Optional[torch.Tensor], kl_coef: float, kl_loss_type: str) -> torch.Tensor:
    """:func:`kernels.rollout_kl` in the kernel's float32 steps, with ``exp(−r)`` from :func:`_f32`."""
    if kl_coef == 0 or kl_loss_type not in ("k3", "low_var_kl"):
        return rollout_kl(old, ref, kl_coef, kl_loss_type)  # no transcendental: the kernel itself
    neg = -(old.to(torch.float32) - ref.to(torch.float32))
    kl = _f32(torch.exp, neg) - 1 - neg
    return torch.clamp(kl, min=-10.0, max=10.0) if kl_loss_type == "low_var_kl" else kl


def _group_normalize(raw: torch.Tensor, groups: torch.Tensor, std_normalization: bool) -> torch.Tensor:
    """:func:`kernels.group_normalize` in its float32 steps, with the group std's square root from
    :func:`_f32` (torch's float32 ``sqrt`` is MKL's too, and not correctly rounded on every code path)."""
    centered = group_normalize(raw, groups, std_normalization=False)
    if not std_normalization or not centered.numel():
        return centered
    _, inverse, counts = torch.unique(groups.to(torch.int64), return_inverse=True, return_counts=True)
    var = segment_sum(centered * centered, inverse, counts.numel()) / (counts - 1).to(torch.float32)
    return centered / (_f32(torch.sqrt, var)[inverse] + STD_EPS)


def _policy_loss_fields(log_probs, old_log_probs, advantages, entropy, loss_mask, lengths, *, eps_clip: float,
                        eps_clip_high: float, entropy_coef: float) -> dict[str, torch.Tensor]:
    """:func:`kernels.policy_loss_fields` op for op (float32, the same sums in the same order), with the
    ratio ``exp(−ppo_kl)`` from :func:`_f32`."""
    lengths = lengths.to(torch.int64)
    n = lengths.numel()
    seg = segment_ids(lengths)
    m = loss_mask.to(torch.float32)
    ppo_kl = old_log_probs.to(torch.float32) - log_probs.to(torch.float32)
    ratio = _f32(torch.exp, -ppo_kl)
    adv = advantages.to(torch.float32)
    pg1 = -ratio * adv
    pg2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * adv
    terms = {"pg": torch.maximum(pg1, pg2) * m, "clip": torch.gt(pg2, pg1).to(torch.float32) * m,
             "kl": ppo_kl * m, "mask": m}
    if entropy is not None:
        terms["ent"] = entropy.to(torch.float32) * m
    sums = {k: torch.zeros(n, dtype=torch.float32) for k in terms}
    for start in range(0, seg.numel(), LOSS_CHUNK):  # the kernel's chunks: the same additions in its order
        for k, x in terms.items():
            sums[k].index_add_(0, seg[start:start + LOSS_CHUNK], x[start:start + LOSS_CHUNK])
    denom = torch.clamp_min(sums["mask"], 1.0)
    pg_loss = (sums["pg"] / denom).sum()
    entropy_loss = (sums["ent"] / denom).sum() if entropy is not None else torch.zeros((), dtype=torch.float32)
    return {"loss": pg_loss - entropy_coef * entropy_loss, "pg_loss": pg_loss, "entropy_loss": entropy_loss,
            "pg_clipfrac": (sums["clip"] / denom).sum(), "ppo_kl": (sums["kl"] / denom).sum()}


def _standard_normal(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """float32 standard normals by Box–Muller in float64, rounded once (``torch.randn`` takes a SIMD path
    whose last bits change with the CPU)."""
    u1 = torch.rand(shape, generator=generator, dtype=torch.float64)
    u2 = torch.rand(shape, generator=generator, dtype=torch.float64)
    return (torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos((2 * math.pi) * u2)).to(torch.float32)


# ------------------------------------------------------------------------------------------ PR #65

PR65_GROUPS = [0, 0, 1, 1]
PR65_RAW = [1.0, 3.0, 10.0, 12.0]
PR65_LENGTHS = [3, 2, 4, 3]
PR65_MASKS = [[1, 1, 1], [1, 1], [1, 1, 0, 1], [1, 1, 1]]


def _pr65_samples(rewards: list[float]) -> list[SampleRecord]:
    return [
        SampleRecord(sample_id=f"s-{i}", group_index=g, response_length=n, total_length=n + 5,
                     loss_mask=m, raw_reward=r, reward=rw, micro_batch_id=f"mb-{i // 2:04d}",
                     prompt=f"What is {i} + {g}?", response=f"It is {i + g}.")
        for i, (g, n, m, r, rw) in enumerate(zip(PR65_GROUPS, PR65_LENGTHS, PR65_MASKS, PR65_RAW, rewards))
    ]


def write_pr65(path: str | Path, *, buggy: bool = True, bundle_id: str = "b-00001",
               format_version: str = FORMAT_VERSION) -> Path:
    """The PR #65 rollout-level bundle. ``buggy``: expected rewards are the batch-normalized ones
    ([−5.5, −3.5, 3.5, 5.5]) that the streamed trainer produced; fixed: [−1, 1, −1, 1]. ``format_version``: the
    manifest's, which picks the layout the writer uses (every builder here takes it)."""
    raw = torch.tensor(PR65_RAW)
    lengths = torch.tensor(PR65_LENGTHS)
    cfg = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=2, grpo_std_normalization=False,
                          kl_loss_type="k3", kl_coef=0.1)
    if buggy:
        rewards = batch_normalize(raw, batch_size=4, std_normalization=False)
    else:
        rewards = group_normalize(raw, torch.tensor(PR65_GROUPS), std_normalization=False)
    total = int(lengths.sum())
    gen = torch.Generator().manual_seed(65)
    old = -torch.rand(total, generator=gen) * 2
    ref = _settle(old + (torch.rand(total, generator=gen) - 0.5) * 0.2, old)
    kl = _rollout_kl(old, ref, cfg.kl_coef, cfg.kl_loss_type)
    advantages = get_grpo_returns(rewards, lengths)
    index = BundleIndex(
        bundle_id=bundle_id,
        identity=Identity(
            rollout_id=120, rollout_partition_ids=["rp-120-0"], consumer_batch_ids=["cb-0", "cb-1"],
            micro_batch_ids=["mb-0000", "mb-0001"], semantic_group_ids=PR65_GROUPS[::2],
            normalization_cohort_ids=["nc-120"], weight_lineage=WeightLineage(rollout_weight=41, actor_weight=42),
            rank={"dp": 1, "tp": 1, "pp": 1, "cp": 1},
        ),
        samples=_pr65_samples(rewards.tolist()),
        config=cfg,
    )
    manifest = Manifest(format_version=format_version, bundle_id=bundle_id, producer=producer(),
                        stage_contracts=contracts(ROLLOUT_STAGES), payloads={},
                        comparison_policy=ComparisonPolicy(), redaction={"prompt": "hash", "response": "truncate:8"})
    expected = {"reward.raw": {"raw_rewards": PR65_RAW}, "reward.post_process": {"rewards": rewards.tolist()}}
    writer = BundleWriter(path, manifest, index, expected)
    writer.write_payload("old_log_probs", old)
    writer.write_payload("ref_log_probs", ref)
    writer.write_payload("kl", kl)
    writer.write_payload("advantages", advantages)
    return writer.finalize(ranks=[0])


def write_step_loss(path: str | Path, *, log_prob: float = 0.5, bundle_id: str = "b-00001-step",
                    format_version: str = FORMAT_VERSION) -> Path:
    """Step-level PR #65 loss bundle: advantages [−1, 1, −1, 1] broadcast, old = 0, logp = ``log_prob``."""
    lengths = torch.tensor(PR65_LENGTHS)
    total = int(lengths.sum())
    rewards = torch.tensor([-1.0, 1.0, -1.0, 1.0])
    advantages = get_grpo_returns(rewards, lengths)
    old = torch.zeros(total)
    logp = torch.full((total,), float(log_prob))
    entropy = torch.linspace(0.5, 1.5, total, dtype=torch.float64).to(torch.float32)
    cfg = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=2, entropy_coef=0.0)
    masks = [[1] * n for n in PR65_LENGTHS]
    mask = torch.tensor([m for row in masks for m in row], dtype=torch.float32)
    fields = _policy_loss_fields(logp, old, advantages, entropy, mask, lengths, eps_clip=cfg.eps_clip,
                                 eps_clip_high=cfg.eps_clip_high, entropy_coef=cfg.entropy_coef)
    samples = [
        SampleRecord(sample_id=f"s-{i}", group_index=g, response_length=n, total_length=n + 5, loss_mask=m,
                     raw_reward=r, reward=float(rw), micro_batch_id=f"mb-{i // 2:04d}")
        for i, (g, n, m, r, rw) in enumerate(zip(PR65_GROUPS, PR65_LENGTHS, masks, PR65_RAW, rewards.tolist()))
    ]
    index = BundleIndex(
        bundle_id=bundle_id,
        identity=Identity(actor_step_id=ActorStepId(rollout_id=120, step_id=0), micro_batch_ids=["mb-0000", "mb-0001"],
                          semantic_group_ids=[0, 1], weight_lineage=WeightLineage(rollout_weight=41, actor_weight=42),
                          rank={"dp": 1, "tp": 1, "pp": 1, "cp": 1}),
        samples=samples, config=cfg,
    )
    manifest = Manifest(format_version=format_version, bundle_id=bundle_id, producer=producer(),
                        stage_contracts=contracts(STEP_STAGES), payloads={}, comparison_policy=ComparisonPolicy(),
                        redaction={})
    expected = {"loss.policy": {k: float(v) for k, v in fields.items()}}
    writer = BundleWriter(path, manifest, index, expected)
    writer.write_payload("log_probs", logp)
    writer.write_payload("old_log_probs", old)
    writer.write_payload("entropy", entropy)
    writer.write_payload("advantages", advantages)
    return writer.finalize(ranks=[0])


# -------------------------------------------------------------------------------------- synthetic


def synthetic_parts(
    *,
    samples: int = 8,
    tokens: int = 16,
    seed: int = 0,
    group_size: int = 4,
    vary_lengths: bool = False,
    kl_coef: float = 0.05,
    kl_loss_type: str = "low_var_kl",
    std_normalization: bool = True,
    entropy_coef: float = 0.01,
    bundle_id: str = "synthetic",
    anchor: Optional[ActorStepId] = ActorStepId(rollout_id=7, step_id=0),
    stages=ALL_STAGES,
    rank_sizes: Optional[dict] = None,
    sample_prefix: str = "s-",
    settle: bool = False,
    batch_offset: int = 0,
    format_version: str = FORMAT_VERSION,
):
    """(manifest, index, expected, payloads) of a clean synthetic bundle: N samples × ~L tokens.

    ``batch_offset``: this bundle's micro-batches and consumer batches are numbered after that many bundles'
    worth of them (a cohort's rank r consumes its own: ``mb-0001`` on rank 1 of a two-rank cohort of 8 samples).

    The same bytes on every host for a given seed (see "Host-independent arithmetic"); expected outputs are
    the kernels' float32 formulas, so it always replays clean. ``settle`` nudges ``log_probs`` and
    ``ref_log_probs`` by a few ulps until every float32 exp the replay takes has one answer: the replay then
    recomputes the recorded values bit for bit, and prints the same digits, on every host (the demos do; it
    costs seconds per million tokens, which benchmark-sized bundles need not pay).
    """
    if samples % group_size:
        raise ValueError("samples must be a multiple of group_size")
    gen = torch.Generator().manual_seed(seed)
    if vary_lengths:
        lengths = torch.randint(0, tokens + 1, (samples,), generator=gen)
    else:
        lengths = torch.full((samples,), tokens, dtype=torch.int64)
    total = int(lengths.sum())
    groups = torch.arange(samples) // group_size
    raw = torch.randint(0, 5, (samples,), generator=gen).to(torch.float32)
    old = -torch.rand(total, generator=gen) * 3
    logp = old + (torch.rand(total, generator=gen) - 0.5) * 0.6
    if settle:
        logp = _settle(logp, old)
    entropy = torch.rand(total, generator=gen) * 2
    mask_flat = (torch.rand(total, generator=gen) < 0.9).to(torch.int64)
    cfg = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=group_size,
                          grpo_std_normalization=std_normalization, kl_loss_type=kl_loss_type, kl_coef=kl_coef,
                          eps_clip=0.2, eps_clip_high=0.28, entropy_coef=entropy_coef)
    rewards = _group_normalize(raw, groups, std_normalization)
    advantages = get_grpo_returns(rewards, lengths)
    payloads = {"old_log_probs": old, "log_probs": logp, "entropy": entropy, "advantages": advantages}
    if kl_coef != 0:
        ref = old + (torch.rand(total, generator=gen) - 0.5) * 0.4
        if settle and kl_loss_type in ("k3", "low_var_kl"):
            ref = _settle(ref, old)
        payloads["ref_log_probs"] = ref
        payloads["kl"] = _rollout_kl(old, ref, kl_coef, kl_loss_type)
    else:
        payloads["kl"] = torch.zeros(total)
    fields = _policy_loss_fields(logp, old, advantages, entropy, mask_flat, lengths, eps_clip=cfg.eps_clip,
                                 eps_clip_high=cfg.eps_clip_high, entropy_coef=entropy_coef)
    offsets = (torch.cumsum(lengths, 0) - lengths).tolist()
    mask_list = mask_flat.tolist()
    n_mb, n_cb = (samples + 7) // 8, max(1, samples // 16)
    first_mb, first_cb = batch_offset * n_mb, batch_offset * n_cb
    records = [
        SampleRecord(sample_id=f"{sample_prefix}{i}", group_index=int(groups[i]), response_length=int(lengths[i]),
                     total_length=int(lengths[i]) + 32,
                     loss_mask=mask_list[offsets[i]: offsets[i] + int(lengths[i])],
                     raw_reward=float(raw[i]), reward=float(rewards[i]),
                     micro_batch_id=f"mb-{i // 8 + first_mb:04d}")
        for i in range(samples)
    ]
    identity = Identity(
        actor_step_id=anchor, rollout_id=None if anchor is not None else 7,
        rollout_partition_ids=["rp-0"], consumer_batch_ids=[f"cb-{first_cb + i}" for i in range(n_cb)],
        micro_batch_ids=[f"mb-{first_mb + i:04d}" for i in range(n_mb)],
        semantic_group_ids=sorted(set(groups.tolist())),
        normalization_cohort_ids=["nc-0"], weight_lineage=WeightLineage(rollout_weight=3, actor_weight=4),
        rank=rank_sizes or {"dp": 1, "tp": 1, "pp": 1, "cp": 1},
    )
    index = BundleIndex(bundle_id=bundle_id, identity=identity, samples=records, config=cfg)
    manifest = Manifest(format_version=format_version, bundle_id=bundle_id, producer=producer(),
                        stage_contracts=contracts(stages), payloads={}, comparison_policy=ComparisonPolicy(),
                        redaction={})
    expected: dict = {}
    if StageId.REWARD_RAW in stages:
        expected["reward.raw"] = {"raw_rewards": raw.tolist()}
    if StageId.REWARD_POST_PROCESS in stages:
        expected["reward.post_process"] = {"rewards": rewards.tolist()}
    if StageId.LOSS_POLICY in stages:
        expected["loss.policy"] = {k: float(v) for k, v in fields.items()}
    return manifest, index, expected, payloads


def write_bundle(path: str | Path, manifest, index, expected, payloads, *, rank=None, ranks=(0,)) -> Path:
    writer = BundleWriter(path, manifest, index, expected, rank=rank)
    for name, tensor in payloads.items():
        writer.write_payload(name, tensor)
    return writer.finalize(ranks=list(ranks))


def write_synthetic(path: str | Path, *, format_version: Optional[str] = None, **kwargs) -> Path:
    """:func:`synthetic_parts` published at ``path``; ``format_version`` (``None``: the default, 1.3.0; e.g.
    ``"1.1.0"``) is the manifest's, which picks the layout the writer uses."""
    return write_bundle(path, *synthetic_parts(format_version=format_version or FORMAT_VERSION, **kwargs))


def write_cohort(path: str | Path, *, ranks: int = 2, bundle_id: str = "cohort-7-0", **kwargs) -> Path:
    path = Path(path)
    for r in range(ranks):
        parts = synthetic_parts(bundle_id=bundle_id, seed=100 + r, sample_prefix=f"r{r}-s-", batch_offset=r,
                                rank_sizes={"dp": ranks, "tp": 1, "pp": 1, "cp": 1}, **kwargs)
        write_bundle(path, *parts, rank=r, ranks=range(ranks))
    return path


# ------------------------------------------------------------------ the bundles the README's screenshots show
# Hand-made faults with known numbers (the TUI tests open them too): each screenshot can be reproduced with
# ``replay-tui --demo NAME``.

KL_BUG_TOKENS = {"s-5": (3, 7, 11), "s-6": (0,)}  # sample → token offsets whose expected kl is +0.25
KL_BUG_DELTA = 0.25
LOSS_BUG_DELTA = 0.5


def write_kl_bug(path: str | Path) -> Path:
    """8 samples × 16 tokens, two groups; the recorded kl is off by +0.25 at s-5@3,7,11 and s-6@0."""
    manifest, index, expected, payloads = synthetic_parts(samples=8, tokens=16, seed=3, bundle_id="kl-bug",
                                                               settle=True)
    kl = payloads["kl"].clone()
    for sid, offsets in KL_BUG_TOKENS.items():
        i = int(sid.split("-")[1])
        for off in offsets:
            kl[i * 16 + off] += KL_BUG_DELTA
    payloads["kl"] = kl
    return write_bundle(path, manifest, index, expected, payloads)


# loose-kl: the bundle's advantage.kl tolerance is atol 0.1 (rtol 0), so each element's tolerance is 0.1 plus a
# rounding bound below 1e-5 and its noise ratio is |a − e| / 0.1 to two digits: s-1@2 is 0.25 off (×2.5, a
# divergence), s-1@5 0.05 (×0.5, within the tolerance).
LOOSE_KL_ATOL = 0.1
LOOSE_KL_DELTAS = {("s-1", 2): 0.25, ("s-1", 5): 0.05}
LOOSE_KL_TOKENS = 8


def write_loose_kl(path: str | Path) -> Path:
    """4 samples × 8 tokens whose recorded kl is off at LOOSE_KL_DELTAS, judged with atol LOOSE_KL_ATOL."""
    import msgspec

    manifest, index, expected, payloads = synthetic_parts(samples=4, tokens=LOOSE_KL_TOKENS, seed=2,
                                                               bundle_id="loose-kl", settle=True)
    kl = payloads["kl"].clone()
    for (sid, offset), delta in LOOSE_KL_DELTAS.items():
        kl[int(sid.split("-")[1]) * LOOSE_KL_TOKENS + offset] += delta
    payloads["kl"] = kl
    policy = msgspec.structs.replace(manifest.comparison_policy, tolerances={
        "advantage.kl": Tolerance(atol=LOOSE_KL_ATOL, rtol=0.0)})
    manifest = msgspec.structs.replace(manifest, comparison_policy=policy)
    return write_bundle(path, manifest, index, expected, payloads)


def write_hazard_clean(path: str | Path) -> Path:
    """The clean twin of kl-bug (8 samples × 16 tokens, seed 3): it replays without a divergence, and the four
    raw rewards of its group g-1 are equal, so the group's normalized rewards are all 0 (a hazard)."""
    return write_bundle(path, *synthetic_parts(samples=8, tokens=16, seed=3, bundle_id="hazard-clean",
                                                         settle=True))


def write_loss_bug(path: str | Path) -> Path:
    """Step-level bundle whose recorded pg_loss (and so loss) is off by +0.5."""
    manifest, index, expected, payloads = synthetic_parts(samples=4, tokens=8, seed=5, bundle_id="loss-bug",
                                                               stages=STEP_STAGES, settle=True)
    loss = dict(expected["loss.policy"])
    loss["pg_loss"] += LOSS_BUG_DELTA
    loss["loss"] += LOSS_BUG_DELTA
    return write_bundle(path, manifest, index, {"loss.policy": loss}, payloads)


# nemo-loo: three groups of four under NeMo-RL's rule (leave-one-out baseline and std, no division where the
# std is 0, a one-sample group 0). g-0's rewards are equal (0.3, not exact in float32): a hazard, never a
# failure; g-2 was normalized with its group mean and std (GRPO's formula) instead of leave-one-out.
NEMO_LOO_RAW = (0.3, 0.3, 0.3, 0.3, 1.0, 0.0, 0.0, 1.0, 0.25, 1.0, 0.5, 0.75)
NEMO_LOO_CONFIG = dict(grpo_std_normalization=True, group_baseline="leave_one_out", std_zero="skip",
                       singleton_group="zero")
NEMO_LOO_BUG_GROUP = 2


def write_nemo_loo(path: str | Path) -> Path:
    """The ``nemo-loo`` demo (rollout-level, 12 samples × 6 tokens, no KL): the recorded rewards are the
    leave-one-out kernel's in float64 rounded once to float32 (host-independent), except group g-2's; the
    advantages broadcast the recorded rewards, so only reward.post_process fails (under teacher forcing)."""
    path = Path(path)
    raw = torch.tensor(NEMO_LOO_RAW, dtype=torch.float32)
    groups = torch.arange(raw.numel()) // 4
    lengths = torch.full((raw.numel(),), 6, dtype=torch.int64)
    raw64 = raw.to(torch.float64)
    rewards = group_normalize(raw64, groups, True, dtype=torch.float64, baseline="leave_one_out", std_zero="skip",
                              singleton="zero")
    grpo = group_normalize(raw64, groups, True, dtype=torch.float64)
    rewards = torch.where(groups == NEMO_LOO_BUG_GROUP, grpo, rewards).to(torch.float32)
    total = int(lengths.sum())
    cfg = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=4, kl_loss_type="k1", kl_coef=0.0,
                          eps_clip=0.2, eps_clip_high=0.28, **NEMO_LOO_CONFIG)
    records = [SampleRecord(sample_id=f"s-{i}", group_index=int(groups[i]), response_length=6, total_length=14,
                            loss_mask=[1] * 6, raw_reward=float(raw[i]), reward=float(rewards[i]),
                            micro_batch_id="mb-0000") for i in range(raw.numel())]
    identity = Identity(rollout_id=3, rollout_partition_ids=["rp-0"], consumer_batch_ids=["cb-0"],
                        semantic_group_ids=[0, 1, 2], normalization_cohort_ids=["nc-0"],
                        weight_lineage=WeightLineage(rollout_weight=2, actor_weight=2))
    index = BundleIndex(bundle_id="nemo-loo", identity=identity, samples=records, config=cfg)
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id="nemo-loo", producer=producer(),
                        stage_contracts=contracts(ROLLOUT_STAGES), payloads={}, comparison_policy=ComparisonPolicy(),
                        redaction={})
    expected = {"reward.raw": {"raw_rewards": raw.tolist()}, "reward.post_process": {"rewards": rewards.tolist()}}
    old = -torch.rand(total, generator=torch.Generator().manual_seed(11)) * 2
    payloads = {"old_log_probs": old, "kl": torch.zeros(total), "advantages": get_grpo_returns(rewards, lengths)}
    return write_bundle(path, manifest, index, expected, payloads)


# verl-dapo: one rank's step of a verl DAPO run (SPEC §4.2): a global token mean over the all-reduced count T
# of the mini-batch × the dp size, dual-clip c = 3 (always on in verl), clip-higher 0.2 / 0.28 — whose
# trainer divided each micro-batch's token sum by that micro-batch's own token count (verl#7321's class).
VERL_DAPO = dict(samples=16, tokens=24, micro_batches=2, dp=4, seed=17)
VERL_DAPO_CONFIG = dict(eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0, log_ratio_clamp=20.0,
                        loss_agg_mode="token_mean", metric_agg_mode="token_mean")


def write_verl_dapo(path: str | Path) -> Path:
    """The ``verl-dapo`` demo (a step bundle, 16 samples × up to 24 tokens in 2 micro-batches, rank 0 of a dp
    group of 4 whose mini-batch has ``T`` = 4× this shard's loss tokens): the per-sample loss terms are the
    kernels' float64 sums, and so are the recorded metrics, while ``pg_loss`` / ``loss`` are the buggy
    trainer's — each micro-batch's ``Σ pg·mask`` over its own token count, × dp. Everything is computed in
    float64 and rounded once to float32 (host-independent). loss.policy fails at the aggregation: the recorded
    per-sample terms are right, their weights are not."""
    from ..kernels.loss import LossKnobs, aggregate, policy_fields_from_sums, policy_token_terms

    n, width, parts, dp = (VERL_DAPO[k] for k in ("samples", "tokens", "micro_batches", "dp"))
    g = torch.Generator().manual_seed(VERL_DAPO["seed"])
    lengths = torch.randint(width // 3, width + 1, (n,), generator=g)
    total = int(lengths.sum())
    mask = (torch.rand(total, generator=g) > 0.15).to(torch.float32)
    old = (-torch.rand(total, generator=g) * 2.0).to(torch.float32)
    # uniform draws and float32 arithmetic only (randn is ATen SIMD); each ratio's float32 exp settled
    logp = _settle((old + (torch.rand(total, generator=g) - 0.5) * 1.2).to(torch.float32), old)
    rewards = (torch.rand(n, generator=g) * 2.0 - 1.0).to(torch.float32)
    advantages = get_grpo_returns(rewards, lengths)
    tokens = int(mask.sum())
    cfg = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=4, kl_coef=0.0, entropy_coef=0.0,
                          loss_token_count=tokens * dp, loss_scale=float(dp), **VERL_DAPO_CONFIG)
    knobs = LossKnobs.of(cfg)
    seg = segment_ids(lengths)
    t = policy_token_terms(logp, old, advantages, knobs, seg=seg, dtype=torch.float64)
    m = mask.to(torch.float64)
    sums = {"pg": segment_sum(t["pg"] * m, seg, n), "clip": segment_sum(t["clip"] * m, seg, n),
            "clip_lower": segment_sum(t["clip_lower"] * m, seg, n), "kl": segment_sum(t["ppo_kl"] * m, seg, n),
            "mask": segment_sum(m, seg, n)}
    fields = policy_fields_from_sums(sums, False, 0.0, knobs)
    bounds = [(k * n // parts, (k + 1) * n // parts) for k in range(parts)]
    buggy = sum(float(aggregate(sums["pg"][a:b], sums["mask"][a:b], "token_mean",
                                LossKnobs(loss_token_count=int(sums["mask"][a:b].sum())), float(dp)))
                for a, b in bounds)
    f32 = lambda v: float(torch.tensor(float(v), dtype=torch.float32))  # noqa: E731
    expected = {name: f32(value) for name, value in fields.items()}
    expected["pg_loss"] = expected["loss"] = f32(buggy)
    expected["per_sample"] = {"pg_sum": sums["pg"].tolist(), "kl_sum": sums["kl"].tolist(),
                              "clip_count": sums["clip"].tolist(), "mask_count": sums["mask"].tolist()}
    offsets = torch.cumsum(lengths, 0) - lengths
    records = [SampleRecord(sample_id=f"s-{i}", group_index=i // 4, response_length=int(lengths[i]),
                            total_length=int(lengths[i]) + 40,
                            loss_mask=[int(x) for x in mask[int(offsets[i]):int(offsets[i] + lengths[i])].tolist()],
                            raw_reward=None, reward=float(rewards[i]),
                            micro_batch_id=f"mb-{next(k for k, (a, b) in enumerate(bounds) if a <= i < b):04d}")
               for i in range(n)]
    identity = Identity(actor_step_id=ActorStepId(rollout_id=40, step_id=1), rollout_partition_ids=["rp-0"],
                        micro_batch_ids=[f"mb-{k:04d}" for k in range(parts)], semantic_group_ids=list(range(n // 4)),
                        weight_lineage=WeightLineage(rollout_weight=39, actor_weight=41),
                        rank={"dp": dp, "tp": 1, "pp": 1, "cp": 1})
    index = BundleIndex(bundle_id="verl-dapo", identity=identity, samples=records, config=cfg)
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id="verl-dapo", producer=producer(),
                        stage_contracts=contracts(STEP_STAGES), payloads={}, comparison_policy=ComparisonPolicy(),
                        redaction={})
    payloads = {"log_probs": logp, "old_log_probs": old, "advantages": advantages}
    return write_bundle(path, manifest, index, {"loss.policy": expected}, payloads)


# Every shipped demo bundle, by the name --demo takes (DEMO_NAMES order).
_DEMO_BUILDERS = {
    "pr65-buggy": lambda p: write_pr65(p, buggy=True),
    "pr65-fixed": lambda p: write_pr65(p, buggy=False, bundle_id="b-00001-fixed"),
    "step-loss": write_step_loss,
    "cohort-2rank": lambda p: write_cohort(p, settle=True),
    "support-fullvocab": lambda p: write_support_bundle(p, **SUPPORT_DEMO),
    "kl-bug": write_kl_bug,
    "loss-bug": write_loss_bug,
    "loose-kl": write_loose_kl,
    "hazard-clean": write_hazard_clean,
    "nemo-loo": write_nemo_loo,
    "verl-dapo": write_verl_dapo,
}


def write_demos(root: str | Path) -> dict[str, Path]:
    """Write every demo bundle under ``root`` (which must not hold them already)."""
    root = Path(root)
    return {name: build(root / name) for name, build in _DEMO_BUILDERS.items()}


def write_demo(name: str, path: str | Path) -> Path:
    """Write the shipped demo ``name`` at ``path`` (which must not exist)."""
    return _DEMO_BUILDERS[name](Path(path))


def materialize_demo(name: str = "pr65-buggy") -> Path:
    """Build one demo bundle in a fresh temporary directory and return its path."""
    if name not in DEMO_NAMES:
        raise ValueError(f"unknown demo {name!r} (expected one of {', '.join(DEMO_NAMES)})")
    tmp = Path(tempfile.mkdtemp(prefix="replay-demo-"))
    try:
        return _DEMO_BUILDERS[name](tmp / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ------------------------------------------------------------------------------- sample support


def _cp_shard_of_tokens(lengths: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Load-balanced context-parallel layout: each trajectory is cut into 2·cp chunks and CP rank r holds
    chunks r and 2·cp − 1 − r. Returns the CP rank of every response token, ``[Σ T]`` int32."""
    from ..kernels import segment_ids, segment_offsets

    lengths = lengths.to(torch.int64)
    seg = segment_ids(lengths)
    offset = torch.arange(seg.numel(), dtype=torch.int64) - segment_offsets(lengths)[seg]
    chunk = offset * (2 * cp_size) // lengths[seg].clamp_min(1)
    return torch.where(chunk < cp_size, chunk, 2 * cp_size - 1 - chunk).to(torch.int32)


def _support_logprobs(ids: torch.Tensor, logits: torch.Tensor, rows) -> torch.Tensor:
    """:func:`support.support_logprobs` in its float32 steps (padding masked, the same row sums), with exp
    and log from :func:`_f32`."""
    x = logits.to(torch.float32).masked_fill(ids < 0, -_INF)
    m = x.amax(1)
    l_y = x.gather(1, rows.sampled_slot[:, None]).squeeze(1)
    out = (l_y - m) - _f32(torch.log, _f32(torch.exp, x - m[:, None]).sum(1))
    return torch.where(rows.has_support & rows.sampled_in_row, out, torch.full_like(out, float("nan")))


def _settle_support(ids: torch.Tensor, logits: torch.Tensor, rows) -> torch.Tensor:
    """Member logits nudged down until every float32 exp that the replay's ``logp_S`` takes, and the log of
    each row's float32 sum of them, has one answer on every host (:func:`_settle`). Only members below their
    row's maximum move, so the maximum, and so every ``l − m``, stays the replay's."""
    x = logits.to(torch.float32).masked_fill(ids < 0, -_INF)
    top = x.amax(1, keepdim=True)
    scored = (ids >= 0) & rows.has_support[:, None]
    out = logits.to(torch.float32).clone()
    out[scored] = _settle(out[scored], top.expand_as(out)[scored])

    def log_ok(r: torch.Tensor, row_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(whether the log is unambiguous, the float32 sum) of each ``[..., K]`` row of ``r``'s logits,
        summed as the replay sums it."""
        pad = (ids[r] < 0).view(r.numel(), *([1] * (row_logits.dim() - 2)), -1)
        top_r = top[r].view(r.numel(), *([1] * (row_logits.dim() - 1)))
        sums = _f32(torch.exp, row_logits.masked_fill(pad, -_INF) - top_r).sum(-1)
        return _unambiguous(torch.log(sums.to(torch.float64))), sums

    # A row whose log is ambiguous moves its largest member below the maximum, by steps that each move the
    # row's sum by about an ulp, until that member's exp and the row's log are both unambiguous.
    second = x.scatter(1, x.argmax(1, keepdim=True), -_INF)
    slot = second.argmax(1)
    todo = torch.nonzero(rows.has_support & (second.amax(1) > -_INF)).reshape(-1)
    todo = todo[~log_ok(todo, out[todo])[0]]
    k = torch.arange(1, SETTLE_ROW_TRIES + 1, dtype=torch.float64)
    for round_ in range(SETTLE_ROUNDS):
        if not todo.numel():
            break
        left = []
        for r in todo.split(SETTLE_BLOCK // SETTLE_ROW_TRIES):
            v, b = out[r, slot[r]], top[r, 0]
            moves_sum = _ulp(log_ok(r, out[r])[1]) / torch.exp((v - b).to(torch.float64))
            step = torch.maximum(torch.maximum(_ulp(v), _ulp(v - b)), moves_sum) * _step_scale(round_)
            cand = (v.to(torch.float64)[:, None] - step[:, None] * k).to(torch.float32)  # [n, tries]
            trial = out[r][:, None, :].repeat(1, SETTLE_ROW_TRIES, 1)  # [n, tries, K]: the row with each candidate
            trial.scatter_(2, slot[r].view(-1, 1, 1).expand(-1, SETTLE_ROW_TRIES, 1), cand[:, :, None])
            good = _exp_is_unambiguous(cand, b[:, None]) & log_ok(r, trial)[0]
            hit, out[r, slot[r]] = _first_passing(cand, good)
            left.append(r[~(hit & log_ok(r, out[r])[0])])  # re-checked on the row as the replay lays it out
        todo = torch.cat(left)
    return out


def support_parts(
    *,
    samples: int = 8,
    tokens: int = 16,
    k: int = 20,
    vocab_size: int = 4096,
    seed: int = 0,
    group_size: int = 4,
    vary_lengths: bool = False,
    eos_last: bool = True,
    full_vocab_bug: bool = False,
    routed: Optional[tuple[int, int, int]] = None,
    cp_size: int = 1,
    bundle_id: str = "support",
    stages=ALL_STAGES + (StageId.LOGPROB_SUPPORT,),
    settle: bool = False,
    format_version: str = FORMAT_VERSION,
):
    """(manifest, index, expected, payloads) of a clean synthetic bundle with sample-support payloads.

    Every response token gets a K-member support row (distinct ids in sampler order, right-padded with −1
    only where a row is empty) with random member logits, and a sampled member. With ``eos_last`` the last
    token of every trajectory is an appended EOS without support that takes its ``full_log_probs`` value.
    ``log_probs`` (= ``old_log_probs``: the first update of a step) are ``logp_S``; with ``full_vocab_bug``
    they are the full-vocabulary log-probs instead (the support holds only part of the softmax mass).
    ``routed = (layers, topk, num_experts)`` adds routed-expert rows; ``cp_size > 1`` adds ``cp_shard``.
    ``settle`` (as in :func:`synthetic_parts`) nudges the member logits, so that the replay's ``logp_S`` is the
    recorded one bit for bit on every host (``log_probs`` here take no exp in the loss: they equal
    ``old_log_probs``).
    """
    import msgspec

    from ..kernels.support import check_support_rows

    if vocab_size < k + 1:
        raise ValueError("vocab_size must exceed k (one id is kept for the appended EOS)")
    manifest, index, expected, payloads = synthetic_parts(
        samples=samples, tokens=tokens, seed=seed, group_size=group_size, vary_lengths=vary_lengths, kl_coef=0.0,
        bundle_id=bundle_id, stages=stages, rank_sizes={"dp": 1, "tp": 1, "pp": 1, "cp": cp_size},
        format_version=format_version,
    )
    lengths = torch.tensor([s.response_length for s in index.samples], dtype=torch.int64)
    total = int(lengths.sum())
    gen = torch.Generator().manual_seed(seed + 2084)
    eos = vocab_size - 1
    # Distinct ids per row (strictly increasing by construction, below the EOS id), then shuffled.
    gaps = torch.randint(1, (vocab_size - 1) // k + 1, (total, k), generator=gen)
    ascending = torch.cumsum(gaps, 1) - 1
    ids = ascending.gather(1, torch.rand(total, k, generator=gen).argsort(1)).to(torch.int32)
    logits = _standard_normal((total, k), gen) * 2
    sampled = ids.gather(1, torch.randint(0, k, (total, 1), generator=gen)).squeeze(1).to(torch.int64)
    if eos_last and total:
        last = (torch.cumsum(lengths, 0) - 1)[lengths > 0]
        ids[last] = -1
        logits[last] = 0.0
        sampled[last] = eos
    rows = check_support_rows(ids, sampled, None)
    if settle:
        logits = _settle_support(ids, logits, rows)
    logp_s = _support_logprobs(ids, logits, rows)
    has_support = (ids >= 0).any(1)
    # Full-vocabulary log-prob: the support carries a fraction 1/(1+u) of the softmax mass.
    outside = torch.rand(total, generator=gen) * 0.99 + 0.01
    eos_logp = -torch.rand(total, generator=gen) * 2 - 0.01
    full = torch.where(has_support, logp_s - _f32(torch.log1p, outside), eos_logp)
    recorded = full if full_vocab_bug else torch.where(has_support, logp_s, full)
    payloads = dict(payloads, log_probs=recorded, old_log_probs=recorded.clone(), support_ids=ids,
                    support_logits=logits, sampled_token_ids=sampled, full_log_probs=full)
    num_experts = None
    if routed is not None:
        layers, topk, num_experts = routed
        gaps = torch.randint(1, num_experts // topk + 1, (total, layers, topk), generator=gen)
        ascending = torch.cumsum(gaps, 2) - 1
        order = torch.rand(total, layers, topk, generator=gen).argsort(2)
        payloads["routed_experts"] = ascending.gather(2, order).to(torch.int32)
    if cp_size > 1:
        payloads["cp_shard"] = _cp_shard_of_tokens(lengths, cp_size)
    config = msgspec.structs.replace(index.config, vocab_size=vocab_size, num_experts=num_experts)
    index = msgspec.structs.replace(index, config=config)
    if "loss.policy" in expected:
        mask = torch.tensor([m for s in index.samples for m in s.loss_mask], dtype=torch.float32)
        fields = _policy_loss_fields(recorded, payloads["old_log_probs"], payloads["advantages"],
                                     payloads["entropy"], mask, lengths, eps_clip=config.eps_clip,
                                     eps_clip_high=config.eps_clip_high, entropy_coef=config.entropy_coef)
        expected = dict(expected, **{"loss.policy": {k_: float(v) for k_, v in fields.items()}})
    return manifest, index, expected, payloads


def write_support_bundle(path: str | Path, **kwargs) -> Path:
    """Write :func:`support_parts` as a bundle (``full_vocab_bug=True``: first divergence ``logprob.support``)."""
    return write_bundle(path, *support_parts(**kwargs))
