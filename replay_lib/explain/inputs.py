"""The inputs of one compared element: what a stage consumed to produce it, as data a view prints.

``element_inputs(ctx, field, index, offset)`` answers "why is this value what it is" for the element under a
debugger's cursor: for a (raw or normalized) reward, its semantic group's raw rewards, their mean and unbiased
std, the eps and the formula, and each member's micro-batch and consumer batch; for a KL token, the two
log-probs, ``r = old − ref`` and the estimator's formula with its value; for an advantage token, the sample's
normalized reward it broadcasts; for a token of a loss field (``pg_losses``, or a per-sample loss term), the
ratio, its clip region, the mask, the advantage, the clipped surrogate and the token's contribution to the
sample's term. Values are recomputed here in float64 from the context's recorded inputs with the kernels
(``replay_lib.kernels``), the same formulas the stages compare, so the strip and the report agree.

Headless (no Textual); cheap enough for every cursor move: O(1) per token, O(group) per reward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from collections.abc import Sequence
from typing import Optional

import msgspec
import torch

from ..kernels import KL_CLAMP, compute_approx_kl, policy_loss_terms
from ..kernels.loss import sample_term
from ..kernels.reward import OWN_RULE_ESTIMATORS, batch_std, group_moments, group_rule, post_process
from ..bundle.loss_knobs import LossKnobs
from ..judge.report import fmt_value
from ..bundle.selection import group_label
from ..stages.base import StageContext, StageInputError

REWARD_FIELDS = ("raw_reward", "reward")
LOSS_TOKEN_FIELDS = ("pg_losses",)
GRAD_TOKEN_FIELDS = ("grad_log_probs",)
LOSS_SAMPLE_FIELDS = ("pg_sum", "entropy_sum", "kl_sum", "clip_count", "mask_count", "pg_contribution")
NOT_RECORDED = "—"

KL_FORMULAS = {
    "k1": "kl = r",
    "k2": "kl = r²/2",
    "k3": "kl = exp(−r) − 1 + r",
    "low_var_kl": f"kl = clamp(exp(−r) − 1 + r, ±{KL_CLAMP:g})",
}


@dataclass(frozen=True)
class ElementInputs:
    """What produced one element: ``items`` are ``(label, value)`` pairs in reading order (values already in
    the CLI's number format), ``formula`` the computation with its inputs substituted, ``members`` one
    ``(sample, micro-batch, consumer batch)`` per sample of a reward's group, ``note`` what the element adds
    to (a loss token's share of its sample's terms)."""

    field: str
    sample_id: Optional[str]
    offset: Optional[int]
    formula: str
    items: tuple[tuple[str, str], ...] = ()
    members: tuple[tuple[str, str, str], ...] = ()
    note: str = ""

    def lines(self) -> list[str]:
        """Plain text, one line per part (for a text view or a test)."""
        out = [self.formula] if self.formula else []
        if self.items:
            out.append("  ".join(f"{k} {v}" for k, v in self.items))
        if self.members:
            out.append("  ".join(f"{s} {m}/{c}" for s, m, c in self.members))
        if self.note:
            out.append(self.note)
        return out


def fmt(x: Optional[float]) -> str:
    """A number as the report prints it; ``nan`` for a missing one."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "nan"
    return fmt_value(float(x))


def fmt_count(x: float) -> str:
    """A mask value or a token count: ``1``, ``4`` (a fractional mask keeps its digits)."""
    return str(int(x)) if float(x).is_integer() else fmt(x)


STREAM_MARK = "~"


def consumer_batch_labels(ctx: StageContext) -> "BatchLabels":
    """Each sample's consumer (transfer) batch, in ``ctx``'s sample order: the recorded ``consumer_batch_id``
    (SPEC §3: optional, per sample); else, when the identity lists ``k`` consumer batches for ``n`` samples, the
    batch a stream consumer would take it in — consecutive runs of ``⌈n / k⌉`` of the index, marked ``~``
    (``~cb-0``: a layout, not a record; the explanations test the same one, ``explain.reward``); else ``—``.
    Computed once per context."""
    cached = ctx.records.get("consumer_batches")
    if cached is None:
        from .reward import consumer_batches, recorded_consumer_batch

        samples = ctx.reader.index.samples
        placed = consumer_batches(ctx)
        if placed is None:
            cached = BatchLabels([NOT_RECORDED], [0] * len(ctx.indices))
        else:
            ids, label = placed
            recorded = all(recorded_consumer_batch(r) is not None for r in samples)
            mark = "" if recorded else STREAM_MARK
            which = label.tolist()
            cached = BatchLabels([mark + str(i) for i in ids], [which[i] for i in ctx.indices] if ctx.partial else which)
        ctx.records["consumer_batches"] = cached
    return cached


class BatchLabels(Sequence[str]):
    """Each sample's consumer batch label (:func:`consumer_batch_labels`): a few batch names and each sample's
    batch, the label made when a row asks for it (a step's thousands of rows draw a screenful)."""

    def __init__(self, names: list[str], which: list[int]) -> None:
        self.names, self.which = names, which

    def __len__(self) -> int:
        return len(self.which)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.names[k] for k in self.which[i]]
        return self.names[self.which[i]]

    def recorded_any(self) -> bool:
        """Some sample sits in a consumer batch (recorded, or by stream order)."""
        return any(self.names[k] != NOT_RECORDED for k in set(self.which))


def element_inputs(ctx: StageContext, field: str, index: int, offset: Optional[int] = None) -> ElementInputs:
    """The inputs of ``field``'s element for sample ``index`` (in ``ctx``'s sample order) and, for a per-token
    field, its token ``offset``. Raises ``KeyError`` for a field without an input breakdown, ``IndexError``
    for an offset outside the sample, :class:`StageInputError` when the inputs are unusable."""
    if not 0 <= index < len(ctx.samples):
        raise IndexError(f"sample index {index} outside 0..{len(ctx.samples) - 1}")
    if field == "raw_reward":
        return raw_reward_inputs(ctx, index)
    if field in REWARD_FIELDS:
        return reward_inputs(ctx, field, index)
    if field in LOSS_SAMPLE_FIELDS:
        return loss_sample_inputs(ctx, field, index)
    if offset is None:
        raise KeyError(f"{field} needs a token offset")
    n = int(ctx.lengths[index])
    if not 0 <= offset < n:
        raise IndexError(f"token offset {offset} outside sample {ctx.sample_ids[index]} ({n} token(s))")
    t = int(ctx.offsets[index]) + offset
    if field == "kl":
        return kl_inputs(ctx, index, offset, t)
    if field == "advantage":
        return advantage_inputs(ctx, index, offset, t)
    if field in LOSS_TOKEN_FIELDS:
        return loss_token_inputs(ctx, field, index, offset, t)
    if field in GRAD_TOKEN_FIELDS:
        return grad_token_inputs(ctx, field, index, offset, t)

    if field == "token_reward":  # a recorded per-token reward against its sample's normalized reward
        base = reward_inputs(ctx, "reward", index)
        recorded = ctx.samples[index].reward
        value = recorded[offset] if type(recorded) is list else recorded
        return replace(base, field=field, offset=offset,
                        formula=f"each token of a per-token reward = the sample's normalized reward: {base.formula}",
                        items=(("token", fmt(value)), *base.items))
    raise KeyError(f"no input breakdown for field {field!r}")


# ------------------------------------------------------------------------------------------ rewards


def raw_reward_inputs(ctx: StageContext, index: int) -> ElementInputs:
    """What reward.raw compares for one sample: the raw reward the trainer normalized (the sample's recorded
    ``raw_reward``, the actual column) against the reward functions' scores as returned (expected.json
    ``reward.raw.raw_rewards``, the expected column) — two recorded values, nothing recomputed — with the
    per-function rewards and their weights where the bundle records them."""
    record = ctx.samples[index]
    recorded = ctx.reader.expected.get("reward.raw", {})
    recorded = recorded if isinstance(recorded, dict) else {}
    returned = recorded.get("raw_rewards")
    n = len(ctx.reader.index.samples)
    position = ctx.indices[index] if ctx.partial else index
    scores = returned[position] if isinstance(returned, list) and len(returned) == n else None
    number = (int, float)
    formula = (f"the trainer normalized raw_reward {fmt(record.raw_reward)} (samples[].raw_reward); the reward "
               f"functions returned {fmt(scores) if isinstance(scores, number) else NOT_RECORDED} "
               f"(expected.json reward.raw.raw_rewards) — both recorded, nothing recomputed")
    items: list[tuple[str, str]] = []
    per_func, weights = recorded.get("rewards_per_func"), recorded.get("reward_weights")
    if isinstance(per_func, list) and n and len(per_func) % n == 0 and len(per_func) // n <= 64:
        k = len(per_func) // n
        row = per_func[position * k:(position + 1) * k]
        if all(isinstance(x, number) for x in row):
            items.append(("per function", "[" + ", ".join(fmt(float(x)) for x in row) + "]"))
    if isinstance(weights, list) and len(weights) <= 64 and all(isinstance(x, number) for x in weights):
        items.append(("weights", "[" + ", ".join(fmt(float(x)) for x in weights) + "]"))
    return ElementInputs(field="raw_reward", sample_id=record.sample_id, offset=None, formula=formula,
                         items=tuple(items))


def reward_inputs(ctx: StageContext, field: str, index: int) -> ElementInputs:
    """A reward's group: raw rewards, mean, std, eps, the normalization formula of the configured rule (baseline,
    std bias, eps, zero-std and singleton rules: ``kernels.group_rule``) with its value (the stage's kernel
    ``post_process`` on the group, in float64), and each member's micro-batch and consumer batch."""
    record = ctx.samples[index]
    g = record.group_index
    members = [j for j, gi in enumerate(ctx.group_indices) if gi == g] if g is not None else [index]
    raw = [ctx.samples[j].raw_reward for j in members]
    batches = consumer_batch_labels(ctx)
    people = tuple((ctx.sample_ids[j], ctx.samples[j].micro_batch_id or NOT_RECORDED, batches[j]) for j in members)
    if g is None or any(r is None for r in raw):
        why = "no group_index" if g is None else "a member has no raw reward"
        return ElementInputs(field=field, sample_id=record.sample_id, offset=None, formula=f"not normalized: {why}",
                             items=(("raw", fmt(record.raw_reward)),), members=people)
    r = torch.tensor(raw, dtype=torch.float64)
    rule = group_rule(ctx.config)
    me = members.index(index)
    # the stage's own kernels on this group: the value under the configured rule, and the baseline and std it
    # used (a leave-one-out std is the std of the other rewards, not the group's)
    one_group = torch.zeros(r.numel(), dtype=torch.int64)
    whole = None  # grpo_std_scope=batch: the std of every raw reward of the bundle, not the group's
    if rule.std_scope == "batch":
        whole = batch_std(torch.tensor([float("nan") if s.raw_reward is None else float(s.raw_reward)
                                        for s in ctx.reader.index.samples], dtype=torch.float64), unbiased=rule.unbiased)
    value = float(post_process(r, one_group, rule, dtype=torch.float64, scope_std=whole)[me])
    _, _, centered, stds = group_moments(r, one_group, torch.float64, unbiased=rule.unbiased, baseline=rule.baseline,
                                         std_scope=rule.std_scope, scope_std=whole)
    mean = float(r.mean())
    std = float(stds[me]) if r.numel() > 1 else float("nan")
    mine = float(record.raw_reward)
    std_on = rule.std
    if ctx.config.advantage_estimator in OWN_RULE_ESTIMATORS:  # the estimator's own rule (stages.reward)
        from ..stages.reward import own_rule_text

        own = ctx.outputs.get("rewards")
        shown = fmt(float(own[index])) if own is not None and index < own.numel() else "(not recomputed)"
        formula = (f"{ctx.config.advantage_estimator}: "
                   f"{own_rule_text(ctx.config, group_rule(msgspec.structs.replace(ctx.config, advantage_estimator='grpo')))}"
                   f" = {shown}")
    elif not rule.center:
        formula = f"{ctx.config.advantage_estimator}: the score passes through unchanged = {fmt(value)}"
    else:
        loo = rule.baseline == "leave_one_out"
        b = "b" if loo else "mean"
        base = mine - float(centered[me])  # r − (r − b)
        if std_on:
            formula = f"(r − {b}) / (std + eps) = ({fmt(mine)} − {fmt(base)}) / ({fmt(std)} + {rule.eps:g}) = {fmt(value)}"
            notes = ([] if rule.unbiased else ["biased std"]) + (["the whole batch's std"] if whole is not None else []) \
                + (["divided only where std > 0"] if rule.std_zero == "skip" else [])
            formula += f" ({', '.join(notes)})" if notes else ""
        else:
            formula = f"r − {b} = {fmt(mine)} − {fmt(base)} = {fmt(value)} (std normalization off)"
        if loo:
            formula += "; b = the mean of the group's other rewards (leave-one-out)"
        if r.numel() == 1 and rule.singleton is not None:
            formula += f"; a one-sample group: singleton_group={rule.singleton}"
    if ctx.config.kl_in_reward is not None:
        formula += f"; the score is the raw reward minus KL (kl_in_reward={ctx.config.kl_in_reward})"
    if field == "raw_reward":
        formula = f"raw reward {fmt(mine)} as recorded; normalized: " + formula
    # under leave-one-out the baseline and the std are the other rewards' (what the formula used), named so
    loo = rule.center and rule.baseline == "leave_one_out"
    stats = (("b (others' mean)", fmt(mine - float(centered[me]))), ("others' std", fmt(std))) if loo else \
        (("mean", fmt(mean)), ("std", fmt(std)))
    items = (("group", group_label(g)), ("raw", "[" + ", ".join(fmt(x) for x in raw) + "]"), *stats,
             ("eps", f"{rule.eps:g}"), ("std-norm", "on" if std_on else "off"))
    return ElementInputs(field=field, sample_id=record.sample_id, offset=None, formula=formula, items=items,
                         members=people)


# ------------------------------------------------------------------------------------------- tokens


def _at(ctx: StageContext, name: str, t: int) -> float:
    return float(ctx.payload(name)[t].to(torch.float64))


def kl_inputs(ctx: StageContext, index: int, offset: int, t: int) -> ElementInputs:
    """``r = old − ref`` and the estimator (``compute_approx_kl``, float64) of one token."""
    cfg = ctx.config
    sid = ctx.sample_ids[index]
    mask = int(ctx.mask_rows(t, t + 1)[0])
    if cfg.kl_coef == 0:
        return ElementInputs(field="kl", sample_id=sid, offset=offset, formula="kl_coef = 0: kl is 0 at every token",
                             items=(("mask", str(mask)),))
    if not ctx.has("ref_log_probs"):
        raise StageInputError("payload 'ref_log_probs' is required when kl_coef != 0", field="ref_log_probs")
    old, ref = _at(ctx, "old_log_probs", t), _at(ctx, "ref_log_probs", t)
    r = old - ref
    kl = float(compute_approx_kl(torch.tensor([old], dtype=torch.float64), torch.tensor([ref], dtype=torch.float64),
                                 cfg.kl_loss_type, dtype=torch.float64)[0])
    formula = f"{cfg.kl_loss_type}: {KL_FORMULAS.get(cfg.kl_loss_type, 'kl = ?')} = {fmt(kl)}"
    items = (("old", fmt(old)), ("ref", fmt(ref)), ("r = old − ref", fmt(r)), ("kl_coef", f"{cfg.kl_coef:g}"),
             ("mask", str(mask)))
    return ElementInputs(field="kl", sample_id=sid, offset=offset, formula=formula, items=items)


def advantage_inputs(ctx: StageContext, index: int, offset: int, t: int) -> ElementInputs:
    """What an advantage token is made of, by the bundle's estimator (``stages.advantage.estimate_kind``): the
    normalized reward broadcast over the sample's tokens (GRPO and its kin), the discounted returns of the
    per-token rewards (REINFORCE++, the KL in the token rewards), or GAE over the recorded values — then
    whitened where the estimator whitens. Only a broadcast names its value: a recursion's is the Diff pane's."""
    from ..stages.advantage import (estimate_kind, grpo_rewards, recorded_token_rewards,  # what advantage.estimate
                                    whitens)  # consumes
    from ..stages.reward import _reward_kl

    cfg = ctx.config
    record = ctx.samples[index]
    mask = str(int(ctx.mask_rows(t, t + 1)[0]))
    tokens = recorded_token_rewards(ctx)
    if tokens is not None:  # per-token rewards (format 1.2 / 2.0): the token's own, recorded
        reward = float(tokens[t])
        items = (("reward", fmt(reward)), ("group", group_label(record.group_index)), ("mask", mask))
        return ElementInputs(field="advantage", sample_id=record.sample_id, offset=offset,
                             formula=f"A = the token's recorded reward = {fmt(reward)} (per-token rewards)",
                             items=items)
    rewards, _ = grpo_rewards(ctx)
    reward = float(rewards[index])
    items = [("reward", fmt(reward)), ("group", group_label(record.group_index)), ("mask", mask)]
    how = "recomputed by reward.post_process (--chain)" if ctx.chain and "rewards" in ctx.outputs else "recorded"
    kind = estimate_kind(cfg)
    if kind == "broadcast":
        formula = f"A = the sample's normalized reward, broadcast over its {int(ctx.lengths[index])} token(s) = " \
                  f"{fmt(reward)} ({how})"
    else:
        kl_term = " − kl_coef·kl_k" if cfg.kl_in_reward == "token_returns" and cfg.kl_coef != 0 else ""
        reward_k = f"r_k = mask_k·(1[k = last loss token]·reward{kl_term})"
        if kind == "returns":
            formula = f"A_t = Σ_k≥t γ^(k−t)·r_k, {reward_k}, γ = {cfg.gamma:g} (reward {how})"
        else:
            formula = (f"A_t = Σ_k≥t (γλ)^(k−t)·δ_k, δ_k = r_k + γ·V_k+1 − V_k, {reward_k}, γ = {cfg.gamma:g}, "
                       f"λ = {cfg.lam:g} (reward {how})")
            if ctx.has("values"):
                items.append(("V", fmt(float(ctx.payload("values")[t]))))
        if kl_term:
            items += [("kl", fmt(float(_reward_kl(ctx, slice(t, t + 1)).kl[0]))), ("kl_coef", f"{cfg.kl_coef:g}")]
    if whitens(cfg):
        formula += "; then whitened over the loss tokens" + (
            " with the recorded stats" if cfg.advantage_whiten_stats is not None else "")
    return ElementInputs(field="advantage", sample_id=record.sample_id, offset=offset, formula=formula,
                         items=tuple(items))


def _loss_token(ctx: StageContext, t: int) -> dict[str, float]:
    """One token of loss.policy's inputs, the surrogate and its clip decision, in float64."""
    from ..stages.loss import loss_inputs  # the inputs the loss stage consumes (recorded or --chain's)

    li = loss_inputs(ctx)
    cfg = ctx.config
    logp = float(li.log_probs[t].to(torch.float64))
    old = float(li.old_log_probs[t].to(torch.float64))
    adv = float(li.advantages[t:t + 1].to(torch.float64)[0])
    ppo_kl = torch.tensor([old - logp], dtype=torch.float64)
    pg, clipped, ratio = policy_loss_terms(ppo_kl, torch.tensor([adv], dtype=torch.float64), cfg.eps_clip,
                                           cfg.eps_clip_high)
    return {"logp": logp, "old": old, "adv": adv, "ratio": float(ratio[0]), "pg": float(pg[0]),
            "clipped": float(clipped[0]), "mask": float(li.mask[t]), "low": 1.0 - float(cfg.eps_clip),
            "high": 1.0 + float(cfg.eps_clip_high)}


def clip_region(ratio: float, low: float, high: float) -> str:
    """Where the ratio lies against the clip range ``[1 − eps_clip, 1 + eps_clip_high]``."""
    if ratio < low:
        return f"below {fmt(low)}"
    if ratio > high:
        return f"above {fmt(high)}"
    return f"inside [{fmt(low)}, {fmt(high)}]"


def _sample_mask_count(ctx: StageContext, index: int) -> float:
    lo = int(ctx.offsets[index])
    return float(ctx.mask_rows(lo, lo + int(ctx.lengths[index])).sum())


# A loss family's (and the masks') own per-token columns, as the why strip names them (kernels.families).
FAMILY_COLUMNS = (("cispo_weight", "sg(clip(r))"), ("sapo_tau", "τ"), ("sapo_gate", "gate f(r)"),
                  ("dppo_valid", "valid"), ("gm_sample_loss", "sample loss −Ā·R"), ("phi", "φ(w)"), ("log_w", "log w"),
                  ("rollout_ratio", "r kept"), ("prob_diff", "|p − p_inf|"),
                  ("ipo_keep", "kept"), ("opsm_seq_kl", "OPSM seq KL"), ("opsm_keep", "OPSM kept"),
                  ("entropy", "entropy"), ("entropy_threshold", "entropy threshold"), ("entropy_keep", "entropy kept"),
                  ("is_weight", "IS weight"), ("opd_loss", "distillation term"))


def family_token_inputs(ctx: StageContext, field: str, index: int, offset: int, t: int) -> ElementInputs:
    """A loss token under a loss family or a mask (OPSM, the entropy mask, distillation): the family's formula
    with the token's value, and its own columns (``FAMILY_COLUMNS``), from ``kernels.loss.policy_token_terms`` in
    float64 (the per-sample quantities from the step's sample pass, as the stage takes them)."""
    from ..kernels.families import FAMILIES, slice_tokens
    from ..kernels.loss import policy_token_terms, sample_log_terms
    from ..stages.loss import loss_inputs

    li = loss_inputs(ctx)
    knobs = li.knobs
    f64 = torch.float64
    terms = sample_log_terms(li.log_probs, li.old_log_probs, li.rollout_log_probs, li.mask, ctx.lengths, knobs, f64,
                             entropy=li.entropy, advantages=li.advantages, family_tokens=li.family_tokens)
    sl = slice(t, t + 1)

    def at(x):
        return None if x is None else x[sl]

    adv = li.advantages[sl].to(f64)
    tt = policy_token_terms(li.log_probs[sl], li.old_log_probs[sl], adv, knobs, seg=torch.tensor([index]),
                            sample_terms=terms, rollout_log_probs=at(li.rollout_log_probs),
                            ref_log_probs=at(li.ref_log_probs), dtype=f64, entropy=at(li.entropy),
                            teacher_log_probs=at(li.teacher_log_probs),
                            family_tokens=slice_tokens(li.family_tokens, sl))
    pg = float(tt["pg"][0])
    name = knobs.policy_loss
    rule = FAMILIES[name].formula if knobs.family else \
        f"max(−r·A, −clamp(r, {fmt(1 - knobs.eps_clip)}, {fmt(1 + knobs.eps_clip_high)})·A)"
    masks = [m for m, on in (("× OPSM kept", knobs.opsm), ("× entropy kept", knobs.entropy_mask)) if on]
    formula = f"{name}: {rule}{' ' + ' '.join(masks) if masks else ''} = {fmt(pg)}"
    items = [("ratio r", fmt(float(tt["ratio"][0]))), ("A", fmt(float(adv[0]))), ("mask", fmt_count(float(li.mask[t])))]
    items += [(label, fmt(float(tt[key][0]))) for key, label in FAMILY_COLUMNS if key in tt]
    term = pg * float(li.mask[t])
    return ElementInputs(field=field, sample_id=ctx.sample_ids[index], offset=offset, formula=formula,
                         items=tuple(items), note=f"adds pg·mask = {fmt(term)} to {ctx.sample_ids[index]}'s pg_sum")


# families whose per-sample terms are taken over each micro-batch (a covariance's means, a top-k): the why strip
# takes them from the step's sample pass, never from the token's sample alone
STEP_WIDE_FAMILIES = ("kl_cov", "clip_cov")


def loss_token_inputs(ctx: StageContext, field: str, index: int, offset: int, t: int) -> ElementInputs:
    """A loss token: ratio ``exp(logp − old)``, its clip region and decision, mask, advantage, the surrogate
    ``max(−r·A, −clamp(r)·A)`` and its contribution ``pg·mask`` to the sample's ``pg_sum`` and
    ``loss_scale · w_i · pg·mask`` to its term of pg_loss (``w_i`` the loss mode's weight, :func:`pg_term`)."""
    knobs = LossKnobs.of(ctx.config)
    if knobs.opsm or knobs.entropy_mask or knobs.opd_loss or knobs.policy_loss in STEP_WIDE_FAMILIES:
        # a mask or the distillation term (any family), or a family whose per-sample terms span the micro-batch
        return family_token_inputs(ctx, field, index, offset, t)
    if knobs.family:
        return _family_token_inputs(ctx, field, index, offset, t)
    v = _loss_token(ctx, t)
    n_mask = _sample_mask_count(ctx, index)
    term = v["pg"] * v["mask"]
    divisor, w, den = pg_term(ctx, n_mask)
    share = term * w
    branch = "clipped: −clamp(r)·A" if v["clipped"] else "unclipped: −r·A"
    formula = f"pg = max(−r·A, −clamp(r, {fmt(v['low'])}, {fmt(v['high'])})·A) = {fmt(v['pg'])} ({branch})"
    items = (("ratio r", fmt(v["ratio"])), ("clip", clip_region(v["ratio"], v["low"], v["high"])),
             ("mask", fmt_count(v["mask"])), ("A", fmt(v["adv"])))
    sid = ctx.sample_ids[index]
    knobs = LossKnobs.of(ctx.config)
    how = f"÷ {fmt_count(n_mask)} mask tokens" if divisor == "max(Σmask, 1)" and knobs.loss_scale == 1 else \
        f"{_scaled(knobs.loss_scale)}÷ {divisor} = {fmt_count(den)}, {knobs.loss_agg_mode}"
    note = f"adds pg·mask = {fmt(term)} to {sid}'s pg_sum, {fmt(share)} to its pg_loss term ({how})"
    beyond = _loss_knobs_beyond_v1(ctx)
    if beyond:
        note = f"the plain clipped surrogate; this step also applies {beyond} (the stage's values include them)"
    if ctx.has("grad_log_probs"):  # the token's gradient beside its loss term (loss.grad)
        items += (("∂L/∂logp", f"{fmt(float(ctx.payload('grad_log_probs')[t]))} recorded, "
                                f"{fmt(float(_gradient(ctx).grad[t]))} analytic"),)
    return ElementInputs(field=field, sample_id=sid, offset=offset, formula=formula, items=items, note=note)


def _gradient(ctx: StageContext):
    """loss.grad's analytic gradient of this context (``stages.grad.recompute_gradient``, computed once)."""
    from ..stages.grad import recompute_gradient

    return recompute_gradient(ctx)[2]


def grad_token_inputs(ctx: StageContext, field: str, index: int, offset: int, t: int) -> ElementInputs:
    """A gradient token (loss.grad): ``g = W_pg·∂pg + W_kl·∂kl`` with the token's coefficient derived — the clip
    branch its policy term took (``∂pg/∂r = −A`` unclipped, 0 clipped), the ratio and the detached importance
    weight, the aggregation weight ``W_i`` (× loss_scale × grad_scale) and the KL term's share of ``g``."""
    from ..kernels.grad import BRANCHES, grad_scale_of
    from ..stages.grad import recompute_gradient

    gi, knobs, g = recompute_gradient(ctx)
    terms = g.terms
    branch = BRANCHES.get(int(terms.branch[t]), "?") if terms.branch is not None else "?"
    total, pg, kl = float(g.grad[t]), float(g.pg[t]), float(g.kl[t])
    recorded = float(ctx.payload(field)[t])
    formula = (f"∂L/∂logp = W_pg·∂pg/∂logp + W_kl·∂kl/∂logp = {fmt(pg)} + {fmt(kl)} = {fmt(total)} "
               f"(recorded {fmt(recorded)})")
    if g.opd is not None:  # on-policy distillation's loss term: its estimator's slope, × opd_coef × W_pg
        opd = float(g.opd[t])
        formula = (f"∂L/∂logp = W_pg·∂pg/∂logp + W_kl·∂kl/∂logp + opd_coef·W_pg·∂opd/∂logp = {fmt(pg)} + "
                   f"{fmt(kl)} + {fmt(opd)} = {fmt(total)} (recorded {fmt(recorded)})")
    items = [("branch", branch), ("ratio r", fmt(float(terms.ratio[t]))), ("A", fmt(float(gi.advantages[t]))),
             ("mask", fmt_count(float(gi.mask[t])))]
    if gi.keep is not None:  # slime's MIS rejection: 0 where the token's terms left the numerators
        items.append(("MIS kept", fmt_count(float(gi.keep[t]))))
    if terms.weight is not None:
        items.append(("IS weight (detached)", fmt(float(terms.weight[t]))))
    items.append(("W_pg", fmt(float(g.pg_weight[t]))))
    if knobs.kl_loss and knobs.kl_loss_rollout_weighted:  # its weight keeps a gradient: w·(∂k + k)
        w = torch.nan_to_num((gi.log_probs[t] - gi.rollout_log_probs[t]).exp(), nan=0.0, posinf=0.0, neginf=0.0)
        items.append(("KL weight w (not detached)", fmt(float(w))))
    if knobs.kl_loss:
        share = abs(kl) / (abs(pg) + abs(kl)) if (pg or kl) else 0.0
        items += [("W_kl", fmt(float(g.kl_weight[t]))), ("KL share", f"{100 * share:.1f}%")]
    scale = grad_scale_of(ctx.config)
    note = (f"W = loss_scale {knobs.loss_scale:g} × grad_scale {scale:g} × the {knobs.loss_agg_mode} weight of "
            f"{ctx.sample_ids[index]}" + (" (GSPO: the sample's ratio, its slopes summed over its tokens)"
                                          if knobs.sequence_ratio else ""))
    return ElementInputs(field=field, sample_id=ctx.sample_ids[index], offset=offset, formula=formula,
                         items=tuple(items), note=note)


# a policy-loss family's own per-token columns (kernels/families) the strip lists, with their labels
def _family_token_inputs(ctx: StageContext, field: str, index: int, offset: int, t: int) -> ElementInputs:
    """A loss token under a policy-loss family: the family's formula (``PolicyFamily.formula``) with the token's
    ``pg``, the ratio, mask, advantage and the family's own columns, from the family's kernel over the token's
    sample (its per-sample terms included) in float64."""
    from ..kernels.families import family
    from ..kernels.loss import policy_token_terms, sample_log_terms
    from ..stages.loss import loss_inputs

    li = loss_inputs(ctx)
    knobs = LossKnobs.of(ctx.config, ctx.samples)
    lo, n = int(ctx.offsets[index]), int(ctx.lengths[index])
    sl = slice(lo, lo + n)
    adv = li.advantages[lo:lo + n].to(torch.float64)
    rollout = li.rollout_log_probs[sl] if li.rollout_log_probs is not None else None
    ref = li.ref_log_probs[sl] if li.ref_log_probs is not None else None
    terms = sample_log_terms(li.log_probs[sl], li.old_log_probs[sl], rollout, li.mask[sl],
                             torch.tensor([n]), knobs, torch.float64, advantages=adv)
    out = policy_token_terms(li.log_probs[sl], li.old_log_probs[sl], adv, knobs, seg=torch.zeros(n, dtype=torch.long),
                             sample_terms=terms, rollout_log_probs=rollout, ref_log_probs=ref, dtype=torch.float64)
    k = t - lo
    items = [("ratio r", fmt(float(out["ratio"][k]))), ("mask", fmt_count(float(li.mask[t]))),
             ("A", fmt(float(adv[k])))]
    items += [(label, fmt(float(out[name][k]))) for name, label in FAMILY_COLUMNS if name in out]
    formula = f"{family(knobs.policy_loss).formula}; pg = {fmt(float(out['pg'][k]))}"
    divisor, w, den = pg_term(ctx, _sample_mask_count(ctx, index))
    term = float(out["pg"][k]) * float(li.mask[t])
    note = (f"policy_loss {knobs.policy_loss}: adds pg·mask = {fmt(term)} to {ctx.sample_ids[index]}'s pg_sum, "
            f"{fmt(term * w)} to its pg_loss term ({knobs.loss_agg_mode})")
    return ElementInputs(field=field, sample_id=ctx.sample_ids[index], offset=offset, formula=formula,
                         items=tuple(items), note=note)


def pg_term(ctx: StageContext, mask_count: float) -> tuple[str, float, float]:
    """``(divisor, w, value)``: a sample's ``pg_sum`` enters pg_loss as ``w·pg_sum = loss_scale · pg_sum / value``
    under the configured ``loss_agg_mode`` (``kernels.loss.sample_term``: ``divisor`` is ``value`` in words)."""
    knobs = LossKnobs.of(ctx.config)
    divisor, value = sample_term(knobs.loss_agg_mode, mask_count, knobs)
    return divisor, knobs.loss_scale / value, value


def _scaled(scale: float) -> str:
    return f"× {scale:g} " if scale != 1 else ""


def _loss_knobs_beyond_v1(ctx: StageContext) -> str:
    """The loss knobs the token breakdown above does not spell out, as ``dual-clip c=3, token_mean``; "" if none."""
    k = LossKnobs.of(ctx.config)
    parts = []
    if k.eps_clip_c is not None:
        parts.append(f"dual-clip c={k.eps_clip_c:g}")
    if k.log_ratio_clamp is not None:
        parts.append(f"log-ratio clamp ±{k.log_ratio_clamp:g}")
    if k.importance_level != "token":
        parts.append(f"{k.importance_level}-level ratio")
    if k.is_level is not None:
        parts.append(f"{k.is_level} IS weights ({k.is_mode})")
    if k.kl_loss_coef:
        parts.append(f"{k.kl_loss_type} KL loss ×{k.kl_loss_coef:g}")
    return ", ".join(parts)  # the aggregation mode and loss_scale: spelled out in the pg_loss term (pg_term)


def loss_sample_inputs(ctx: StageContext, field: str, index: int) -> ElementInputs:
    """A per-sample loss term: how many loss tokens, how many clipped, and the term's share of pg_loss
    (``loss_scale · w_i · pg_sum``, :func:`pg_term`). The sums are the stage's own recomputation when it compared
    them (every loss knob included), else the plain clipped surrogate's."""
    from ..stages.loss import loss_inputs

    li = loss_inputs(ctx)
    cfg = ctx.config
    lo, n = int(ctx.offsets[index]), int(ctx.lengths[index])
    ppo_kl = li.old_log_probs[lo:lo + n].to(torch.float64) - li.log_probs[lo:lo + n].to(torch.float64)
    adv = li.advantages[lo:lo + n].to(torch.float64)
    pg, clipped, _ = policy_loss_terms(ppo_kl, adv, cfg.eps_clip, cfg.eps_clip_high)
    mask = li.mask[lo:lo + n].to(torch.float64)
    n_mask = float(mask.sum())
    stage = {f.name: f for f in ctx.fields.get("loss.policy", ())}

    def term(name: str, plain: torch.Tensor) -> float:
        return float(stage[name].actual[index]) if name in stage else float((plain * mask).sum())

    pg_sum = term("pg_sum", pg)
    clips = term("clip_count", clipped)
    kl_sum = term("kl_sum", ppo_kl)
    divisor, w, den = pg_term(ctx, n_mask)
    share = pg_sum * w
    scale = _scaled(LossKnobs.of(cfg).loss_scale)
    formula = f"pg_loss term = pg_sum {scale}/ {divisor} = {fmt(pg_sum)} {scale}/ {fmt_count(den)} = {fmt(share)}"
    # a sum's own field: the sum first, then the term it makes (pg_contribution's formula above)
    own = {"pg_sum": f"pg_sum = Σ_t pg·mask = {fmt(pg_sum)}",
           "kl_sum": f"kl_sum = Σ_t (old − logp)·mask = {fmt(kl_sum)}",
           "clip_count": f"clip_count = Σ_t clipped·mask = {fmt_count(clips)}",
           "mask_count": f"mask_count = Σ_t mask = {fmt_count(n_mask)}"}
    if field == "entropy_sum" and li.entropy is not None:
        entropy_sum = term("entropy_sum", li.entropy[lo:lo + n].to(torch.float64))
        own["entropy_sum"] = f"entropy_sum = Σ_t entropy·mask = {fmt(entropy_sum)}"
    if field in own:
        formula = own[field] + ("; its pg_loss term " + fmt(share) if field == "pg_sum" else "")
    items = (("tokens", str(n)), ("mask", fmt_count(n_mask)), ("clipped", fmt_count(clips)), ("pg_sum", fmt(pg_sum)),
             ("kl_sum", fmt(kl_sum)))
    return ElementInputs(field=field, sample_id=ctx.sample_ids[index], offset=None, formula=formula, items=items)


def loss_scalar_inputs(ctx: StageContext, label: str) -> Optional[ElementInputs]:
    """A loss.policy scalar (a row of the loss table): the per-sample sums it aggregates, their weights under its
    mode and the value — over the stage's own recompute (its per-sample sums, every loss knob included), or for
    a ``…_from_terms`` row over the recorded per-sample terms. ``None`` where the stage left no sums (``--exact``)
    or the row is none of these."""
    from ..kernels.loss import agg_weights, field_aggregation, loss_total
    from ..stages.loss import AGGREGATE_SUFFIX, ROW_OF_FIELD, SUMS_OUTPUT, TERM_OF_FIELD

    recorded = label.endswith(AGGREGATE_SUFFIX)
    name = label.removesuffix(AGGREGATE_SUFFIX)
    sums = ctx.outputs.get(SUMS_OUTPUT)
    if sums is None:
        return None
    knobs = LossKnobs.of(ctx.config, ctx.samples)
    terms = {f.name: f.expected for f in ctx.fields.get("loss.policy", ()) if f.per == "sample"} if recorded else {}
    counts = terms.get("mask_count", sums["mask"])

    def value_of(key: str) -> Optional[tuple[float, str, float, str]]:
        """``(value, mode, scale, Σ rows)`` of scalar ``key``."""
        row, term = ROW_OF_FIELD[key], TERM_OF_FIELD.get(key)
        values = terms.get(term) if recorded else sums.get(row)
        if values is None:
            return None
        mode, scale = field_aggregation(key, knobs)
        return float((values * agg_weights(mode, counts, knobs)).sum()) * scale, mode, scale, term or row

    source = "the recorded per-sample terms" if recorded else "the recompute's per-sample sums"
    n = ", ".join((f"{int(counts.numel())} sample(s)", f"{fmt_count(float(counts.sum()))} loss token(s)"))
    if name == "loss":
        parts = [("pg_loss", 1.0), ("entropy_loss", -knobs.entropy_coef)]
        if knobs.kl_loss:
            parts.append(("kl_loss", knobs.kl_loss_coef))
        got = {key: (coef, value_of(key)) for key, coef in parts if coef != 0 or key == "pg_loss"}
        if any(v is None for _, v in got.values()):
            return None
        suffix = AGGREGATE_SUFFIX if recorded else ""
        words = " ".join(("" if i == 0 else "+ " if coef > 0 else "− ") + (f"{abs(coef):g}·" if i else "") + key
                         + suffix for i, (key, (coef, _)) in enumerate(got.items()))
        numbers = " ".join(("" if i == 0 else "+ " if coef > 0 else "− ") + (f"{abs(coef):g}·" if i else "")
                           + fmt(v[0]) for i, (coef, v) in enumerate(got.values()))
        value = {key: v[0] for key, (_, v) in got.items()}
        total = loss_total(value["pg_loss"], value.get("entropy_loss", 0.0), value.get("kl_loss", 0.0),
                           knobs.entropy_coef, knobs)
        formula = f"{label} = {words} = {fmt(total)}" if len(got) == 1 else \
            f"{label} = {words} = {numbers} = {fmt(total)}"
        return ElementInputs(field="loss", sample_id=None, offset=None, formula=formula,
                             items=(("from", source), ("over", n)))
    if name not in ROW_OF_FIELD:
        return None
    got = value_of(name)
    if got is None:
        return None
    value, mode, scale, term = got
    divisor, _ = sample_term(mode, 1.0, knobs)
    scaled = f"{scale:g}·" if scale != 1 else ""
    return ElementInputs(field="loss", sample_id=None, offset=None,
                         formula=f"{label} = {scaled}Σ_i {term}_i / {divisor} = {fmt(value)} ({mode})",
                         items=(("from", source), ("over", n)))


__all__ = ["ElementInputs", "element_inputs", "loss_scalar_inputs", "clip_region", "consumer_batch_labels",
           "KL_FORMULAS"]
