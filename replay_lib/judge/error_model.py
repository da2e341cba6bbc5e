"""The error model (SPEC §5.1): a divergence is what floating-point noise cannot explain.

The replay recomputes every stage in float64 from the recorded values (``T``, the truth every legitimate
producer approximates) and judges each element against

    tolerance = atol + rtol·|e|  +  a bound on the producer's rounding for that element

where ``atol``/``rtol`` are the bundle's (``comparison_policy.tolerances``, see :func:`bundle_tolerance` for
what ``--tolerance-policy`` lets a bundle loosen) and the bound is computed alongside, in float64, from the
condition of the formula — the sum of the magnitudes of its terms, ``cond = Σ|terms|``: a computation that
rounds each term by a relative ``u`` cannot be off by more than a small multiple of ``u·cond``, whatever the
order of its operations. ``u`` is the unit roundoff of the producer's declared precision
(``comparison_policy.producer_precision``, default float32/float32):

==================  =======  ==================================================================================
``compute``         u_t      the per-token outputs it evaluated (the ``kl`` payload) and the per-token terms
                             of its loss: 2⁻²⁴ float32, 2⁻⁸ bfloat16, 2⁻¹¹ float16
``accumulate``      u_a      its reductions (sums over tokens and samples): 2⁻²⁴ float32, 2⁻⁵³ float64
rewards             u = 2⁻²⁴ reward normalization runs on the rollout side on Python floats / float32 tensors
                             in every framework, whatever the actor's forward precision (a bf16 ``compute``
                             does not loosen it)
==================  =======  ==================================================================================

The bounds, element by element (``T`` the float64 recompute; constants derived below):

* **reward.post_process** (a group of ``n`` raw rewards ``r``, float64 std ``s``, ``g = T``):
  ``8u·[(|r_i| + √n·max|r|)/(s + eps) + √n·|g_i|]`` with std normalization, ``8u·(|r_i| + √n·max|r|)``
  without. A float32 producer rounds each reward (``u·|r|``) and its group mean (``≈ √n·u·max|r|`` for a sum
  of ``n`` terms, worst cases of rounding being rare); the division by ``s + eps`` magnifies both, and the std
  it divides by carries a relative error of the same order, which ``√n·|g|`` covers. Measured on the
  producers of ``tests/producers`` (float32 ``torch.sum``, Megatron batched views, GPU trees, NumPy pairwise,
  float64): worst error 0.3 of the bound up to groups of 1,024.
  *All-equal groups* (``s = 0``): the exact answer is 0, but a float32 producer's mean of eight 0.3s is
  one ulp off, and ``1 ulp / eps`` is what it writes (±0.0074, and 0.0298 for the original tool's formula).
  The bound takes ``s = 0`` at face value: ``8u·(1 + √n)·max|r| / eps`` (0.55 for n = 8, r = 0.3) admits
  every such value, which is sound — a value there carries no information beyond its rounding — and the
  group is reported as a ``near_zero_std`` hazard (never a failure), so nobody reads a pass there as a
  verified value. A bug that moves such a group by more than the bound is still caught.
* **advantage.kl** (``r = old − ref``): ``8·u_t·cond + u_s·|T|``, ``cond = |r|`` (k1), ``r²`` (k2),
  ``exp(−r) + 1 + |r|`` (k3, low_var_kl: the clamp is 1-Lipschitz, so the unclamped bound holds); ``u_s`` is
  the unit roundoff of the payload's own dtype (a bf16 payload rounds each value once more). 8: the
  subtraction, ``exp`` (a CUDA ``__expf``/``exp2`` path is within 2 ulp), the two additions and the final
  rounding, each ≤ ``u·cond``, with room to spare; measured within 3 ulp·cond on torch, NumPy and a CUDA-like
  exp, and within 4·2⁻⁸·cond for bf16 arithmetic.
* **payloads stored coarser than the declared compute** (:func:`storage_unit`, ``u_s``: a capture that keeps
  bf16 copies of float32 log-probs): every expected value was computed from values the bundle no longer has,
  each within ``u_s·|x|`` of the recorded one, so a recomputation from them admits ``2·Σ|∂F/∂x|·u_s·|x|`` — the
  first-order propagation of one rounding per input — each input's rounding taken as the half spacing of its
  stored value, ``u_s·2^⌊log2|x|⌋`` (:func:`storage_error`: the stored value is the nearest of its format, so
  the computed one lies within that) —, doubled for the exponentials' second-order term
  (``C_STORE``), summed without cancellation (a worst case: the roundings of a real step mostly cancel, so this
  admits far more than they do, which the ``coarse_payload`` hazard says). k1/k2/k3 take ``2·e_r·max|dKL/dr|``
  over ``r ± e_r``, ``e_r = u_s·(|old| + |ref|)`` (:func:`kl_slope`: at ``r = 0`` the slope is 0, the move is
  not); the loss fields the per-token ``|∂x_t|·e_t`` summed with their aggregation's weights
  (:func:`loss_storage_bounds`), and the clip decisions within ``2·e`` of a bound are open; the KL penalty in the
  score ``2·u_s·|kl_coef|·Σ|kl|``, a GAE or discounted-return recursion ``2·u_s`` times its recursion over the
  magnitudes, the value loss ``2·(|d| + e)·e`` per token (``stages.value``), and an expected payload stored
  coarser (pg_losses, a support-scored log-prob) its own one rounding. Each such stage raises one
  ``coarse_payload`` hazard. A payload as fine as the compute format holds the values themselves (a bf16
  forward's log-probs upcast for a float32 loss): 0.
  Measured on ``tests/producers`` ``stored_bf16`` (slime's float32 arithmetic, bf16 payloads) and the loss-knob
  producer's ``stored_bf16``: clean at every size and config (worst 0.015 of the tolerance), sign-flipped
  advantages, k1 for k3, PR #65, biased std, the clip and token-mean bugs, a per-micro-batch denominator and
  dual-clip on positive advantages still caught.
* **advantage.estimate**: the recorded normalized reward broadcast over the sample's tokens (teacher
  forcing), ``2·u_s·|T|`` — the reward's one rounding to float32 and the payload's, ``u_s`` = max(float32,
  the payload dtype). Under ``--chain`` the advantage is the recomputed reward, and the reward's own rounding
  bound (the part above, without atol/rtol) is added: a legitimate producer's reward can be that far off T.
* **advantage side of SPEC §4.2** (:func:`reward_bound`'s knobs, :func:`singleton_bound`, :func:`recursion_bound`,
  :func:`whiten_bound`): the reward bound takes the configured eps, the leave-one-out factor ``n/(n − 1)`` and
  NeMo-RL's ``E[r²] − b²`` cancellation (``8u·|g|·2·max|r|²/s²``; ``|c|/eps`` where the others' std is 0 without
  being exact); KL in the score adds its float32 sum (``3·|seq32 − T| + 8u·kl_coef·Σ|kl|``). Per-token
  recursions (discounted returns, GAE) take ``8u·cond + 3·|T32 − T|`` — cond the recursion over the magnitudes
  of its terms, ``T32`` the recursion in float32 (a sequential evaluation drifts like ``L·u`` on long, nearly
  constant sequences; measured inside it at 16 × 2,048 tokens). Whitening adds ``(ρ + Δμ)/σ + |A'|·(Δσ/σ + 2u)``
  with ``Δμ = 2u·√N·mean|A| + mean ρ`` and ``Δσ/σ = u·√N + Σ|A − μ|·ρ/((N − 1)σ²)``, 0 for recorded statistics.
* **loss.policy** (each field ``F = Σ_i μ_i``, ``μ_i = Σ_t x_t·m_t / n_i``):
  ``2·u32·|T| + max(2·u_a·(K_sum + K_outer) + 2·u_t·K_tok, 3·|seq32 − T|)`` (+ the clip and chain terms),
  with ``K_sum = Σ_i Σ_t |x_t·m_t| / n_i`` (the per-sample sums' condition), ``K_outer = Σ_i |μ_i|`` (the sum
  over samples and the divisions), ``K_tok = Σ_i Σ_t c_t·m_t / n_i`` (the per-token evaluation: ``c_t =
  (3 + 2|ppo_kl_t|)·|pg_t|`` for the surrogate — exp of a rounded difference, a product, a clamp —, ``|ppo_kl_t|``
  for ppo_kl, 0 for the entropy and the clip indicator, which are recorded values and exact 0/1). ``seq32``
  is the same sums evaluated sequentially in float32 (``index_add_`` in token order, then left to right over
  the samples): a plain condition bound is not sound for *sequential* producers, whose error on long, nearly
  constant sums grows like ``n·u`` (10–160× a √n estimate on constant data); three times the error of one
  such evaluation covers producers as bad as it. ``2·u32·|T|``: the scalar's final rounding to float32 and
  the rounding of its last operation. With ``accumulate: float64`` the reductions are ``u_a = 2⁻⁵³`` and
  the sequential term is dropped.
  ``pg_clipfrac`` adds ``Σ_i near_i / n_i``, ``near_i`` the sample's loss tokens with ``A ≠ 0`` whose ratio
  lies within ``8·u_t`` (relative) of ``1 − eps_clip`` or ``1 + eps_clip_high``: a legitimate rounding may
  put each on either side, and each moves the fraction by ``1/n_i``.
  Under ``--chain`` (advantages recomputed) the pg terms add ``Σ_i (Σ_t ratio_t·m_t / n_i)·ρ_i``, ``ρ_i`` the
  rounding bound of the sample's advantage, and the clip fraction 1 per sample with loss tokens whose
  ``|A_i| ≤ ρ_i ≠ 0`` (its sign, and so every clip decision, is rounding-dominated).
  The loss-side knobs of SPEC §4.2 (``loss_scalar_bounds(knobs=…)``): a field is ``scale·Σ_i S_i/(inner_i·outer)``
  under its aggregation mode (``kernels.loss.agg_divisors``), so ``1/n_i`` above becomes the mode's weight
  ``w_i`` and the loss terms carry ``|loss_scale|`` (``aggregated_condition``, ``scalar_bound``). The surrogate's
  ``|ppo_kl|`` becomes the condition of what it exponentiates: the (clamped) token log-ratio, plus
  ``√n_i·Σ_t|Δ_t|·m_t/n_i`` for GSPO's sample ratio and ``√n_i·Σ_t|old − rollout|·m_t`` (÷ n_i geometric) for a
  sequence importance weight, ``|old − rollout|`` for a token one. ``kl_loss``: ``K_tok`` is the estimator's
  ``kl_condition`` at the clamped log-ratio. ``pg_clipfrac_lower`` admits the tokens with ``A < 0`` whose chosen
  ratio lies within ``8·u_t·(1 + cond)`` of c; an IcePop mask admits the whole ``w·|pg|`` of a token whose weight
  lies within that of ``is_low`` / ``is_high``. ``loss_aggregate_bound``: the recorded scalars against the
  recorded per-sample terms, ``2·u32·|T| + 2·u_a·n·Σ_i|w_i·S_i|``.

Measured on the independent producers of ``tests/producers`` (9 families, up to 512 × 16,384 tokens), no
clean bundle diverges, while the bug classes of ``tests/producers/bugs.py`` are caught where their signal
exceeds the declared noise (see the README).

``--exact`` replaces all of this with bitwise equality of a float32 recompute (same kernels, same hardware).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np
import torch

from ..bundle.dtypes import stored_dtype
from ..bundle.schema import ComparisonPolicy, Manifest, Tolerance

UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8,
                 # float8 payloads (storage only): u = 2^-p, p = stored mantissa bits + 1, as bfloat16's 2^-8
                 "float8_e4m3fn": 2.0 ** -4, "float8_e4m3fnuz": 2.0 ** -4,
                 "float8_e5m2": 2.0 ** -3, "float8_e5m2fnuz": 2.0 ** -3}
U32 = UNIT_ROUNDOFF["float32"]
# The smallest normal magnitude of the float8 formats, by their unit roundoff (the larger of fn and fnuz: 2^-6 for
# e4m3fn against e4m3fnuz's 2^-7, 2^-14 for e5m2 against 2^-15). Below it a float8 value is subnormal (or 0), its
# rounding absolute — at most u·normal_min, half the subnormal spacing — not u·|x|: a log-prob of −0.001 stored
# as e4m3fn is −2^-9 (0.00095 off). The other formats' normal ranges reach below any value a bundle holds.
FLOAT8_NORMAL_MIN = {2.0 ** -4: 2.0 ** -6, 2.0 ** -3: 2.0 ** -14}

C_REWARD = 8.0
C_TOKEN = 8.0
C_ADVANTAGE = 2.0
C_REDUCE = 2.0
C_SEQUENTIAL = 3.0
C_FINAL = 2.0
C_NEAR_CLIP = 8.0
C_STORE = 2.0
# The share of a value its inputs' storage rounding may reach before a coarse_payload hazard names it: a change
# smaller than that goes unseen there.
STORAGE_HAZARD = 0.1
# The surrogate's per-token condition: c_t = (PG_COND + PG_KL_COND·|ppo_kl|)·|pg|.
PG_COND, PG_KL_COND = 3.0, 2.0

TOLERANCE_POLICIES = ("bundle", "default")
DEFAULT_TOLERANCE = Tolerance()


def unit_roundoff(dtype) -> float:
    """u of a precision name (``"bfloat16"``), a torch dtype or a payload (the dtype it was stored in:
    ``bundle.dtypes.stored_dtype``, float8 for the float32 copy of a float8 payload)."""
    if isinstance(dtype, torch.Tensor):
        dtype = stored_dtype(dtype)
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    return UNIT_ROUNDOFF.get(dtype, U32)


@dataclass(frozen=True)
class Rules:
    """How one replay judges: ``chain`` (each stage consumes the recomputed outputs before it, instead of its
    recorded inputs), ``exact`` (a float32 recompute compared bitwise) and ``tolerance_policy``."""

    chain: bool = False
    exact: bool = False
    tolerance_policy: str = "bundle"
    # --bitwise: rollout_log_probs and old_log_probs must agree bit for bit on every loss token (the oracle of
    # stage logprob.mismatch; config.true_on_policy asks the same of one bundle)
    bitwise: bool = False

    def __post_init__(self) -> None:
        if self.tolerance_policy not in TOLERANCE_POLICIES:
            raise ValueError(f"tolerance policy must be one of {', '.join(TOLERANCE_POLICIES)}, "
                             f"got {self.tolerance_policy!r}")

    @property
    def mode(self) -> str:
        return "chained" if self.chain else "per_stage"

    @property
    def dtype(self) -> torch.dtype:
        """What the stages recompute in: float64, or the producer's float32 kernels under ``--exact``."""
        return torch.float32 if self.exact else torch.float64


@dataclass(frozen=True)
class Precision:
    """The producer's declared precision as unit roundoffs: ``token`` (u_t) and ``reduce`` (u_a)."""

    compute: str = "float32"
    accumulate: str = "float32"

    @classmethod
    def of(cls, policy: ComparisonPolicy) -> "Precision":
        p = policy.producer_precision
        return cls(compute=p.compute, accumulate=p.accumulate)

    @property
    def token(self) -> float:
        return UNIT_ROUNDOFF[self.compute]

    @property
    def reduce(self) -> float:
        return UNIT_ROUNDOFF[self.accumulate]

    @property
    def sequential(self) -> bool:
        """Reductions in float32: a sequential float32 evaluation bounds them too (see the module doc)."""
        return self.accumulate == "float32"


# ------------------------------------------------------------------------------ bundle tolerances


def is_exact_field(policy: ComparisonPolicy, stage: str, field: str) -> bool:
    """Whether the bundle's ``exact_fields`` name the field (alone or as ``stage.field``): no tolerance at all."""
    return field in policy.exact_fields or f"{stage}.{field}" in policy.exact_fields


def bundle_tolerance(policy: ComparisonPolicy, stage: str, field: str, tolerance_policy: str = "bundle") -> tuple[float, float]:
    """``(atol, rtol)`` of a field: 0 for an exact field of the bundle's policy; else the stage's declared
    tolerance — as declared under ``--tolerance-policy bundle`` (the default; a looser value than the
    defaults is used and reported as a warning), capped at the defaults (1e-6, 1e-5) under ``default``
    (a bundle may tighten its tolerances, never loosen them)."""
    if is_exact_field(policy, stage, field):
        return 0.0, 0.0
    tol = policy.tolerance(stage)
    atol, rtol = float(tol.atol), float(tol.rtol)
    if tolerance_policy == "default":
        atol, rtol = min(atol, DEFAULT_TOLERANCE.atol), min(rtol, DEFAULT_TOLERANCE.rtol)
    return atol, rtol


def tolerance_warnings(manifest: Manifest, where: str, tolerance_policy: str = "bundle") -> list[str]:
    """One warning per declared tolerance looser than the defaults: what the bundle asked for, and whether
    this replay used it."""
    out = []
    for stage, tol in sorted(manifest.comparison_policy.tolerances.items()):
        for name, default in (("atol", DEFAULT_TOLERANCE.atol), ("rtol", DEFAULT_TOLERANCE.rtol)):
            value = float(getattr(tol, name))
            if value > default:
                fate = ("used as declared (--tolerance-policy default caps it)" if tolerance_policy == "bundle"
                        else f"capped at {default:g} (--tolerance-policy default)")
                out.append(f"{where}: $.comparison_policy.tolerances.{stage}.{name}={value:g} is looser than the "
                           f"default {default:g}: {fate}")
    return out


# ---------------------------------------------------------------------------------------- rewards


@dataclass(frozen=True)
class GroupStats:
    """Per sample (``[n]``) and per group statistics of the raw rewards, float64."""

    inverse: torch.Tensor  # group of each sample (0 … groups − 1)
    size: torch.Tensor  # float64 [groups]
    max_abs: torch.Tensor  # float64 [groups]
    std: torch.Tensor  # float64 [groups], unbiased (NaN for a singleton)


def group_stats(raw: torch.Tensor, groups: torch.Tensor, dense: bool = False) -> GroupStats:
    """``dense``: ``groups`` are already numbered ``0 … k − 1``, each number used (no sort to find the groups)."""
    r = raw.to(torch.float64)
    if dense:
        inverse = groups.to(torch.int64)
        counts = torch.bincount(inverse)
    else:
        _, inverse, counts = torch.unique(groups.to(torch.int64), return_inverse=True, return_counts=True)
    k = counts.numel()
    size = counts.to(torch.float64)
    max_abs = torch.zeros(k, dtype=torch.float64).scatter_reduce(0, inverse, r.abs(), reduce="amax", include_self=True)
    low = torch.full((k,), float("inf"), dtype=torch.float64).scatter_reduce(0, inverse, r, reduce="amin",
                                                                               include_self=True)
    shifted = r - low[inverse]
    mean = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, shifted) / size
    centered = shifted - mean[inverse]
    var = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, centered * centered) / (size - 1)
    return GroupStats(inverse=inverse, size=size, max_abs=max_abs, std=torch.sqrt(var))


def reward_bound(raw: torch.Tensor, stats: GroupStats, truth: torch.Tensor, std_normalization: bool,
                 eps: float, *, leave_one_out: bool = False, sample_std: Optional[torch.Tensor] = None,
                 magnitude: Optional[torch.Tensor] = None, score_error: Optional[torch.Tensor] = None,
                 cancellation: bool = True, std_zero: str = "eps") -> torch.Tensor:
    """float64 ``[n]``: the rounding bound of each normalized reward (module doc); 0 for a group of equal
    rewards whose every partial sum is exact in float32 (:func:`exact_multiples`).

    SPEC §4.2 knobs: ``leave_one_out`` — the centred value is ``n/(n − 1)·(r − mean)`` and the std (given per
    sample in ``sample_std``) is NeMo-RL's ``E[r²] − b²`` form, whose cancellation adds ``2·max|r|²/s²`` of
    relative error (``cancellation=False``: a std known to be exact), and where that std is 0 over others that are
    not exactly equal, a producer may divide its centred value ``c`` by a rounding-level std or not: up to
    ``|c|/eps`` (``std_zero`` says how ``c`` relates to ``T``); ``magnitude`` — each score's condition when it is not the raw reward (``|r| + kl_coef·Σ|kl|``
    for KL in the reward); ``score_error`` — a further absolute error of each score (its float32 sum), which
    enters a group's values and its mean."""
    mag = raw.to(torch.float64).abs() if magnitude is None else magnitude.to(torch.float64)
    inv = stats.inverse
    size = stats.size[inv]
    sqrt_n = size.sqrt()
    if magnitude is None:
        group_max = stats.max_abs
    else:
        group_max = torch.zeros(stats.size.numel(), dtype=torch.float64).scatter_reduce(
            0, inv, mag, reduce="amax", include_self=True)
    spread = mag + sqrt_n * group_max[inv]
    extra = torch.zeros_like(spread)
    if score_error is not None:
        worst = torch.zeros(stats.size.numel(), dtype=torch.float64).scatter_reduce(
            0, inv, score_error.to(torch.float64), reduce="amax", include_self=True)
        extra = score_error.to(torch.float64) + worst[inv]
    factor = torch.where(size > 1, size / (size - 1), torch.ones_like(size)) if leave_one_out else torch.ones_like(size)
    if not std_normalization:
        bound = (C_REWARD * U32 * spread + extra) * factor
    else:
        s = stats.std[inv] if sample_std is None else sample_std.to(torch.float64)
        g = truth.to(torch.float64).abs()
        bound = (C_REWARD * U32 * spread + extra) * factor / (s + eps) + C_REWARD * U32 * sqrt_n * g
        if leave_one_out and cancellation:
            # s = 0 over others that are not exactly equal in float32: a producer's E[r²] − b² may leave a
            # rounding-level std and divide by it (or, under std_zero="skip", not): anything up to |c|/eps
            centred = g * eps if std_zero == "eps" else g
            at_zero = (centred + C_REWARD * U32 * spread * factor + extra * factor) / eps if eps > 0 \
                else torch.full_like(g, float("inf"))
            with torch.no_grad():
                spread_term = C_REWARD * U32 * g * 2 * group_max[inv] ** 2 / torch.where(s > 0, s * s, torch.ones_like(s))
            bound = torch.where(s > 0, bound + spread_term, torch.maximum(bound, at_zero))
    equal = torch.nonzero(stats.std == 0).reshape(-1) if magnitude is None else torch.zeros(0, dtype=torch.int64)
    if equal.numel():
        value = torch.zeros(stats.size.numel(), dtype=torch.float64).index_copy_(
            0, stats.inverse, raw.to(torch.float64))  # any member's reward: they are equal
        values, sizes = value.tolist(), stats.size.tolist()
        exact = [k for k in equal.tolist() if exact_multiples(values[k], int(sizes[k]))]
        if exact:
            hit = torch.zeros(stats.size.numel(), dtype=torch.bool)
            hit[exact] = True
            bound = torch.where(hit[stats.inverse], torch.zeros_like(bound), bound)
    return bound


def exact_multiples(r: float, n: int) -> bool:
    """Whether every sum of up to ``n`` copies of ``r`` is exact in float32 (``r`` a float32 value whose
    significand, widened by the bits of ``n``, still fits in 24 bits: 0, 1, 3.0, 0.5 in any group up to
    millions). Then a group of ``n`` equal rewards ``r`` has the mean ``r`` exactly in any summation order,
    every centered value is 0, and so is the normalized reward (with or without std): any float32 producer
    writes exactly 0, and the bound there is 0."""
    if r == 0:
        return True
    # the magnitude first: within it the float32 round trip (struct's correctly rounded cast) cannot overflow
    if not math.isfinite(r) or abs(r) < 2.0 ** -100 or abs(r) * n > 2.0 ** 100 \
            or struct.unpack("f", struct.pack("f", r))[0] != r:
        return False
    mantissa = int(abs(math.frexp(r)[0]) * 2 ** 24)  # a 24-bit integer: r is a float32 value
    width = mantissa.bit_length() - ((mantissa & -mantissa).bit_length() - 1)
    return width + int(n).bit_length() <= 24


def exact_zero_std(raw: torch.Tensor, stats: GroupStats, sample_std: torch.Tensor) -> torch.Tensor:
    """bool per sample: a leave-one-out std of exactly 0 over other rewards that are equal, float32 values and
    exact multiples of each other's sums (:func:`exact_multiples`): then every float32 producer's std is 0 too,
    and the zero-std rule applies to the same samples in the producer and here. Others that are all exactly 0 (the
    lone success of a binary-reward group, whatever its reward) qualify whatever this sample's reward: a masked sum
    (NeMo-RL's ``(1 − I)·r``) adds only zeros, and a total less this reward gives back exactly 0, for ``r`` and
    ``r²`` alike."""
    out = torch.zeros(raw.numel(), dtype=torch.bool)
    r = raw.to(torch.float64)
    for i in torch.nonzero(sample_std == 0).reshape(-1).tolist():
        others = r[(stats.inverse == stats.inverse[i]) & (torch.arange(r.numel()) != i)]
        if others.numel() and bool((others == others[0]).all()):
            mine = float(r[i])
            if float(others[0]) == 0.0:
                out[i] = math.isfinite(mine)
                continue
            out[i] = exact_multiples(float(others[0]), others.numel()) and exact_multiples(mine, 1) \
                and float(torch.tensor(mine - float(others[0]), dtype=torch.float32)) == mine - float(others[0])
    return out


def batch_std_bound(truth: torch.Tensor, n: int) -> torch.Tensor:
    """float64 ``[n]``: a batch std's (TRL ``scale_rewards="batch"``) relative rounding carried into each
    normalized value ``T``, as :func:`reward_bound` bounds a group std's, over the batch's ``n`` samples:
    ``C_REWARD·u·√n·|T|``."""
    return C_REWARD * U32 * math.sqrt(max(n, 1)) * truth.to(torch.float64).abs()


def near_zero_std(stats: GroupStats) -> torch.Tensor:
    """bool per group: a std at the rounding level of the group's mean (a float32 producer's normalized
    values there are rounding noise)."""
    return stats.std <= C_REWARD * U32 * stats.size.sqrt() * stats.max_abs


# ---------------------------------------------------------------------------------------- per token


def kl_condition(log_ratio: torch.Tensor, kl_type: str, exp_neg: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``Σ|terms|`` of the KL estimate at ``r = log_ratio`` (float64); ``exp_neg``: ``exp(−r)`` when the caller
    has it already (``kernels.kl.kl_of_log_ratio``)."""
    if kl_type in ("k1", "abs"):
        return log_ratio.abs()
    if kl_type == "k2":
        return log_ratio * log_ratio
    return (torch.exp(-log_ratio) if exp_neg is None else exp_neg) + 1 + log_ratio.abs()


def kl_slope(log_ratio: torch.Tensor, kl_type: str, reach: torch.Tensor,
             exp_neg: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The largest ``|dKL/dr|`` over ``[r − reach, r + reach]`` (float64; ``r = log_ratio``): 1 (k1),
    ``|r| + reach`` (k2), ``|1 − exp(−r ∓ reach)|`` at the farther end (k3, whose slope grows away from 0 on
    either side; low_var_kl's clamp is 1-Lipschitz) — how far an error of up to ``reach`` in ``r`` moves the
    estimate (at ``r = 0`` the slope is 0, the move is not)."""
    if kl_type in ("k1", "abs"):
        return torch.ones_like(log_ratio)
    if kl_type == "k2":
        return log_ratio.abs() + reach
    e = torch.exp(-log_ratio) if exp_neg is None else exp_neg
    return torch.maximum((1.0 - e * reach.exp()).abs_(), (1.0 - e * (-reach).exp()).abs_())


def kl_bound(log_ratio: torch.Tensor, truth: torch.Tensor, kl_type: str, u_token: float, u_store: float,
             exp_neg: Optional[torch.Tensor] = None, input_error: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``8·u_t·cond + u_s·|T|``, plus ``2·e_r·max|dKL/dr|`` over ``r ± e_r`` where the log-probs are stored coarser
    than the compute format (``input_error``: ``e_r``, :func:`storage_error` of the two log-probs)."""
    bound = C_TOKEN * u_token * kl_condition(log_ratio, kl_type, exp_neg) + u_store * stored_magnitude(
        truth, FLOAT8_NORMAL_MIN.get(u_store))
    if input_error is not None:
        bound += kl_storage_error(log_ratio, kl_type, input_error, exp_neg)
    return bound


def kl_storage_error(log_ratio: torch.Tensor, kl_type: str, input_error: torch.Tensor,
                     exp_neg: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64 per token: ``2·e_r·max|dKL/dr|`` over ``r ± e_r`` — how far the KL recomputed from log-probs
    stored coarser than the compute can be from the producer's (``input_error``: ``e_r``, :func:`storage_error`
    of the two log-probs). advantage.kl's bound, and what the KL in the reward carries under ``--chain``."""
    return kl_slope(log_ratio, kl_type, input_error, exp_neg).mul_(input_error).mul_(C_STORE)


def storage_unit(compute: str, *tensors: Optional[torch.Tensor]) -> float:
    """``u_s``: the unit roundoff of the coarsest of ``tensors`` (payloads) stored coarser than the declared
    ``compute`` format, 0 when none is. Such a payload holds one rounding of the values the producer computed
    from (a capture that keeps a bf16 copy of float32 log-probs): its every recomputation from them is that far
    from the producer's own (:func:`storage_error`). A payload as fine as the compute format holds the values
    themselves (a bf16 forward's log-probs, upcast to compute a float32 loss)."""
    u_t = UNIT_ROUNDOFF.get(compute, U32)
    stored = [unit_roundoff(t) for t in tensors if isinstance(t, torch.Tensor)]
    return max((u for u in stored if u > u_t), default=0.0)


def coarse_payloads(compute: str, named: Mapping[str, "Optional[torch.Tensor | str]"]) -> str:
    """``"log_probs, old_log_probs (bfloat16, u = 2^-8)"``: those of ``named`` (tensors, or the manifest's dtype
    names, ``"torch.bfloat16"``) stored coarser than ``compute`` (``""``: none) — what a ``coarse_payload`` hazard
    names, and ``--exact``'s warning."""
    u_t = UNIT_ROUNDOFF.get(compute, U32)
    by_dtype: dict[str, list[str]] = {}
    for name, t in named.items():
        dtype = str(stored_dtype(t)) if isinstance(t, torch.Tensor) else t if isinstance(t, str) else None
        if dtype is not None and unit_roundoff(dtype := dtype.removeprefix("torch.")) > u_t:
            by_dtype.setdefault(dtype, []).append(name)
    return "; ".join(f"{', '.join(names)} ({dtype}, u = {_power_of_two(unit_roundoff(dtype))})"
                     for dtype, names in by_dtype.items())


def _power_of_two(u: float) -> str:
    """``2^-8``: a unit roundoff as the power of two it is."""
    return f"2^{int(math.log2(u))}"


def storage_error(u_s: float, *values: torch.Tensor) -> torch.Tensor:
    """float64 per token: ``u_s·Σ 2^⌊log2|x|⌋`` — how far a difference (or sum) of the stored ``values`` can be
    from the same of the values they round. A stored value ``x`` is the nearest of its format to what was computed,
    so that lies within half the spacing around ``x``: ``u_s·2^⌊log2|x|⌋`` (the spacing below a power of two is
    half of it above, the larger side bounds both), at most ``u_s·|x|`` and half of it just below a power of two.
    A float8 ``u_s`` takes ``max(|x|, normal_min)`` (:data:`FLOAT8_NORMAL_MIN`): a subnormal or zero value is within
    ``u_s·normal_min`` of what it rounds."""
    floor = FLOAT8_NORMAL_MIN.get(u_s)
    out = stored_binade(values[0], floor)
    for v in values[1:]:
        out += stored_binade(v, floor)
    return out.mul_(u_s)


def stored_binade(values: torch.Tensor, floor: Optional[float]) -> torch.Tensor:
    """float64 ``2^⌊log2|x|⌋`` of each stored value (of ``max(|x|, floor)`` where one is given), 0 for 0 and
    ``|x|`` where it is not finite: the power of two whose ``u_s`` multiple is the value's half spacing."""
    mag = stored_magnitude(values, floor)
    mantissa, exponent = torch.frexp(mag)  # mag = mantissa · 2^exponent, mantissa in [0.5, 1)
    binade = torch.ldexp(torch.ones_like(mag), exponent - 1)
    return torch.where(torch.isfinite(mag) & (mag > 0), binade, mag)


def stored_magnitude(values: torch.Tensor, floor: Optional[float]) -> torch.Tensor:
    """float64 ``|x|``, at least ``floor`` where one is given."""
    out = values.to(torch.float64).abs()
    return out.clamp_min_(floor) if floor else out


def advantage_bound(truth: torch.Tensor, u_store: float) -> torch.Tensor:
    return C_ADVANTAGE * max(u_store, U32) * stored_magnitude(truth, FLOAT8_NORMAL_MIN.get(u_store))


def singleton_bound(truth: torch.Tensor, rule: Optional[str]) -> Optional[torch.Tensor]:
    """The bound of a one-sample group's value under its ``singleton_group`` rule: ``zero`` is exact (0),
    ``raw`` one float32 rounding of ``r/(1 + eps)`` (``2·u·|T|``), ``nan`` is not compared (0); ``None``
    without a rule (the arithmetic's own bound)."""
    if rule is None:
        return None
    if rule == "raw":
        return C_ADVANTAGE * U32 * truth.to(torch.float64).abs()
    return torch.zeros_like(truth, dtype=torch.float64)


def recursion_bound(truth: torch.Tensor, truth32: torch.Tensor, condition: torch.Tensor, u_token: float) -> torch.Tensor:
    """float64 per token: the bound of a backward recursion a producer evaluates token by token (discounted
    returns, GAE): ``8·u·cond + 3·|T32 − T|``. ``cond`` is the same recursion over the magnitudes of its terms
    (each rounded by ``u``); ``T32`` the recursion evaluated in float32, whose error on a long, nearly constant
    sequence grows like ``L·u`` (the sequential case of the loss bound: three times one such evaluation)."""
    seq = (truth32.to(torch.float64) - truth.to(torch.float64)).abs()
    seq = torch.where(torch.isfinite(seq), seq, torch.zeros_like(seq))
    return C_TOKEN * u_token * condition + C_SEQUENTIAL * seq


def whiten_bound(values: torch.Tensor, bound: torch.Tensor, mask: torch.Tensor, whitened: torch.Tensor,
                 mean: float, divisor: float, recorded: bool, u_reduce: float = U32,
                 divides: bool = True) -> torch.Tensor:
    """float64 per token: the bound of whitened advantages ``A' = (A − μ)/σ`` over ``N`` loss tokens, given the
    bound ``ρ`` of the advantages ``A`` before it (a producer's own ``A`` is that far from ``T``):
    ``(ρ_t + Δμ)/σ + |A'_t|·(Δσ/σ + 2u)``, with ``Δμ = 2·u_a·√N·mean|A| + mean ρ`` and
    ``Δσ/σ = u_a·√N + Σ|A − μ|·ρ/((N − 1)·σ²)`` (a sum of ``N`` terms rounds by about ``√N·u`` of its
    magnitude, as the group sums above; the variance's terms are positive). With recorded statistics
    (``advantage_whiten_stats``) ``μ`` and ``σ`` are the producer's own: ``Δμ = Δσ = 0``. A centring without
    the division (``divides=False``, ``σ = 1``): ``Δσ = 0``. The ``N − 1`` covers a biased variance (over ``N``)
    too, and a variance floored at ε (``clamp``) moves its divisor less than the variance moves."""
    m = mask.to(torch.float64)
    a = values.to(torch.float64)
    rho = bound.to(torch.float64)
    n = float(m.sum())
    if recorded or n < 2:
        d_mean, d_rel = 0.0, 0.0
    else:
        d_mean = C_REDUCE * u_reduce * math.sqrt(n) * float((a.abs() * m).sum()) / n + float((rho * m).sum()) / n
        d_rel = (u_reduce * math.sqrt(n) + float(((a - mean).abs() * rho * m).sum()) / ((n - 1) * divisor * divisor)
                 if divides else 0.0)
    w = whitened.to(torch.float64).abs()
    return (rho + d_mean) / divisor + w * (d_rel + 2 * U32)


# -------------------------------------------------------------------------------------- loss scalars

# Per-sample sums the loss bound needs beside the float64 fields' own (kernels.POLICY_SUMS): the terms'
# magnitudes (K_sum), |ppo_kl|·|pg| (with |pg|, K_tok), tokens near a clip bound, Σ ratio (--chain); and the
# float32 sequential sums of the surrogate, ppo_kl and entropy (seq32; the clip and mask counts are whole
# numbers, exact in either precision).
ABS_SUMS = ("abs_pg", "abs_kl", "abs_ent", "kl_pg", "near_clip", "ratio")
SEQ32_SUMS = ("pg32", "kl32", "ent32", "kl_loss32")


def loss_clip_hits(ratio: torch.Tensor, advantages: torch.Tensor, u_token: float, eps_clip: float,
                   eps_clip_high: float, stored: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bool per token: the ratio within ``8·u_t`` (relative; plus ``2·e`` for log-probs stored coarser than the
    compute format, ``stored`` = ``e`` the log-ratio's storage error) of a clip bound and ``A ≠ 0`` — a token a
    legitimate rounding may clip either way."""
    near = ratio * (C_NEAR_CLIP * u_token) if stored is None else ratio * (stored * C_STORE + C_NEAR_CLIP * u_token)
    # within it of either bound ⇔ within it of the nearer one (a min picks one of the two, exactly; NaN stays NaN)
    to_low = (ratio - (1 - eps_clip)).abs_()
    nearer = torch.minimum(to_low, (ratio - (1 + eps_clip_high)).abs_(), out=to_low)
    close = nearer <= near
    # rare: a chunk with no ratio near a bound has nothing to restrict to A ≠ 0
    # (numpy's any: torch's costs a reduction's fixed cost per chunk, ≈ 30× numpy's on 32K booleans)
    return close.logical_and_(advantages != 0) if close.numpy().any() else close


def sequential_sum32(values: torch.Tensor) -> float:
    """``((0 + v0) + v1) + …`` in float32, left to right (torch's own float32 sums accumulate in double or
    pairwise). numpy's ``add.accumulate`` is that loop in C: each partial sum is the float32 addition of the
    previous one and the next value, correctly rounded (no pairwise regrouping, unlike ``sum``); ``+ 0.0``
    gives an all-zero sum the sign the loop from ``0.0`` gives it."""
    flat = values.detach().reshape(-1).to(torch.float32).numpy()
    if flat.size == 0:
        return 0.0
    return float(np.add.accumulate(flat, dtype=np.float32)[-1]) + 0.0


def near_value(x: torch.Tensor, edge: float, u_token: float, cond, stored=None) -> torch.Tensor:
    """bool per token: ``x`` within ``8·u_t·(1 + cond)`` (relative; plus ``2·e`` for an exponent whose inputs are
    stored coarser than the compute format, ``stored`` = ``e`` its storage error) of ``edge`` — a comparison with
    ``edge`` (a dual-clip bound c, an IcePop bound) that a legitimate producer's rounding of ``x`` may decide
    either way (``cond``: the condition of the exponent ``x`` was computed from)."""
    slack = (C_NEAR_CLIP * u_token) * (1.0 + cond)
    if stored is not None:
        slack = slack + stored * C_STORE
    return (x - edge).abs() <= x.abs() * slack


def sample_exponent_condition(log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                              rollout_log_probs: Optional[torch.Tensor], mask: torch.Tensor, lengths: torch.Tensor,
                              knobs) -> Optional[torch.Tensor]:
    """float64 ``[samples]``: the condition of a per-sample exponent (module doc) — ``√n_i`` times the sample's
    mean ``|logp − old|`` (GSPO's ratio) plus its ``Σ_t |old − rollout|·m_t`` (÷ n_i for ``geometric``; a
    sequence or geometric importance weight); ``None`` when no knob exponentiates a per-sample sum."""
    from ..kernels import segment_ids

    if not knobs.needs_sample_pass:
        return None
    n_samples = int(lengths.numel())
    seg = segment_ids(lengths)
    m = mask.to(torch.float64)

    def per_sample(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_samples, dtype=torch.float64).index_add_(0, seg, x)

    count = per_sample(m)
    cond = torch.zeros(n_samples, dtype=torch.float64)
    if knobs.sequence_ratio:
        cond += per_sample((log_probs.to(torch.float64) - old_log_probs.to(torch.float64)).abs_().mul_(m)) \
            / count.clamp_min(1.0)
    if knobs.is_level in ("sequence", "geometric"):
        total = per_sample((old_log_probs.to(torch.float64) - rollout_log_probs.to(torch.float64)).abs_().mul_(m))
        cond += total / count.clamp_min(1.0) if knobs.is_level == "geometric" else total
    return cond * count.sqrt()


@dataclass(frozen=True)
class StorageUnits:
    """``u_s`` (:func:`storage_unit`) of the inputs of each loss term: the log-ratio's (log-probs, old log-probs),
    the importance weight's (old, rollout), the KL term's (log-probs, reference), the entropy's and the
    advantages'; all 0 when every payload is as fine as the declared compute. The loss stage's scalars and its
    per-sample and per-token terms take their storage errors from here alike."""

    ratio: float = 0.0
    weight: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    advantage: float = 0.0
    teacher: float = 0.0  # on-policy distillation's loss term: (log-probs, teacher)

    @classmethod
    def of(cls, compute: str, *, log_probs, old_log_probs, rollout_log_probs=None, ref_log_probs=None, entropy=None,
           advantages=None, teacher_log_probs=None) -> "StorageUnits":
        return cls(ratio=storage_unit(compute, log_probs, old_log_probs),
                   weight=storage_unit(compute, old_log_probs, rollout_log_probs),
                   kl=storage_unit(compute, log_probs, ref_log_probs),
                   entropy=storage_unit(compute, entropy), advantage=storage_unit(compute, advantages),
                   teacher=storage_unit(compute, log_probs, teacher_log_probs) if teacher_log_probs is not None
                   else 0.0)

    @property
    def any(self) -> bool:
        return any((self.ratio, self.weight, self.kl, self.entropy, self.advantage, self.teacher))

    def sample_errors(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                      rollout_log_probs: Optional[torch.Tensor], mask: torch.Tensor, lengths: torch.Tensor,
                      knobs) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 ``([samples], [samples])``: the storage error of a per-sample exponent — GSPO's mean
        log-ratio, ``u·Σ_t (|logp| + |old|)·m / n_i``, and a sequence (geometric: ÷ n_i) importance weight's log,
        ``u·Σ_t (|old| + |rollout|)·m``; zeros where no knob has the exponent."""
        from ..kernels import segment_ids

        n_samples = int(lengths.numel())
        ratio = torch.zeros(n_samples, dtype=torch.float64)
        weight = torch.zeros(n_samples, dtype=torch.float64)
        if not knobs.needs_sample_pass:
            return ratio, weight
        seg = segment_ids(lengths)
        m = mask.to(torch.float64)
        count = torch.zeros(n_samples, dtype=torch.float64).index_add_(0, seg, m).clamp_min_(1.0)
        if knobs.sequence_ratio and self.ratio:
            ratio.index_add_(0, seg, storage_error(self.ratio, log_probs, old_log_probs).mul_(m)).div_(count)
        if knobs.is_level in ("sequence", "geometric") and self.weight:
            weight.index_add_(0, seg, storage_error(self.weight, old_log_probs, rollout_log_probs).mul_(m))
            if knobs.is_level == "geometric":
                weight.div_(count)
        return ratio, weight

    def token_errors(self, knobs, seg: torch.Tensor, sample: tuple[torch.Tensor, torch.Tensor], log_probs, old_log_probs,
                     rollout_log_probs=None, ref_log_probs=None, teacher_log_probs=None) -> dict[str, torch.Tensor]:
        """float64 per token of one run of tokens (``seg``: their samples; ``sample``: :meth:`sample_errors`):
        ``log_ratio`` (of ``old − logp``, ppo_kl's), ``ratio`` (of the exponent the ratio takes: the token's, or
        GSPO's sample one), ``weight`` (of the importance weight's log), and ``kl`` (of the KL term's
        ``logp − ref``, with a KL term)."""
        out = {"log_ratio": storage_error(self.ratio, log_probs, old_log_probs)}
        out["ratio"] = sample[0][seg] if knobs.sequence_ratio else out["log_ratio"]
        out["weight"] = sample[1][seg]
        if knobs.is_level == "token" and self.weight:
            out["weight"] = out["weight"] + storage_error(self.weight, old_log_probs, rollout_log_probs)
        if ref_log_probs is not None:
            out["kl"] = storage_error(self.kl, log_probs, ref_log_probs)
        if getattr(knobs, "kl_loss_rollout_weighted", False) and rollout_log_probs is not None:
            # the KL weight's exponent logp − rollout (kl_loss_rollout_weighted): the coarser of its two units
            out["kl_weight"] = storage_error(max(self.ratio, self.weight), log_probs, rollout_log_probs)
        if teacher_log_probs is not None:  # the distillation term's ``logp − teacher``
            out["opd"] = storage_error(self.teacher, log_probs, teacher_log_probs)
        return out


def loss_storage_bounds(sums: Mapping[str, torch.Tensor], names, *, entropy_coef: float, knobs) -> dict[str, float]:
    """What payloads stored coarser than the compute format (:func:`storage_unit`) add to each loss.policy
    field: ``2·Σ_i w_i·Σ_t |∂x_t|·e_t·m_t`` with the per-sample sums :func:`loss_scalar_bounds` is given
    (``store_pg``: ``|pg|·(e_ratio + e_weight + u_adv)``, ``store_kl``: ``e_Δ``, ``store_ent``: ``u_ent·|entropy|``,
    ``store_kl_loss``: ``e_r·max|dKL/dr|``), weighted as the field aggregates them; ``{}`` when no payload is."""
    if "store_pg" not in sums:
        return {}
    from ..kernels.loss import agg_weights, field_aggregation

    def weighted(row: str, field: str) -> float:
        mode, scale = field_aggregation(field, knobs)
        return C_STORE * abs(float(scale)) * float((agg_weights(mode, sums["mask"], knobs) * sums[row]).sum())

    out = {"pg_loss": weighted("store_pg", "pg_loss"), "entropy_loss": weighted("store_ent", "entropy_loss"),
           "ppo_kl": weighted("store_kl", "ppo_kl")}
    out["loss"] = out["pg_loss"] + abs(entropy_coef) * out["entropy_loss"]
    if "store_kl_loss" in sums:
        out["kl_loss"] = weighted("store_kl_loss", "kl_loss")
        out["loss"] += abs(float(knobs.kl_loss_coef)) * out["kl_loss"]
    if "store_opd_loss" in sums:  # the distillation term: e_r·max|dk/dr| of r = logp − teacher
        out["opd_loss"] = weighted("store_opd_loss", "opd_loss")
        out["loss"] += abs(float(knobs.opd_coef)) * out["opd_loss"]
    return {name: out[name] for name in names if name in out}


def loss_aggregate_bound(weighted, value: float, precision: Precision) -> float:
    """The rounding bound of a scalar aggregated from recorded per-sample terms (``weighted``: the terms'
    ``w_i·S_i`` columns, float64): the producer summed ``n`` of them (``2·u_a·n·Σ|w_i·S_i|``, a sequential sum's
    worst case) and rounded the result (``2·u32·|value|``)."""
    cond = sum(float(w.abs().sum()) for w in weighted)
    count = max((int(w.numel()) for w in weighted), default=0)
    return C_FINAL * U32 * abs(value) + C_REDUCE * precision.reduce * count * cond


def aggregated_condition(signed: torch.Tensor, magnitude: Optional[torch.Tensor], tok, seq32: Optional[torch.Tensor],
                         inner: torch.Tensor, outer: float, scale: float = 1.0):
    """``(K_sum, K_outer, K_tok, seq32)`` of a field ``scale·(Σ_i S_i / inner_i) / outer`` (module doc) from its
    per-sample sums: ``signed`` (S_i, float64), ``magnitude`` (Σ_t|x_t·m_t|; None: |S_i|, a 0/1 count's),
    ``tok`` (Σ_t c_t·m_t, the per-token evaluation's condition; None: exact terms) and ``seq32`` (the float32
    sequential per-sample sums; None: ``signed`` in float32) — the sum over samples evaluated sequentially in
    float32, divided and scaled as a float32 producer does."""
    w = 1.0 / (inner * outer)
    s = abs(float(scale))
    mean = signed * w
    k_sum = (magnitude * w).sum() * s if magnitude is not None else mean.abs().sum() * s
    k_tok = (tok * w).sum() * s if isinstance(tok, torch.Tensor) else torch.zeros((), dtype=torch.float64)
    source = seq32 if seq32 is not None else signed.to(torch.float32)
    outer32 = float(torch.tensor(outer, dtype=torch.float32))
    sq = sequential_sum32(source / inner.to(torch.float32)) / outer32 * float(torch.tensor(scale, dtype=torch.float32))
    return k_sum, mean.abs().sum() * s, k_tok, sq


def scalar_bound(truth: float, condition, precision: Precision) -> float:
    """``2·u32·|T| + max(2·u_a·(K_sum + K_outer) + 2·u_t·K_tok, 3·|seq32 − T|)`` (module doc; the sequential
    term only for float32 accumulation)."""
    ks, ko, kt, sq = condition
    cond = C_REDUCE * precision.reduce * float(ks + ko) + C_REDUCE * precision.token * float(kt)
    sequential = C_SEQUENTIAL * abs(sq - truth) if precision.sequential else 0.0
    return C_FINAL * U32 * abs(truth) + max(cond, sequential if math.isfinite(sequential) else 0.0)


def loss_scalar_bounds(sums: Mapping[str, torch.Tensor], fields: Mapping[str, torch.Tensor], names, *,
                       entropy_coef: float, precision: Precision,
                       advantage_bound_per_sample: Optional[torch.Tensor] = None,
                       advantage_per_sample: Optional[torch.Tensor] = None, knobs=None) -> dict[str, float]:
    """The rounding bound of each loss.policy field (module doc) from the per-sample sums of one pass:
    the float64 ones (``pg, clip, kl, ent, mask`` and, as the knobs ask, ``clip_lower``, ``kl_loss``),
    :data:`ABS_SUMS`, and the float32 sequential ones (:data:`SEQ32_SUMS`). ``advantage_bound_per_sample``:
    ρ_i under ``--chain``. ``knobs`` (``kernels.loss.LossKnobs``, default V1's): a field is
    ``scale·(Σ_i S_i / inner_i) / outer`` (``kernels.loss.agg_divisors``), so every sum over samples is
    weighted by ``w_i = 1/(inner_i·outer)`` and the loss terms by ``|loss_scale|``; the KL term's per-token
    condition is the estimator's (``kl_condition``); ``pg_clipfrac_lower`` admits the tokens whose ratio lies
    within rounding of ``c``; an IcePop mask the tokens it may keep or drop."""
    from ..kernels.loss import LossKnobs, agg_divisors

    knobs = knobs or LossKnobs(entropy_coef=entropy_coef)
    n = sums["mask"]
    scale = abs(float(knobs.loss_scale))

    loss_mode, metric_mode = agg_divisors(knobs.loss_agg_mode, n, knobs), agg_divisors(knobs.metric_agg_mode, n, knobs)

    def term(signed: str, magnitude: Optional[str], tok, seq: Optional[str], metric: bool,
             mode: Optional[str] = None):
        inner, outer = metric_mode if metric else agg_divisors(mode, n, knobs) if mode else loss_mode
        return aggregated_condition(sums[signed], sums[magnitude] if magnitude else None, tok,
                                    sums[seq] if seq else None, inner, outer, 1.0 if metric else knobs.loss_scale)

    terms = {
        "pg_loss": term("pg", "abs_pg", PG_COND * sums["abs_pg"] + PG_KL_COND * sums["kl_pg"], "pg32", False),
        "entropy_loss": term("ent", "abs_ent", None, "ent32", False, knobs.entropy_mode),
        "pg_clipfrac": term("clip", None, None, None, True),
        "ppo_kl": term("kl", "abs_kl", sums["abs_kl"], "kl32", True),
    }
    if "clip_lower" in sums:
        terms["pg_clipfrac_lower"] = term("clip_lower", None, None, None, True)
    if "kl_loss" in sums:
        terms["kl_loss"] = term("kl_loss", "abs_kl_loss", sums["kl_loss_tok"], "kl_loss32", False, knobs.kl_mode)
    if "opd_loss" in sums:  # on-policy distillation's supervised term (its estimator's condition, as the KL term's)
        terms["opd_loss"] = term("opd_loss", "abs_opd_loss", sums["opd_loss_tok"], None, False)
    c = abs(entropy_coef)
    c32 = float(torch.tensor(entropy_coef, dtype=torch.float32))
    pg, ent = terms["pg_loss"], terms["entropy_loss"]
    loss = [pg[k] + c * ent[k] for k in range(3)] + [pg[3] - c32 * ent[3]]
    if "kl_loss" in terms:
        kc = abs(float(knobs.kl_loss_coef))
        kl = terms["kl_loss"]
        loss = [loss[k] + kc * kl[k] for k in range(3)] + [loss[3] + float(torch.tensor(
            knobs.kl_loss_coef, dtype=torch.float32)) * kl[3]]
    if "opd_loss" in terms:
        oc = abs(float(knobs.opd_coef))
        od = terms["opd_loss"]
        loss = [loss[k] + oc * od[k] for k in range(3)] + [loss[3] + float(torch.tensor(
            knobs.opd_coef, dtype=torch.float32)) * od[3]]
    terms["loss"] = tuple(loss)
    inner_l, outer_l = loss_mode
    inner_m, outer_m = metric_mode
    extra_pg = extra_clip = 0.0
    if advantage_bound_per_sample is not None and sums["ratio"].numel():
        rho = advantage_bound_per_sample.to(torch.float64)
        extra_pg = float(((sums["ratio"] / (inner_l * outer_l)) * rho).sum()) * scale
        if knobs.dual_clip:
            extra_pg = max(extra_pg, extra_pg * float(knobs.eps_clip_c))
        if advantage_per_sample is not None:
            a = advantage_per_sample.to(torch.float64).abs()
            extra_clip = float(((rho > 0) & (a <= rho) & (n > 0)).sum())
    if "is_flip" in sums:
        extra_pg += float((sums["is_flip"] / (inner_l * outer_l)).sum()) * scale
    if "mask_flip" in sums:  # OPSM or the entropy mask may keep or drop these tokens' terms
        extra_pg += float((sums["mask_flip"] / (inner_l * outer_l)).sum()) * scale
    if "edge_flip" in sums:  # a policy-loss family's mask decided within rounding of its edge: its term is open
        extra_pg += float((sums["edge_flip"] / (inner_l * outer_l)).sum()) * scale
    out = {}
    stored = loss_storage_bounds(sums, names, entropy_coef=entropy_coef, knobs=knobs)
    for name in names:
        bound = scalar_bound(float(fields[name]), terms[name], precision) + stored.get(name, 0.0)
        if name in ("loss", "pg_loss"):
            bound += extra_pg
        if name == "pg_clipfrac":
            bound += float((sums["near_clip"] / (inner_m * outer_m)).sum()) + extra_clip
        if name == "pg_clipfrac_lower":
            # dual-clip's c; a policy-loss family's edges are all counted in near_clip
            bound += float((sums.get("near_lower", sums["near_clip"]) / (inner_m * outer_m)).sum()) + extra_clip
        out[name] = bound
    return out
