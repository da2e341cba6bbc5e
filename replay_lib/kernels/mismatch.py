"""Train–inference mismatch (stage ``logprob.mismatch``, SPEC §4.4): the engine's log-probs of the sampled tokens
(``rollout_log_probs``) against the trainer's (``old_log_probs``, and the first minibatch's ``log_probs``).

* :func:`ulp_distance` — how many representable numbers lie between two log-probs, on the lattice of the
  stored dtype (float32 unless one side is float64; bf16/fp16 values are exact float32 values and are
  counted on the float32 lattice).
* :func:`difference_summary` — the bitwise comparison on loss tokens: count, max |Δ|, max ulp, first (sample,
  token).
* :func:`mismatch_metrics` — the mismatch metrics the frameworks log, recomputed in float64 from the same
  payloads. Each formula follows the framework's own code (the file is cited at each metric); names are the
  frameworks' metric keys, so ``expected.json $.logprob.mismatch`` holds them as the trainer logged them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

# verl rollout_corr_helper.py SAFETY_BOUND (the clamp of a log-ratio before exp in its chi² metrics)
SAFETY_BOUND = 20.0
# Tokens per chunk of the stage's one pass: each per-token array of a chunk (1 MiB in float64) stays in cache
# while a few dozen operations read it, and a million tokens take eight chunks' worth of dispatches.
MISMATCH_CHUNK = 1 << 17
# verl_F.masked_mean's denominator term (verl/utils/torch_functional.py masked_mean: Σ x·m / (Σ m + 1e-8))
VERL_MASKED_MEAN_EPS = 1e-8

# The metric keys this engine recomputes, by framework (SPEC §4.4 lists the formula of each).
VERL_DEBUG = ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean",
              "training/rollout_probs_diff_std")
VERL_ROLLOUT_CORR = tuple(f"rollout_corr/{k}" for k in (
    "kl", "k3_kl", "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
    "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq"))
NEMO_RL = ("token_mult_prob_error", "gen_kl_error", "policy_kl_error")
TRL = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
       "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
       "sampling/importance_sampling_ratio/max")
METRICS = VERL_DEBUG + VERL_ROLLOUT_CORR + NEMO_RL + TRL


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """int64 keys in the order of the floats (``+0`` and ``−0`` the same key): adjacent floats differ by 1."""
    if x.dtype == torch.float64:
        bits = x.view(torch.int64)
        mag = bits & 0x7FFFFFFFFFFFFFFF
    else:
        bits = x.to(torch.float32).view(torch.int32).to(torch.int64)
        mag = bits & 0x7FFFFFFF
    return torch.where(bits < 0, -mag, mag)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 ``|key(a) − key(b)|``: the number of float steps from ``a`` to ``b`` on the float32 lattice
    (the float64 one when either is float64); ``inf`` where either is NaN or exactly one is infinite."""
    wide = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    a, b = a.to(wide), b.to(wide)
    d = (_ordered(a) - _ordered(b)).abs().to(torch.float64)
    odd = torch.isnan(a) | torch.isnan(b) | (torch.isinf(a) != torch.isinf(b)) | (torch.isinf(a) & (a != b))
    return d.masked_fill_(odd, math.inf)


@dataclass
class DifferenceSummary:
    """``a`` vs ``b`` on the loss tokens, bit for bit."""

    compared: int = 0
    count: int = 0
    max_abs: float = 0.0
    max_ulp: float = 0.0
    first: Optional[int] = None  # the first differing token's index on the (selected) token axis, None when none

    def as_dict(self, sample_of) -> dict:
        out = {"compared": self.compared, "count": self.count, "max_abs_diff": self.max_abs, "max_ulp": self.max_ulp}
        if self.first is not None:
            sample, token = sample_of(self.first)
            out.update(first_sample=sample, first_token=token)
        return out

    def add(self, a: torch.Tensor, b: torch.Tensor, on: torch.Tensor, start: int,
            absd: Optional[torch.Tensor] = None) -> None:
        """Fold in the tokens ``[start, start + len)`` of a chunk (the chunks in token order). ``absd``: float64
        ``|a − b|`` on the loss tokens and 0 elsewhere, when the caller has it (:meth:`MismatchScan.add`)."""
        compared = int(on.sum())
        self.compared += compared
        diff = differing(a, b, on)
        count = int(diff.sum())
        if not count:
            return
        self.count += count
        if count * 4 < diff.numel():  # few: gather them
            idx = diff.nonzero().reshape(-1)
            a, b = a[idx], b[idx]
            first = int(idx[0])
            absd = None
        else:  # most: mask the others (a gather would copy nearly everything)
            first = int(diff.to(torch.uint8).argmax()) if self.first is None else 0
            if compared < on.numel():  # equal pairs are 0 ulp apart; the off tokens' are not compared
                a = torch.where(diff, a, b)
        if absd is None:
            absd = (a.to(torch.float64) - b.to(torch.float64)).abs()
        top = float(absd.max())
        self.max_abs = top if math.isnan(top) or math.isnan(self.max_abs) else max(self.max_abs, top)
        if math.isfinite(top) and a.dtype == b.dtype == torch.float32:
            ulp = _ulp32_max(a, b)  # both finite: the int32 keys' distance (the common case, a third of the work)
        else:
            ulp = float(ulp_distance(a, b).max())
        self.max_ulp = max(self.max_ulp, ulp)
        if self.first is None:
            self.first = start + first


    def add_masked(self, a, b, diff: torch.Tensor, m: torch.Tensor, cnt: float, start: int, big: float) -> None:
        """:meth:`add` for a chunk whose float64 ``diff`` = ±(a − b)·m is finite everywhere (``m``: float64 1 on
        the loss tokens, 0 elsewhere; ``cnt``: Σ m; ``big``: max |diff|), without a comparison array (on the
        CPU a bool result costs several float passes). ``a`` and ``b`` are the chunk's values, or its
        :class:`MaskedBits` when both are float32: then the count, the max ulp and the first differing token come
        from the integer distance of their ordered keys (0 exactly when the floats are equal, ±0 included);
        otherwise from ``diff`` (two floats differ exactly when their float64 difference is not 0: a difference
        of two distinct floats never rounds to 0)."""
        self.compared += int(cnt)
        step = pair_step(a, b) if isinstance(a, MaskedBits) else diff
        count = int(torch.count_nonzero(step))
        if not count:
            return
        self.count += count
        self.max_abs = big if math.isnan(self.max_abs) else max(self.max_abs, big)
        if step is diff:  # bf16, fp16 or float64 payloads: the differing tokens' distances
            idx = diff.nonzero().reshape(-1)
            ulp = float(ulp_distance(a[idx], b[idx]).max())
        else:
            low, high = torch.aminmax(step)
            ulp = float(max(int(high), -int(low)))
        self.max_ulp = max(self.max_ulp, ulp)
        if self.first is None:
            self.first = start + _first_nonzero(step)


def _first_nonzero(x: torch.Tensor) -> int:
    """The index of ``x``'s first non-zero element (there is one): looked for in growing prefixes."""
    width = 1024
    while True:
        idx = x[:width].nonzero()
        if idx.numel():
            return int(idx[0])
        width *= 16


def _keys32(bits: torch.Tensor) -> torch.Tensor:
    """int32 keys in the order of the float32 values of ``bits`` (``+0`` and ``−0`` both 0): the magnitude's bits,
    negated for a negative float (no overflow: magnitudes are below 2^31)."""
    sign = bits >> 31  # 0 or −1
    return (bits & 0x7FFFFFFF).bitwise_xor_(sign).sub_(sign)


class MaskedBits:
    """A finite float32 chunk's bit patterns on the loss tokens (× the int32 0/1 mask: 0 elsewhere), made once
    for every pair it is compared in. ``kind``: ``"neg"`` when no value is above 0 (log-probs: ``raw`` is then
    the magnitudes' bits, the keys negated), ``"pos"`` when none is below +0 (``raw``: the bits, the keys
    themselves), else ``"mixed"`` (:meth:`keys`: the ordered keys, ±0 one key)."""

    def __init__(self, x: torch.Tensor, mi: torch.Tensor) -> None:
        self.bits = x.view(torch.int32) * mi
        low, high = (int(v) for v in torch.aminmax(self.bits)) if self.bits.numel() else (0, 0)
        self.kind = "neg" if high <= 0 else "pos" if low >= 0 else "mixed"
        self.raw = self.bits & 0x7FFFFFFF if self.kind == "neg" else self.bits
        self._keys: Optional[tuple[torch.Tensor, int, int]] = None

    def keys(self) -> tuple[torch.Tensor, int, int]:
        """The ordered keys and their range."""
        if self._keys is None:
            keys = self.raw if self.kind == "pos" else -self.raw if self.kind == "neg" else _keys32(self.bits)
            low, high = (int(v) for v in torch.aminmax(keys)) if keys.numel() else (0, 0)
            self._keys = (keys, low, high)
        return self._keys


def pair_step(a: MaskedBits, b: MaskedBits) -> torch.Tensor:
    """± the ulp distance per token (the difference of the ordered keys; 0 off the loss tokens): of the raw
    patterns when both chunks are of one sign (no overflow), else of the keys, in int64 when their ranges could
    overflow int32."""
    if a.kind == b.kind != "mixed":
        return a.raw - b.raw
    (ka, a_lo, a_hi), (kb, b_lo, b_hi) = a.keys(), b.keys()
    if max(a_hi - b_lo, b_hi - a_lo) < 2 ** 31:
        return ka - kb
    return ka.to(torch.int64) - kb.to(torch.int64)


def _ulp32_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """max :func:`ulp_distance` of finite float32 values: between two of one sign, the difference of their bit
    patterns as int32; between a positive and a negative one, the sum of their magnitudes' bit patterns (the steps
    down to ±0 on each side; +0 and −0 are one key, as in :func:`ulp_distance`)."""
    ba, bb = a.view(torch.int32), b.view(torch.int32)
    step = ba - bb  # one sign per pair: the distance is the bits' difference (no int32 overflow)
    top = 0
    cross = (ba ^ bb) < 0
    crossing = int(cross.sum())
    if crossing:  # opposite signs (rare: log-probs are ≤ 0): the two magnitudes' sum, in int64
        ca, cb = ba, bb
        if crossing * 4 < cross.numel():  # few: gather them
            idx = cross.nonzero().reshape(-1)
            ca, cb = ba[idx], bb[idx]
        apart = (ca & 0x7FFFFFFF).add_(cb & 0x7FFFFFFF)  # in int32 first: below 2^31 unless both are ≥ 2 in size
        if ca is ba:
            apart.masked_fill_(~cross, 0)
        low_a, high_a = torch.aminmax(apart)
        if int(low_a) < 0:  # it wrapped: again in int64
            apart = (ca & 0x7FFFFFFF).to(torch.int64) + (cb & 0x7FFFFFFF).to(torch.int64)
            high_a = (apart if ca is not ba else apart.masked_fill_(~cross, 0)).max()
        top = int(high_a)
        step.masked_fill_(cross, 0)
    low, high = torch.aminmax(step)
    return float(max(top, int(high), -int(low)))


def differing(a: torch.Tensor, b: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """bool per token: ``on`` and ``a``, ``b`` not the same float (NaN never equals anything; ``+0 == −0``)."""
    return on & (a != b)  # a float32 and a float64 side are compared in float64 (exact)


def difference_summary(a: torch.Tensor, b: torch.Tensor, on: torch.Tensor) -> DifferenceSummary:
    out = DifferenceSummary()
    out.add(a, b, on, 0)
    return out


def _kl(logprobs: torch.Tensor, reference: torch.Tensor, kind: str) -> torch.Tensor:
    """NeMo-RL ``calculate_kl(logprobs, logprobs_reference, kl_type)`` (nemo_rl/algorithms/utils.py): k1
    ``lp − ref``; k2 ``(ref − lp)²/2``; k3 ``exp(ref − lp) − (ref − lp) − 1``."""
    if kind == "k1":
        return logprobs - reference
    log_ratio = reference - logprobs
    if kind == "k2":
        return 0.5 * log_ratio * log_ratio
    return torch.expm1(log_ratio) - log_ratio


@dataclass
class Folded:
    """What :meth:`MismatchScan.add` leaves of a chunk for the bitwise comparisons: ``m`` float64 1 on the loss
    tokens and 0 elsewhere, ``old`` the float64 old log-probs there (0 elsewhere), ``diff`` = old − rollout on
    them when every value is finite (``None`` otherwise: compare with :meth:`DifferenceSummary.add`), ``absd``
    its magnitude, ``count`` Σ m and ``big`` max |diff| (NaN without ``diff``)."""

    m: torch.Tensor
    old: torch.Tensor
    diff: Optional[torch.Tensor]
    absd: torch.Tensor
    count: float = 0.0
    big: float = math.nan
    _mi: Optional[torch.Tensor] = None

    @property
    def mi(self) -> torch.Tensor:
        """``m`` as int32 (made once, for the bit patterns)."""
        if self._mi is None:
            self._mi = self.m.to(torch.int32)
        return self._mi


# the per-token rows of MismatchScan's one-pass path, in buffer order (summed together: clip last, when it is used)
_ROWS = ("d", "e", "inv", "absd", "pd", "tm", "clip")


class MismatchScan:
    """The metrics of :data:`METRICS` in float64, folded a chunk of tokens at a time (:meth:`add`, the chunks in
    token order; every per-token quantity of a chunk stays in cache), then :meth:`metrics`. ``n``: samples;
    ``kl_type``: NeMo-RL's ``reference_policy_kl_type``; ``is_*``: the bundle's importance-correction knobs (TRL's
    ratio statistics are those of its corrected weight). ``condition``: also accumulate
    :func:`metric_condition`'s magnitude (for the rounding bound of recorded metrics). ``binary``: every mask
    value is 0 or 1 (then it is its own 0/1 loss-token mask)."""

    def __init__(self, n: int, *, kl_type: str = "k3", is_level: Optional[str] = None, is_mode: str = "truncate",
                 is_low: Optional[float] = None, is_high: Optional[float] = None, condition: bool = False,
                 binary: bool = False) -> None:
        f64 = torch.float64
        self.n, self.kl_type, self.condition, self.binary = n, kl_type, condition, binary
        self.is_level, self.is_mode, self.is_low, self.is_high = is_level, is_mode, is_low, is_high
        self.seq = torch.zeros((4, n), dtype=f64)  # Σ_t m·old, Σ_t m·rollout, Σ_t m·(old − rollout), Σ_t m
        self.sums: dict[str, float] = dict(tokens=0.0, pd=0.0, d=0.0, k3=0.0, rho2=0.0, tm=0.0, gen=0.0, pol=0.0,
                                           absd=0.0, absd_n=0.0, ratio=0.0, cond=0.0)
        self.pd_parts: list[tuple[float, float, float]] = []  # (count, mean, M2) per chunk: Chan's combination
        self.max: dict[str, float] = dict(pd=-math.inf, absd=-math.inf, ratio=-math.inf)
        self.min: dict[str, float] = dict(ratio=math.inf)
        self._buf: Optional[torch.Tensor] = None

    def _clip(self, ratio: torch.Tensor) -> torch.Tensor:
        if self.is_mode == "mask":
            low = -math.inf if self.is_low is None else self.is_low
            high = math.inf if self.is_high is None else self.is_high
            return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
        if self.is_low is not None or self.is_high is not None:
            return ratio.clamp(min=self.is_low, max=self.is_high)
        return ratio

    def add(self, rollout: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, seg: torch.Tensor) -> "Folded":
        """Fold in one chunk; returns its :class:`Folded` (the float64 mask and old log-probs, and, when every
        value is finite, ``old − rollout`` on the loss tokens): views of this scan's buffers, valid until the next
        :meth:`add`."""
        f64 = torch.float64
        buf = self._buffer(mask.numel())
        m, lo, lr = buf[len(_ROWS)], buf[len(_ROWS) + 1], buf[len(_ROWS) + 2]
        # 1 on the loss tokens, 0 elsewhere, in float arithmetic (sign, clamp): a comparison's bool array costs
        # several float passes on the CPU
        m.copy_(mask)
        if not self.binary:
            torch.sign(m, out=m).clamp_(min=0.0)
        cnt = float(m.sum())
        # the values off the loss tokens never enter: × 0 (in float64, exact; a non-finite value there makes the
        # sums non-finite, and the general path replaces it by 0 as verl's masked_sum does). A conversion then an
        # in-place product: a mixed-dtype product takes torch's slower casting loop
        lo.copy_(old).mul_(m)
        lr.copy_(rollout).mul_(m)
        fast = self._add_finite(buf, lo, lr, m, cnt, seg)
        if fast is not None:
            return fast
        on = mask > 0
        lo = torch.where(on, old, 0.0).to(f64)
        lr = torch.where(on, rollout, 0.0).to(f64)
        absd = self._add_general(lo, lr, on.to(f64), on, float(on.sum()), seg)
        return Folded(on.to(f64), lo, None, absd, float(on.sum()))

    def _buffer(self, numel: int) -> torch.Tensor:
        """The float64 rows of one chunk (:data:`_ROWS`, then the mask, old and rollout), allocated once: a
        chunk's temporaries stay in cache and in place instead of fresh pages for every operation."""
        if self._buf is None or self._buf.shape[1] < numel:
            self._buf = torch.empty((len(_ROWS) + 3, numel), dtype=torch.float64)
        return self._buf[:, :numel]

    def _add_finite(self, buf: torch.Tensor, lo: torch.Tensor, lr: torch.Tensor, m: torch.Tensor, cnt: float,
                    seg: torch.Tensor) -> Optional["Folded"]:
        """:meth:`add` for a chunk whose ``d = old − rollout`` and ``exp(±d)`` are all finite (else ``None``, nothing
        folded in): every metric from a handful of float64 sums over the chunk, its per-token terms written into
        the rows of ``buf`` and summed in one reduction. Off the loss tokens d = 0 and exp(d) = 1 exactly, so a
        sum over the whole chunk less ``off`` (their count) is the sum over the loss tokens: Σ k3 = Σ e − Σ d −
        numel, Σ exp(|d|) = Σ max(e, 1/e) − off, and so on. The cancellations lose at most a few float64 ulps of
        the chunk's size, far below the float32 rounding bound of the metrics (:func:`metric_condition`)."""
        numel = lo.numel()
        d, e, inv, absd, pd, tm, clipped = (buf[k] for k in range(len(_ROWS)))
        if not numel:
            return Folded(m, lo, d, d, cnt, 0.0)
        torch.sub(lo, lr, out=d)
        torch.exp(d, out=e)
        torch.reciprocal(e, out=inv)
        torch.abs(d, out=absd)
        # verl debug metrics: |exp(old) − exp(rollout)| = |x − x·e|, x = exp(rollout) (0 off the loss tokens)
        torch.exp(lr, out=pd).addcmul_(pd, e, value=-1.0).abs_()
        torch.maximum(e, inv, out=tm)  # exp(|Δ|)
        token_ratio = self.is_level != "sequence" and cnt and self.is_mode != "mask"
        low, high = self.is_low, self.is_high
        clamps = token_ratio and (low is not None or high is not None)
        if clamps:
            torch.clamp(e, min=low, max=high, out=clipped)
        s_d, s_e, s_inv, s_absd, s_pd, s_tm, *rest = buf[:len(_ROWS) if clamps else len(_ROWS) - 1].sum(dim=1).tolist()
        if not all(math.isfinite(v) for v in (s_d, s_e, s_inv)):  # NaN, ±inf or an exp overflow
            return None
        off = numel - cnt
        big, pd_max = buf[3:5].amax(dim=1).tolist()  # max |d|, max pd
        S = self.sums
        S["tokens"] += cnt
        S["pd"] += s_pd
        if cnt:
            self.max["pd"] = _max(self.max["pd"], pd_max)
            mean = s_pd / cnt  # M2 = Σ pd² − cnt·mean² (pd is 0 off the loss tokens)
            self.pd_parts.append((cnt, mean, max(float(torch.dot(pd, pd)) - cnt * mean * mean, 0.0)))
        S["d"] += s_d
        k3 = s_e - s_d - numel
        S["k3"] += k3
        if big <= SAFETY_BOUND:
            S["rho2"] += float(torch.dot(e, e)) - off
        else:
            rho = torch.exp(d.clamp(-SAFETY_BOUND, SAFETY_BOUND))
            S["rho2"] += float(torch.dot(rho, rho)) - off
        S["tm"] += s_tm - off
        if self.kl_type == "k1":
            S["gen"] -= s_d
            S["pol"] += s_d
        elif self.kl_type == "k2":
            S["gen"] += 0.5 * float(torch.dot(d, d))
            S["pol"] += 0.5 * float(torch.dot(d, d))
        else:
            S["gen"] += k3
            S["pol"] += s_inv + s_d - numel
        # TRL: |old − sampling| on the loss tokens
        S["absd"] += s_absd
        S["absd_n"] += cnt
        if cnt:
            self.max["absd"] = _max(self.max["absd"], big)
        if self.is_level != "sequence" and cnt:
            if self.is_mode == "mask":
                on = m > 0
                ratio = self._clip(e)
                S["ratio"] += float(torch.dot(ratio, m))
                self.max["ratio"] = max(self.max["ratio"], float(torch.where(on, ratio, -math.inf).max()))
                self.min["ratio"] = min(self.min["ratio"], float(torch.where(on, ratio, math.inf).min()))
            else:  # the clamp is monotone: the extremes of the clamped ratio are the clamped extremes of e
                clamp = (lambda v: min(max(v, -math.inf if low is None else low), math.inf if high is None else high))
                S["ratio"] += (rest[0] if clamps else s_e) - off * clamp(1.0)
                e_min, e_max = (float(v) for v in torch.aminmax(e))
                if off and not (e_max > 1.0 and e_min < 1.0):  # a 1 of an off token may be an extreme: look closer
                    on = m > 0
                    e_max = float(torch.where(on, e, -math.inf).max())
                    e_min = float(torch.where(on, e, math.inf).min())
                self.max["ratio"] = max(self.max["ratio"], clamp(e_max))
                self.min["ratio"] = min(self.min["ratio"], clamp(e_min))
        if self.condition and cnt:
            self._fold_condition(lo, lr, absd, tm, m)
        # the chunk's samples (seg sorted); Σ d per sample is Σ old − Σ rollout (float64)
        _sample_sums(self.seq, lo, lr, m, seg)
        return Folded(m, lo, d, absd, cnt, big)

    def _fold_condition(self, lo, lr, absd, tm, m) -> None:
        size = torch.maximum(lo.abs(), lr.abs()).add_(1)
        c = (1 + absd.clamp(max=SAFETY_BOUND)) * tm.clamp(max=math.exp(SAFETY_BOUND)) * size
        self.sums["cond"] += float(torch.dot(torch.nan_to_num(c, nan=0.0, posinf=0.0), m))

    def _add_general(self, lo: torch.Tensor, lr: torch.Tensor, m: torch.Tensor, on: torch.Tensor, cnt: float,
                     seg: torch.Tensor) -> torch.Tensor:
        """:meth:`add` for any chunk (NaN, infinities): one array per term."""
        S = self.sums
        S["tokens"] += cnt
        # verl debug metrics: |exp(old) − exp(rollout)| (0 off the loss tokens, never the max: |Δp| ≥ 0)
        pd = (torch.exp(lo) - torch.exp(lr)).abs_()
        psum = float(pd.sum())
        S["pd"] += psum
        self.max["pd"] = _max(self.max["pd"], float(pd.max())) if cnt else self.max["pd"]
        if cnt:
            mean = psum / cnt
            self.pd_parts.append((cnt, mean, float(((pd - mean).square_() * m).sum())))
        d = lo - lr  # old − rollout: 0 off the loss tokens
        e = torch.exp(d)
        S["d"] += float(d.sum())
        k3 = e - d - 1
        S["k3"] += float(k3.sum())
        absd = d.abs()
        big = float(absd.max()) if d.numel() else 0.0
        rho = e if big <= SAFETY_BOUND else torch.exp(d.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        S["rho2"] += float(torch.dot(rho * rho, m)) if d.numel() else 0.0
        inv = e.reciprocal()
        tm = torch.where(d >= 0, e, inv)  # exp(|Δ|)
        S["tm"] += float(torch.dot(tm, m)) if d.numel() else 0.0
        if self.kl_type == "k1":
            gen, pol = -d, d
        elif self.kl_type == "k2":
            gen = pol = 0.5 * d * d
        else:
            gen, pol = k3, inv + d - 1
        S["gen"] += float(gen.sum())
        S["pol"] += float(pol.sum())
        # TRL: |old − sampling| on the loss tokens, NaN left out
        nan = torch.isnan(absd)
        if bool(nan.any()):
            S["absd"] += float(absd.nansum())
            S["absd_n"] += float((on & ~nan).sum())
            self.max["absd"] = _max(self.max["absd"], float(absd.nan_to_num(nan=-math.inf).max()))
        else:
            S["absd"] += float(absd.sum())
            S["absd_n"] += cnt
            self.max["absd"] = _max(self.max["absd"], big) if cnt else self.max["absd"]
        if self.is_level != "sequence" and cnt:
            ratio = self._clip(torch.where(nan, 1.0, e))  # TRL: the difference's NaN → 0, the ratio 1
            S["ratio"] += float(torch.dot(ratio, m))
            self.max["ratio"] = max(self.max["ratio"], float(torch.where(on, ratio, -math.inf).max()))
            self.min["ratio"] = min(self.min["ratio"], float(torch.where(on, ratio, math.inf).min()))
        if self.condition and cnt:
            self._fold_condition(lo, lr, absd, tm, m)
        segment_add(self.seq, (lo, lr, torch.nan_to_num(d, nan=0.0), m), seg)
        return absd

    def metrics(self) -> dict[str, float]:
        S, n = self.sums, self.n
        tokens = S["tokens"]
        out: dict[str, float] = {}
        # verl verl/utils/debug/metrics.py:112-121 calculate_debug_metrics: |exp(old) − exp(rollout)| on the
        # response mask, max / mean / std (torch.std: Bessel's correction); no valid token: NaN (:103-110)
        if tokens:
            mean = S["pd"] / tokens
            m2 = sum(M2 + c * (mu - mean) ** 2 for c, mu, M2 in self.pd_parts)
            out["training/rollout_probs_diff_max"] = self.max["pd"]
            out["training/rollout_probs_diff_mean"] = mean
            out["training/rollout_probs_diff_std"] = math.sqrt(m2 / (tokens - 1)) if tokens > 1 else math.nan
        else:
            out.update({k: math.nan for k in VERL_DEBUG})
        # verl verl/trainer/ppo/rollout_corr_helper.py:904-1010 compute_offpolicy_metrics. verl_F.masked_mean
        # divides by Σ m + 1e-8 with a float32 mask: the epsilon rounds away for any count ≥ 1, so it only keeps
        # a fully masked sequence's 0/0 at 0. Per sequence along the tokens, then a plain mean over sequences.
        denom = tokens if tokens else VERL_MASKED_MEAN_EPS
        s_old, s_roll, s_d, count = self.seq
        count = torch.where(count > 0, count, torch.full_like(count, VERL_MASKED_MEAN_EPS))
        mean_old, mean_roll = s_old / count, s_roll / count
        out["rollout_corr/training_ppl"] = float(torch.exp(-mean_old).mean())
        out["rollout_corr/training_log_ppl"] = float((-mean_old).mean())
        out["rollout_corr/kl"] = -S["d"] / denom
        out["rollout_corr/k3_kl"] = S["k3"] / denom
        out["rollout_corr/rollout_ppl"] = float(torch.exp(-mean_roll).mean())
        out["rollout_corr/rollout_log_ppl"] = float((-mean_roll).mean())
        log_ppl_diff = mean_roll - mean_old
        out["rollout_corr/log_ppl_diff"] = float(log_ppl_diff.mean())
        out["rollout_corr/log_ppl_abs_diff"] = float(log_ppl_diff.abs().mean())
        out["rollout_corr/log_ppl_diff_max"] = float(log_ppl_diff.max()) if n else math.nan
        out["rollout_corr/log_ppl_diff_min"] = float(log_ppl_diff.min()) if n else math.nan
        out["rollout_corr/ppl_ratio"] = float(torch.exp(log_ppl_diff).mean())
        out["rollout_corr/chi2_token"] = S["rho2"] / denom - 1.0
        out["rollout_corr/chi2_seq"] = float(torch.exp(2.0 * s_d.clamp(-SAFETY_BOUND, SAFETY_BOUND)).mean()) - 1.0
        # NeMo-RL nemo_rl/algorithms/loss_functions.py ClippedPGLossFn (clipped_pg_diagnostic_metrics):
        # token_mult_prob_error = masked_mean(exp(|gen − prev|·mask)); gen_kl_error = masked_mean(calculate_kl(gen,
        # prev)); policy_kl_error = masked_mean(calculate_kl(prev, gen)): global token means, no epsilon
        nan = math.nan
        out["token_mult_prob_error"] = S["tm"] / tokens if tokens else nan
        out["gen_kl_error"] = S["gen"] / tokens if tokens else nan
        out["policy_kl_error"] = S["pol"] / tokens if tokens else nan
        # TRL trl/trainer/grpo_trainer.py:2660-2705 (the corrected ratio) and :2860-2896 (its statistics): the
        # difference (old − sampling)·mask, NaN → 0; per token, or summed per sequence; truncate = clamp, mask = 0
        # outside [min, max]; statistics over the loss tokens (token modes) or every sequence (sequence modes);
        # none: 0
        out["sampling/sampling_logp_difference/mean"] = S["absd"] / S["absd_n"] if S["absd_n"] else 0.0
        out["sampling/sampling_logp_difference/max"] = self.max["absd"] if S["absd_n"] else 0.0
        if self.is_level == "sequence":
            ratio = self._clip(torch.exp(s_d))
            if n:
                out["sampling/importance_sampling_ratio/min"] = float(ratio.min())
                out["sampling/importance_sampling_ratio/mean"] = float(ratio.mean())
                out["sampling/importance_sampling_ratio/max"] = float(ratio.max())
        elif tokens:
            out["sampling/importance_sampling_ratio/min"] = self.min["ratio"]
            out["sampling/importance_sampling_ratio/mean"] = S["ratio"] / tokens
            out["sampling/importance_sampling_ratio/max"] = self.max["ratio"]
        for k in TRL[2:]:
            out.setdefault(k, 0.0)
        return {k: out[k] for k in METRICS}

    def condition_value(self) -> float:
        """:func:`metric_condition` of what was folded in (``condition=True``)."""
        return max(self.sums["cond"] / self.sums["tokens"], 1.0) if self.sums["tokens"] else 1.0


class ChunkSamples:
    """The samples of one chunk of the token axis, without a per-token array: ``samples`` those with a token in the
    chunk (in order), ``starts`` each one's first token within the chunk; :attr:`seg` (each token's sample, what
    :func:`kernels.segments.token_chunks` gives) made on first use."""

    def __init__(self, samples: torch.Tensor, starts: torch.Tensor, size: int) -> None:
        self.samples, self.starts, self.size = samples, starts, size
        self.first, self.last = int(samples[0]), int(samples[-1])
        self._seg: Optional[torch.Tensor] = None

    def numel(self) -> int:
        return self.size

    @property
    def seg(self) -> torch.Tensor:
        if self._seg is None:
            counts = torch.diff(self.starts, append=torch.tensor([self.size]))
            self._seg = torch.repeat_interleave(self.samples, counts)
        return self._seg


def chunk_samples(lengths: torch.Tensor, chunk: int = MISMATCH_CHUNK):
    """``(start, stop, ChunkSamples)`` for consecutive chunks of the token axis of samples of ``lengths`` (empty
    samples are in no chunk): the chunks of ``token_chunks`` with each sample's boundaries by binary search instead
    of a per-token sample index."""
    lengths = lengths.to(torch.int64)
    ends = torch.cumsum(lengths, 0)
    present = (lengths > 0).nonzero().reshape(-1)
    p_ends = ends[present]
    p_starts = p_ends - lengths[present]
    total = int(ends[-1]) if lengths.numel() else 0
    for start in range(0, total, chunk):
        stop = min(start + chunk, total)
        a = int(torch.searchsorted(p_ends, start, right=True))  # the first sample ending after start
        b = int(torch.searchsorted(p_starts, stop))  # the samples starting before stop
        yield start, stop, ChunkSamples(present[a:b], (p_starts[a:b] - start).clamp_(min=0), stop - start)


def _sample_sums(seq: torch.Tensor, lo: torch.Tensor, lr: torch.Tensor, m: torch.Tensor, seg) -> None:
    """``seq[0..3, s] +=`` Σ old, Σ rollout, Σ (old − rollout), Σ m over sample ``s``'s tokens of one chunk
    (``seg``: each token's sample, or the chunk's :class:`ChunkSamples`)."""
    first, last = (seg.first, seg.last) if isinstance(seg, ChunkSamples) else (int(seg[0]), int(seg[-1]))
    part = torch.zeros((3, last - first + 1), dtype=torch.float64)
    segment_add(part, (lo, lr, m), seg, first)
    window = seq[:, first:last + 1]
    window[0] += part[0]
    window[1] += part[1]
    window[2] += part[0] - part[1]
    window[3] += part[2]


def segment_add(acc: torch.Tensor, rows, seg, base: int = 0) -> None:
    """``acc[r, s − base] += Σ rows[r][t]`` over each token ``t`` of sample ``s`` in one chunk (``seg`` sorted, or the
    chunk's :class:`ChunkSamples`): long samples take one ``reduceat`` per row, many short ones one ``index_add_``
    per row."""
    if not seg.numel():
        return
    if isinstance(seg, ChunkSamples):
        if seg.samples.numel() * 256 <= seg.numel():
            samples, starts = seg.samples - base, seg.starts.numpy()
            for r, row in enumerate(rows):
                acc[r].index_add_(0, samples, torch.from_numpy(np.add.reduceat(row.contiguous().numpy(), starts)))
            return
        seg = seg.seg
    first, last = int(seg[0]), int(seg[-1])
    if (last - first + 1) * 256 <= seg.numel():  # samples of 256 tokens or more on average
        # each sample's first token by binary search (seg is sorted); an empty sample (no token) is left out
        samples = torch.arange(first, last + 1)
        starts = torch.searchsorted(seg, samples)
        ends = torch.cat([starts[1:], torch.tensor([seg.numel()])])
        present = ends > starts
        if not bool(present.all()):
            samples, starts = samples[present], starts[present]
        starts, samples = starts.numpy(), samples - base
        for r, row in enumerate(rows):  # row by row (no stacked copy of the chunk), one reduceat each
            acc[r].index_add_(0, samples, torch.from_numpy(np.add.reduceat(row.contiguous().numpy(), starts)))
    else:
        at = seg - base if base else seg
        for r, row in enumerate(rows):
            acc[r].index_add_(0, at, row)


def _max(a: float, b: float) -> float:
    return b if math.isnan(b) or math.isnan(a) else max(a, b)


def mismatch_metrics(rollout: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, seg: torch.Tensor, n: int, *,
                     kl_type: str = "k3", is_level: Optional[str] = None, is_mode: str = "truncate",
                     is_low: Optional[float] = None, is_high: Optional[float] = None) -> dict[str, float]:
    """Every metric of :data:`METRICS` in float64 over the loss tokens (``mask`` > 0) of ``n`` samples
    (``seg``: each token's sample): :class:`MismatchScan` over the whole token axis."""
    scan = MismatchScan(n, kl_type=kl_type, is_level=is_level, is_mode=is_mode, is_low=is_low, is_high=is_high)
    scan.add(rollout, old, mask, seg)
    return scan.metrics()


def metric_condition(rollout: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> float:
    """A magnitude every metric's float32 rounding error is proportional to: the masked mean of
    ``(1 + |Δ|)·exp(|Δ|)·(1 + max(|old|, |rollout|))`` (each term is an exp, a difference or a product of those, of
    log-probs of that size; |Δ| clamped to 20), at least 1."""
    scan = MismatchScan(1, condition=True)
    scan.add(rollout, old, mask, torch.zeros(rollout.numel(), dtype=torch.int64))
    return scan.condition_value()


# verl's factor of rollout_is_batch_normalize (rollout_corr_helper.py:627-655), logged as a metric
IS_NORM_METRIC = "rollout_corr/rollout_is_batch_norm_factor"


def is_batch_norm_factor(rollout: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, seg: torch.Tensor, n: int,
                         knobs) -> float:
    """verl's ``rollout_is_batch_normalize`` divisor over these tokens (``rollout_corr_helper.py:627-655``, one
    process: ``masked_mean``), in float64: the mean of the corrected weights (truncated or masked, before the
    division) over the loss tokens (token level), or over the samples with a loss token of each sample's weight
    (sequence level); 1.0 when that mean is not above 1e-8 (verl then leaves the weights as they are). verl's
    float32 ``Σ mask + 1e-8`` denominators round to ``Σ mask`` for any count ≥ 1."""
    from dataclasses import replace

    from .loss import importance_weight

    raw = replace(knobs, is_norm=None)
    on = mask > 0
    m = on.to(torch.float64)
    d = torch.where(on, old, 0.0).to(torch.float64) - torch.where(on, rollout, 0.0).to(torch.float64)
    if knobs.is_level == "token":
        total = float(torch.dot(importance_weight(d, raw), m))
        count = float(m.sum())
    else:  # sequence: one weight per sample, exp of its sum
        count_i = torch.zeros(n, dtype=torch.float64).index_add_(0, seg, m)
        log_w = torch.zeros(n, dtype=torch.float64).index_add_(0, seg, d)
        present = (count_i > 0).to(torch.float64)
        total = float(torch.dot(importance_weight(log_w, raw), present))
        count = float(present.sum())
    mean = total / (count if count >= 1 else VERL_MASKED_MEAN_EPS)
    return mean if mean > 1e-8 else 1.0


# slime's MIS levels as the rejection chain's k1 statistics (k1 = rollout − old = −Δ): the token's, the sample's
# sum, the sample's mean over its loss tokens
MIS_LEVELS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


def mis_chain(mis_rs, veto: Optional[float]) -> list[tuple[str, Optional[float], float]]:
    """slime's MIS rejection (``examples/train_infer_mismatch_helper/mis.py:131-147, 243-263`` at 624b824a8) as
    a :func:`rejection_decisions` chain: ``low ≤ exp(Δ) ≤ high`` at a level is ``log(1/high) ≤ k1 ≤ log(1/low)``
    of that level's k1; the veto (a sample dropped when a loss token's ``Δ < log veto``) keeps a sample whose
    largest token k1 is ``≤ log(1/veto)``."""
    chain = [(MIS_LEVELS[level], math.log(1.0 / high), math.log(1.0 / low)) for level, low, high in mis_rs or ()]
    if veto is not None:
        chain.append(("seq_max_k1", None, math.log(1.0 / veto)))
    return chain


def rejection_keep(log_ratio: torch.Tensor, mask: torch.Tensor, seg: torch.Tensor, n: int,
                   chain: list[tuple[str, Optional[float], float]]) -> torch.Tensor:
    """:func:`rejection_decisions`' keep mask alone."""
    return rejection_decisions(log_ratio, mask, seg, n, chain)[0]


def rejection_decisions(log_ratio: torch.Tensor, mask: torch.Tensor, seg: torch.Tensor, n: int,
                        chain: list[tuple[str, Optional[float], float]], unit: float = 2.0 ** -24
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's rejection sampling (``rollout_corr_helper.py:197-413`` ``compute_rollout_rejection_mask``): bool per
    token, kept by every option of ``chain`` (``bundle.rollout_rs.parse_rollout_rs``). ``log_ratio`` = old −
    rollout, clamped to ±20; per token k1 = −log_ratio, k2 = log_ratio²/2, k3 = exp(log_ratio) − 1 − log_ratio;
    token options test each token, ``seq_sum`` / ``seq_mean`` / ``seq_max`` the sample's sum, mean (over
    ``Σ mask``) or max (0 without a loss token) over its loss tokens; k1 keeps ``lower ≤ stat ≤ upper`` (log
    bounds), k2/k3 ``stat ≤ upper``. Off the loss tokens the result is True (the mask there is 0 anyway).

    Also (second result) the loss tokens whose decision lies within the float32 producer's rounding of a bound
    (``unit``: its unit roundoff), which a legitimate producer may take either way: per token the statistic's
    rounding error is at most ``4u·(1 + |lr| + lr² + exp(lr))`` (the difference ``old − rollout``, a square, an
    exp and two subtractions); a sequence sum adds its terms' errors and ``(⌈log2 count⌉ + 1)·u·Σ|stat|``, a mean
    divides that by the count, a max takes its largest term's. A sequence option's near decision is its every
    loss token's."""
    on = mask > 0
    lr = torch.where(on, log_ratio, 0.0).to(torch.float64).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": torch.exp(lr) - 1.0 - lr}
    err = 4.0 * unit * (1.0 + lr.abs() + lr * lr + torch.exp(lr))
    keep = torch.ones_like(on)
    near = torch.zeros_like(on)
    firm = torch.zeros_like(on)  # rejected by an option far from its bounds: no rounding keeps it
    m = on.to(torch.float64)
    count = torch.zeros(n, dtype=torch.float64).index_add_(0, seg, m)
    depth = torch.ceil(torch.log2(count + 1.0)) + 1.0
    for option, lower, upper in chain:
        stat = stats[option[-2:]]
        margin = err
        if option.startswith("seq_sum") or option.startswith("seq_mean"):
            per = torch.zeros(n, dtype=torch.float64).index_add_(0, seg, stat * m)
            slack = torch.zeros(n, dtype=torch.float64).index_add_(0, seg, err * m)
            slack += depth * unit * torch.zeros(n, dtype=torch.float64).index_add_(0, seg, stat.abs() * m)
            if option.startswith("seq_mean"):
                denom = torch.where(count > 0, count, VERL_MASKED_MEAN_EPS)  # verl's float32 Σm + 1e-8
                per = per / denom
                slack = slack / denom + unit * per.abs()
            stat, margin = per[seg], slack[seg]
        elif option.startswith("seq_max"):
            per = torch.full((n,), -math.inf, dtype=torch.float64).scatter_reduce_(
                0, seg, torch.where(on, stat, -math.inf), reduce="amax")
            slack = torch.zeros(n, dtype=torch.float64).scatter_reduce_(
                0, seg, torch.where(on, err, 0.0), reduce="amax")
            stat, margin = torch.where(per == -math.inf, 0.0, per)[seg], slack[seg]
        ok = stat <= upper
        close = (stat - upper).abs() <= margin
        if lower is not None:
            ok &= stat >= lower
            close |= (stat - lower).abs() <= margin
        keep &= ok
        near |= close
        firm |= ~ok & ~close
    return keep | ~on, near & on & ~firm


__all__ = ["IS_NORM_METRIC", "MIS_LEVELS", "mis_chain", "ChunkSamples", "chunk_samples", "METRICS", "MISMATCH_CHUNK", "is_batch_norm_factor", "DifferenceSummary", "Folded", "MaskedBits", "pair_step", "MismatchScan", "difference_summary", "differing", "metric_condition",
           "mismatch_metrics", "rejection_decisions", "rejection_keep", "segment_add", "ulp_distance"]
