"""Policy-loss family producers (``RecomputeConfig.policy_loss``): a verl-like actor whose loss is one of verl
0.9.1's registered policy losses (CISPO, SAPO, GMPO ``geo_mean``, DPPO-TV/KL, DRO, GPG) or TRL 1.16's CISPO
(the absolute cap), written from the frameworks' code (verl ``trainer/ppo/core_algos.py``: cispo 2047-2106,
sapo 1622-1704, geo_mean 1928-2011, dppo_tv 1379-1457, dppo_kl 1460-1542, dro 2014-2044, gpg 1707-1740; TRL
``trainer/grpo_trainer.py:3109-3111``) in float32 eager PyTorch on padded ``[batch, length]`` micro-batches —
never with ``replay_lib.kernels``.

The step is split into ``micro_batches`` equal micro-batches; the loss terms of each are divided by the global
token count (or, for the seq-mean modes, the global sequence count) times the dp size, added over the
micro-batches in float32 (verl ``agg_loss`` with ``global_batch_info``); the metrics are each micro-batch's masked
token mean, averaged over the micro-batches (verl ``losses.py`` ``AggregationType.MEAN``). GMPO's loss is the
plain mean over each micro-batch's sequences, summed over the micro-batches. ``precision="bfloat16"``: the
log-probs are bf16 values, stored as bf16 payloads.

:data:`FAMILY_BUGS` is one real bug per family: ``cispo_cap_swapped`` (the absolute cap ``min(r, ε_high)`` where
the relative ``clamp(r, 1 − ε_low, 1 + ε_high)`` is configured), ``sapo_tau_sign`` (τ_pos taken where A ≤ 0),
``gmpo_arith_mean`` (the arithmetic mean of the clipped token ratios, not the geometric one), ``dppo_mask_sign``
(the trust-region test of the other sign of A), ``dro_beta_sign``
(the quadratic penalty added with the wrong sign), ``gpg_old_logp`` (the old log-probs in place of the current),
``kl_cov_global_topk`` (KL-Cov's top-k taken over the whole step instead of each micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import msgspec
import numpy as np
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, Identity, Manifest, ProducerInfo,
                                      RecomputeConfig, SampleRecord, StageId, stage_contracts)

from . import comparison_policy
from .inputs import Size, make_inputs

FAMILY_BUGS = {"cispo": "cispo_cap_swapped", "cispo_trl": "cispo_cap_swapped", "sapo": "sapo_tau_sign",
               "geo_mean": "gmpo_arith_mean", "dppo_tv": "dppo_mask_sign", "dppo_kl": "dppo_mask_sign",
               "dro": "dro_beta_sign", "gpg": "gpg_old_logp", "kl_cov": "kl_cov_global_topk"}


@dataclass(frozen=True)
class FamilyConfig:
    """What the producer runs (and declares)."""

    loss: str = "cispo"  # a key of FAMILY_BUGS (cispo_trl: TRL's absolute cap)
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    params: dict = field(default_factory=dict)
    dp: int = 2
    micro_batches: int = 4

    def __str__(self) -> str:
        return self.loss


def _f32(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def _pad(flat: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    out = torch.zeros((len(lengths), max(lengths)), dtype=flat.dtype)
    at = 0
    for i, n in enumerate(lengths):
        out[i, :n] = flat[at:at + n]
        at += n
    return out


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x * m).sum() / m.sum()


def _micro(logp, old, adv, m, cfg: FamilyConfig, bug: Optional[str], step=None):
    """One padded micro-batch: ``(pg_losses [B, L] or per-sequence [B], clip, lower, ppo_kl)`` in float32."""
    lo, hi = cfg.eps_clip, cfg.eps_clip_high
    name = cfg.loss
    if name in ("cispo", "cispo_trl", "sapo", "dppo_tv", "dppo_kl"):
        nkl = logp - old
        if name != "cispo_trl":  # verl clamps ±20; TRL does not
            nkl = torch.clamp(nkl, min=-20.0, max=20.0)
        ratio = torch.exp(nkl)
        ppo_kl = -nkl
    else:
        nkl = logp - old
        ratio = torch.exp(nkl)
        ppo_kl = -nkl
    zero = torch.zeros_like(logp)
    if name in ("cispo", "cispo_trl"):
        if (name == "cispo_trl") != (bug == "cispo_cap_swapped"):  # the configured cap, or the other one
            w = torch.clamp(ratio, max=hi)
        else:
            w = torch.clamp(ratio, 1 - lo, 1 + hi)
        pg = -w.detach() * adv * logp
        clip = ((ratio > hi) & (adv > 0)).float() if name == "cispo_trl" else (ratio != w).float()
        return pg, clip, zero, ppo_kl
    if name == "sapo":
        tp, tn = cfg.params.get("tau_pos", 1.0), cfg.params.get("tau_neg", 1.05)
        taus = torch.where(adv > 0, torch.tensor(tp), torch.tensor(tn)) if bug != "sapo_tau_sign" else \
            torch.where(adv > 0, torch.tensor(tn), torch.tensor(tp))
        gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
        return -gates * adv, zero, zero, ppo_kl
    if name in ("dppo_tv", "dppo_kl"):
        c = cfg.params.get("trunc", 20.0)
        tr = torch.clamp(ratio, max=c).detach()
        p, po = torch.exp(logp), torch.exp(old)
        if name == "dppo_tv":
            pos = (p - po) <= hi
            neg = (p - po) >= -lo
            valid = torch.where(adv > 0, neg, pos) if bug == "dppo_mask_sign" else torch.where(adv > 0, pos, neg)
        else:
            bkl = po * (old - logp) + (1 - po) * torch.log((1.0 - po + 1e-8) / (1.0 - p + 1e-8))
            pos, neg = (bkl <= hi) | (p <= po), (bkl <= lo) | (p >= po)
            valid = torch.where(adv > 0, neg, pos) if bug == "dppo_mask_sign" else torch.where(adv > 0, pos, neg)
        valid = valid.float()
        pg = -adv * tr * logp * valid
        return pg, 1.0 - valid, (ratio > c).float() * valid, ppo_kl
    if name == "dro":
        beta = cfg.params["beta"]
        sign = -1.0 if bug == "dro_beta_sign" else 1.0
        return -(logp * adv - sign * 0.5 * beta * nkl.square()), zero, zero, ppo_kl
    if name == "gpg":
        return -(old if bug == "gpg_old_logp" else logp) * adv, zero, zero, ppo_kl
    if name == "kl_cov":  # core_algos.py:1886-1911 on the micro-batch's valid tokens (the global ones under the bug)
        ratio_k, coef = cfg.params["kl_cov_ratio"], cfg.params["ppo_kl_coef"]
        pg = -adv * ratio
        valid = m > 0
        a_v, l_v = adv[valid], logp[valid]
        pg = pg.reshape(-1).clone()
        if step is None:
            cov = (a_v - a_v.mean()) * (l_v - l_v.mean())
            top = torch.topk(cov, max(1, int(len(cov) * ratio_k))).indices
            flat = torch.nonzero(valid.reshape(-1), as_tuple=True)[0][top]
        else:  # the bug: the step's means and k-th largest covariance
            mean_a, mean_l, threshold = step
            cov = (adv - mean_a) * (logp - mean_l)
            flat = torch.nonzero((valid & (cov >= threshold)).reshape(-1), as_tuple=True)[0]
        pg[flat] += coef * nkl.abs().reshape(-1)[flat]
        return pg.reshape(adv.shape), zero, zero, nkl.abs()
    if name == "geo_mean":
        sgn = torch.sign(adv)
        clamped = torch.clamp(nkl, -lo, hi)
        kmin = sgn * torch.min(sgn * nkl, sgn * clamped)
        n = m.sum(dim=-1)
        if bug == "gmpo_arith_mean":
            r = (torch.exp(kmin) * m).sum(dim=-1) / (n + 1e-8)
        else:
            r = torch.exp((kmin * m).sum(dim=-1) / (n + 1e-8))
        a = (adv * m).sum(dim=-1) / (n + 1e-8)
        clipped = torch.ne(nkl, clamped)
        return -a * r, (clipped * (adv > 0)).float(), (clipped * (adv < 0)).float(), ppo_kl
    raise ValueError(name)


def family_step(logp, old, adv, mask, lengths: list[int], cfg: FamilyConfig, bug: Optional[str] = None
                ) -> dict[str, float]:
    """The reported loss.policy fields of one step (module doc)."""
    n = len(lengths)
    bounds = np.linspace(0, n, cfg.micro_batches + 1).astype(int)
    offsets = np.r_[0, np.cumsum(lengths)]
    tokens = float(mask.sum())
    out = {k: torch.zeros((), dtype=torch.float32) for k in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")}
    k = 0
    step = None
    if cfg.loss == "kl_cov" and bug == "kl_cov_global_topk":  # one top-k over the step's valid tokens
        valid = mask > 0
        a_v, l_v = adv[valid], logp[valid]
        cov = (a_v - a_v.mean()) * (l_v - l_v.mean())
        step = (a_v.mean(), l_v.mean(), torch.topk(cov, max(1, int(len(cov) * cfg.params["kl_cov_ratio"]))).values.min())
    for a, b in zip(bounds[:-1], bounds[1:]):
        sl = slice(int(offsets[a]), int(offsets[b]))
        ls = lengths[a:b]
        P = [_pad(x[sl], ls) for x in (logp, old, adv, mask)]
        m = P[3]
        pg, clip, lower, ppo_kl = _micro(*P, cfg, bug, step)
        if cfg.loss == "geo_mean":  # torch.mean over the micro-batch's sequences, summed over micro-batches
            out["pg_loss"] += torch.mean(pg)
        elif cfg.loss == "sapo":  # seq-mean-token-mean over the global sequence count × dp
            seq = (pg * m).sum(dim=-1) / (m.sum(dim=-1) + 1e-8)
            out["pg_loss"] += seq.sum() / n * cfg.dp
        else:  # token-mean over the global token count × dp
            out["pg_loss"] += (pg * m).sum() / tokens * cfg.dp
        out["pg_clipfrac"] += _masked_mean(clip, m)
        out["pg_clipfrac_lower"] += _masked_mean(lower, m)
        out["ppo_kl"] += _masked_mean(ppo_kl, m)
        k += 1
    fields = {"pg_loss": float(out["pg_loss"]), "pg_clipfrac": float(out["pg_clipfrac"] / k),
              "pg_clipfrac_lower": float(out["pg_clipfrac_lower"] / k), "ppo_kl": float(out["ppo_kl"] / k)}
    fields["loss"] = fields["pg_loss"]
    fields["entropy_loss"] = 0.0
    if cfg.loss in ("dro", "gpg", "kl_cov"):  # verl reports only ppo_kl for DRO and KL-Cov, nothing for GPG
        del fields["pg_clipfrac"], fields["pg_clipfrac_lower"]
        if cfg.loss == "gpg":
            del fields["ppo_kl"]
    if cfg.loss == "cispo_trl":  # TRL reports no lower clip fraction
        del fields["pg_clipfrac_lower"]
    return fields


def recompute_config(cfg: FamilyConfig, tokens: int, samples: int) -> RecomputeConfig:
    """The declared config, as the verl / TRL mappings write it."""
    params = dict(cfg.params)
    base = dict(eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, loss_agg_mode="token_mean",
                loss_token_count=tokens, loss_scale=float(cfg.dp), metric_agg_mode="micro_batch_token_mean",
                log_ratio_clamp=20.0)
    name = cfg.loss
    if name == "cispo_trl":
        name, params = "cispo", {**params, "cap": "absolute"}
        base["log_ratio_clamp"] = None
    if name in ("geo_mean", "dro", "gpg", "kl_cov"):
        base["log_ratio_clamp"] = None
    if name == "sapo":
        base.update(loss_agg_mode="seq_mean_token_mean", loss_seq_count=samples)
    if name == "geo_mean":
        base.update(loss_agg_mode="seq_mean_token_sum", loss_seq_count=samples // cfg.micro_batches, loss_scale=1.0)
    return RecomputeConfig(policy_loss=name, policy_loss_params=params, **base)


def produce_family_bundle(path: str | Path, seed: int, size: Size, cfg: FamilyConfig = FamilyConfig(), *,
                          precision: str = "float32", bug: Optional[str] = None,
                          policy_loss: Optional[str] = None, params: Optional[dict] = None) -> Path:
    """Write the bundle this producer records for one step of ``size`` drawn from ``seed`` (``policy_loss`` /
    ``params``: a different family or parameters declared than the one run, for the refusals)."""
    if bug is not None and bug != FAMILY_BUGS[cfg.loss]:
        raise ValueError(f"unknown bug {bug!r} for {cfg.loss} (its bug: {FAMILY_BUGS[cfg.loss]})")
    if size.samples % cfg.micro_batches:
        raise ValueError("the samples must split into equal micro-batches")
    inputs = make_inputs(seed, size, "rm")
    rng = np.random.Generator(np.random.PCG64(seed + 7))
    adv = np.repeat(rng.normal(0, 1, size.samples), inputs.lengths).astype(np.float32)
    logp, old = inputs.log_probs, inputs.old_log_probs
    payload_dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    if precision == "bfloat16":
        logp, old = (_f32(x).to(torch.bfloat16).float().numpy() for x in (logp, old))
    lengths = inputs.lengths.tolist()
    mask = _f32(inputs.mask)
    fields = family_step(_f32(logp), _f32(old), _f32(adv), mask, lengths, cfg, bug)
    tokens = int(inputs.mask.sum())
    bundle_id = f"family-{cfg.loss}-{precision}-{size}-s{seed}" + (f"-{bug}" if bug else "")
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=int(inputs.groups[i]), response_length=int(n),
                            total_length=int(n) + 32, loss_mask=inputs.mask[o:o + n].tolist(), raw_reward=0.0,
                            reward=0.0, micro_batch_id=f"mb-{i * cfg.micro_batches // size.samples}")
               for i, (n, o) in enumerate(zip(lengths, inputs.offsets.tolist()))]
    index = BundleIndex(bundle_id=bundle_id, identity=Identity(actor_step_id=ActorStepId(rollout_id=3, step_id=0),
                                                               rank={"dp": cfg.dp}),
                        samples=samples, config=recompute_config(cfg, tokens, size.samples))
    if policy_loss is not None or params is not None:
        index = msgspec.structs.replace(index, config=msgspec.structs.replace(
            index.config, policy_loss=policy_loss or index.config.policy_loss,
            policy_loss_params=index.config.policy_loss_params if params is None else params))
    declared = {"compute": precision, "accumulate": "float32"} if precision == "bfloat16" else None
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=bundle_id,
                        producer=ProducerInfo(commit="tests.producers.loss_families", torch_version=torch.__version__),
                        stage_contracts=stage_contracts((StageId.SAMPLE, StageId.LOSS_POLICY)), payloads={},
                        comparison_policy=comparison_policy(declared), redaction={})
    writer = BundleWriter(path, manifest, index, {"loss.policy": fields})
    for name, values in (("log_probs", logp), ("old_log_probs", old)):
        writer.write_payload(name, _f32(values).to(payload_dtype))
    writer.write_payload("advantages", _f32(adv))
    return writer.finalize(ranks=[0])


CONFIGS = (
    FamilyConfig("cispo"),
    FamilyConfig("cispo_trl", eps_clip_high=1.2),
    FamilyConfig("sapo", params={"tau_pos": 1.0, "tau_neg": 1.05}),
    FamilyConfig("geo_mean", eps_clip=0.1, eps_clip_high=0.1),
    FamilyConfig("dppo_tv", eps_clip=0.05, eps_clip_high=0.05, params={"trunc": 1.2}),
    FamilyConfig("dppo_kl", eps_clip=0.01, eps_clip_high=0.01, params={"trunc": 1.2}),
    FamilyConfig("dro", params={"beta": 0.5}),
    FamilyConfig("gpg"),
    FamilyConfig("kl_cov", params={"kl_cov_ratio": 0.2, "ppo_kl_coef": 5.0}),
)

__all__ = ["CONFIGS", "FAMILY_BUGS", "FamilyConfig", "family_step", "produce_family_bundle"]
