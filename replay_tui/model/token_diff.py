"""The diff view's rows: one field's expected, actual and tolerance per element (:class:`FieldDiff`).

Part of :mod:`replay_tui.model` (pure data, no Textual)."""

from __future__ import annotations

import bisect
import functools
import math
from typing import Optional

import numpy as np
import torch

from replay_lib.bundle import BundleSet
from replay_lib.bundle.selection import group_label
from replay_lib.judge.compare import as_float64
from replay_lib.judge.error_model import Rules
from replay_lib.judge.fields import noise_ratio

from .fields import FIELD_BY_NAME, KIND_SAMPLE, KIND_TOKEN
from .recompute import ShardRecompute, recompute_shard, stages_that_ran


class FieldDiff:
    """Rows of one field for the diff viewer: a sample's tokens, every sample, or the loss fields.

    ``labels`` is empty for token rows (the row index *is* the token offset). The values are kept as
    tensors; the viewer reads the rows it draws (:meth:`row`, converted a block at a time), so a
    32k-token sample costs its first frame nothing per token. ``expected`` / ``actual`` / ``abs_error``
    / ``bad`` are the whole columns as lists (converted on first use)."""

    BLOCK = 256

    def __init__(self, *, field: str, stage: str, kind: str, expected, actual, abs_error, bad,
                 mask: Optional[list[int]] = None, sample_id: Optional[str] = None,
                 labels: Optional[list[str]] = None, groups: Optional[list[str]] = None,
                 atol: float = 0.0, rtol: float = 0.0, note: str = "", tolerance=None,
                 grad: Optional[torch.Tensor] = None) -> None:
        self.field, self.stage, self.kind = field, stage, kind
        self.expected_tensor = as_float64(expected)
        self.actual_tensor = as_float64(actual)
        self.error_tensor = as_float64(abs_error)
        self.bad_tensor = bad.detach().reshape(-1).to(torch.bool) if isinstance(bad, torch.Tensor) \
            else torch.tensor(list(bad), dtype=torch.bool)
        self.mask = mask
        self.sample_id = sample_id
        self.labels = labels if labels is not None else []
        self.groups = groups if groups is not None else []
        self.atol, self.rtol = atol, rtol  # the bundle's part of the tolerance (the header shows it)
        # a loss token's recorded ∂L/∂logp beside its loss term (``grad_log_probs``, stage loss.grad), per row
        self.grad = grad
        # the effective bound of each row (the bundle's atol + rtol·|e| plus the producer's rounding bound)
        self.tolerance_tensor: Optional[torch.Tensor] = as_float64(tolerance) if tolerance is not None else None
        self.note = note  # what the values are, when the table does not say it (the loss fields' sums)
        self.divergent: list[int] = torch.nonzero(self.bad_tensor).reshape(-1).tolist()
        self._blocks: dict[int, list[tuple[float, float, float, bool]]] = {}

    def row(self, i: int) -> tuple[float, float, float, bool]:
        """``(expected, actual, abs error, divergent)`` of row ``i``."""
        b, r = divmod(i, self.BLOCK)
        block = self._blocks.get(b)
        if block is None:
            lo, hi = b * self.BLOCK, (b + 1) * self.BLOCK
            block = self._blocks[b] = list(zip(self.expected_tensor[lo:hi].tolist(), self.actual_tensor[lo:hi].tolist(),
                                               self.error_tensor[lo:hi].tolist(), self.bad_tensor[lo:hi].tolist()))
        return block[r]

    def error_model_row(self, i: int) -> tuple[Optional[float], Optional[float]]:
        """``(tolerance, noise ratio)`` of row ``i`` (``(None, None)`` without tolerances), converted a block at
        a time like :meth:`row`: the viewer draws these two columns beside it on every cursor move."""
        if self.tolerance_tensor is None:
            return None, None
        b, r = divmod(i, self.BLOCK)
        block = self._error_model_blocks.get(b)
        if block is None:
            lo, hi = b * self.BLOCK, (b + 1) * self.BLOCK
            block = self._error_model_blocks[b] = list(zip(self.tolerance_tensor[lo:hi].tolist(),
                                                           self.noise_tensor[lo:hi].tolist()))
        return block[r]

    @functools.cached_property
    def _error_model_blocks(self) -> dict[int, list[tuple[float, float]]]:
        return {}

    @functools.cached_property
    def noise_tensor(self) -> Optional[torch.Tensor]:
        """``|a − e| / tolerance`` per row (NaN where a side is not finite); None without tolerances."""
        if self.tolerance_tensor is None:
            return None
        return noise_ratio(self.error_tensor, self.tolerance_tensor)

    @functools.cached_property
    def expected(self) -> list[float]:
        return self.expected_tensor.tolist()

    @functools.cached_property
    def actual(self) -> list[float]:
        return self.actual_tensor.tolist()

    @functools.cached_property
    def abs_error(self) -> list[float]:
        return self.error_tensor.tolist()

    @functools.cached_property
    def bad(self) -> list[bool]:
        return self.bad_tensor.tolist()

    def __len__(self) -> int:
        return self.expected_tensor.numel()

    @property
    def mismatches(self) -> int:
        return len(self.divergent)

    def label(self, row: int) -> str:
        return self.labels[row] if self.labels else str(row)

    def next_divergence(self, row: int, direction: int = 1) -> Optional[int]:
        """The next (``direction`` = 1) or previous (−1) divergent row strictly after/before ``row``."""
        if direction > 0:
            i = bisect.bisect_right(self.divergent, row)
            return self.divergent[i] if i < len(self.divergent) else None
        i = bisect.bisect_left(self.divergent, row)
        return self.divergent[i - 1] if i > 0 else None

    def error_profile(self, bins: int) -> list[tuple[float, bool]]:
        """``bins`` × ``(max |err| normalised to [0, 1], any divergence)`` along the row axis.

        Fewer rows than bins: each row spans several bins (the strip always fills its width). A
        non-finite element (NaN/Inf on either side) counts as the maximum error."""
        peaks, flagged, top = self.error_peaks(bins)
        scale = top if top > 0 else 1.0
        return [(min(p, scale) / scale, f) for p, f in zip(peaks, flagged)]

    def error_peaks(self, bins: int) -> tuple[list[float], list[bool], float]:
        """``(max |err| per bin, any divergence per bin, the largest finite |err|)`` along the row axis; a
        non-finite element (NaN/Inf on either side) is ``inf`` (the error plot draws it full height)."""
        n = len(self)
        if n == 0 or bins <= 0:
            return [], [], 0.0
        err = self.error_tensor
        top = float(err.max())  # a max propagates NaN: finite exactly when every element is
        if not math.isfinite(top):
            err = torch.where(torch.isnan(err) & self.bad_tensor, torch.full_like(err, float("inf")), err)
            err = torch.nan_to_num(err, nan=0.0, posinf=float("inf"))
            # the largest finite |err| (a where, not a boolean index: that costs ms on a 32k-token sample)
            top = float(torch.where(torch.isinf(err), torch.zeros_like(err), err).max())
        if bins >= n:
            rows = torch.arange(bins, dtype=torch.int64) * n // bins
            return err[rows].tolist(), self.bad_tensor[rows].tolist(), top
        # bin b draws the rows from row_of_bin(b) to the next bin's first: contiguous runs, none empty, each bin's
        # max one reduction over its run
        starts = [self.row_of_bin(b, bins) for b in range(bins)]
        peak = np.maximum.reduceat(err.numpy(), starts).tolist()
        flagged = torch.zeros(bins, dtype=torch.bool)
        flagged[torch.nonzero(self.bad_tensor).reshape(-1) * bins // n] = True
        return peak, flagged.tolist(), top

    def row_of_bin(self, b: int, bins: int) -> int:
        """The first row drawn in bin ``b`` (clicking the strip jumps there)."""
        n = len(self)
        if n == 0:
            return 0
        if bins >= n:
            return min(n - 1, b * n // bins)
        return min(n - 1, -(-b * n // bins))

    def bins_of_row(self, row: int, bins: int) -> range:
        """The bins that draw ``row`` (the cursor's marker on the strip)."""
        n = len(self)
        if n == 0:
            return range(0)
        if bins >= n:
            return range(-(-row * bins // n), -(-(row + 1) * bins // n))
        b = row * bins // n
        return range(b, b + 1)

def token_rows(shard: ShardRecompute, index: int, field_name: str) -> FieldDiff:
    """One sample's slice of a per-token field: offset | expected | actual | abs err | loss mask."""
    ctx = shard.ctx
    start = int(ctx.offsets[index])
    n = int(ctx.lengths[index])
    result = shard.results[field_name]
    w = result.window(start, start + n)  # the sample's rows of the judged chunks: no copy of the whole field
    err = w.shown_error
    bad = shard.bad[field_name][start:start + n]
    sample = shard.reader.index.samples[index]
    atol, rtol = shard.tolerances[field_name]
    recorded = shard.reader.sample_mask(index)  # read, never written: a 32k-token sample's list is not copied
    mask = recorded if len(recorded) == n else recorded[:n] + [0] * max(0, n - len(recorded))
    grad = None
    if field_name == "pg_losses" and shard.reader.has_payload("grad_log_probs"):
        grad = ctx.payload("grad_log_probs")[start:start + n].to(torch.float64)
    return FieldDiff(field=field_name, stage=FIELD_BY_NAME[field_name].stage, kind=KIND_TOKEN,
                     expected=w.expected, actual=w.actual, abs_error=err, bad=bad, mask=mask,
                     sample_id=sample.sample_id, atol=atol, rtol=rtol, tolerance=w.tolerance, grad=grad)

def token_diff(bundles: BundleSet, sample_id: str, field_name: str, rules: Rules = Rules()) -> FieldDiff:
    """Expected / actual / abs-error / loss-mask arrays of one sample's per-token (or per-sample) field.

    Standalone: recomputes the shard holding ``sample_id`` as a full replay would. Raises ``KeyError``
    for an unknown sample or a field the bundle does not compare."""
    spec = FIELD_BY_NAME.get(field_name)
    if spec is None:
        raise KeyError(f"unknown field {field_name!r} (expected one of {', '.join(FIELD_BY_NAME)})")
    for shard in bundles.shards:
        for i, s in enumerate(shard.index.samples):
            if s.sample_id != sample_id:
                continue
            rec = recompute_shard(shard, stages_that_ran(None, shard), fields=[field_name], rules=rules)
            if field_name not in rec.values:
                raise KeyError(f"field {field_name!r} is not available: {rec.unavailable.get(field_name, 'stage not run')}")
            if spec.kind == KIND_TOKEN:
                return token_rows(rec, i, field_name)
            if spec.kind == KIND_SAMPLE:
                e, a = rec.values[field_name]
                err, bad = rec.errors[field_name][i:i + 1], rec.bad[field_name][i:i + 1]
                atol, rtol = rec.tolerances[field_name]
                return FieldDiff(field=field_name, stage=spec.stage, kind=KIND_SAMPLE, expected=e[i:i + 1],
                                 actual=a[i:i + 1], abs_error=err, bad=bad, labels=[sample_id],
                                 groups=[group_label(s.group_index)], atol=atol, rtol=rtol,
                                 tolerance=rec.results[field_name].tolerance[i:i + 1])
            raise KeyError(f"field {field_name!r} is cohort-level, not per sample")
    raise KeyError(f"no sample {sample_id!r} in bundle {bundles.bundle_id}")
