"""A gradient producer for the policy-loss families (loss.grad, SPEC §4.3): one actor step whose loss is one of the
families of ``kernels.families`` — written here in float32 eager PyTorch from the frameworks' code (verl 0.9.1
``core_algos.py``: cispo 2047-2106, sapo 1622-1704, geo_mean 1928-2011, dppo_tv/kl 1379-1542, dro 2014-2044, gpg
1707-1740, kl_cov 1848-1925; TRL 1.16 ``grpo_trainer.py``: cispo's absolute cap 3109-3111, vespo 2969-3018 and
3125-3136 with φ under ``no_grad``, the entropy mask 1380-1415, OPSM 2945-2967; SkyRL @ a9564572 ``ppo_utils.py``:
rollout_is 825-863, dppo 866-935, importance_sampling 1095-1142, cross_entropy 1057-1092, the keep masks of
``off_policy_correction_utils.py``; prime-rl @ 559b4477 ``loss.py:164-196``: ipo), never with ``replay_lib.kernels``
— and its per-token gradient ``grad_log_probs`` read off the log-prob leaf by ``torch.autograd`` after the step's
backward (each micro-batch's loss backpropagated in turn).

The knobs that multiply any family's term: OPSM (``opsm_delta``), TRL's entropy mask (``top_entropy_quantile``,
the quantile of each micro-batch's loss-token entropies), SkyRL's keep masks (``is_keep``), a token TIS weight,
and on-policy distillation's supervised loss term (``opd``: its estimate of ``logp − teacher``, × ``opd_coef``).

:data:`FAMILY_GRAD_BUGS`: one bug per family whose loss value is right and whose gradient is not (a stop-gradient
missing or added, a term under ``no_grad``, a mask applied straight-through, a scale applied to backward only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, ComparisonPolicy, Identity,
                                      Manifest, ProducerInfo, RecomputeConfig, SampleRecord, StageId, Tolerance,
                                      stage_contracts)

from .inputs import Size, make_inputs

# family → its gradient bug (the loss value unchanged)
FAMILY_GRAD_BUGS = {
    "ppo": "mask_straight_through",  # a keep mask applied to the value only: pg + (pg·keep − pg).detach()
    "cispo": "weight_not_detached",  # clip(r) without its detach
    "sapo": "ratio_detached",
    "geo_mean": "clip_straight_through",  # the clipped log-ratio passing the gradient of the unclipped one
    "dppo_tv": "trunc_not_detached",
    "dppo_kl": "trunc_not_detached",
    "dro": "penalty_no_grad",  # the quadratic term under no_grad
    "gpg": "logp_detached",
    "kl_cov": "penalty_no_grad",
    "vespo": "phi_not_detached",  # φ(w) computed with its gradient
    "ipo": "kl_no_grad",
    "rollout_is": "ratio_not_detached",
    "importance_sampling": "ratio_detached",
    "cross_entropy": "scaled_backward",  # backward of 2·loss − loss.detach(): the value right, the gradient × 2
    "dppo_mu": "ratio_detached",
    "opd": "opd_no_grad",  # the distillation term under no_grad
}


@dataclass(frozen=True)
class FamilyGradConfig:
    family: str = "cispo"
    params: dict = field(default_factory=dict)
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    log_ratio_clamp: Optional[float] = None
    dp: int = 2
    micro_batches: int = 2
    opsm_delta: Optional[float] = None
    top_entropy_quantile: float = 1.0
    is_keep: Optional[dict] = None
    tis_high: Optional[float] = None  # a token TIS weight min(exp(old − rollout), tis_high), detached
    opd: Optional[str] = None  # the distillation term's estimator (k1, k2, k3, low_var_kl, abs)
    opd_coef: float = 0.5
    spread: float = 0.25
    edge: bool = False  # the first loss token: its ratio to the rollout 1 + eps_clip_high in float32 (A > 0)

    def __str__(self) -> str:
        knobs = [k for k, on in (("opsm", self.opsm_delta is not None), ("ent", self.top_entropy_quantile < 1),
                                 ("keep", self.is_keep is not None), ("tis", self.tis_high is not None),
                                 (f"opd-{self.opd}", self.opd is not None)) if on]
        return "-".join([self.family, *knobs])


def _f32(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def _seg_sum(x: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=x.dtype).index_add(0, seg, x)


def _estimate(r: torch.Tensor, kind: str) -> torch.Tensor:
    """A KL estimate of ``r = student − teacher`` as TRL/verl write them."""
    if kind == "k1":
        return r
    if kind == "k2":
        return 0.5 * r * r
    if kind == "abs":
        return r.abs()
    k3 = torch.exp(-r) - 1 + r
    return torch.clamp(k3, -10.0, 10.0) if kind == "low_var_kl" else k3


def _family_terms(x, old, adv, roll, m, seg, n, cfg: FamilyGradConfig, bug: Optional[str], mb_mask):
    """``(per-token pg, per-sample pg or None)`` of one micro-batch, float32, differentiable in ``x``."""
    p = cfg.params
    name = cfg.family
    lo, hi = cfg.eps_clip, cfg.eps_clip_high
    d = x - old
    if cfg.log_ratio_clamp is not None:
        d = torch.clamp(d, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    if name == "ppo":
        r = torch.exp(d)
        return torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - lo, 1 + hi)), None
    if name == "cispo":
        r = torch.exp(d)
        w = torch.clamp(r, max=hi) if p.get("cap") == "absolute" else torch.clamp(r, 1 - lo, 1 + hi)
        if bug != "weight_not_detached":
            w = w.detach()
        return -w * adv * x, None
    if name == "sapo":
        r = torch.exp(d)
        if bug == "ratio_detached":
            r = r.detach()
        tau = torch.where(adv > 0, torch.tensor(p.get("tau_pos", 1.0)), torch.tensor(p.get("tau_neg", 1.05)))
        return -torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * adv, None
    if name == "geo_mean":
        sgn = torch.sign(adv)
        clipped = sgn * torch.minimum(sgn * d, sgn * torch.clamp(d, -lo, hi))
        if bug == "clip_straight_through":
            clipped = d + (clipped - d).detach()
        cnt = _seg_sum(m, seg, n)
        ratio = torch.exp(_seg_sum(clipped * m, seg, n) / (cnt + 1e-8))
        mean_adv = _seg_sum(adv * m, seg, n) / (cnt + 1e-8)
        return None, -mean_adv * ratio
    if name in ("dppo_tv", "dppo_kl"):
        r = torch.exp(d)
        tr = torch.clamp(r, max=p.get("trunc", 20.0))
        if bug != "trunc_not_detached":
            tr = tr.detach()
        with torch.no_grad():
            pc, po = torch.exp(x), torch.exp(old)
            if name == "dppo_tv":
                valid = torch.where(adv > 0, pc - po <= hi, pc - po >= -lo)
            else:
                bkl = po * (old - x) + (1 - po) * torch.log((1.0 - po + 1e-8) / (1.0 - pc + 1e-8))
                valid = torch.where(adv > 0, (bkl <= hi) | (pc <= po), (bkl <= lo) | (pc >= po))
        return -adv * tr * x * valid.float(), None
    if name == "dro":
        beta = p["beta"]
        if bug == "penalty_no_grad":
            with torch.no_grad():
                quad = 0.5 * beta * d.square()
        else:
            quad = 0.5 * beta * d.square()
        return -(x * adv - quad), None
    if name == "gpg":
        return -(x.detach() if bug == "logp_detached" else x) * adv, None
    if name == "kl_cov":
        r = torch.exp(d)
        with torch.no_grad():  # the top kl_cov_ratio of (A − Ā)·(logp − mean logp) over the micro-batch's tokens
            on = m > 0
            a, lp = adv[on], x[on]
            cov = (a - a.mean()) * (lp - lp.mean())
            k = max(1, int(int(on.sum()) * p["kl_cov_ratio"]))
            sel = torch.zeros_like(m)
            sel[torch.nonzero(on).reshape(-1)[torch.topk(cov, k).indices]] = 1.0
        if bug == "penalty_no_grad":
            with torch.no_grad():
                pen = p["ppo_kl_coef"] * d.abs()
        else:
            pen = p["ppo_kl_coef"] * d.abs()
        return -adv * r + pen * sel, None
    if name == "vespo":
        def phi_of(dd):
            log_w = torch.clamp(_seg_sum(torch.clamp(dd, -20.0, 20.0) * m, seg, n), math.log(1e-8), 20.0)[seg]
            k = torch.where(adv >= 0, p.get("k_pos", 2.0), p.get("k_neg", 3.0))
            lam = torch.where(adv >= 0, p.get("lambda_pos", 3.0), p.get("lambda_neg", 2.0)).clamp(min=1e-4)
            return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        if bug == "phi_not_detached":
            phi = phi_of(x - old)
        else:
            with torch.no_grad():
                phi = phi_of(x - old)
        return -phi * adv * x, None
    if name == "ipo":
        lr = x - roll
        r = torch.exp(lr)
        with torch.no_grad():
            keep = ~((torch.exp(x) - torch.exp(roll)).abs() > p.get("ipo_threshold", 0.1))
        surrogate = keep.float() * p.get("adv_tau", 1.0) * adv * r
        if bug == "kl_no_grad":
            with torch.no_grad():
                kl = p.get("kl_tau", 1e-3) * lr * lr
        else:
            kl = p.get("kl_tau", 1e-3) * lr * lr
        return -surrogate + kl, None
    if name == "rollout_is":
        r = torch.exp(torch.clamp(x - roll, -20.0, 20.0))
        kept = torch.where((r > 1 - lo) & (r < 1 + hi), r, torch.zeros_like(r))
        if bug != "ratio_not_detached":
            kept = kept.detach()
        return -(kept * adv * x), None
    if name == "importance_sampling":
        r = torch.exp(x - old)
        return (r.detach() if bug == "ratio_detached" else r) * -adv, None
    if name == "cross_entropy":
        return -x, None
    if name == "dppo_mu":
        r = torch.exp(torch.clamp(x - roll, -20.0, 20.0))
        if bug == "ratio_detached":
            r = r.detach()
        with torch.no_grad():
            diff = torch.exp(x) - torch.exp(roll)
            drop = ((adv > 0) & (diff > hi)) | ((adv < 0) & (-diff > lo))
        return -adv * r * (~drop).float(), None
    raise ValueError(name)


def _keep_masks(x, old, adv, roll, ent, m, seg, n, cfg: FamilyGradConfig):
    """The 0/1 masks the knobs multiply the term by (no gradient of their own), float32 per token."""
    keep = torch.ones_like(m)
    with torch.no_grad():
        if cfg.opsm_delta is not None:
            kl = _seg_sum((old - x) * m, seg, n) / torch.clamp(_seg_sum(m, seg, n), min=1.0)
            keep = keep * ((adv >= 0) | (kl[seg] <= cfg.opsm_delta)).float()
        if cfg.top_entropy_quantile < 1.0:
            threshold = torch.quantile(ent[m > 0], 1.0 - cfg.top_entropy_quantile)
            keep = keep * (ent >= threshold).float()
        if cfg.is_keep is not None:
            low, high = cfg.is_keep["token"]
            r = torch.exp(torch.clamp(old - roll, -20.0, 20.0))
            keep = keep * ((r >= low) & (r <= high)).float()
    return keep


def family_grad_step(logp, old, adv, roll, ent, teacher, mask, lengths, cfg: FamilyGradConfig,
                     bug: Optional[str] = None) -> tuple[dict[str, float], torch.Tensor]:
    """``(loss fields, grad_log_probs)``: each micro-batch's loss backpropagated into one float32 leaf."""
    x = logp.clone().requires_grad_(True)
    n_all = lengths.numel()
    bounds = np.linspace(0, n_all, cfg.micro_batches + 1).astype(int)
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    tokens = float(mask.sum())
    pg_total = torch.zeros(())
    opd_total = torch.zeros(())
    for a, b in zip(bounds[:-1], bounds[1:]):
        if a == b:
            continue
        sl = slice(int(starts[a]), int(ends[b - 1]))
        lens = lengths[a:b]
        n = lens.numel()
        seg = torch.repeat_interleave(torch.arange(n), lens)
        m = mask[sl]
        xs = x[sl]
        tok, per_sample = _family_terms(xs, old[sl], adv[sl], roll[sl], m, seg, n, cfg, bug, m)
        if per_sample is not None:  # GMPO: the mean of the samples' losses over the global sample count × dp
            pg_part = per_sample.sum() / n_all * cfg.dp
        else:
            keep = _keep_masks(xs, old[sl], adv[sl], roll[sl], ent[sl], m, seg, n, cfg)
            if cfg.tis_high is not None:
                tok = tok * torch.clamp(torch.exp(old[sl] - roll[sl]), max=cfg.tis_high)
            if bug == "mask_straight_through":
                tok = tok + (tok * keep - tok).detach()
            else:
                tok = tok * keep
            pg_part = torch.sum(tok * m / tokens) * cfg.dp
        loss = pg_part
        if cfg.opd is not None:
            est = _estimate(xs - teacher[sl], cfg.opd)
            if bug == "opd_no_grad":
                est = est.detach()
            opd_part = torch.sum(est * m / tokens) * cfg.dp
            loss = loss + cfg.opd_coef * opd_part
            opd_total += opd_part.detach()
        if bug == "scaled_backward":
            loss = 2 * loss - loss.detach()
        if loss.requires_grad:  # a term with no gradient at all (a detached ratio) leaves the leaf's zero
            loss.backward()
        pg_total += pg_part.detach()
    # the entropy term's value (coefficient 0: no gradient) as the policy term aggregates, when it is recorded
    entropy_loss = float(torch.sum(ent * mask / tokens) * cfg.dp) if cfg.top_entropy_quantile < 1.0 else 0.0
    fields = {"pg_loss": float(pg_total), "entropy_loss": entropy_loss}
    if cfg.opd is not None:
        fields["opd_loss"] = float(opd_total)
        fields["loss"] = float(pg_total + cfg.opd_coef * opd_total)
    else:
        fields["loss"] = float(pg_total)
    return fields, (x.grad if x.grad is not None else torch.zeros_like(x)).detach().clone()


def recompute_config(cfg: FamilyGradConfig, tokens: int, samples: int) -> RecomputeConfig:
    name, params = cfg.family, dict(cfg.params)
    base = dict(eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, loss_agg_mode="token_mean",
                loss_token_count=tokens, loss_scale=float(cfg.dp), log_ratio_clamp=cfg.log_ratio_clamp)
    if name == "geo_mean":
        base.update(loss_agg_mode="seq_mean_token_sum", loss_seq_count=samples)
    if name != "ppo":
        base.update(policy_loss=name, policy_loss_params=params)
    if cfg.opsm_delta is not None:
        base.update(opsm_delta=cfg.opsm_delta, opsm_anchor="old")
    if cfg.top_entropy_quantile < 1.0:
        base.update(top_entropy_quantile=cfg.top_entropy_quantile)
    if cfg.is_keep is not None:
        base.update(is_keep=cfg.is_keep)
    if cfg.tis_high is not None:
        base.update(is_level="token", is_mode="truncate", is_high=cfg.tis_high)
    if cfg.opd is not None:
        base.update(opd_placement="loss", opd_kl_type=cfg.opd, opd_coef=cfg.opd_coef)
    return RecomputeConfig(**base)


def produce_family_grad_bundle(path: str | Path, seed: int, size: Size, cfg: FamilyGradConfig, *,
                               bug: Optional[str] = None) -> Path:
    """Write the step bundle (loss.policy and loss.grad) this producer records for ``seed``."""
    if bug is not None and bug not in FAMILY_GRAD_BUGS.values():
        raise ValueError(f"unknown gradient bug {bug!r}")
    inputs = make_inputs(seed, size, "rm")
    rng = np.random.Generator(np.random.PCG64(seed + 11))
    total = int(inputs.lengths.sum())
    logp = inputs.log_probs.astype(np.float32)
    old = (logp + rng.normal(0, cfg.spread, total)).astype(np.float32)
    roll = (old + rng.normal(0, 0.2, total)).astype(np.float32)
    teacher = (logp + rng.normal(0, 0.3, total)).astype(np.float32)
    ent = rng.uniform(0.1, 3.0, total).astype(np.float32)
    adv = np.repeat(rng.normal(0, 1, size.samples), inputs.lengths).astype(np.float32)
    if cfg.edge:  # a decision at its edge: rollout_is's range, dppo_mu's and the IcePop-like tests
        t = int(np.flatnonzero(inputs.mask)[0])
        roll[t] = np.float32(logp[t] - np.float32(np.log1p(np.float32(cfg.eps_clip_high))))
        adv[:int(inputs.lengths[0])] = abs(adv[0]) + 0.5
    lengths = torch.from_numpy(inputs.lengths.astype(np.int64))
    mask = torch.from_numpy(inputs.mask.astype(np.float32))
    fields, grad = family_grad_step(_f32(logp), _f32(old), _f32(adv), _f32(roll), _f32(ent), _f32(teacher), mask,
                                    lengths, cfg, bug)
    tokens = int(inputs.mask.sum())
    bundle_id = f"grad-family-{cfg}-{size}-s{seed}" + (f"-{bug}" if bug else "")
    bounds = np.linspace(0, size.samples, cfg.micro_batches + 1).astype(int)
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=int(inputs.groups[i]), response_length=int(n),
                            total_length=int(n) + 32, loss_mask=inputs.mask[o:o + n].tolist(), raw_reward=0.0,
                            reward=0.0, micro_batch_id=f"mb-{int(np.searchsorted(bounds, i, side='right') - 1)}")
               for i, (n, o) in enumerate(zip(inputs.lengths.tolist(), inputs.offsets.tolist()))]
    index = BundleIndex(bundle_id=bundle_id, identity=Identity(actor_step_id=ActorStepId(rollout_id=3, step_id=0),
                                                               rank={"dp": cfg.dp}),
                        samples=samples, config=recompute_config(cfg, tokens, size.samples))
    policy = ComparisonPolicy(tolerances={"loss.grad": Tolerance(atol=0.0, rtol=1e-6)})
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=bundle_id,
                        producer=ProducerInfo(commit="tests.producers.grad_families",
                                              torch_version=torch.__version__),
                        stage_contracts=stage_contracts((StageId.SAMPLE, StageId.LOSS_POLICY, StageId.LOSS_GRAD)),
                        payloads={}, comparison_policy=policy, redaction={})
    writer = BundleWriter(path, manifest, index, {"loss.policy": fields})
    payloads = [("log_probs", logp), ("old_log_probs", old), ("rollout_log_probs", roll), ("advantages", adv)]
    if cfg.top_entropy_quantile < 1.0:
        payloads.append(("entropy", ent))
    if cfg.opd is not None:
        payloads.append(("teacher_log_probs", teacher))
    for name, values in payloads:
        writer.write_payload(name, _f32(values))
    writer.write_payload("grad_log_probs", grad)
    return writer.finalize(ranks=[0])


# one config per family, and the knobs on a family each
CONFIGS = (
    FamilyGradConfig("cispo", log_ratio_clamp=20.0),
    FamilyGradConfig("cispo", params={"cap": "absolute"}, eps_clip_high=1.2),
    FamilyGradConfig("sapo", params={"tau_pos": 1.0, "tau_neg": 1.05}, log_ratio_clamp=20.0),
    FamilyGradConfig("sapo", params={"tau_pos": 4.0, "tau_neg": 8.0}, log_ratio_clamp=20.0, spread=0.6),
    FamilyGradConfig("geo_mean", eps_clip=0.1, eps_clip_high=0.1),
    FamilyGradConfig("dppo_tv", eps_clip=0.05, eps_clip_high=0.05, params={"trunc": 1.2}, log_ratio_clamp=20.0),
    FamilyGradConfig("dppo_kl", eps_clip=0.01, eps_clip_high=0.01, params={"trunc": 1.2}, log_ratio_clamp=20.0),
    FamilyGradConfig("dro", params={"beta": 0.5}),
    FamilyGradConfig("gpg"),
    FamilyGradConfig("kl_cov", params={"kl_cov_ratio": 0.2, "ppo_kl_coef": 5.0}),
    FamilyGradConfig("vespo", spread=0.02),
    FamilyGradConfig("ipo", params={"ipo_threshold": 0.05, "adv_tau": 1.0, "kl_tau": 0.01}),
    FamilyGradConfig("rollout_is"),
    FamilyGradConfig("importance_sampling"),
    FamilyGradConfig("cross_entropy"),
    FamilyGradConfig("dppo_mu", eps_clip=0.05, eps_clip_high=0.05, params={"divergence": "tv", "anchor": "rollout"}),
    # the knobs that multiply a family's term, and the distillation term
    FamilyGradConfig("ppo", opsm_delta=0.0, log_ratio_clamp=20.0),
    FamilyGradConfig("cispo", top_entropy_quantile=0.5, log_ratio_clamp=20.0),
    FamilyGradConfig("ppo", is_keep={"token": [0.8, 1.25]}, tis_high=2.0, log_ratio_clamp=20.0),
    FamilyGradConfig("gpg", opd="k3"),
    FamilyGradConfig("dppo_tv", eps_clip=0.05, eps_clip_high=0.05, params={"trunc": 1.2}, log_ratio_clamp=20.0,
                     tis_high=2.0, is_keep={"token": [0.8, 1.25]}),
    FamilyGradConfig("sapo", opsm_delta=0.0, opd="k1", log_ratio_clamp=20.0),
)

__all__ = ["CONFIGS", "FAMILY_GRAD_BUGS", "FamilyGradConfig", "family_grad_step", "produce_family_grad_bundle"]
