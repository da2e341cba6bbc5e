"""What a view can show: each field's stage, kind and label; which field a divergence is in.

Part of :mod:`replay_tui.model` (pure data, no Textual)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from replay_lib.bundle.schema import PER_SAMPLE_TERMS
from replay_lib.judge.fields import PER_SCALAR, FieldResult
from replay_lib.stages.support import SCORED_FIELDS

KIND_SAMPLE = "sample"  # one value per sample (a table of samples)

TREE_GROUP, TREE_SAMPLE = "group", "sample"  # the sample tree's row kinds

KIND_TOKEN = "token"  # one value per response token of the selected sample

KIND_COHORT = "cohort"  # one value per bundle (loss fields)

SUPPORT_STAGE = "logprob.support"

@dataclass(frozen=True)
class FieldSpec:
    name: str
    stage: str
    kind: str
    title: str
    sort: str = ""  # the diff viewer's default row order ("err": by |err|, largest first)
    # A field only some bundles have: ``(reader -> whether this bundle can have it, why not)``; None: every bundle
    # whose stage runs.
    present: Optional[tuple] = None

FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("raw_reward", "reward.raw", KIND_SAMPLE, "raw reward per sample"),
    FieldSpec("reward", "reward.post_process", KIND_SAMPLE, "normalized reward per sample"),
    FieldSpec("token_reward", "reward.post_process", KIND_TOKEN,
              "recorded per-token reward vs the sample's normalized reward (format 1.2)",
              present=(lambda reader: any(type(s.reward) is list for s in reader.index.samples),
                       "no per-token reward recorded")),
    FieldSpec("kl", "advantage.kl", KIND_TOKEN, "rollout-vs-reference KL per token"),
    FieldSpec("advantage", "advantage.estimate", KIND_TOKEN, "advantage per token"),
    FieldSpec("returns", "advantage.estimate", KIND_TOKEN, "returns per token (GAE: advantages + values)"),
    # logprob.support: one field per recorded log-prob payload the stage compares (log_probs first)
    FieldSpec("support_logprob", SUPPORT_STAGE, KIND_TOKEN, "recorded log_probs vs logp_S over the support"),
    FieldSpec("support_old_logprob", SUPPORT_STAGE, KIND_TOKEN, "recorded old_log_probs vs logp_S over the support"),
    FieldSpec("support_ref_logprob", SUPPORT_STAGE, KIND_TOKEN, "recorded ref_log_probs vs logp_S over the support"),
    # logprob.mismatch: the oracle's per-token field (--bitwise / true_on_policy), the importance weight per sample
    # before and after the correction's clamp or mask, and the share of loss tokens it truncated or masked
    FieldSpec("rollout_log_probs", "logprob.mismatch", KIND_TOKEN, "rollout_log_probs vs old_log_probs, bit for bit"),
    FieldSpec("is_weight", "logprob.mismatch", KIND_SAMPLE, "importance weight per sample: raw (pre-clamp) vs applied"),
    FieldSpec("is_changed_fraction", "logprob.mismatch", KIND_SAMPLE,
              "share of each sample's loss tokens truncated or masked by the correction"),
    FieldSpec("loss", "loss.policy", KIND_COHORT, "policy loss fields (cohort scalars)"),
    # loss.policy's per-token and per-sample terms (replay_lib.stages.loss_terms), when the bundle records them
    FieldSpec("pg_losses", "loss.policy", KIND_TOKEN, "per-token clipped surrogate (loss tokens)"),
    FieldSpec("pg_contribution", "loss.policy", KIND_SAMPLE,
              "each sample's term of pg_loss (w_i · pg_sum, the loss mode's weight)",
              sort="err"),
    *(FieldSpec(name, "loss.policy", KIND_SAMPLE, f"per-sample {name}") for name in PER_SAMPLE_TERMS),
    # loss.grad (SPEC §4.3): the recorded gradient per token against the analytic one (the why strip derives the
    # token's coefficient: its clip branch, the KL term's share, the aggregation weight)
    FieldSpec("grad_log_probs", "loss.grad", KIND_TOKEN, "∂L/∂log_probs per token (recorded vs analytic)",
              sort="err"),
    FieldSpec("grad_values", "loss.grad", KIND_TOKEN, "∂L/∂values per token (PPO's value loss)"),
)

FIELD_BY_NAME = {f.name: f for f in FIELDS}

# A stage's own field (what opening the stage shows): the first one listed for it.
FIELD_BY_STAGE = {f.stage: f for f in reversed(FIELDS)}

# Support field → the recorded payload it compares (the stage's own names, see replay_lib.stages.support).
SUPPORT_SOURCE = {field_name: source for source, field_name in SCORED_FIELDS.items()}

LOSS_TERM_FIELDS = ("pg_losses", *PER_SAMPLE_TERMS)

# Fields the model derives from a stage's fields (not compared by a stage; never counted as mismatches).
DERIVED_FIELDS = ("pg_contribution",)

def field_for_divergence(stage: str, field_name: str) -> Optional[str]:
    """The viewable field a report divergence belongs to (loss sub-fields → ``loss``)."""
    if field_name in FIELD_BY_NAME and FIELD_BY_NAME[field_name].stage == stage:
        return field_name
    spec = FIELD_BY_STAGE.get(stage)
    return spec.name if spec else None

def cohort_result(results: Iterable[FieldResult], name: str) -> Optional[FieldResult]:
    """The cohort table of a stage: every per-scalar field it compared, in the stage's order, as one result
    named ``name`` (loss.policy: the recorded scalars against the recorded per-sample terms' aggregation —
    ``pg_loss_from_terms`` — before the scalars against the recompute). ``None`` when it compared none."""
    scalars = [r for r in results if r.per == PER_SCALAR and r.length_mismatch is None]
    if len(scalars) <= 1:
        return scalars[0] if scalars else None
    own = next((r for r in scalars if r.name == name), scalars[-1])  # its note says what the values are
    labels = [label for r in scalars for label in (r.labels or [r.name] * r.size)]
    note = "; ".join([own.note, *(f"{r.name} rows: {r.note}" for r in scalars
                                  if r.note and r is not own)])
    return FieldResult(stage=own.stage, name=name, per=PER_SCALAR,
                       expected=torch.cat([r.expected for r in scalars]),
                       actual=torch.cat([r.actual for r in scalars]),
                       tolerance=torch.cat([r.tolerance for r in scalars]), labels=labels, note=note,
                       exact=own.exact, rank=own.rank)
