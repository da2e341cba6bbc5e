"""The support strip under the diff rows: the recorded sampler support of the token under the cursor.

Line 1 says what the row is (the sampled member's rank and renormalized probability, or what is wrong
with the row); line 2 lists the members by logit, highest first, with the sampled one highlighted. A
cursor move repaints these two lines only (the diff rows are untouched); the row itself is O(K) to build,
so a 32k-token sample costs the same as a 4-token one. One line at short terminals: members only, after
a one-glyph status."""

from __future__ import annotations

import math
from typing import Optional, Union

from rich.cells import cell_len, set_cell_size
from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

from replay_lib.safe_text import safe

from ..cells import DIM, FAIL, WARN, strip_of
from .followed import FollowedView
from ..model import KIND_TOKEN, ReplayModel, SupportRow

SAMPLED = Style(color="black", bgcolor="bright_yellow", bold=True)
LABEL = Style(bold=True)
SEP = " · "
Parts = list[tuple[str, Optional[Style]]]


def fmt_prob(p: float) -> str:
    """A member's probability in 5 cells: ``0.220``, ``1.000``, ``<.001`` (never rounds a member to 0)."""
    if math.isnan(p):
        return "  nan"
    if 0 < p < 0.0005:
        return "<.001"
    return f"{p:.3f}"


def member_text(row: SupportRow, i: int) -> str:
    text = f"{row.ids[i]} {fmt_prob(row.probs[i])}"
    return text + " ◀" if i == row.sampled_member else text


def members_parts(row: SupportRow, width: int) -> Parts:
    """Members by logit within ``width`` cells: as many as fit, then ``… +N``; the sampled member is
    always shown (after the ellipsis, with its rank, when it ranks too low to fit in order)."""
    if row.empty:
        return [(f"no members: {row.k} slot(s), all padding", DIM)]
    order = row.ranked()
    texts = [member_text(row, i) for i in order]
    j = row.sampled_member
    rank = order.index(j) if j is not None else None
    missing: Parts = [] if j is not None else [(f"  ✗ sampled {row.sampled_id} not in row", FAIL)]

    def tail(n: int) -> Parts:
        """What follows the first ``n`` members."""
        hidden = len(order) - n
        if not hidden:
            return []
        if rank is not None and rank >= n:
            more = [(f" +{hidden - 1}", DIM)] if hidden > 1 else []
            return [(f" … #{rank + 1} ", DIM), (texts[rank], SAMPLED)] + more
        return [(f" … +{hidden}", DIM)]

    def cells(parts: Parts) -> int:
        return sum(cell_len(t) for t, _ in parts)

    fixed = cells(missing)
    shown, used = 1, cell_len(texts[0])
    while shown < len(order):
        step = len(SEP) + cell_len(texts[shown])
        if used + step + cells(tail(shown + 1)) + fixed > width:
            break
        used += step
        shown += 1
    parts: Parts = []
    for n, (i, text) in enumerate(zip(order[:shown], texts)):
        if n:
            parts.append((SEP, DIM))
        parts.append((text, SAMPLED if i == j else None))
    return parts + tail(shown) + missing


def fit_parts(parts: Parts, width: int) -> Parts:
    """``parts`` cut to ``width`` cells, ending in ``…`` where something was cut."""
    out: Parts = []
    used = 0
    for text, style in parts:
        n = cell_len(text)
        if used + n <= width:
            out.append((text, style))
            used += n
            continue
        room = width - used
        if room > 0:
            out.append((set_cell_size(text, room - 1) + "…" if room > 1 else "…", style))
        break
    return out


def status_parts(row: SupportRow) -> Parts:
    """What the row is: an invariant it breaks, the synthetic EOS, a missing sampled id, or the sampled
    member's rank, probability and ``logp_S``."""
    if row.issues:
        field, text = row.issues[0]
        more = f" (+{len(row.issues) - 1} more)" if len(row.issues) > 1 else ""
        return [(f"✗ {safe(field)}: {safe(text)}{more}", FAIL)]  # the report's message may quote the bundle
    if row.empty:
        if row.eos:
            full = f"={row.full_log_prob:.6g}" if row.full_log_prob is not None else ""
            return [(f"∅ no support row: appended EOS (sampled {row.sampled_id}), scored with full_log_probs{full}",
                     WARN)]
        return [(f"∅ no support row (sampled {row.sampled_id}; loss mask {row.loss_mask}: not compared)", DIM)]
    if row.sampled_member is None:
        return [(f"sampled {row.sampled_id} is not in its row (loss mask {row.loss_mask}: not compared)", WARN)]
    p = row.probs[row.sampled_member]
    parts: Parts = [(f"sampled {row.sampled_id}", LABEL),
                    (f" · rank {row.rank_of_sampled()}/{len(row.ids)} · p={fmt_prob(p).strip()} · "
                     f"logp_S={row.logp_s:.6g}", None)]
    if row.padding:
        parts.append((f" · {row.padding} padding", DIM))
    if not row.loss_mask:
        parts.append((" · loss mask 0", DIM))
    return parts


class SupportStrip(Widget):
    """Shown under a per-token diff when the bundle records support rows (``DiffPanel`` decides)."""

    DEFAULT_CSS = """
    SupportStrip { height: 2; background: $boost; display: none; }
    """

    def __init__(self, view: FollowedView, *, id: str | None = None) -> None:
        """``view``: the DiffView whose cursor this strip follows."""
        super().__init__(id=id)
        self.view = view
        self.model: Optional[ReplayModel] = None
        self._key: tuple = ()
        self._row: Union[SupportRow, str, None] = None

    @property
    def wanted(self) -> bool:
        diff = self.view.diff
        return self.model is not None and self.model.has_support and diff is not None and diff.kind == KIND_TOKEN

    @property
    def row(self) -> Union[SupportRow, str, None]:
        """The support row under the cursor; a string says why there is none."""
        diff = self.view.diff
        if not self.wanted:
            return None
        key = (id(self.model), id(diff), self.view.cursor)
        if key != self._key:
            self._key = key
            try:
                self._row = self.model.support_row(diff.sample_id, self.view.cursor)
            except (KeyError, IndexError) as exc:
                self._row = str(exc.args[0])
        return self._row

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self.rich_style
        row = self.row
        if row is None or y >= self.size.height:
            return Strip.blank(width, base)
        offset = self.view.cursor
        if isinstance(row, str):
            parts: Parts = [(f"support {self.view.diff.sample_id}@{offset} ", LABEL), (row, DIM)] if y == 0 else []
            return strip_of(fit_parts(parts, width), width, base)
        if self.size.height == 1:  # members only, unless the row is broken or empty (✗ / ∅ say which)
            head = f"@{offset} "
            body = status_parts(row) if row.issues or row.empty else members_parts(row, width - len(head))
            return strip_of(fit_parts([(head, LABEL)] + body, width), width, base)
        if y == 0:
            head = f"support {row.sample_id}@{offset}: "
            return strip_of(fit_parts([(head, LABEL)] + status_parts(row), width), width, base)
        label = "" if row.empty else "top by logit "
        return strip_of(fit_parts([(label, DIM)] + members_parts(row, width - len(label)), width), width, base)
