"""The support strip's row: one token's sampled-support check (:class:`SupportRow`).

Part of :mod:`replay_tui.model` (pure data, no Textual)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from replay_lib.judge.report import ReplayReport
from replay_lib.kernels.support import SUPPORT_PAD, support_logprobs
from replay_lib.stages.support import SupportTokens

from .fields import SUPPORT_STAGE
from .recompute import ShardRecompute


@dataclass(frozen=True)
class SupportRow:
    """The recorded support of one response token, for the support strip under the diff rows.

    ``ids``/``logits``/``probs`` list the members (slots with an id ≥ 0) in recorded slot order; ``probs``
    are the renormalized probabilities ``exp(logp_S(member))`` from the stage's kernel, so the sampled
    member's entry is ``exp(logp_S(y))``. ``issues`` are ``(stage field, text)`` pairs: the report's message
    where the report kept that divergence, else a short description of the broken invariant."""

    sample_id: str
    token_offset: int
    k: int  # slots per row (members + padding)
    ids: tuple[int, ...]
    logits: tuple[float, ...]
    probs: tuple[float, ...]
    sampled_id: int
    sampled_member: Optional[int]  # index into ``ids`` of the sampled token; None when it is not a member
    padding: int  # slots that are not members (−1 padding, or a negative id)
    loss_mask: int
    logp_s: float  # NaN without members or without the sampled token
    full_log_prob: Optional[float]
    eos: bool  # the one loss-bearing token of its trajectory allowed without support (the appended EOS)
    issues: tuple[tuple[str, str], ...] = ()

    @property
    def empty(self) -> bool:
        return not self.ids

    def ranked(self) -> list[int]:
        """Member indices by logit, highest first (recorded order among equal logits)."""
        return sorted(range(len(self.ids)), key=lambda i: (-self.logits[i], i))

    def rank_of_sampled(self) -> Optional[int]:
        """1-based rank of the sampled member by logit."""
        if self.sampled_member is None:
            return None
        return self.ranked().index(self.sampled_member) + 1

def _row_issue_text(field_name: str, sup: SupportTokens, t: int, vocab: Optional[int]) -> str:
    row = sup.ids[t].tolist()
    y = int(sup.sampled[t])
    if field_name == "support_id_range":
        bad = next(x for x in row if x < SUPPORT_PAD or (vocab is not None and x >= vocab))
        return f"support id {bad} is outside [-1, vocab_size={vocab})"
    if field_name == "support_padding":
        return "padding (-1) precedes a member; padding must be trailing"
    if field_name == "support_duplicate":
        members = [x for x in row if x >= 0]
        dup = next(x for x in members if members.count(x) > 1)
        return f"member id {dup} appears {members.count(dup)} times in the row"
    if field_name == "sampled_id_range":
        return f"sampled token id {y} is outside [0, vocab_size={vocab})"
    if field_name == "sampled_not_in_support":
        return f"sampled token {y} is not in its support row"
    if field_name == "unsupported_token":
        return "loss-bearing token without support that is not its trajectory's one appended EOS"
    if field_name == "full_log_probs":
        return "token without support needs its full-vocabulary log-prob; the bundle has no full_log_probs"
    if field_name == "routed_experts":
        return "routed expert id out of range or repeated within a layer"
    if field_name == "cp_shard":
        return "cp_shard outside [0, identity.rank.cp)"
    return field_name

def support_row(shard: ShardRecompute, index: int, offset: int,
                report: Optional[ReplayReport] = None) -> SupportRow:
    """The support row of token ``offset`` of sample ``index`` (in the shard's index order). O(K): cheap
    enough to run on every cursor move, whatever the sample's length. Raises ``IndexError`` for an offset
    outside the sample and ``StageInputError`` for unusable support payloads."""
    ctx = shard.ctx
    n = int(ctx.lengths[index])
    if not 0 <= offset < n:
        raise IndexError(f"token offset {offset} outside sample {ctx.sample_ids[index]} ({n} token(s))")
    sup = shard.support_tokens()
    t = int(ctx.offsets[index]) + offset
    row_ids = sup.ids[t]
    member = row_ids >= 0
    ids = row_ids[member].to(torch.int64)
    logits = sup.logits[t][member].to(torch.float32)
    if ids.numel():
        # every member's logp_S with the stage's kernel: the row repeated once per member, each "sampled"
        m = ids.numel()
        logp = support_logprobs(ids[None, :].expand(m, m).contiguous(), logits[None, :].expand(m, m).contiguous(),
                                ids)
        probs = tuple(torch.exp(logp.to(torch.float64)).tolist())
    else:
        probs = ()
    y = int(sup.sampled[t])
    id_list = ids.tolist()
    sampled_member = id_list.index(y) if y in id_list else None
    sample_id = ctx.sample_ids[index]
    messages = {}
    if report is not None:
        stage = report.stage(SUPPORT_STAGE)
        for d in stage.divergences if stage is not None else ():
            if d.sample_id == sample_id and d.token_offset == offset and d.message and d.rank == shard.rank:
                messages.setdefault(d.field, d.message)
    issues = tuple((f, messages.get(f) or _row_issue_text(f, sup, t, ctx.config.vocab_size))
                   for f, flags in sup.invariants.items() if bool(flags[t]))
    return SupportRow(
        sample_id=sample_id, token_offset=offset, k=int(row_ids.numel()), ids=tuple(id_list),
        logits=tuple(logits.tolist()), probs=probs, sampled_id=y, sampled_member=sampled_member,
        padding=int((~member).sum()), loss_mask=int(ctx.mask_rows(t, t + 1)[0]), logp_s=float(sup.actual[t])
        if bool(sup.rows.has_support[t]) else float("nan"),
        full_log_prob=float(sup.full[t]) if sup.full is not None else None, eos=bool(sup.allowed_eos[t]),
        issues=issues,
    )
