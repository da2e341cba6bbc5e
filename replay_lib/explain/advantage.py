"""``advantage.estimate`` hypotheses: the advantages are not the normalized rewards broadcast, but

* the **raw** rewards broadcast (un-normalized);
* the normalized rewards **negated** (sign-flipped);
* **shifted by one token** along the packed token axis (``A'[t] = A[t − 1]``, later, or ``A[t + 1]``,
  earlier: a sample's first or last token carries its neighbour's value), or inside every sample (the
  vacated token 0);
* **permuted between samples**: the recorded per-sample values are the normalized rewards of other samples
  (as a multiset they equal the normalized rewards, within tolerance, and some sample holds another's).

The normalized rewards are the ones the stage consumed on its recorded inputs (teacher forcing:
``stages.advantage.grpo_rewards``). Each value's own bound is ``error_model.advantage_bound``.

Under a per-token estimator (REINFORCE++, GAE, token returns) or whitening (:func:`token_hypotheses`), the
stage's own estimate with one knob changed, judged with the stage's tolerance:

* GAE with ``λ = 1`` (Monte-Carlo returns minus the values) or ``λ = 0`` (one-step TD) where another λ is declared;
* the advantages whitened **per consumer batch** (each batch's loss tokens its own mean and std) instead of over
  the step's loss tokens, for each placement of the recorded consumer batches (``reward.consumer_batch_layouts``);
* whitening switched (not whitened where declared, whitened where not);
* with the KL in the token rewards (``kl_in_reward=token_returns``), the penalty added instead of subtracted.
"""

from __future__ import annotations

import bisect
from typing import Optional

import torch

from ..judge.error_model import advantage_bound, unit_roundoff
from ..judge.fields import FieldResult
from ..kernels import GrpoReturns
from ..stages import StageContext
from ..stages.advantage import grpo_rewards, recorded_token_rewards
from .base import Hypothesis, listing

STAGE = "advantage.estimate"


class _SampleOf:
    """The sample of each token of a contiguous range (a marks-and-cumsum scan, as ``kernels.token_chunks``
    does), remembered for the last few ranges: the hypotheses of the stage read the same row blocks, each
    shifted by at most one token."""

    def __init__(self, returns: GrpoReturns, lengths: torch.Tensor) -> None:
        self.returns = returns
        self.ends = returns.ends.tolist()
        self.starts = returns.ends - lengths.to(torch.int64)
        self.memo: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, lo: int, hi: int) -> torch.Tensor:
        key = (lo, hi)
        if key not in self.memo:
            if len(self.memo) > 8:
                self.memo.clear()
            first, last = bisect.bisect_right(self.ends, lo), bisect.bisect_right(self.ends, hi - 1)
            marks = torch.zeros(hi - lo, dtype=torch.int64)
            marks.index_add_(0, self.starts[first + 1:last + 1] - lo, torch.ones(last - first, dtype=torch.int64))
            self.memo[key] = marks.cumsum_(0).add_(first)
        return self.memo[key]


def _broadcast(rewards: torch.Tensor, sample_of: _SampleOf, u: float, shift: int = 0, in_sample: bool = False):
    """``(values, bound)`` columns of ``rewards`` broadcast over the tokens, each token reading the one ``shift``
    tokens before it (0 past either end; ``in_sample``: 0 where that token is another sample's)."""
    total = sample_of.returns.numel()
    last: dict[tuple[int, int], torch.Tensor] = {}

    def values(lo: int, hi: int) -> torch.Tensor:
        if (lo, hi) in last:
            return last[(lo, hi)]
        out = torch.zeros(hi - lo, dtype=torch.float64)
        a, b = max(lo - shift, 0), min(hi - shift, total)  # the source tokens inside the axis
        if a < b:
            src_sample = sample_of(a, b)
            keep = torch.ones(b - a, dtype=torch.bool)
            if in_sample:
                keep = src_sample == sample_of(a + shift, b + shift)
            out[a + shift - lo:b + shift - lo] = torch.where(keep, rewards[src_sample], torch.zeros(b - a,
                                                                                                 dtype=torch.float64))
        last.clear()
        last[(lo, hi)] = out
        return out

    def bound(lo: int, hi: int) -> torch.Tensor:
        return advantage_bound(values(lo, hi), u)

    return values, bound


def _permutation(ctx: StageContext, rewards: torch.Tensor, recorded: torch.Tensor, u: float) -> Optional[torch.Tensor]:
    """The sample whose normalized reward each sample's recorded advantages hold, when the recorded per-sample
    values are the normalized rewards rearranged (module doc); ``None`` otherwise."""
    nonempty = torch.nonzero(ctx.lengths > 0).reshape(-1)
    if nonempty.numel() < 2:
        return None
    starts = (torch.cumsum(ctx.lengths, 0) - ctx.lengths)[nonempty]
    rec = recorded[starts].to(torch.float64)
    cor = rewards[nonempty]
    tol = advantage_bound(cor, u) + 1e-6 + 1e-5 * cor.abs()
    rs, _ = torch.sort(rec)
    cs, corder = torch.sort(cor)
    if not bool(((rs - cs).abs() <= torch.maximum(tol[corder], advantage_bound(rs, u) + 1e-6 + 1e-5 * rs.abs())).all()):
        return None
    at = torch.searchsorted(cs, rec).clamp(max=cs.numel() - 1)
    below = (at - 1).clamp(min=0)
    nearest = torch.where((cs[below] - rec).abs() < (cs[at] - rec).abs(), below, at)
    source = nonempty[corder[nearest]]
    stays = (rec - cor).abs() <= tol
    source = torch.where(stays, nonempty, source)
    if bool(stays.all()):
        return None
    full = torch.arange(ctx.n, dtype=torch.int64)
    full[nonempty] = source
    return full


class _Configured:
    """``ctx`` read with another config (every other attribute is the context's own; hazards are not recorded):
    the stage's estimate of a hypothesized knob."""

    def __init__(self, ctx: StageContext, config) -> None:
        self._ctx = ctx
        self.config = config

    def __getattr__(self, name: str):
        if name in ("hazard", "coarse_payload_hazard"):
            return lambda *args, **kwargs: None
        return getattr(self._ctx, name)


def token_hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    """The per-token estimators' and whitening's hypotheses (module doc), over a whole shard (a selection's
    whitening statistics are the shard's: not varied here)."""
    import msgspec

    from ..kernels import whiten
    from ..stages.advantage import _TokenEstimate, estimate_kind, whiten_modes, whitens
    from ..stages.base import StageInputError
    from .reward import consumer_batch_layouts

    cfg = ctx.config
    if ctx.partial or not any(f.name == "advantage" for f in fields) or not ctx.has("advantages"):
        return []
    out: list[Hypothesis] = []

    def estimate(config):
        try:
            est = _TokenEstimate(_Configured(ctx, config))
        except (StageInputError, ValueError):
            return None
        return est

    def add(hid: str, detail: str, values: torch.Tensor, returns: Optional[torch.Tensor] = None) -> None:
        columns = {"advantage": values.to(torch.float64)}
        if returns is not None and any(f.name == "returns" for f in fields):
            columns["returns"] = returns.to(torch.float64)
        out.append(Hypothesis(stage=STAGE, id=hid, detail=detail, values=columns))

    if estimate_kind(cfg) == "gae":
        for lam in (1.0, 0.0):
            if float(cfg.lam) == lam:
                continue
            est = estimate(msgspec.structs.replace(cfg, lam=lam))
            if est is not None:
                what = "Monte-Carlo returns minus the values" if lam == 1.0 else "one-step TD errors"
                add(f"advantage.gae_lambda_{lam:g}", f"the recorded advantages are GAE with λ={lam:g} ({what}): the "
                    f"declared λ={cfg.lam:g} was not applied", est.finish(None, 0.0)[0], est.returns)
    if cfg.kl_in_reward == "token_returns" and cfg.kl_coef != 0:
        flipped = estimate(msgspec.structs.replace(cfg, kl_coef=-cfg.kl_coef))
        if flipped is not None:
            add("advantage.kl_sign", f"the recorded advantages are returns of token rewards with the KL penalty "
                f"added, r + {cfg.kl_coef:g}·kl (config: r − {cfg.kl_coef:g}·kl)", flipped.finish(None, 0.0)[0],
                flipped.returns)
    est = estimate(cfg)
    if est is None:
        return out
    if est.whiten_stats is None and whitens(cfg):
        variance, eps_mode = whiten_modes(cfg)
        pre = est.pre.to(torch.float64)
        mask = est.mask
        for ids, batch, size in consumer_batch_layouts(ctx):
            if len(ids) < 2:
                continue
            values = pre.clone()
            of_token = batch[ctx.seg]
            for b in range(len(ids)):
                at = torch.nonzero(of_token == b).reshape(-1)
                if at.numel() and bool((mask[at] != 0).any()):
                    values[at] = whiten(pre[at], mask[at], dtype=torch.float64, variance=variance, eps_mode=eps_mode)
            sized = "" if size is None else f" of {size} samples"
            add("advantage.whitened_per_consumer_batch" + ("" if size is None else f"_{size}"),
                f"the recorded advantages are whitened per consumer batch{sized} ({listing(ids)}: each batch's loss "
                f"tokens their own mean and std) instead of over the step's loss tokens", values)
        add("advantage.not_whitened", "the recorded advantages are not whitened (config: whitened over the step's "
            "loss tokens)", pre)
    elif not whitens(cfg) and bool((est.mask != 0).sum() > 1):
        add("advantage.whitened", "the recorded advantages are whitened over the step's loss tokens (config: not "
            "whitened)", whiten(est.pre.to(torch.float64), est.mask, dtype=torch.float64))
    return out


def hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    cfg = ctx.config
    grpo = cfg.advantage_estimator == "grpo" and not cfg.normalize_advantages and cfg.kl_in_reward is None
    if not grpo:
        return token_hypotheses(ctx, fields)
    if not any(f.name == "advantage" for f in fields) or not ctx.has("advantages"):
        return []  # only GRPO's broadcast rewards are varied here
    if recorded_token_rewards(ctx) is not None:
        return []  # per-token rewards: no per-sample reward to vary
    recorded = ctx.payload("advantages")
    u = unit_roundoff(recorded)
    rewards, _ = grpo_rewards(ctx)
    rewards = rewards.to(torch.float64)
    out: list[Hypothesis] = []

    sample_of = _SampleOf(GrpoReturns(rewards, ctx.lengths, dtype=torch.float64), ctx.lengths)

    def add(hid: str, detail: str, per_sample: torch.Tensor, shift: int = 0, in_sample: bool = False) -> None:
        values, bound = _broadcast(per_sample.to(torch.float64), sample_of, u, shift, in_sample)
        out.append(Hypothesis(stage=STAGE, id=hid, detail=detail, values={"advantage": values},
                              bounds={"advantage": bound}))

    raw = ctx.raw_rewards
    if bool(torch.isfinite(raw).all()):
        add("advantage.unnormalized", "the recorded advantages are the raw rewards broadcast (not normalized)", raw)
    add("advantage.sign_flipped", "the recorded advantages are the normalized rewards negated", -rewards)
    add("advantage.shifted_later", "the recorded advantages are shifted one token later along the packed tokens "
        "(each sample's first token holds the previous sample's)", rewards, shift=1)
    add("advantage.shifted_earlier", "the recorded advantages are shifted one token earlier along the packed "
        "tokens (each sample's last token holds the next sample's)", rewards, shift=-1)
    add("advantage.shifted_later_in_sample", "the recorded advantages are shifted one token later inside every "
        "sample (its first token 0)", rewards, shift=1, in_sample=True)
    add("advantage.shifted_earlier_in_sample", "the recorded advantages are shifted one token earlier inside "
        "every sample (its last token 0)", rewards, shift=-1, in_sample=True)
    source = _permutation(ctx, rewards, recorded, u)
    if source is not None:
        moved = [i for i in range(ctx.n) if int(source[i]) != i]
        pairs = [f"{ctx.sample_ids[i]} has {ctx.sample_ids[int(source[i])]}'s" for i in moved]
        add("advantage.permuted", f"the recorded advantages are the normalized rewards permuted between samples "
            f"({listing(pairs, 3)})", rewards[source])
    return out
