"""``loss.policy``: clipped surrogate, sum of per-sample masked means. (``loss.value`` has no adapter: it is
listed in ``stages.UNSUPPORTED``.)"""

from __future__ import annotations

from ..bundle import BundleReader
from ..fields import PER_SCALAR
from ..kernels import LOSS_FIELDS, policy_loss_fields
from ..report import StageReport
from ..schema import RecomputeConfig, StageCapability, StageId
from .base import StageContext, StageDef, StageInputError


def recompute_policy_loss(ctx: StageContext) -> tuple[dict, dict]:
    """``(expected, actual)`` of the loss fields the bundle records, recomputed from the inputs this
    stage consumes: the recorded ``advantages`` payload (teacher forcing); under ``--chain``, or without
    the payload, what advantage.estimate recomputed."""
    cfg = ctx.config
    recorded = ctx.reader.expected.get("loss.policy", {})
    expected = {f: recorded[f] for f in LOSS_FIELDS if f in recorded}
    if not expected:
        raise StageInputError("expected.json $.loss.policy has none of " + ", ".join(LOSS_FIELDS), field="loss")
    advantages = ctx.outputs.get("advantages") if ctx.chain or not ctx.has("advantages") else None
    if advantages is None:
        advantages = ctx.payload("advantages")
    entropy = ctx.payload("entropy") if ctx.has("entropy") else None
    if entropy is None and cfg.entropy_coef != 0:
        raise StageInputError("payload 'entropy' is required when entropy_coef != 0", field="entropy")
    actual = policy_loss_fields(
        ctx.payload("log_probs"), ctx.payload("old_log_probs"), advantages, entropy, ctx.loss_mask, ctx.lengths,
        eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, entropy_coef=cfg.entropy_coef,
    )
    return expected, {f: actual[f] for f in expected}


def run_loss_policy(ctx: StageContext) -> StageReport:
    expected, actual = recompute_policy_loss(ctx)
    names = list(expected)
    n = ctx.n
    field = ctx.field("loss.policy", "loss", PER_SCALAR, [expected[f] for f in names],
                      [float(actual[f]) for f in names], labels=names,
                      note=f"each a sum over {n} sample{'s' if n != 1 else ''} of per-sample means")

    def fail_reason(total, per) -> str:
        return "loss field mismatch: " + ", ".join(f for f, bad in zip(names, field.bad.tolist()) if bad)

    return ctx.report(StageId.LOSS_POLICY, [field], fail_reason=fail_reason,
                      pass_reason=f"{len(names)} field(s) over {n} sample(s) compared")


def _loss_requirements(reader: BundleReader) -> list[str]:
    cfg = reader.index.config
    missing = [f"payloads/{n}.pt" for n in ("log_probs", "old_log_probs") if not reader.has_payload(n)]
    if cfg.entropy_coef != 0 and not reader.has_payload("entropy"):
        missing.append("payloads/entropy.pt")
    est = reader.manifest.stage_contracts.get(StageId.ADVANTAGE_ESTIMATE)
    if not reader.has_payload("advantages") and not (est is not None and est.capability == StageCapability.RECOMPUTE):
        missing.append("payloads/advantages.pt")
    if not any(f in reader.expected.get("loss.policy", {}) for f in LOSS_FIELDS):
        missing.append("expected.json $.loss.policy.loss")
    return missing


def _loss_refuse(cfg: RecomputeConfig) -> list[tuple[str, str]]:
    out = []
    for knob, why in (
        ("use_kl_loss", "True: a KL term in the actor loss is not implemented in V1"),
        ("use_tis", "True: truncated importance sampling is not implemented in V1"),
        ("calculate_per_token_loss", "True: per-token loss aggregation is not implemented in V1"),
        ("normalize_advantages", "True: advantage whitening is not implemented in V1"),
        ("use_rollout_logprobs", "True: rollout log-probs as the PPO anchor are not implemented in V1"),
    ):
        if getattr(cfg, knob):
            out.append((knob, why))
    if cfg.eps_clip_c is not None:
        out.append(("eps_clip_c", f"{cfg.eps_clip_c}: dual-clip PPO is not implemented in V1"))
    return out


LOSS_POLICY = StageDef(
    id=StageId.LOSS_POLICY, run=run_loss_policy, needs=(StageId.SAMPLE, StageId.ADVANTAGE_ESTIMATE),
    cohort_level=True, refuse=_loss_refuse, requirements=_loss_requirements,
    description="clipped policy loss, sum of per-sample masked means",
)
