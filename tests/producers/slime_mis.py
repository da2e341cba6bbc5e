"""slime's MIS (masked importance sampling) step, written from reading slime's code — never with
``replay_lib.kernels`` — in float32 on per-sample 1-D tensors, as slime holds them:

* ``THUDM/slime@624b824a8`` ``examples/train_infer_mismatch_helper/mis.py``: ``compute_mis_weights`` (:150-307):
  per sequence ``Δ = train − rollout`` (train: the trainer's ``log_probs`` batch key, our ``old_log_probs``,
  ``slime/backends/megatron_utils/loss.py:987-989, 1067``); the IS weight ``exp(clamp(Δ at tis_level, ±20))``
  (token: Δ, sequence: ``masked_sum``, geometric: ``masked_mean`` with ``clamp_min(Σ m, 1)``, :12-19, 192-200,
  221-223); ``truncate`` ``w.clamp(0, upper)·m`` (:103-113), ``clip`` ``w.clamp(lower, upper)·m`` (:116-128),
  ``mask`` ``w·m`` kept and ``modified_mask = m·1[lower ≤ w ≤ upper]`` (:131-147); ``use_rs`` another mask at
  ``rs_level`` (:243-256) and the veto: a sequence with a loss token ``Δ < log(veto)`` fully dropped (:82-100,
  258-263); ``lower`` defaults to ``1/upper`` (:174), the RS bounds to the TIS ones (:175-176);
* ``slime/backends/megatron_utils/loss.py`` ``policy_loss_function``: ``ppo_kl = old − logp`` (:1030),
  ``compute_policy_loss`` (``slime/utils/ppo_utils.py``: ``max(−r·A, −clip(r)·A)``), ``pg_loss × weights``
  (mis.py:371-373), then ``sum_of_sample_mean`` rebuilt with the modified masks as numerators and the original
  ``rollout_mask_sums`` as denominators (loss.py:1080-1091) for pg_loss, pg_clipfrac, ppo_kl, entropy and the KL
  loss (:1100-1130); ``get_sum_of_sample_mean`` (CP 1): ``Σ_i Σ_t x·m' / clamp(Σ_t m, 1)``.

``grad``: the step's ``pg_loss + kl_coef·kl_loss`` backpropagated into float32 leaves of the log-probs
(``torch.autograd``), recorded as ``grad_log_probs`` for ``loss.grad``.

``bug``: ``"denominator"`` — the rejected tokens also leave the denominators (the reducer rebuilt from the
modified masks alone, the bug loss.py:1080-1085's comment warns of)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, Identity, Manifest, ProducerInfo,
                                      SampleRecord, StageId, stage_contracts)

SAFETY_BOUND = 20.0


@dataclass(frozen=True)
class Mis:
    """mis.yaml's settings."""

    tis_level: str = "token"
    tis_mode: str = "truncate"
    tis_lower_bound: Optional[float] = 0.5
    tis_upper_bound: float = 2.0
    use_rs: bool = False
    rs_level: str = "token"
    rs_lower_bound: Optional[float] = None
    rs_upper_bound: Optional[float] = None
    rs_veto_threshold: Optional[float] = None

    def args(self) -> dict:
        return {"use_tis": True, "custom_tis_function_path":
                "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp", **self.__dict__}


def _level(diff: torch.Tensor, m: torch.Tensor, level: str) -> torch.Tensor:
    if level == "token":
        return diff
    total = (diff * m).sum()
    if level == "sequence":
        return total.expand_as(diff)
    return (total / torch.clamp_min(m.sum(), 1)).expand_as(diff)


def mis_weights(cfg: Mis, train: list, rollout: list, masks: list) -> tuple[list, list]:
    lower = cfg.tis_lower_bound if cfg.tis_lower_bound is not None else 1.0 / cfg.tis_upper_bound
    rs_lower = cfg.rs_lower_bound if cfg.rs_lower_bound is not None else lower
    rs_upper = cfg.rs_upper_bound if cfg.rs_upper_bound is not None else cfg.tis_upper_bound
    weights, modified = [], []
    for t, r, m in zip(train, rollout, masks):
        m = m.float()
        diff = t - r
        new_mask = m.clone()
        w = torch.exp(torch.clamp(_level(diff, m, cfg.tis_level), -SAFETY_BOUND, SAFETY_BOUND))
        if cfg.tis_mode == "truncate":
            w = w.clamp(0, cfg.tis_upper_bound) * m
        elif cfg.tis_mode == "clip":
            w = w.clamp(lower, cfg.tis_upper_bound) * m
        else:
            new_mask = m * ((w >= lower) & (w <= cfg.tis_upper_bound)).float()
            w = w * m
        if cfg.use_rs:
            w_rs = torch.exp(torch.clamp(_level(diff, m, cfg.rs_level), -SAFETY_BOUND, SAFETY_BOUND))
            new_mask = new_mask * ((w_rs >= rs_lower) & (w_rs <= rs_upper)).float()
            if cfg.rs_veto_threshold is not None:
                bad = (diff < math.log(cfg.rs_veto_threshold)) & m.bool()
                new_mask = new_mask * (~bad.any()).float()
        weights.append(w)
        modified.append(new_mask)
    return weights, modified


def slime_mis_step(cfg: Mis, logp, old, rollout, adv, ref, masks, *, eps=0.2, kl_coef=0.01, bug: str = "",
                   grad: bool = False):
    """The recorded loss fields of one slime step (lists of per-sample float32 tensors); ``grad``: and
    ``"grad_log_probs"``, ∂(pg_loss + kl_coef·kl_loss)/∂logp concatenated over the samples."""
    weights, modified = mis_weights(cfg, old, rollout, masks)
    if grad:
        logp = [lp.clone().requires_grad_(True) for lp in logp]
    numer, denom = modified, modified if bug == "denominator" else masks

    def reduce(values):
        return sum((v * n).sum() / torch.clamp_min(d.sum(), 1) for v, n, d in zip(values, numer, denom))

    pg, clip, ppo_kl, kl = [], [], [], []
    for lp, o, a, w, rf in zip(logp, old, adv, weights, ref):
        k = o - lp
        ratio = torch.exp(-k)
        l1, l2 = -ratio * a, -ratio.clamp(1 - eps, 1 + eps) * a
        pg.append(torch.maximum(l1, l2) * w)
        clip.append(torch.gt(l2, l1).float())
        ppo_kl.append(k)
        kl.append(lp - rf)  # k1
    pg_loss, kl_loss = reduce(pg), reduce(kl)
    if grad:
        (pg_loss + kl_coef * kl_loss).backward()
        grads = torch.cat([lp.grad for lp in logp]).detach()
        pg_loss, kl_loss = pg_loss.detach(), kl_loss.detach()
        return {"loss": float(pg_loss + kl_coef * kl_loss), "pg_loss": float(pg_loss), "pg_clipfrac":
                float(reduce(clip)), "ppo_kl": float(reduce([k.detach() for k in ppo_kl])),
                "kl_loss": float(kl_loss), "grad_log_probs": grads}
    return {"loss": float(pg_loss + kl_coef * kl_loss), "pg_loss": float(pg_loss), "pg_clipfrac": float(reduce(clip)),
            "ppo_kl": float(reduce(ppo_kl)), "kl_loss": float(kl_loss)}


def make_step(seed: int, samples: int = 8, longest: int = 40):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(longest // 3, longest + 1, (samples,), generator=g)
    masks = []
    for i, n in enumerate(lengths.tolist()):
        m = (torch.rand(n, generator=g) > 0.15).float()
        if i == 3:
            m.zero_()  # a fully masked sample
        masks.append(m)
    old = [-torch.rand(n, generator=g) * 3 for n in lengths.tolist()]
    logp = [o + torch.randn(o.shape, generator=g) * 0.2 for o in old]
    # each sample its own train/rollout offset and spread: the sequence and geometric weights spread too
    rollout = [o + float(torch.randn(1, generator=g)) * 0.05 + torch.randn(o.shape, generator=g) * 0.4 for o in old]
    rollout[5][2] = old[5][2] + 12.0  # a catastrophic token (Δ = −12 < log 1e-4) for the veto
    masks[5][2] = 1.0
    ref = [lp + torch.randn(lp.shape, generator=g) * 0.3 for lp in logp]
    adv = [torch.full((n,), float(torch.randn(1, generator=g))) for n in lengths.tolist()]
    return lengths, masks, old, logp, rollout, ref, adv


# slime's arguments of the step beyond the MIS ones (the test maps them with replay_lib.frameworks.from_slime)
STEP_ARGS = {"eps_clip": 0.2, "use_kl_loss": True, "kl_loss_coef": 0.01, "kl_loss_type": "k1"}


def produce_slime_mis_bundle(path: str | Path, cfg: Mis, config, seed: int = 3, bug: str = "",
                             grad: bool = False) -> Path:
    """``config``: the RecomputeConfig the test maps from slime's arguments (:meth:`Mis.args` plus
    :data:`STEP_ARGS`), recorded as the bundle's; the step is this module's own."""
    lengths, masks, old, logp, rollout, ref, adv = make_step(seed)
    policy = slime_mis_step(cfg, logp, old, rollout, adv, ref, masks, bug=bug, grad=grad)
    grads = policy.pop("grad_log_probs", None)
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=i // 4, response_length=int(n), total_length=int(n) + 5,
                            loss_mask=[int(v) for v in masks[i]], raw_reward=0.0, reward=0.0)
               for i, n in enumerate(lengths.tolist())]
    bundle_id = f"slime-mis-{cfg.tis_level}-{cfg.tis_mode}-s{seed}" + (f"-{bug}" if bug else "")
    index = BundleIndex(bundle_id=bundle_id, identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0)),
                        samples=samples, config=config)
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=bundle_id,
                        producer=ProducerInfo(commit="tests.producers.slime_mis", torch_version=torch.__version__),
                        stage_contracts=stage_contracts((StageId.SAMPLE, StageId.LOSS_POLICY)
                                                        + ((StageId.LOSS_GRAD,) if grad else ())), payloads={},
                        redaction={})
    writer = BundleWriter(path, manifest, index, {"loss.policy": policy})
    for name, values in (("log_probs", logp), ("old_log_probs", old), ("rollout_log_probs", rollout),
                         ("ref_log_probs", ref), ("advantages", adv)):
        writer.write_payload(name, torch.cat(values).float())
    if grads is not None:
        writer.write_payload("grad_log_probs", grads)
    return writer.finalize(ranks=[0])
