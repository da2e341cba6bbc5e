"""Loss-family producers (issue 34): a trainer step whose policy term is one of the families and masks the replay
recomputes beyond the clipped surrogate — VESPO, OPSM, TRL's entropy mask, on-policy distillation's supervised term,
prime-rl's IPO, SkyRL's rollout_is, importance_sampling and cross_entropy — written with its own code and numerics
(float32 eager PyTorch, per micro-batch, the micro-batches' token-mean values added in float32 as verl's metrics
accumulate), never with ``replay_lib.kernels``.

``precision="bfloat16"``: the log-probs (and entropies) are bf16 values, stored as bf16 payloads, the loss computed
from them upcast — the declared ``compute: bfloat16``.

:data:`FAMILY_BUGS` holds one typical bug per family: VESPO's ``(k, λ)`` by the wrong sign; OPSM anchored on the
old log-probs where TRL's sampling ones are declared; the entropy quantile flipped (``q`` for ``1 − q``); the
distillation estimate on ``teacher − student``; IPO's ratio to the old log-probs; rollout_is's clamp where it
zeroes; importance_sampling's advantages negated; cross_entropy's sign flipped.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, Identity, Manifest, ProducerInfo,
                                      RecomputeConfig, SampleRecord, StageId, stage_contracts)

from . import comparison_policy
from .inputs import Size, make_inputs

FAMILIES = ("vespo", "opsm", "entropy_mask", "opd_loss", "ipo", "rollout_is", "importance_sampling", "cross_entropy",
            "icepop")
FAMILY_BUGS = {"vespo": "vespo_sign", "opsm": "opsm_anchor", "entropy_mask": "quantile_flipped",
               "opd_loss": "opd_direction", "ipo": "ipo_old_anchor", "rollout_is": "rollout_is_clamp",
               "importance_sampling": "adv_negated", "cross_entropy": "ce_sign", "icepop": "icepop_old_anchor"}
MICRO_BATCHES = 4
# the metrics each framework reports beside the loss (TRL's VESPO logs no clip ratio, grpo_trainer.py:3287-3288;
# SkyRL's importance_sampling none, its cross_entropy neither that nor a KL): what the bundle records
REPORTED = {"vespo": ("ppo_kl",), "importance_sampling": ("ppo_kl",), "cross_entropy": (),
            # prime-rl's IcePop: is_masked (the dropped fraction), no old policy to report a KL against
            "icepop": ("pg_clipfrac",)}
ICEPOP = (0.2, 5.0)  # prime-rl #3526: ratio_low, ratio_high (inclusive)
# the families whose bundle also records grad_log_probs (loss.grad: a registered gradient)
WITH_GRAD = ("icepop",)
EPS_LOW, EPS_HIGH = 0.2, 0.28
VESPO = (2.0, 3.0, 3.0, 2.0)  # k_pos, λ_pos, k_neg, λ_neg (TRL's defaults)
OPSM_DELTA = 0.02
QUANTILE = 0.2
OPD = dict(opd_placement="loss", opd_kl_type="k3", opd_coef=0.5, opd_clamp=10.0)


def _config(family: str, tokens: int) -> RecomputeConfig:
    base = dict(eps_clip=EPS_LOW, eps_clip_high=EPS_HIGH, loss_agg_mode="token_mean", loss_token_count=tokens)
    extra = {"vespo": dict(policy_loss="vespo"), "opsm": dict(opsm_delta=OPSM_DELTA, opsm_anchor="rollout"),
             "entropy_mask": dict(top_entropy_quantile=QUANTILE), "opd_loss": OPD,
             "ipo": dict(policy_loss="ipo"), "rollout_is": dict(policy_loss="rollout_is"),
             "importance_sampling": dict(policy_loss="importance_sampling"),
             "cross_entropy": dict(policy_loss="cross_entropy"), "icepop": dict(policy_loss="icepop")}[family]
    return RecomputeConfig(**base, **extra)


def _clipped(logp, old, adv):
    ratio = torch.exp(logp - old)
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)), \
        (-adv * torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) > -adv * ratio).float()


def _per_token(family, logp, old, adv, rollout, teacher, ent, mask, seg, n_samples, threshold, bug):
    """One micro-batch's per-token policy term and clip indicator (float32)."""
    zeros = torch.zeros_like(logp)
    if family == "vespo":
        k_pos, l_pos, k_neg, l_neg = VESPO if bug is None else (VESPO[2], VESPO[3], VESPO[0], VESPO[1])
        log_w = torch.zeros(n_samples).index_add_(0, seg, torch.clamp(logp - old, -20, 20) * mask)
        log_w = torch.clamp(log_w, math.log(1e-8), 20.0)[seg]
        pos = adv >= 0
        k = torch.where(pos, torch.full_like(adv, k_pos), torch.full_like(adv, k_neg))
        lam = torch.where(pos, torch.full_like(adv, l_pos), torch.full_like(adv, l_neg))
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return -phi * adv * logp, zeros
    if family == "ipo":
        anchor = old if bug else rollout
        lr = logp - anchor
        keep = (torch.abs(torch.exp(logp) - torch.exp(anchor)) <= 0.1).float()
        return -(keep * adv * torch.exp(lr)) + 1e-3 * lr * lr, 1 - keep
    if family == "icepop":  # prime-rl #3526: the band tested on log r, a dropped log-ratio zeroed before exp
        lr = logp - (old if bug else rollout)
        keep = (lr >= math.log(ICEPOP[0])) & (lr <= math.log(ICEPOP[1]))
        ratio = torch.exp(torch.where(keep, lr, zeros))
        return -(adv * ratio) * keep.float(), (~keep).float()
    if family == "rollout_is":
        r = torch.exp(torch.clamp(logp - rollout, -20, 20))
        inside = (r > 1 - EPS_LOW) & (r < 1 + EPS_HIGH)
        kept = torch.clamp(r, 1 - EPS_LOW, 1 + EPS_HIGH) if bug else torch.where(inside, r, zeros)
        return -(kept * adv * logp), (~inside).float()
    if family == "importance_sampling":
        return -(torch.exp(logp - old) * (-adv if bug else adv)), zeros
    if family == "cross_entropy":
        return (logp if bug else -logp), zeros
    pg, clip = _clipped(logp, old, adv)
    if family == "opsm":
        anchor = old if bug else rollout
        kl = torch.zeros(n_samples).index_add_(0, seg, (anchor - logp) * mask)
        kl = kl / torch.zeros(n_samples).index_add_(0, seg, mask).clamp(min=1.0)
        keep = ((adv >= 0) | (kl[seg] <= OPSM_DELTA)).float()
        return pg * keep, clip
    if family == "entropy_mask":
        return pg * (ent >= threshold).float(), clip
    return pg, clip


def _threshold(ent, mask, bug) -> float:
    q = QUANTILE if bug else 1 - QUANTILE
    values = np.sort(ent[mask > 0].numpy().astype(np.float64))
    pos = q * (len(values) - 1)
    lo = int(np.floor(pos))
    hi = min(lo + 1, len(values) - 1)
    return float(np.float32(values[lo] + (pos - lo) * (values[hi] - values[lo])))


def _opd(logp, teacher, bug):
    r = (teacher - logp) if bug else (logp - teacher)
    return torch.clamp(torch.exp(-r) - 1 + r, -10.0, 10.0)


def loss_step(family: str, logp, old, adv, rollout, teacher, ent, mask, lengths, bug: Optional[str]) -> dict:
    n = lengths.numel()
    bounds = np.linspace(0, n, MICRO_BATCHES + 1).astype(int)
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    total = float(mask.sum())
    threshold = _threshold(ent, mask, bug) if family == "entropy_mask" else 0.0
    out = {k: torch.zeros((), dtype=torch.float32) for k in ("pg_loss", "pg_clipfrac", "ppo_kl", "opd_loss")}
    for a, b in zip(bounds[:-1], bounds[1:]):
        if a == b:
            continue
        sl = slice(int(starts[a]), int(ends[b - 1]))
        seg = torch.repeat_interleave(torch.arange(b - a), lengths[a:b])
        m = mask[sl]
        pg, clip = _per_token(family, logp[sl], old[sl], adv[sl], rollout[sl], teacher[sl], ent[sl], m, seg, b - a,
                              threshold, bug)
        out["pg_loss"] += torch.sum(pg * m) / total
        out["pg_clipfrac"] += torch.sum(clip * m) / total
        out["ppo_kl"] += torch.sum((old[sl] - logp[sl]) * m) / total
        if family == "opd_loss":
            out["opd_loss"] += torch.sum(_opd(logp[sl], teacher[sl], bug) * m) / total
    fields = {k: float(v) for k, v in out.items()
              if k not in ("pg_clipfrac", "ppo_kl") or k in REPORTED.get(family, ("pg_clipfrac", "ppo_kl"))}
    fields["entropy_loss"] = float(torch.sum(ent * mask) / total)
    if family == "opd_loss":
        fields["loss"] = float(out["pg_loss"] + OPD["opd_coef"] * out["opd_loss"])
    else:
        del fields["opd_loss"]
        fields["loss"] = fields["pg_loss"]
    return fields


def produce_family_bundle(path: str | Path, family: str, seed: int, size: Size, *, precision: str = "float32",
                          bug: Optional[str] = None) -> Path:
    """The step bundle of ``family`` (:data:`FAMILIES`) for one step of ``size`` drawn from ``seed``; ``bug``:
    ``FAMILY_BUGS[family]``."""
    if bug is not None and bug != FAMILY_BUGS[family]:
        raise ValueError(f"the {family} producer's bug is {FAMILY_BUGS[family]!r}, not {bug!r}")
    inputs = make_inputs(seed, size, "rm")
    rng = np.random.Generator(np.random.PCG64(seed + 7))
    total = int(inputs.lengths.sum())
    logp = inputs.log_probs.astype(np.float32)
    old = inputs.old_log_probs.astype(np.float32)
    # the sampler's log-probs: token noise and a shift per sample (its sequence mean differs from the old one's)
    rollout = (old + rng.normal(0, 0.05, total) + np.repeat(rng.normal(0, 0.05, size.samples), inputs.lengths)
               ).astype(np.float32)
    teacher = np.minimum(logp + rng.normal(0, 0.5, total), 0).astype(np.float32)
    if family == "icepop":  # tokens the band drops: an extreme ratio (exp overflows float32: the 0·inf guard) and
        # moderate ones past either bound
        at = np.nonzero(inputs.mask)[0][[1, 5, 9]]  # three loss tokens
        rollout[at] = logp[at] + np.array([-100.0, -2.0, 2.0], dtype=np.float32)
    ent = inputs.entropy.astype(np.float32)
    adv = np.repeat(rng.normal(0, 1, size.samples), inputs.lengths).astype(np.float32)
    to = (lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)))
    if precision == "bfloat16":
        logp, old, rollout, teacher, ent = (to(x).to(torch.bfloat16).float().numpy()
                                            for x in (logp, old, rollout, teacher, ent))
    lengths = torch.from_numpy(inputs.lengths.astype(np.int64))
    mask = torch.from_numpy(inputs.mask.astype(np.float32))
    fields = loss_step(family, to(logp), to(old), to(adv), to(rollout), to(teacher), to(ent), mask, lengths, bug)
    tokens = int(inputs.mask.sum())
    bundle_id = f"family-{family}-{precision}-{size}-s{seed}" + (f"-{bug}" if bug else "")
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=int(inputs.groups[i]), response_length=int(n),
                            total_length=int(n) + 32, loss_mask=inputs.mask[o:o + n].tolist(), raw_reward=0.0,
                            reward=0.0) for i, (n, o) in enumerate(zip(inputs.lengths.tolist(), inputs.offsets.tolist()))]
    index = BundleIndex(bundle_id=bundle_id, identity=Identity(actor_step_id=ActorStepId(rollout_id=4, step_id=0)),
                        samples=samples, config=_config(family, tokens))
    declared = {"compute": precision, "accumulate": "float32"} if precision == "bfloat16" else None
    stages = (StageId.SAMPLE, StageId.LOSS_POLICY) + ((StageId.LOSS_GRAD,) if family in WITH_GRAD else ())
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=bundle_id,
                        producer=ProducerInfo(commit="tests.producers.loss_families_b", torch_version=torch.__version__),
                        stage_contracts=stage_contracts(stages), payloads={},
                        comparison_policy=comparison_policy(declared), redaction={})
    writer = BundleWriter(path, manifest, index, {"loss.policy": fields})
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    for name, values in (("log_probs", logp), ("old_log_probs", old), ("rollout_log_probs", rollout),
                         ("teacher_log_probs", teacher), ("entropy", ent)):
        writer.write_payload(name, to(values).to(dtype))
    writer.write_payload("advantages", to(adv))
    if family in WITH_GRAD:  # ∂pg_loss/∂log_probs by torch.autograd of the same per-token term, token mean
        x = to(logp).requires_grad_(True)
        seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        pg, _ = _per_token(family, x, to(old), to(adv), to(rollout), to(teacher), to(ent), mask, seg,
                           lengths.numel(), 0.0, bug)
        (torch.sum(pg * mask) / float(mask.sum())).backward()
        writer.write_payload("grad_log_probs", x.grad.detach())
    return writer.finalize(ranks=[0])


__all__ = ["FAMILIES", "FAMILY_BUGS", "loss_step", "produce_family_bundle"]
