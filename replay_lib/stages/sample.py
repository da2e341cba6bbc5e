"""``sample``: structural integrity of the sample records against the token payloads."""

from __future__ import annotations

from ..judge.compare import Comparison
from ..judge.report import Divergence, StageReport
from ..bundle.schema import StageId
from .base import StageContext, StageDef
from .support import SUPPORT_TOKEN_PAYLOADS

# Per-token payloads whose first dimension must equal Σ response_length: the GRPO ones and the support
# stage's, except ``cp_shard`` (a layout record, whose rows that stage checks itself).
TOKEN_PAYLOADS = ("old_log_probs", "log_probs", "ref_log_probs", "entropy", "kl", "advantages") + tuple(
    name for name in SUPPORT_TOKEN_PAYLOADS if name != "cp_shard")


def run_sample(ctx: StageContext) -> StageReport:
    divs: list[Divergence] = []
    mismatches = 0

    def add(d: Divergence) -> None:
        nonlocal mismatches
        mismatches += 1
        if len(divs) < ctx.keep:
            divs.append(d)

    for k, s in enumerate(ctx.samples):
        if not (0 <= s.response_length <= s.total_length):
            add(Divergence(
                stage="sample", rank=ctx.rank, sample_id=s.sample_id, group_index=s.group_index, field="length",
                expected=float(s.total_length), actual=float(s.response_length),
                abs_error=float(abs(s.total_length - s.response_length)),
                message=f"response_length={s.response_length} outside [0, total_length={s.total_length}]",
            ))
        masked = ctx.reader.mask_length(ctx.indices[k])  # a packed mask's length is checked by the reader
        if masked != s.response_length:
            add(Divergence(
                stage="sample", rank=ctx.rank, sample_id=s.sample_id, group_index=s.group_index,
                field="loss_mask_length", expected=float(s.response_length), actual=float(masked),
                abs_error=float(abs(masked - s.response_length)),
                message=f"len(loss_mask)={masked} != response_length={s.response_length}",
            ))
    for name in TOKEN_PAYLOADS:
        if not ctx.has(name):
            continue
        t = ctx.reader.payload_meta(name)  # its form only: no byte of it read
        rows = int(t.shape[0]) if t.dim() else 0
        if rows != ctx.full_total:
            add(Divergence(
                stage="sample", rank=ctx.rank, field="length", expected=float(ctx.full_total), actual=float(rows),
                abs_error=float(abs(rows - ctx.full_total)),
                message=f"payload {name!r} has {rows} row(s), Σ response_length is {ctx.full_total}",
            ))
    # structural checks only: no value is compared, so the stage has no field
    found = Comparison(compared=ctx.n, mismatches=mismatches, divergences=divs)
    return ctx.report(StageId.SAMPLE, [], structural=found,
                      fail_reason=f"sample integrity broken in {mismatches} place(s)",
                      pass_reason=f"{ctx.n} sample(s), {int(ctx.lengths.sum())} token(s) consistent")


SAMPLE = StageDef(id=StageId.SAMPLE, run=run_sample, description="lengths, loss masks and payload rows agree",
                  any_cp=True)
