"""Loss-side producers (SPEC §4.2): a verl-like actor that computes its loss with the knobs of real runs —
a global token mean whose denominator is the all-reduced token count, dual-clip, the KL term in the loss
with its clamps, token/sequence importance correction (truncate or IcePop mask), GSPO — with its own code and
numerics, never with ``replay_lib.kernels``.

The step is split into ``micro_batches`` micro-batches; each evaluates its per-token terms in float32 eager
PyTorch (``exp`` of a clamped log-ratio as ``compute_policy_loss_vanilla`` does, ``torch.where`` dual-clip,
``kl_penalty``'s ``exp(kl) − kl − 1``), reduces them with ``torch.sum`` and divides by the global count times
the dp size (verl ``agg_loss``); the reported scalar is the float32 sum of the micro-batches' values, as
verl's metrics accumulate. ``precision="bfloat16"``: the log-probs are bf16 values (a bf16 forward), stored as
bf16 payloads, the loss computed from them upcast — the declared ``compute: bfloat16``. ``precision="stored_bf16"``:
the loss computed from the float32 log-probs, their bf16 copies stored (a capture that halves the bundle) — the
declared ``compute: float32``; the bundle no longer has the values the loss consumed.

:data:`LOSS_BUGS` are the bug classes a loss side really has: ``denominator`` (verl#7321's class: the token
mean divided by the micro-batch's own token count instead of the global one), ``dual_clip_sign`` (dual-clip
applied to positive advantages too), ``kl_direction`` (the KL term's estimator evaluated on ``logp − ref``
instead of ``ref − logp``: the reverse KL), ``is_inverted`` (the importance weight ``exp(rollout − old)`` instead of ``exp(old − rollout)``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, Identity, Manifest, ProducerInfo,
                               RecomputeConfig, SampleRecord, StageId, stage_contracts)

from . import comparison_policy
from .inputs import Size, make_inputs

LOSS_BUGS = ("denominator", "dual_clip_sign", "kl_direction", "is_inverted")


@dataclass(frozen=True)
class LossConfig:
    """What the producer runs (and declares in its RecomputeConfig)."""

    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    eps_clip_c: Optional[float] = 3.0
    kl_loss_type: Optional[str] = "low_var_kl"  # None: no KL term
    kl_loss_coef: float = 0.001
    is_level: Optional[str] = "token"  # token | sequence | None
    is_mode: str = "truncate"
    is_low: Optional[float] = None
    is_high: Optional[float] = 2.0
    importance_level: str = "token"
    dp: int = 4
    micro_batches: int = 4

    def __str__(self) -> str:
        return (f"c{self.eps_clip_c}-kl{self.kl_loss_type}-is{self.is_level}:{self.is_mode}-"
                f"{self.importance_level}")


def _f32(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def _micro_terms(logp, old, adv, rollout, ref, mask, lengths, cfg: LossConfig, bug: Optional[str]):
    """One micro-batch's per-token surrogate and KL term (float32), and its clip indicators."""
    log_ratio = logp - old
    if cfg.importance_level == "sequence":  # GSPO: one ratio per sample, the masked mean of its log-ratios
        seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        n = torch.zeros(lengths.numel()).index_add_(0, seg, mask).clamp(min=1)
        mean = torch.zeros(lengths.numel()).index_add_(0, seg, log_ratio * mask) / n
        log_ratio_used = mean[seg].clamp(-20.0, 20.0)
    else:
        log_ratio_used = torch.clamp(log_ratio, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio_used)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - cfg.eps_clip, 1 + cfg.eps_clip_high)
    pg = torch.maximum(pg1, pg2)
    clip = torch.gt(pg2, pg1).float()
    lower = torch.zeros_like(pg)
    if cfg.eps_clip_c is not None:
        pg3 = -adv * cfg.eps_clip_c
        negative = adv < 0 if bug != "dual_clip_sign" else torch.ones_like(adv, dtype=torch.bool)
        lower = torch.gt(pg, pg3).float() * (adv < 0).float()
        pg = torch.where(negative, torch.minimum(pg3, pg), pg)
    if cfg.is_level is not None:
        log_w = (rollout - old) if bug == "is_inverted" else (old - rollout)
        if cfg.is_level == "sequence":
            seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
            log_w = torch.zeros(lengths.numel()).index_add_(0, seg, log_w * mask)[seg]
        w = torch.exp(log_w)
        if cfg.is_mode == "truncate":
            w = w.clamp(min=cfg.is_low, max=cfg.is_high)
        else:
            keep = torch.ones_like(w, dtype=torch.bool)
            if cfg.is_low is not None:
                keep &= w >= cfg.is_low
            if cfg.is_high is not None:
                keep &= w <= cfg.is_high
            w = torch.where(keep, w, torch.zeros_like(w))
        pg = pg * w
    kl = None
    if cfg.kl_loss_type is not None:
        r = torch.clamp(ref - logp if bug != "kl_direction" else logp - ref, min=-20, max=20)
        kl = torch.clamp(torch.exp(r) - r - 1, min=-10, max=10)
    return pg, clip, lower, -log_ratio, kl


def loss_step(logp, old, adv, rollout, ref, mask, lengths, cfg: LossConfig, bug: Optional[str] = None
              ) -> dict[str, float]:
    """The reported loss.policy fields: per micro-batch ``Σ x·m / T · dp`` (the loss terms) and ``Σ x·m / T``
    (the metrics), the micro-batches' values added in float32."""
    n = lengths.numel()
    bounds = np.linspace(0, n, cfg.micro_batches + 1).astype(int)
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    total_tokens = float(mask.sum())
    out = {k: torch.zeros((), dtype=torch.float32) for k in ("pg_loss", "kl_loss", "pg_clipfrac", "pg_clipfrac_lower",
                                                           "ppo_kl")}
    for a, b in zip(bounds[:-1], bounds[1:]):
        if a == b:
            continue
        lo, hi = int(starts[a]), int(ends[b - 1])
        sl = slice(lo, hi)
        m = mask[sl]
        pg, clip, lower, ppo_kl, kl = _micro_terms(logp[sl], old[sl], adv[sl], rollout[sl], ref[sl], m,
                                                   lengths[a:b], cfg, bug)
        denom = float(m.sum()) if bug == "denominator" else total_tokens
        out["pg_loss"] += torch.sum(pg * m) / denom * cfg.dp
        if kl is not None:
            out["kl_loss"] += torch.sum(kl * m) / denom * cfg.dp
        out["pg_clipfrac"] += torch.sum(clip * m) / total_tokens
        out["pg_clipfrac_lower"] += torch.sum(lower * m) / total_tokens
        out["ppo_kl"] += torch.sum(ppo_kl * m) / total_tokens
    fields = {k: float(v) for k, v in out.items()}
    fields["loss"] = float(out["pg_loss"] + cfg.kl_loss_coef * out["kl_loss"]) if cfg.kl_loss_type else fields[
        "pg_loss"]
    if cfg.kl_loss_type is None:
        del fields["kl_loss"]
    if cfg.eps_clip_c is None:
        del fields["pg_clipfrac_lower"]
    fields["entropy_loss"] = 0.0
    return fields


def recompute_config(cfg: LossConfig, tokens: int) -> RecomputeConfig:
    kl = {} if cfg.kl_loss_type is None else dict(use_kl_loss=True, kl_loss_coef=cfg.kl_loss_coef,
                                                  kl_loss_type=cfg.kl_loss_type, kl_loss_input_clamp=20.0,
                                                  kl_loss_output_clamp=10.0)
    return RecomputeConfig(eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, eps_clip_c=cfg.eps_clip_c,
                           log_ratio_clamp=20.0, importance_level=cfg.importance_level, is_level=cfg.is_level,
                           is_mode=cfg.is_mode, is_low=cfg.is_low, is_high=cfg.is_high, loss_agg_mode="token_mean",
                           loss_token_count=tokens, loss_scale=float(cfg.dp), **kl)


def replace_config(config: RecomputeConfig, extra: Optional[dict]) -> RecomputeConfig:
    import msgspec

    return msgspec.structs.replace(config, **extra) if extra else config


def produce_loss_bundle(path: str | Path, seed: int, size: Size, cfg: LossConfig = LossConfig(), *,
                        precision: str = "float32", bug: Optional[str] = None, reject=None,
                        config_extra: Optional[dict] = None) -> Path:
    """Write the step bundle this producer records for one step of ``size`` drawn from ``seed``. ``reject``:
    ``(old, rollout, mask, lengths) -> mask`` the loss is computed with (rejection sampling: the bundle records
    the response mask, the loss used the rejected one); ``config_extra``: more RecomputeConfig fields."""
    if bug is not None and bug not in LOSS_BUGS:
        raise ValueError(f"unknown loss bug {bug!r} (expected one of {', '.join(LOSS_BUGS)})")
    inputs = make_inputs(seed, size, "rm")
    rng = np.random.Generator(np.random.PCG64(seed + 1))
    total = int(inputs.lengths.sum())
    rollout = (inputs.old_log_probs + rng.normal(0, 0.3, total)).astype(np.float32)
    adv = np.repeat(rng.normal(0, 1, size.samples), inputs.lengths).astype(np.float32)
    logp, old, ref = inputs.log_probs, inputs.old_log_probs, inputs.ref_log_probs
    payload_dtype = torch.bfloat16 if precision in ("bfloat16", "stored_bf16") else torch.float32
    if precision == "bfloat16":
        logp, old, ref, rollout = (_f32(x).to(torch.bfloat16).float().numpy() for x in (logp, old, ref, rollout))
    lengths = torch.from_numpy(inputs.lengths.astype(np.int64))
    mask = torch.from_numpy(inputs.mask.astype(np.float32))
    loss_mask = mask if reject is None else reject(_f32(old), _f32(rollout), mask, lengths)
    fields = loss_step(_f32(logp), _f32(old), _f32(adv), _f32(rollout), _f32(ref), loss_mask, lengths, cfg, bug)
    tokens = int(loss_mask.sum())
    bundle_id = f"loss-{precision}-{size}-s{seed}" + (f"-{bug}" if bug else "")
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=int(inputs.groups[i]), response_length=int(n),
                            total_length=int(n) + 32, loss_mask=inputs.mask[o:o + n].tolist(), raw_reward=0.0,
                            reward=0.0, micro_batch_id=f"mb-{i * cfg.micro_batches // size.samples}")
               for i, (n, o) in enumerate(zip(inputs.lengths.tolist(), inputs.offsets.tolist()))]
    index = BundleIndex(bundle_id=bundle_id, identity=Identity(actor_step_id=ActorStepId(rollout_id=3, step_id=0),
                                                               rank={"dp": cfg.dp}),
                        samples=samples, config=replace_config(recompute_config(cfg, tokens), config_extra))
    declared = {"compute": precision, "accumulate": "float32"} if precision == "bfloat16" else \
        {"compute": "float32", "accumulate": "float32"} if precision == "stored_bf16" else None
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=bundle_id,
                        producer=ProducerInfo(commit="tests.producers.loss_knobs", torch_version=torch.__version__),
                        stage_contracts=stage_contracts((StageId.SAMPLE, StageId.LOSS_POLICY)), payloads={},
                        comparison_policy=comparison_policy(declared), redaction={})
    writer = BundleWriter(path, manifest, index, {"loss.policy": fields})
    for name, values in (("log_probs", logp), ("old_log_probs", old), ("ref_log_probs", ref),
                         ("rollout_log_probs", rollout)):
        writer.write_payload(name, _f32(values).to(payload_dtype))
    writer.write_payload("advantages", _f32(adv))
    return writer.finalize(ranks=[0])


CONFIGS = (
    LossConfig(),  # verl DAPO-like: token mean, dual-clip, low_var_kl in the loss, token TIS
    LossConfig(is_mode="mask", is_low=0.5, is_high=2.0, kl_loss_type=None),  # IcePop
    LossConfig(importance_level="sequence", eps_clip_c=None, is_level="sequence", is_high=4.0),  # GSPO + seq IS
)

__all__ = ["CONFIGS", "LOSS_BUGS", "LossConfig", "loss_step", "produce_loss_bundle", "replace"]
