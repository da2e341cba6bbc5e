"""Export of the viewed field: expected, actual, abs error, tolerance and the divergence mark of each element,
for one sample's tokens or the whole stage, as CSV or JSON (by the file's extension). Pure data: the model's
field results, no Textual.

CSV: a header line, then one line per element: ``rank, sample_id, offset, label, expected, actual, abs_error,
tolerance, divergent`` (``rank`` for a cohort's shard, ``offset`` for a per-token field, ``label`` for a table
row — a sample id or a loss field —, each empty where it does not apply; numbers as Python's shortest float repr, ``nan``/``inf`` as such;
text escaped as the views show it, with a leading ``'`` where a spreadsheet would read a formula).
JSON: ``{"field", "stage", "scope", "columns", "rows": [[…], …]}`` with the same columns (a row a line), a
non-finite number as ``null``. Written as it is made, a block of samples at a time (:data:`EXPORT_BLOCK`): a whole
stage's export holds one block's rows, never the file's text. A file that exists is never replaced unless the caller says so (the dialog asks first); the
file is written beside its final name and renamed into place, so a failed write leaves no half file."""

from __future__ import annotations

import csv
import errno
import io
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, TextIO

import torch

from replay_lib.safe_text import safe

from .model import FIELD_BY_NAME, KIND_COHORT, KIND_TOKEN, ReplayModel

COLUMNS = ("rank", "sample_id", "offset", "label", "expected", "actual", "abs_error", "tolerance", "divergent")


@dataclass(frozen=True)
class ExportRequest:
    field: str
    sample_id: Optional[str]  # the viewed sample (a per-token field), else None
    whole_stage: bool  # every sample of the stage (a table is always whole)

    @property
    def scope(self) -> str:
        if FIELD_BY_NAME[self.field].kind == KIND_COHORT:
            return "cohort"
        return "stage" if self.whole_stage or self.sample_id is None else "sample"


# Where the export dialog proposes to write (an absolute path, whatever the working directory): created on the
# first export, the file readable by others like any file the user writes (0644 under the usual umask 022).
EXPORT_DIR = Path("~/trajectory-replay/exports")


def _name_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


def default_export_path(request: ExportRequest, bundle: str = "") -> str:
    """``~/trajectory-replay/exports/<bundle>-kl-s-5.csv`` (``…-kl-stage.csv``, ``…-reward.csv``): in
    :data:`EXPORT_DIR`, a file name made of the bundle's name, the field and the scope (characters outside
    ``[A-Za-z0-9._-]`` become ``_``), expanded to an absolute path."""
    return str((EXPORT_DIR / ((f"{_name_part(bundle)}-" if bundle else "") + export_file_name(request))).expanduser())


def export_file_name(request: ExportRequest) -> str:
    """``kl-s-5.csv``, ``kl-stage.csv``, ``reward.csv``: the field and the scope (a sample id's characters outside
    ``[A-Za-z0-9._-]`` become ``_``)."""
    if request.scope == "sample":
        stem = f"{request.field}-{re.sub(r'[^A-Za-z0-9._-]', '_', request.sample_id)}"
    elif request.scope == "stage" and FIELD_BY_NAME[request.field].kind == KIND_TOKEN:
        stem = f"{request.field}-stage"
    else:
        stem = request.field
    return f"{stem}.csv"


def _number(x: float):
    return x if math.isfinite(x) else None


# Elements per block of a whole stage's export: the rows of one block are Python lists for a moment, written, then
# dropped — the export of a 134M-token stage never holds more than a block's rows (nor the file's text).
EXPORT_BLOCK = 1 << 16


def export_rows(model: ReplayModel, request: ExportRequest) -> tuple[str, list[list]]:
    """``(stage, rows)``: one row per element in :data:`COLUMNS` order (every block of :func:`export_blocks`)."""
    stage, blocks = export_blocks(model, request)
    return stage, [row for block in blocks for row in block]


def export_blocks(model: ReplayModel, request: ExportRequest) -> tuple[str, Iterator[list[list]]]:
    """``(stage, blocks)``: the rows in :data:`COLUMNS` order, a block of at most about :data:`EXPORT_BLOCK`
    elements at a time (whole samples; a sample longer than a block is one block), made as they are taken."""
    spec = FIELD_BY_NAME[request.field]
    if spec.kind == KIND_TOKEN and request.scope == "sample":
        diff = model.field_diff(request.field, request.sample_id)
        row = model.sample(request.sample_id)
        rank = model.shards[row.shard].rank if row is not None else None
        return spec.stage, iter([_rows(diff.expected_tensor, diff.actual_tensor, diff.error_tensor,
                                       diff.tolerance_tensor, diff.bad_tensor, rank=rank,
                                       sample_ids=[diff.sample_id] * len(diff), offsets=range(len(diff)))])
    if spec.kind == KIND_TOKEN:
        return spec.stage, _stage_blocks(model, request.field)
    diff = model.field_diff(request.field)
    return spec.stage, iter([_rows(diff.expected_tensor, diff.actual_tensor, diff.error_tensor, diff.tolerance_tensor,
                                   diff.bad_tensor, labels=diff.labels,
                                   sample_ids=diff.labels if spec.kind != KIND_COHORT else None)])


def _stage_blocks(model: ReplayModel, field: str) -> Iterator[list[list]]:
    """Every shown sample's tokens of a per-token field, shard by shard, in blocks of whole samples."""
    shown = set(model.samples.ids)
    for shard in model.shards:
        if not shard.ensure(field):
            continue
        result = shard.results[field]
        ctx = shard.ctx
        starts, lengths = ctx.offsets.tolist(), ctx.lengths.tolist()
        keep = [i for i, sid in enumerate(ctx.sample_ids) if sid in shown]
        at = 0
        while at < len(keep):
            block, size = [], 0
            while at < len(keep) and (not block or size + lengths[keep[at]] <= EXPORT_BLOCK):
                block.append(keep[at])
                size += lengths[keep[at]]
                at += 1
            # the block's rows judged as a window (FieldResult.window): the field's float64 columns are never
            # built for the whole step (≈ 34 bytes a token) by an export
            lo, hi = starts[block[0]], starts[block[-1]] + lengths[block[-1]]
            w = result.window(lo, hi)
            index = torch.cat([torch.arange(starts[i] - lo, starts[i] - lo + lengths[i]) for i in block])
            marked = w.bad if result.flagged is None else w.bad | result.flagged[lo:hi]
            yield _rows(w.expected[index], w.actual[index], w.shown_error[index], w.tolerance[index],
                        marked[index], rank=shard.rank,
                        sample_ids=[ctx.sample_ids[i] for i in block for _ in range(lengths[i])],
                        offsets=[t for i in block for t in range(lengths[i])])


def _rows(expected, actual, err, tol, bad, *, rank=None, sample_ids=None, offsets=None, labels=None) -> list[list]:
    n = int(expected.numel())
    cols = [expected.tolist(), actual.tolist(), err.tolist(), tol.tolist() if tol is not None else [None] * n,
            bad.tolist()]
    sample_ids = list(sample_ids) if sample_ids is not None else [None] * n
    offsets = list(offsets) if offsets is not None else [None] * n
    labels = list(labels) if labels is not None else [None] * n
    return [[rank, sample_ids[i], offsets[i], labels[i], cols[0][i], cols[1][i], cols[2][i], cols[3][i],
             bool(cols[4][i])] for i in range(n)]


def render(path: str, field: str, stage: str, scope: str, rows: list[list]) -> str:
    """The file's text: JSON for a ``.json`` path, else CSV (:func:`write_rows` into a string)."""
    out = io.StringIO()
    write_rows(out, path, field, stage, scope, iter([rows]))
    return out.getvalue()


def write_rows(out: TextIO, path: str, field: str, stage: str, scope: str, blocks: Iterable[list[list]]) -> int:
    """Write the rows of ``blocks`` to ``out`` as they come, JSON for a ``.json`` path (one row a line), else CSV;
    returns the number of rows."""
    count = 0
    if path.lower().endswith(".json"):
        head = json.dumps({"field": field, "stage": stage, "scope": scope, "columns": list(COLUMNS)})
        out.write(head[:-1] + ', "rows": [')
        for block in blocks:
            for row in block:
                out.write(("\n" if count == 0 else ",\n")
                          + json.dumps([_number(v) if isinstance(v, float) else v for v in row], allow_nan=False))
                count += 1
        out.write("\n]}\n")
        return count
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for block in blocks:
        writer.writerows(["" if v is None else repr(v) if isinstance(v, float) else _cell(v) if isinstance(v, str)
                          else v for v in row] for row in block)
        count += len(block)
    return count


# A cell a spreadsheet would evaluate as a formula (OWASP's list of first characters).
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _cell(text: str) -> str:
    """A text cell of the CSV (a sample id or a label, from the bundle): escaped as every view shows it
    (``safe_text.safe``: a control character as ``\\x1b``, so ``cat`` of the file cannot act on the terminal),
    and with a leading ``'`` when a spreadsheet would run it as a formula."""
    text = safe(text)
    return "'" + text if text.startswith(_FORMULA_START) else text


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class ExportCancelled(Exception):
    """The export was cancelled between two blocks: the partial file was removed, nothing else written."""


def _watched(blocks: Iterable[list[list]], progress: Optional[Callable[[int], None]],
             cancelled: Optional[Callable[[], bool]]) -> Iterator[list[list]]:
    """``blocks``, with ``cancelled()`` asked before each (:class:`ExportCancelled` when true) and ``progress(rows)``
    told the rows written once each has been taken."""
    done = 0
    for block in blocks:
        if cancelled is not None and cancelled():
            raise ExportCancelled()
        yield block
        done += len(block)
        if progress is not None:
            progress(done)


def export_field(model: ReplayModel, request: ExportRequest, path: str, *, overwrite: bool = False,
                 progress: Optional[Callable[[int], None]] = None,
                 cancelled: Optional[Callable[[], bool]] = None) -> str:
    """Write the export to ``path``; returns the one-line result to show. Raises ``FileExistsError`` when
    ``path`` exists and ``overwrite`` is False (nothing is written), ``OSError`` when it cannot be written,
    :class:`ExportCancelled` when ``cancelled()`` turned true between two blocks (the partial file removed).
    ``progress(rows)``: the rows written so far, after each block (the dialog runs this on a worker thread)."""
    target = Path(path).expanduser()
    if target.is_dir():  # never offered for overwriting: no file can replace it
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(target))
    if target.exists() and not overwrite:
        raise FileExistsError(str(target))
    stage, blocks = export_blocks(model, request)
    if target.parent == EXPORT_DIR.expanduser():
        target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=str(target.parent))
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 → the mode open() gives a new file
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            count = write_rows(f, str(target), request.field, stage, request.scope,
                               _watched(blocks, progress, cancelled))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    what = "JSON" if str(target).lower().endswith(".json") else "CSV"
    return f"wrote {count} row(s) of {request.field} ({request.scope}) to {target} as {what}"
