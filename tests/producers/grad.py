"""A gradient producer (loss.grad, SPEC §4.3): a verl-like actor step whose per-token gradient ``grad_log_probs``
comes from ``torch.autograd`` on a loss this module writes itself (float32 eager PyTorch, never
``replay_lib.kernels``), read off the log-prob leaf after the step's backward passes.

The step is split into ``micro_batches`` micro-batches; each computes its surrogate (``exp`` of a clamped
log-ratio, ``torch.maximum`` of the two branches, ``torch.where`` dual-clip, a ``clamp``-ed TIS weight or an IcePop
``where``-mask, GSPO's per-sample mean log-ratio), its KL term (``exp(ref − logp) − (ref − logp) − 1`` clamped, as
verl's ``low_var_kl``; ``k1``/``k2``/``abs`` too), aggregates them with its mode (the global token count × dp for
``token_mean``, ``seq_mean_token_mean`` over the global sample count, ``micro_batch_token_mean`` over its own
tokens and the micro-batch count, the per-sample means of ``sum_of_sample_means``) and calls ``backward`` on it —
divided by the micro-batch count first with ``accumulate=True`` (gradient accumulation: the bundle records
``grad_scale = 1/K``, the step reporting the undivided sum).

:data:`GRAD_BUGS` are the bug classes whose loss value is right and whose gradient is not: ``kl_no_grad`` (the KL
term computed under ``no_grad``, SkyRL#1353), ``is_not_detached`` (the importance weight ``exp(logp − rollout)``
from the current log-probs, not detached: the same value on-policy, verl#4105), ``ratio_detached`` (the ratio
frozen by a detach: the policy term has no gradient, torchforge#571), ``zero_coef_nan`` (a KL term of coefficient
0 whose clamped ``exp`` overflows: 0·NaN in backward, slime#2258), ``scale_twice`` (the accumulation divisor
applied twice before backward), ``kl_weight_detached`` (``kl_rollout_weighted``: the KL term's weight
``exp(logp − rollout)`` detached, the score-function part of its gradient lost — NeMo-RL before #2506),
``mis_not_in_backward`` (``mis_rs``: the rejected tokens left out of the reported loss only, the backward pass
taking every loss token's term).

``kl_rollout_weighted`` writes NeMo-RL's on-policy KL approximation as NVIDIA-NeMo/RL @ 7ea279ab does
(``nemo_rl/algorithms/loss/loss_functions.py:482-493``: ``w = exp(curr − generation)`` not detached, NaN/±inf → 0;
``nemo_rl/algorithms/utils.py:72-99``: ``logr = ref − logp`` clamped to ±20 with ``w`` detached where the clamp
holds, ``w·k3`` clamped to ±10). ``mis_rs`` / ``mis_veto`` write slime's MIS rejection as
``examples/train_infer_mismatch_helper/mis.py`` (THUDM/slime@624b824a8, :131-147, 243-263) decides it and
``slime/backends/megatron_utils/loss.py:1080-1091`` applies it: the modified mask in every term's numerator, the
original mask's counts as the denominators.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, ComparisonPolicy, Identity,
                                      Manifest, ProducerInfo, RecomputeConfig, SampleRecord, StageId, Tolerance,
                                      stage_contracts)

from .inputs import Size, make_inputs

GRAD_BUGS = ("kl_no_grad", "is_not_detached", "ratio_detached", "zero_coef_nan", "scale_twice")
# the bugs of one knob each (kl_rollout_weighted, mis_rs / mis_veto)
KNOB_BUGS = ("kl_weight_detached", "mis_not_in_backward")


@dataclass(frozen=True)
class GradConfig:
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    eps_clip_c: Optional[float] = 3.0
    kl_loss_type: Optional[str] = "low_var_kl"  # None: no KL term
    kl_loss_coef: float = 0.1
    kl_ratio_weighted: bool = False
    is_level: Optional[str] = "token"  # token | sequence | None
    is_mode: str = "truncate"
    is_low: Optional[float] = None
    is_high: Optional[float] = 2.0
    importance_level: str = "token"
    agg: str = "token_mean"
    dp: int = 2
    micro_batches: int = 2
    accumulate: bool = False
    on_policy: bool = False  # old_log_probs == log_probs (a first mini-batch)
    spread: float = 0.25  # the std of logp − old off-policy
    edge: bool = False  # the first loss token: ratio 1 + eps_clip_high in float32 (a clip decision at its edge)
    kl_rollout_weighted: bool = False  # NeMo-RL's on-policy KL approximation (kl_loss_type "k1"/"k2"/"k3")
    mis_rs: tuple = ()  # slime's MIS rejection: ((level "token", low, high), ...)
    mis_veto: Optional[float] = None
    mis_edge: bool = False  # the first loss token: exp(old − rollout) at mis_rs[0]'s high bound in float32

    def __str__(self) -> str:
        return (f"{self.agg}-c{self.eps_clip_c}-kl{self.kl_loss_type}{'w' if self.kl_ratio_weighted else ''}"
                f"{'r' if self.kl_rollout_weighted else ''}-"
                f"is{self.is_level}:{self.is_mode}-{self.importance_level}{'-acc' if self.accumulate else ''}"
                f"{'-mis' if self.mis_rs or self.mis_veto else ''}")


def _kl(logp: torch.Tensor, ref: torch.Tensor, kind: str, clamp_input: bool) -> torch.Tensor:
    """The KL term's estimate per token, written as verl's ``kl_penalty`` does (``ref − logp`` first)."""
    r = ref - logp
    if clamp_input:
        r = torch.clamp(r, min=-20.0, max=20.0)
    if kind == "k1":
        return -r
    if kind == "k2":
        return 0.5 * r.square()
    if kind == "abs":
        return r.abs()
    k3 = torch.exp(r) - r - 1
    return torch.clamp(k3, min=-10.0, max=10.0)


def _nemo_rl_kl(x: torch.Tensor, ref: torch.Tensor, rollout: torch.Tensor, kind: str, bug: Optional[str]
                ) -> torch.Tensor:
    """NeMo-RL's ``calculate_kl`` with the on-policy approximation's weight (module doc): ``logr = ref − logp``
    clamped to ±20, the weight detached where the clamp holds, ``w·k`` clamped to ±10."""
    w = torch.nan_to_num(torch.exp(x - rollout), nan=0.0, posinf=0.0, neginf=0.0)
    if bug == "kl_weight_detached":
        w = w.detach()
    logr = ref - x
    clamped = torch.clamp(logr, min=-20.0, max=20.0)
    w = torch.where(logr == clamped, w, w.detach())
    kl = {"k1": lambda r: -r, "k2": lambda r: torch.square(r) / 2, "k3": lambda r: torch.exp(r) - 1 - r}[kind](clamped)
    return torch.clamp(w * kl, min=-10.0, max=10.0)


def mis_keep(old: torch.Tensor, rollout: torch.Tensor, m: torch.Tensor, seg: torch.Tensor, n: int,
             cfg: "GradConfig") -> torch.Tensor:
    """slime's modified mask (module doc), token-level rejection and the veto: ``m·[low ≤ exp(clamp(old −
    rollout, ±20)) ≤ high]``, a sample with a loss token ``old − rollout < log(veto)`` dropped whole."""
    keep = m.clone()
    diff = old - rollout
    for level, low, high in cfg.mis_rs:
        if level != "token":
            raise ValueError(level)
        w = torch.exp(torch.clamp(diff, -20.0, 20.0))
        keep = keep * ((w >= low) & (w <= high)).float()
    if cfg.mis_veto is not None:
        import math

        bad = ((diff < math.log(cfg.mis_veto)) & (m > 0)).float()
        vetoed = torch.zeros(n).index_add_(0, seg, bad) > 0
        keep = keep * (~vetoed).float()[seg]
    return keep


def _weights(mode: str, m: torch.Tensor, seg: torch.Tensor, n: int, tokens: float, seqs: int, k: int,
             dp: int) -> tuple[torch.Tensor, float]:
    """``(per-token divisor, multiplier)``: the micro-batch's part of the loss is ``Σ x·m / divisor · mult``."""
    counts = torch.zeros(n).index_add_(0, seg, m)
    if mode == "token_mean":
        return torch.full_like(m, tokens), float(dp)
    if mode == "seq_mean_token_mean":
        return counts.clamp(min=1)[seg] * seqs, float(dp)
    if mode == "micro_batch_token_mean":
        return torch.full_like(m, max(float(m.sum()), 1.0) * k), 1.0
    if mode == "sum_of_sample_means":
        return counts.clamp(min=1)[seg], 1.0
    raise ValueError(mode)


def _micro_loss(x, logp_v, old, adv, rollout, ref, m, lengths, cfg: GradConfig, bug: Optional[str], tokens: float,
                seqs: int, k: int, rejection: bool = True):
    """One micro-batch's loss (pg part, kl part) as float32 0-d tensors of the leaf slice ``x`` (``rejection``:
    slime's MIS rejection applied to the numerators, when the config has one)."""
    n = lengths.numel()
    seg = torch.repeat_interleave(torch.arange(n), lengths)
    numer = mis_keep(old, rollout, m, seg, n, cfg) if rejection and (cfg.mis_rs or cfg.mis_veto) else m
    log_ratio = x - old
    if cfg.importance_level == "sequence":
        cnt = torch.zeros(n).index_add_(0, seg, m).clamp(min=1)
        mean = torch.zeros(n).index_add_(0, seg, log_ratio * m) / cnt
        ratio = torch.exp(torch.clamp(mean, -20.0, 20.0))[seg]
    else:
        ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    if bug == "ratio_detached":
        ratio = ratio.detach()
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - cfg.eps_clip, 1 + cfg.eps_clip_high)
    pg = torch.maximum(loss1, loss2)
    if cfg.eps_clip_c is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.eps_clip_c), pg)
    if cfg.is_level is not None:
        base = x if bug == "is_not_detached" else old
        log_w = base - rollout
        if cfg.is_level == "sequence":
            log_w = torch.zeros(n).index_add_(0, seg, log_w * m)[seg]
        w = torch.exp(log_w)
        if bug != "is_not_detached":
            w = w.detach()
        if cfg.is_mode == "truncate":
            w = torch.clamp(w, min=cfg.is_low, max=cfg.is_high)
            pg = pg * w
        else:
            keep = torch.ones_like(m, dtype=torch.bool)
            if cfg.is_low is not None:
                keep &= w >= cfg.is_low
            if cfg.is_high is not None:
                keep &= w <= cfg.is_high
            pg = torch.where(keep, pg * w, torch.zeros_like(pg))
    div, mult = _weights(cfg.agg, m, seg, n, tokens, seqs, k, cfg.dp)
    pg_part = torch.sum(pg * numer / div) * mult
    kl_part = None
    if cfg.kl_loss_type is not None:
        clamp_input = bug != "zero_coef_nan"
        if cfg.kl_rollout_weighted:
            kl = _nemo_rl_kl(x, ref, rollout, cfg.kl_loss_type, bug)
        elif bug == "kl_no_grad":
            with torch.no_grad():
                kl = _kl(x, ref, cfg.kl_loss_type, clamp_input)
        else:
            kl = _kl(x, ref, cfg.kl_loss_type, clamp_input)
        if cfg.kl_ratio_weighted:
            kl = kl * ratio
        kl_part = torch.sum(kl * numer / div) * mult
    return pg_part, kl_part


def grad_step(logp, old, adv, rollout, ref, mask, lengths, cfg: GradConfig, bug: Optional[str] = None
              ) -> tuple[dict[str, float], torch.Tensor]:
    """``(loss fields, grad_log_probs)``: each micro-batch's loss backpropagated into one float32 leaf."""
    coef = 0.0 if bug == "zero_coef_nan" else cfg.kl_loss_coef
    x = logp.clone().requires_grad_(True)
    n = lengths.numel()
    bounds = np.linspace(0, n, cfg.micro_batches + 1).astype(int)
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    tokens = float(mask.sum())
    k = sum(1 for a, b in zip(bounds[:-1], bounds[1:]) if a != b)
    pg_total = torch.zeros(())
    kl_total = torch.zeros(())
    for a, b in zip(bounds[:-1], bounds[1:]):
        if a == b:
            continue
        lo, hi = int(starts[a]), int(ends[b - 1])
        sl = slice(lo, hi)
        args = (x[sl], logp[sl], old[sl], adv[sl], rollout[sl], ref[sl], mask[sl], lengths[a:b], cfg, bug, tokens,
                n, k)
        pg, kl = _micro_loss(*args)
        if bug == "mis_not_in_backward":  # the reported loss rejects, the backward pass does not
            pg_b, kl_b = _micro_loss(*args, rejection=False)
            loss = pg_b if kl_b is None else pg_b + coef * kl_b
        else:
            loss = pg if kl is None else pg + coef * kl
        if cfg.accumulate:
            loss = loss / k
            if bug == "scale_twice":
                loss = loss / k
        loss.backward()
        pg_total += pg.detach()
        if kl is not None:
            kl_total += kl.detach()
    fields = {"pg_loss": float(pg_total)}
    if cfg.kl_loss_type is not None and coef != 0:
        fields["kl_loss"] = float(kl_total)
        fields["loss"] = float(pg_total + coef * kl_total)
    else:
        fields["loss"] = float(pg_total)
    return fields, x.grad.detach().clone()


def recompute_config(cfg: GradConfig, tokens: int, samples: int, bug: Optional[str]) -> RecomputeConfig:
    coef = 0.0 if bug == "zero_coef_nan" else cfg.kl_loss_coef
    kl = {} if cfg.kl_loss_type is None else dict(
        use_kl_loss=True, kl_loss_coef=coef, kl_loss_type=cfg.kl_loss_type,
        kl_loss_input_clamp=20.0 if cfg.kl_loss_type == "low_var_kl" or cfg.kl_rollout_weighted else None,
        kl_loss_output_clamp=10.0 if cfg.kl_loss_type == "low_var_kl" or cfg.kl_rollout_weighted else None)
    if cfg.kl_ratio_weighted:
        kl["kl_loss_ratio_weighted"] = True
    if cfg.kl_rollout_weighted:
        kl["kl_loss_rollout_weighted"] = True
    if cfg.mis_rs:
        kl["mis_rs"] = [tuple(option) for option in cfg.mis_rs]
    if cfg.mis_veto is not None:
        kl["mis_veto"] = cfg.mis_veto
    counts = {"token_mean": dict(loss_token_count=tokens), "seq_mean_token_mean": dict(loss_seq_count=samples)}
    scale = float(cfg.dp) if cfg.agg in ("token_mean", "seq_mean_token_mean") else 1.0
    extra = dict(grad_scale=1.0 / cfg.micro_batches) if cfg.accumulate else {}
    return RecomputeConfig(eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, eps_clip_c=cfg.eps_clip_c,
                           log_ratio_clamp=20.0, importance_level=cfg.importance_level, is_level=cfg.is_level,
                           is_mode=cfg.is_mode, is_low=cfg.is_low, is_high=cfg.is_high, loss_agg_mode=cfg.agg,
                           loss_scale=scale, **counts.get(cfg.agg, {}), **kl, **extra)


def _f32(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def grad_inputs(seed: int, size: Size, cfg: GradConfig, bug: Optional[str] = None):
    """The step's float32 inputs: ``(logp, old, adv, rollout, ref, mask, lengths, inputs)``."""
    inputs = make_inputs(seed, size, "rm")
    rng = np.random.Generator(np.random.PCG64(seed + 7))
    total = int(inputs.lengths.sum())
    logp = inputs.log_probs.astype(np.float32).copy()
    old = logp.copy() if cfg.on_policy else (logp + rng.normal(0, cfg.spread, total)).astype(np.float32)
    rollout = (old + rng.normal(0, 0.3, total)).astype(np.float32)
    ref = (logp + rng.normal(0, 0.3, total)).astype(np.float32)
    adv = np.repeat(rng.normal(0, 1, size.samples), inputs.lengths).astype(np.float32)
    if cfg.edge:  # A > 0, ratio at the upper clip bound; no IS weight (rollout = old), no KL slope (ref = logp)
        t = int(np.flatnonzero(inputs.mask)[0])
        old[t] = np.float32(logp[t] - np.float32(np.log1p(np.float32(cfg.eps_clip_high))))
        rollout[t], ref[t] = old[t], logp[t]
        adv[:int(inputs.lengths[0])] = abs(adv[0]) + 0.5
    if cfg.mis_edge:  # exp(old − rollout) = high in float32 at the first loss token: the decision at its edge
        t = int(np.flatnonzero(inputs.mask)[0])
        rollout[t] = np.float32(old[t] - np.float32(np.log(np.float32(cfg.mis_rs[0][2]))))
    if bug == "zero_coef_nan":  # one loss token whose reference is e^100 times likelier: exp(ref − logp) overflows
        t = int(np.flatnonzero(inputs.mask)[0])
        logp[t] = old[t] = rollout[t] = -110.0
        ref[t] = -10.0
    return logp, old, adv, rollout, ref, inputs


def produce_grad_bundle(path: str | Path, seed: int, size: Size, cfg: GradConfig = GradConfig(), *,
                        bug: Optional[str] = None, value: Optional[dict] = None) -> Path:
    """Write the step bundle (loss.policy and loss.grad) this producer records for ``seed``; ``value``: the
    value loss's payloads to record beside (``values``, ``old_values``, ``returns``, ``grad_values``, float32
    arrays over the tokens) and its ``value_clip``."""
    if bug is not None and bug not in GRAD_BUGS + KNOB_BUGS:
        raise ValueError(f"unknown gradient bug {bug!r} (expected one of {', '.join(GRAD_BUGS + KNOB_BUGS)})")
    logp, old, adv, rollout, ref, inputs = grad_inputs(seed, size, cfg, bug)
    lengths = torch.from_numpy(inputs.lengths.astype(np.int64))
    mask = torch.from_numpy(inputs.mask.astype(np.float32))
    fields, grad = grad_step(_f32(logp), _f32(old), _f32(adv), _f32(rollout), _f32(ref), mask, lengths, cfg, bug)
    tokens = int(inputs.mask.sum())
    bundle_id = f"grad-{cfg}-{size}-s{seed}" + (f"-{bug}" if bug else "")
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=int(inputs.groups[i]), response_length=int(n),
                            total_length=int(n) + 32, loss_mask=inputs.mask[o:o + n].tolist(), raw_reward=0.0,
                            reward=0.0, micro_batch_id=f"mb-{_micro_batch(i, size.samples, cfg.micro_batches)}")
               for i, (n, o) in enumerate(zip(inputs.lengths.tolist(), inputs.offsets.tolist()))]
    index = BundleIndex(bundle_id=bundle_id, identity=Identity(actor_step_id=ActorStepId(rollout_id=3, step_id=0),
                                                               rank={"dp": cfg.dp}),
                        samples=samples, config=recompute_config(cfg, tokens, size.samples, bug))
    if value is not None:
        import msgspec

        index = msgspec.structs.replace(index, config=msgspec.structs.replace(index.config,
                                                                              value_clip=value["value_clip"]))
    policy = ComparisonPolicy(tolerances={"loss.grad": Tolerance(atol=0.0, rtol=1e-6)})
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=bundle_id,
                        producer=ProducerInfo(commit="tests.producers.grad", torch_version=torch.__version__),
                        stage_contracts=stage_contracts((StageId.SAMPLE, StageId.LOSS_POLICY, StageId.LOSS_GRAD)),
                        payloads={}, comparison_policy=policy, redaction={})
    writer = BundleWriter(path, manifest, index, {"loss.policy": fields})
    for name, values in (("log_probs", logp), ("old_log_probs", old), ("ref_log_probs", ref),
                         ("rollout_log_probs", rollout), ("advantages", adv)):
        writer.write_payload(name, _f32(values))
    writer.write_payload("grad_log_probs", grad)
    for name in ("values", "old_values", "returns", "grad_values") if value is not None else ():
        writer.write_payload(name, _f32(value[name]))
    return writer.finalize(ranks=[0])


def _micro_batch(i: int, n: int, k: int) -> int:
    """The micro-batch of sample ``i`` as :func:`grad_step` splits ``n`` samples (``np.linspace`` bounds)."""
    bounds = np.linspace(0, n, k + 1).astype(int)
    return int(np.searchsorted(bounds, i, side="right") - 1)


CONFIGS = (
    GradConfig(),  # token mean × dp, dual-clip, low_var_kl with its clamps, token TIS
    GradConfig(is_mode="mask", is_low=0.5, is_high=1.5, kl_loss_type="k2", kl_ratio_weighted=True,
               agg="seq_mean_token_mean"),  # IcePop, a ratio-weighted k2 term, per-sequence means
    GradConfig(importance_level="sequence", eps_clip_c=None, is_level="sequence", is_high=4.0, kl_ratio_weighted=True,
               agg="micro_batch_token_mean", micro_batches=3, accumulate=True),  # GSPO, accumulation
    GradConfig(kl_loss_type="k1", is_level=None, agg="sum_of_sample_means", spread=0.05),
    GradConfig(kl_loss_type="abs", eps_clip_c=None, is_level="token", is_mode="mask", is_low=0.8, is_high=1.25,
               agg="token_mean", accumulate=True, micro_batches=4),
)

__all__ = ["CONFIGS", "GRAD_BUGS", "KNOB_BUGS", "GradConfig", "grad_step", "produce_grad_bundle"]
