"""NeMo-RL's semantics as the producer, from a reference written from its code (NeMo-RL cannot be installed here):
NVIDIA-NeMo/RL @ 7ea279abfbeb, ``nemo_rl/algorithms/advantage_estimator.py`` (below ``adv.py``),
``nemo_rl/algorithms/utils.py`` (``utils.py``), ``nemo_rl/algorithms/loss/loss_functions.py`` (``loss.py``) and
``nemo_rl/algorithms/grpo.py``. Each function below is that code's formula in torch, cited by line, evaluated in
float32 as NeMo-RL evaluates it; none calls ``replay_lib.kernels``.

Random GRPO steps (three prompts of four generations) with trailing padding, interior masked spans (tool output
inside a response: token mask 0), a fully masked sample and three micro-batches whose losses sum to the step's
(``masked_mean`` over ``global_valid_toks``), with float32 and bf16 log-probs; each bundle is mapped by
``from_nemo_rl`` from a NeMo-RL config and must replay with 0 divergences; an injected bug is named at its stage.
"""

from __future__ import annotations

from typing import Optional

import msgspec
import pytest
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, Identity, Manifest, ProducerInfo,
                                      SampleRecord, StageId, stage_contracts)
from replay_lib.errors import FrameworkConfigError, UnsupportedFrameworkConfig
from replay_lib.frameworks import from_nemo_rl
from replay_lib.run.runner import replay

from producers import comparison_policy

GROUPS, N = 3, 4
B = GROUPS * N
MICRO = 3
STAGES = (StageId.SAMPLE, StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_ESTIMATE, StageId.LOSS_POLICY)
PRECISIONS = ("float32", "bfloat16")

# The configs: grpo_math_1B.yaml's defaults (LOO baseline + LOO std, k3 KL loss at 0.01 clamped 20/10, clip
# 0.2/0.2, token-level), its common variations (no std, the plain mean baseline, no KL, DAPO's 0.28, dual-clip,
# sequence-level loss, k1/k2 KL, TIS and IcePop importance correction).
CONFIGS = {
    "default": {},
    "no-std": {"grpo": {"normalize_rewards": False}},
    "mean-baseline": {"grpo": {"use_leave_one_out_baseline": False}},
    "no-kl-clip-high": {"loss_fn": {"reference_policy_kl_penalty": 0.0, "ratio_clip_max": 0.28}},
    "dual-clip-k2": {"loss_fn": {"ratio_clip_c": 3.0, "reference_policy_kl_type": "k2"}},
    "seq-level-k1": {"loss_fn": {"token_level_loss": False, "reference_policy_kl_type": "k1"}},
    "tis": {"loss_fn": {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis",
                        "truncated_importance_sampling_ratio": 2.0}},
    "icepop": {"loss_fn": {"use_importance_sampling_correction": True,
                           "truncated_importance_sampling_type": "icepop",
                           "truncated_importance_sampling_ratio": 2.0,
                           "truncated_importance_sampling_ratio_min": 0.5}},
    "is-untruncated": {"loss_fn": {"use_importance_sampling_correction": True}},
    # Reinforce++ (advantage_estimator.py:193-267): the prompt's mean baseline, or the raw reward, whitened
    "reinforce-pp": {"grpo": {"adv_estimator": {"name": "reinforce_plus_plus"}}},
    "reinforce-pp-no-baseline-k1": {"grpo": {"adv_estimator": {"name": "reinforce_plus_plus", "minus_baseline": False}},
                                    "loss_fn": {"reference_policy_kl_type": "k1"}},
    "reinforce-pp-kl-in-reward": {"grpo": {"adv_estimator": {"name": "reinforce_plus_plus"}},
                                  "loss_fn": {"use_kl_in_reward": True, "reference_policy_kl_penalty": 0.0}},
    # use_kl_in_reward under GRPO: the loss's KL coefficient is 0 (loss.py:240-242), the estimator never reads it
    "grpo-kl-in-reward": {"loss_fn": {"use_kl_in_reward": True}},
    "gdpo": {"grpo": {"adv_estimator": {"name": "gdpo"}}},
    "gdpo-weighted-mean-baseline": {"grpo": {"adv_estimator": {"name": "gdpo", "reward_weights": [1.0, 0.3]},
                                             "use_leave_one_out_baseline": False}},
    # GSPO: sequence-level ratios with the per-sequence loss (loss.py:265-268, 526-541), plain and with TIS
    "gspo": {"loss_fn": {"sequence_level_importance_ratios": True, "token_level_loss": False}},
    "gspo-tis": {"loss_fn": {"sequence_level_importance_ratios": True, "token_level_loss": False,
                             "use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis",
                             "truncated_importance_sampling_ratio": 2.0}},
    # the ratio forced to 1 (loss.py:399-402, 520-525): prev_logprobs recorded as NeMo-RL leaves them (zeros)
    "force-on-policy-is": {"loss_fn": {"force_on_policy_ratio": True, "use_importance_sampling_correction": True}},
    # the REINFORCE surrogate −A·logp (loss.py:540-543), plain and with IcePop (the OPD recipe's loss)
    "reinforce": {"loss_fn": {"disable_ppo_ratio": True}},
    "reinforce-icepop-seq": {"loss_fn": {"disable_ppo_ratio": True, "token_level_loss": False,
                                         "use_importance_sampling_correction": True,
                                         "truncated_importance_sampling_type": "icepop",
                                         "truncated_importance_sampling_ratio": 2.0,
                                         "truncated_importance_sampling_ratio_min": 0.5}},
    # REINFORCE under sequence-level IS weights (loss.py:568-576): −A·logp per token, the sample's weight
    "reinforce-seq-is": {"loss_fn": {"disable_ppo_ratio": True, "sequence_level_importance_ratios": True,
                                     "token_level_loss": False, "use_importance_sampling_correction": True}},
    # seq-mask-tis (loss.py:637-665): untruncated token weights, a sample dropped by its geometric-mean weight
    "seq-mask-tis": {"loss_fn": {"use_importance_sampling_correction": True,
                                 "truncated_importance_sampling_type": "seq-mask-tis",
                                 "truncated_importance_sampling_ratio": 1.1,
                                 "truncated_importance_sampling_ratio_min": 0.9}},
    # the on-policy KL approximation (loss.py:480-491): the KL × exp(curr − gen) before the output clamp
    "kl-approx": {"loss_fn": {"use_on_policy_kl_approximation": True, "reference_policy_kl_penalty": 0.05}},
    "kl-approx-k1-seq": {"loss_fn": {"use_on_policy_kl_approximation": True, "reference_policy_kl_type": "k1",
                                     "token_level_loss": False}},
    # on-policy distillation (adv.py:551-600): sg(teacher − prev)·mask, with the recipe's loss (the estimator's
    # docstring: disable_ppo_ratio and IcePop)
    "opd": {"grpo": {"adv_estimator": {"name": "opd"}}},
    "opd-recipe": {"grpo": {"adv_estimator": {"name": "opd"}},
                   "loss_fn": {"disable_ppo_ratio": True, "use_importance_sampling_correction": True,
                               "truncated_importance_sampling_type": "icepop",
                               "truncated_importance_sampling_ratio": 2.0,
                               "truncated_importance_sampling_ratio_min": 0.5, "reference_policy_kl_penalty": 0.0}},
}


def _config(name: str) -> dict:
    """``CONFIGS[name]`` with the step's four generations per prompt (``grpo.num_generations_per_prompt``)."""
    cfg = {section: dict(values) for section, values in CONFIGS[name].items()}
    cfg.setdefault("grpo", {})["num_generations_per_prompt"] = N
    return cfg


def _knobs(cfg: dict) -> dict:
    """The values NeMo-RL's ClippedPGLossConfig / grpo_math_1B.yaml default (loss.py:113-164; yaml:8-9,80-102)."""
    g, lf = cfg.get("grpo", {}), cfg.get("loss_fn", {})
    est = g.get("adv_estimator", {})
    kl_in_reward = lf.get("use_kl_in_reward", False)
    beta = lf.get("reference_policy_kl_penalty", 0.01)
    return dict(
        normalize=g.get("normalize_rewards", True), loo=g.get("use_leave_one_out_baseline", True),
        estimator=est.get("name", "grpo"), minus_baseline=est.get("minus_baseline", True),
        reward_weights=est.get("reward_weights"),
        kl_in_reward=kl_in_reward, reward_beta=beta,
        beta=0 if kl_in_reward else beta,  # loss.py:240-242
        seq_ratio=lf.get("sequence_level_importance_ratios", False),
        kl_type=lf.get("reference_policy_kl_type", "k3"),
        clip_min=lf.get("ratio_clip_min", 0.2), clip_max=lf.get("ratio_clip_max", 0.2),
        clip_c=lf.get("ratio_clip_c"), token_level=lf.get("token_level_loss", True),
        is_on=lf.get("use_importance_sampling_correction", False),
        tis_type=lf.get("truncated_importance_sampling_type"),
        tis_max=lf.get("truncated_importance_sampling_ratio"),
        tis_min=lf.get("truncated_importance_sampling_ratio_min"),
        force=lf.get("force_on_policy_ratio", False), disable=lf.get("disable_ppo_ratio", False),
        kl_approx=lf.get("use_on_policy_kl_approximation", False))


# ------------------------------------------------------------------------------------ NeMo-RL's formulas


def baseline_and_std(prompts: torch.Tensor, rewards: torch.Tensor, loo: bool):
    """utils.py:104-198 ``calculate_baseline_and_std_per_prompt`` (every sample valid): per prompt a matrix of
    ones (minus the identity under leave-one-out) times the rewards over ``num_valid`` (:163-171), the std from
    the mean of squares minus the squared mean, × ``num_valid/(num_valid − 1)``, sqrt, NaN → 0 (:188-196); a
    prompt with one valid sample gets baseline = reward (:156-159)."""
    baseline = torch.zeros_like(rewards)
    std = torch.zeros_like(rewards)
    for p in torch.unique(prompts):
        idx = torch.nonzero(prompts == p).reshape(-1)
        n = len(idx)
        if n <= 1:
            baseline[idx] = rewards[idx]
            continue
        matrix = 1 - torch.eye(n, dtype=rewards.dtype) if loo else torch.ones(n, n, dtype=rewards.dtype)
        num_valid = float(n - int(loo))
        base = matrix @ rewards[idx] / num_valid
        square = matrix @ rewards[idx].pow(2) / num_valid
        baseline[idx] = base
        std[idx] = ((square - base.square()) * (num_valid / (num_valid - 1))).sqrt().nan_to_num(0)
    return baseline, std


def grpo_advantages(prompts: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, normalize: bool, loo: bool):
    """adv.py:72-99 ``GRPOAdvantageEstimator.compute_advantage``: ``rewards − baseline`` (:88), divided by
    ``std + 1e-6`` only where ``std > 0`` (:90-96), then ``expand(mask.shape)`` (:98): every token of the row holds
    the value, the mask-0 ones (tool spans, padding) included — no multiplication by the mask."""
    baseline, std = baseline_and_std(prompts, rewards, loo)
    adv = (rewards - baseline).unsqueeze(-1)
    if normalize:
        nz = std > 0
        adv[nz] = adv[nz] / (std.unsqueeze(-1)[nz] + 1e-6)
    return adv.expand(mask.shape)


def gdpo_advantages(prompts: torch.Tensor, comps: torch.Tensor, mask: torch.Tensor, normalize: bool, loo: bool,
                    weights=None):
    """adv.py:116-190 ``GDPOAdvantageEstimator.compute_advantage``: each component (the sorted ``reward/<name>``
    keys, here the columns of ``comps``) ``r − baseline`` over the prompt, divided by ``std + 1e-6`` only where
    ``std > 0`` (:168-182), ``Σ w·A`` (weights all 1 when unset, :145-147,184-186), then ``(A − A.mean())/A.std()``
    over the samples, or ``A − A.mean()`` where that std is 0 (:187-192), ``expand(mask.shape)`` (:194)."""
    parts = []
    for j in range(comps.shape[1]):
        r = comps[:, j]
        baseline, std = baseline_and_std(prompts, r, loo)
        adv = (r - baseline).unsqueeze(-1)
        if normalize:
            nz = std > 0
            adv[nz] = adv[nz] / (std.unsqueeze(-1)[nz] + 1e-6)
        parts.append(adv)
    w = weights if weights is not None else [1.0] * len(parts)
    adv = sum(wj * a for wj, a in zip(w, parts))
    spread = adv.std()
    adv = (adv - adv.mean()) / spread if spread > 0 else adv - adv.mean()
    return adv.expand(mask.shape)


def reinforce_pp_advantages(k: dict, prompts, rewards, mask, prev=None, ref=None):
    """adv.py:233-267 ``ReinforcePlusPlusAdvantageEstimator.compute_advantage``: ``r −`` the prompt's mean
    (``calculate_baseline_and_std_per_prompt`` without leave-one-out, :234-241) or ``r`` (``minus_baseline``
    false), ``expand(mask.shape)`` (:245-246), minus ``β·calculate_kl(prev, ref)`` per token under
    ``use_kl_in_reward`` (:249-259), then whitened over the mask: ``Σ adv·mask/Σ mask``, the variance likewise,
    ``var.clamp(min=1e-8).rsqrt()`` (:262-265) — never × the mask."""
    if k["minus_baseline"]:
        mean, _ = baseline_and_std(prompts, rewards, loo=False)
        adv = rewards - mean
    else:
        adv = rewards
    adv = adv.unsqueeze(-1).expand(mask.shape)
    if k["kl_in_reward"]:
        adv = adv - k["reward_beta"] * calculate_kl(prev, ref, k["kl_type"])
    adv_mean = (adv * mask).sum() / mask.sum()
    adv_var = ((adv - adv_mean).pow(2) * mask).sum() / mask.sum()
    return (adv - adv_mean) * adv_var.clamp(min=1e-8).rsqrt()


def calculate_kl(logprobs, reference, kl_type, input_clamp=20.0, output_clamp=10.0, weights=None):
    """utils.py:42-101: ``logr = ref − logp`` clamped to ±input_clamp, the weights detached where the clamp holds
    (:72-81); k1 ``−logr``, k2 ``logr²/2``, k3 ``exp(logr) − 1 − logr`` (:83-93); × ``importance_sampling_weights``
    when given (:95-96), then the value clamped to ±output_clamp (:98-99)."""
    raw = reference - logprobs
    logr = raw.clamp(-input_clamp, input_clamp)
    if weights is not None:
        weights = torch.where(raw == logr, weights, weights.detach())
    kl = {"k1": -logr, "k2": logr.square() / 2, "k3": logr.exp() - 1 - logr}[kl_type]
    if weights is not None:
        kl = weights * kl
    return kl.clamp(-output_clamp, output_clamp)


def masked_mean(x, mask, dim=None, global_normalization_factor=None):
    """utils.py ``masked_mean``: ``Σ x·mask / (Σ mask)`` (or over ``global_normalization_factor``)."""
    total = (x * mask).sum() if dim is None else (x * mask).sum(dim)
    if global_normalization_factor is not None:
        return total / global_normalization_factor
    return total / ((mask.sum() if dim is None else mask.sum(dim)) + 1e-8)


def clipped_pg_loss(k: dict, curr, prev, gen, ref, adv, token_mask, sample_mask, global_toks, global_seqs):
    """loss.py:374-720 ``ClippedPGLossFn.__call__`` on one micro-batch: ``mask = token_mask · sample_mask``
    (:396); the KL term a masked mean over the global tokens (token level) or the mean of per-sample means over
    the global sequences (:505-515); with ``force_on_policy_ratio`` prev := curr (:399-402) and the ratio 1
    (:520-525), else ``exp(curr − prev)`` clamped to [1 − min, 1 + max] (:527-541); ``max(−A·r, −A·r_c)``
    (:548-553), dual-clip under ``A < 0`` (:555-563); the actor IS weights ``exp(prev − gen)`` truncated (tis,
    :612-631) or kept inside [min, max] (icepop, :632-650), used only with the correction on (:683-686); the actor
    loss a masked mean like the KL (:688-702). Returns ``(actor_loss, kl)``."""
    mask = token_mask * sample_mask.unsqueeze(-1)
    if k["force"]:
        prev = curr
    if k["beta"] != 0:
        # :480-491: exp(curr − gen) with the on-policy approximation, else exp(curr − curr.detach()) = 1; NaN/±inf → 0
        on = k["kl_approx"] and k.get("bug") != "kl_weight_off"  # the bug: the approximation's weight left out
        w = (curr - gen).exp() if on else (curr - curr.detach()).exp()
        if k.get("bug") == "kl_weight_detached":  # its value unchanged, its gradient (the score function's) lost
            w = w.detach()
        w = w.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        kl = calculate_kl(curr, ref, k["kl_type"], weights=w)
        kl = (masked_mean(kl, mask, global_normalization_factor=global_toks) if k["token_level"] else
              masked_mean(masked_mean(kl, token_mask, dim=-1), sample_mask, global_normalization_factor=global_seqs))
    else:
        kl = torch.tensor(0.0)
    if k["force"]:
        ratios = (curr - curr).exp()
        clamped = ratios
    elif k["disable"]:  # :540-543: the log-probs themselves, unclamped
        ratios = curr
        clamped = curr
    elif k["seq_ratio"]:  # :528-535: exp of the sample's masked mean log-ratio, repeated over its tokens
        ratios = masked_mean(curr - prev, token_mask, dim=-1).unsqueeze(-1).exp().repeat(1, adv.shape[1])
        clamped = ratios.clamp(1.0 - k["clip_min"], 1.0 + k["clip_max"])
    else:
        ratios = (curr - prev).exp()
        clamped = ratios.clamp(1.0 - k["clip_min"], 1.0 + k["clip_max"])
    clip_loss = torch.max(-adv * ratios, -adv * clamped)
    if k["clip_c"] is not None:
        clip_loss = torch.where(adv < 0, torch.min(clip_loss, -adv * k["clip_c"]), clip_loss)
    if k["seq_ratio"]:  # :568-576: exp(Σ_t (prev − gen)·mask) of the sample
        weights = ((prev - gen) * mask).sum(dim=-1).exp().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).unsqueeze(-1)
    else:
        weights = (prev - gen).exp().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    if k["tis_max"] is not None:
        if k["tis_type"] == "tis":
            weights = weights.clamp(min=0.0 if k["tis_min"] is None else k["tis_min"], max=k["tis_max"])
        elif k["tis_type"] == "icepop":
            keep = (weights >= k["tis_min"]) & (weights <= k["tis_max"])
            weights = torch.where(keep, weights, torch.zeros_like(weights))
        elif k["tis_type"] == "seq-mask-tis":  # :637-665: the geometric mean over the token mask, both bounds kept
            log_is = (prev - gen).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
            geo = masked_mean(log_is, token_mask, dim=-1).exp()
            kept = ((geo >= k["tis_min"]) & (geo <= k["tis_max"])).float()
            if k.get("bug") == "seq_mask_off":
                kept = torch.ones_like(kept)
            weights = weights * kept.unsqueeze(-1)
    used = weights if k["is_on"] else torch.ones_like(prev)
    if k["token_level"]:
        actor = masked_mean(used * clip_loss, mask, global_normalization_factor=global_toks)
    else:
        actor = masked_mean(masked_mean(used * clip_loss, token_mask, dim=-1), sample_mask,
                            global_normalization_factor=global_seqs)
    return actor, kl


# ---------------------------------------------------------------------------------------------- the step


def _batch(seed: int, precision: str) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (B,), generator=g)
    width = int(lengths.max())
    valid = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    mask = valid.clone()
    mask[1, 1:3] = False  # an interior tool span
    mask[5, 0] = False
    mask[9, 2] = False
    mask[6] = False  # a fully masked sample
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    old = (-torch.rand(B, width, generator=g) * 3).to(dtype)

    def near(scale: float) -> torch.Tensor:
        return (old.float() + torch.randn(B, width, generator=g) * scale).to(dtype)

    curr, gen, ref = near(0.3), near(0.4), near(0.8)
    ref[3, 1] = old[3, 1] + 13.0  # k3 beyond the ±10 output clamp
    raw = torch.randint(0, 2, (B,), generator=g).float() + torch.rand(B, generator=g) * 0.2
    raw[4:8] = raw[4]  # one prompt of equal rewards: std 0, not divided
    # two reward components (GDPO): a 0/1 correctness and a format score, equal in one prompt (std 0)
    comps = torch.stack([torch.randint(0, 2, (B,), generator=g).float(),
                         torch.randint(0, 3, (B,), generator=g).float() * 0.1], dim=1)
    comps[0:4, 1] = 0.2
    teacher = near(0.5)  # a teacher's log-probs (on-policy distillation), drawn last: the draws above unchanged
    return dict(comps=comps, lengths=lengths, valid=valid, mask=mask.float(), old=old, curr=curr, gen=gen, ref=ref, raw=raw,
                prompts=torch.arange(B) // N, width=width, teacher=teacher,
                zeros=torch.zeros_like(old))  # what NeMo-RL leaves in prev_logprobs under force_on_policy_ratio


def _produce(cfg: dict, s: dict, bug: Optional[str] = None, grad: bool = False) -> dict:
    """The step's recorded values; ``grad``: each micro-batch's ``actor + β·kl`` backpropagated into a float32
    leaf of the current log-probs too (``out["grad"]``, ∂L/∂logp of the step)."""
    k = _knobs(cfg)
    mask = s["mask"]
    curr, old, gen, ref = (s[n].float() for n in ("curr", "old", "gen", "ref"))
    leaf = curr.clone().requires_grad_(True) if grad else None
    if grad:
        curr = leaf
    if k["estimator"] == "reinforce_plus_plus":  # grpo.py:3290: the prev log-probs as logprobs_policy
        adv = reinforce_pp_advantages(k, s["prompts"], s["raw"], mask, old, ref).float()
        base = baseline_and_std(s["prompts"], s["raw"], loo=False)[0] if k["minus_baseline"] else 0.0
        reward = s["raw"] - base  # the broadcast value before the whitening (reward.post_process)
    elif k["estimator"] == "gdpo":
        adv = gdpo_advantages(s["prompts"], s["comps"], mask, k["normalize"], k["loo"], k["reward_weights"]).float()
        reward = gdpo_advantages(s["prompts"], s["comps"], torch.ones(B, 1), k["normalize"], k["loo"],
                                 k["reward_weights"])[:, 0]
    else:
        adv = grpo_advantages(s["prompts"], s["raw"], mask, k["normalize"], k["loo"]).float()
        reward = grpo_advantages(s["prompts"], s["raw"], torch.ones(B, 1), k["normalize"], k["loo"])[:, 0]
    if k["estimator"] == "opd":  # adv.py:590-597: sg(teacher − prev_logprobs) × mask; the rewards are not read
        adv = (s["teacher"].float() - old).detach()
        if bug != "opd_unmasked":
            adv = adv * mask
    k["bug"] = bug
    if bug == "advantage_masked":  # the verl convention: × the mask (0 at the tool spans)
        adv = adv * mask
    if bug == "advantage_sign":
        adv = -adv
    sample_mask = torch.ones(B)
    global_toks = mask.sum()
    global_seqs = sample_mask.sum()  # grpo.py: every sample of the step (a fully masked one too)
    actor = kl = torch.zeros(())
    for m in range(MICRO):  # micro-batches: each a masked mean over the global counts, summed
        ix = list(range(m, B, MICRO))
        a, k_ = clipped_pg_loss(k, curr[ix], old[ix], gen[ix], ref[ix], adv[ix], mask[ix], sample_mask[ix],
                                global_toks, global_seqs)
        if grad:
            (a + k["beta"] * k_).backward()
            a, k_ = a.detach(), k_.detach()
        actor, kl = actor + a, kl + k_
    loss = {"pg_loss": float(actor)}
    if k["beta"] != 0:
        loss["kl_loss"] = float(kl)
    return dict(adv=adv, reward=reward, loss=loss, **({"grad": leaf.grad.detach()} if grad else {}))


def _write(path, rc, s: dict, out: dict, precision: str, old_key: str = "old"):
    valid, mask = s["valid"], s["mask"]
    lengths = s["lengths"].tolist()
    micro_of = {i: m for m in range(MICRO) for i in range(m, B, MICRO)}
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=int(s["prompts"][i]), response_length=n,
                            total_length=n + 16, loss_mask=[int(v) for v in mask[i, :n].tolist()],
                            raw_reward=float(s["raw"][i]), reward=float(out["reward"][i]),
                            micro_batch_id=f"mb-{micro_of[i]}",
                            **({"reward_components": [float(v) for v in s["comps"][i]]}
                               if rc.advantage_estimator == "gdpo" else {}))
               for i, n in enumerate(lengths)]
    config = msgspec.structs.replace(rc, loss_token_count=int(mask.sum()), loss_seq_count=B)
    index = BundleIndex(bundle_id=path.name, identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0),
                                                               micro_batch_ids=[f"mb-{m}" for m in range(MICRO)]),
                        samples=samples, config=config)
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=path.name,
                        producer=ProducerInfo(commit="nemo-rl@7ea279abfbeb", torch_version=torch.__version__),
                        stage_contracts=stage_contracts(STAGES + ((StageId.LOSS_GRAD,) if "grad" in out else ())),
                        payloads={},
                        comparison_policy=comparison_policy({"compute": precision, "accumulate": "float32"}),
                        redaction={})
    expected = {"reward.post_process": {"rewards": out["reward"].tolist()}, "loss.policy": out["loss"]}
    writer = BundleWriter(path, manifest, index, expected)
    for name, key in (("old_log_probs", old_key), ("log_probs", "curr"), ("ref_log_probs", "ref"),
                      ("rollout_log_probs", "gen")):
        writer.write_payload(name, s[key][valid].contiguous())
    writer.write_payload("advantages", out["adv"][valid].contiguous())
    if "grad" in out:
        writer.write_payload("grad_log_probs", out["grad"][valid].contiguous())
    if rc.opd_placement == "advantage":
        writer.write_payload("teacher_log_probs", s["teacher"][valid].contiguous())
    return writer.finalize(ranks=[0])


def _run(tmp_path, name: str, precision: str, seed: int, bug: Optional[str] = None, grad: bool = False, **knobs):
    cfg = _config(name)
    rc = msgspec.structs.replace(from_nemo_rl(cfg), **knobs)
    s = _batch(seed, precision)
    old_key = "zeros" if _knobs(cfg)["force"] else "old"  # NeMo-RL's prev_logprobs placeholder (grpo.py:3238-3249)
    return replay(_write(tmp_path / f"{name}-{precision}-{seed}-{bug}", rc, s, _produce(cfg, s, bug, grad=grad),
                         precision, old_key=old_key))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_clean_bundle_replays_clean(tmp_path, name, precision):
    report = _run(tmp_path, name, precision, seed=sorted(CONFIGS).index(name))
    failing = [(st.stage, st.reason) for st in report.stages if st.status == "fail"]
    assert failing == [] and report.exit_code == 0


BUGS = [
    ("default", "advantage_sign", "advantage.estimate", "advantage mismatch"),
    # the tool spans of samples 1 (two tokens) and 9 (one); samples 5 and 6 are in the prompt of equal rewards,
    # whose advantages are 0 either way
    ("tis", "advantage_masked", "advantage.estimate", "advantage mismatch in 3 token(s) of 2 sample(s)"),
    ("reinforce-pp", "advantage_sign", "advantage.estimate", "advantage mismatch in 69 token(s) of 11 sample(s)"),
    ("gspo", "advantage_sign", "advantage.estimate", "advantage mismatch in 51 token(s) of 8 sample(s)"),
    # the mapped configs of issue 33: each bug named at the stage it changes
    ("seq-mask-tis", "seq_mask_off", "loss.policy", "loss field mismatch: pg_loss"),
    # (k1: with k3, one token's KL beyond the output clamp leaves the bfloat16 bound of kl_loss above the bug)
    ("kl-approx-k1-seq", "kl_weight_off", "loss.policy", "loss field mismatch: kl_loss"),
    # the mask-0 tokens of samples 1 (two), 5, 9 (one each) and 6 (fully masked)
    ("opd", "opd_unmasked", "advantage.estimate", "advantage mismatch in 9 token(s) of 4 sample(s)"),
    ("reinforce", "advantage_sign", "advantage.estimate", "advantage mismatch"),
]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name, bug, stage, reason", BUGS)
def test_injected_bug_is_named_at_its_stage(tmp_path, name, bug, stage, reason, precision):
    report = _run(tmp_path, name, precision, seed=1, bug=bug)
    failing = [st for st in report.stages if st.status == "fail"]
    assert report.exit_code == 1
    assert failing[0].stage == stage and failing[0].reason.startswith(reason)


def test_nemo_rl_broadcasts_without_masking(tmp_path):
    """NeMo-RL's advantages hold the sample's value at its mask-0 tokens (adv.py:98): the mapping says
    ``masked_token_value="computed"``; read as verl's ``zero``, the clean bundle's mask-0 tokens with a nonzero
    advantage diverge: the tool spans of samples 1 (two tokens) and 9 (one) — samples 5 (a span) and 6 (fully
    masked) are in the prompt of equal rewards, whose advantage is 0 either way."""
    assert from_nemo_rl({}).masked_token_value == "computed"
    s = _batch(1, "float32")
    cfg = _config("default")
    zero = replay(_write(tmp_path / "zero", msgspec.structs.replace(from_nemo_rl(cfg), masked_token_value="zero"),
                         s, _produce(cfg, s), "float32"))
    stage = next(st for st in zero.stages if st.stage == "advantage.estimate")
    assert (zero.exit_code, stage.status, stage.reason) == (1, "fail", "advantage mismatch in 3 token(s) of 2 sample(s)")


def test_force_on_policy_ratio_reads_the_current_log_probs_as_old(tmp_path):
    """With ``force_on_policy_ratio`` NeMo-RL's ratio is 1 (prev := curr, loss.py:399-402, 520-525) and the
    step's ``prev_logprobs`` are a zero placeholder (grpo.py:2493-2510, 3238-3249): the mapping sets
    ``force_on_policy_ratio`` and loss.policy takes the current log-probs as old, so the bundle recording the zeros
    replays clean; mapped as the regular loss (the former refusal's workaround), the same bundle diverges."""
    cfg = _config("force-on-policy-is")
    rc = from_nemo_rl(cfg)
    assert rc.force_on_policy_ratio is True and rc.policy_loss == "ppo"
    s = _batch(4, "float32")
    out = _produce(cfg, s)
    assert replay(_write(tmp_path / "zeros", rc, s, out, "float32", old_key="zeros")).exit_code == 0
    regular = msgspec.structs.replace(rc, force_on_policy_ratio=False)
    wrong = replay(_write(tmp_path / "regular", regular, s, out, "float32", old_key="zeros"))
    loss = next(st for st in wrong.stages if st.stage == "loss.policy")
    assert (wrong.exit_code, loss.status, loss.reason) == (1, "fail", "loss field mismatch: pg_loss")


# a knob of the mapping replaced by the value it had before (or the other framework's): the clean bundle diverges
# at the stage that knob decides — NeMo-RL's REINFORCE++ whitens with the biased variance (adv.py:263) and
# keeps the raw reward without minus_baseline (adv.py:242-243); its GSPO ratio is the sample's (loss.py:528-535),
# and so is its IS weight under sequence-level ratios (loss.py:568-576)
WRONG_KNOBS = [
    ("reinforce-pp", {"whiten_variance": "unbiased"}, "advantage.estimate",
     "advantage mismatch in 69 token(s) of 11 sample(s)"),
    ("reinforce-pp-no-baseline-k1", {"rewards_normalization": True}, "reward.post_process",
     "normalized reward mismatch in 12 sample(s)"),
    ("gspo", {"importance_level": "token"}, "loss.policy", "loss field mismatch: pg_loss"),
    ("gspo-tis", {"is_level": "token"}, "loss.policy", "loss field mismatch: pg_loss"),
    # without each new knob: seq-mask-tis's sample mask, the KL's rollout weight, OPD's zero base, REINFORCE's −A·logp
    ("seq-mask-tis", {"is_keep": None}, "loss.policy", "loss field mismatch: pg_loss"),
    ("kl-approx", {"kl_loss_rollout_weighted": False}, "loss.policy", "loss field mismatch: kl_loss"),
    ("opd", {"opd_base": "returns"}, "advantage.estimate",
     "advantage mismatch in 48 token(s) of 8 sample(s) (GRPO returns − 1·k1(old − teacher))"),
    ("reinforce", {"policy_loss": "ppo"}, "loss.policy", "loss field mismatch: pg_loss"),
    ("reinforce-seq-is", {"is_level": "token"}, "loss.policy", "loss field mismatch: pg_loss"),
]


@pytest.mark.parametrize("name, knobs, stage, reason", WRONG_KNOBS)
def test_each_mapped_knob_decides_its_stage(tmp_path, name, knobs, stage, reason):
    report = _run(tmp_path, name, "float32", seed=1, **knobs)
    failing = [(st.stage, st.reason) for st in report.stages if st.status == "fail"]
    assert report.exit_code == 1 and failing[0] == (stage, reason)


REFUSED = [
    ({"grpo": {"adv_estimator": {"name": "reinforce_plus_plus"}}, "loss_fn": {"use_kl_in_reward": True}},
     "nemo-rl config: loss_fn.use_kl_in_reward=True: NeMo-RL's REINFORCE++ subtracts reference_policy_kl_penalty × "
     "calculate_kl(prev_logprobs, reference) at each token of the broadcast advantage, without a discounted sum, "
     "before whitening (advantage_estimator.py:248-265); not recomputed: a bundle would need a per-token in-reward "
     "KL mode (no returns), or the KL-shaped advantages recorded with reference_policy_kl_penalty 0"),
    ({"loss_fn": {"positive_example_nll_weight": 0.1}},
     "nemo-rl config: loss_fn.positive_example_nll_weight=0.1: NeMo-RL adds μ × the mean of −log π over the loss "
     "tokens of the samples whose reward is > 0, each micro-batch divided by its own count of those tokens "
     "(loss_functions.py:720-735), to loss; not recomputed: a bundle would need each sample's raw reward and "
     "micro_batch_id with an NLL loss term, and the term recorded apart in loss.policy"),
    ({"loss_fn": {"disable_ppo_ratio": True, "ratio_clip_c": 3.0}},
     "nemo-rl config: loss_fn.ratio_clip_c=3.0: NeMo-RL dual-clips −A·logp under disable_ppo_ratio "
     "(loss.py:555-563), which the GPG surrogate does not: not recomputed; a bundle would need a dual-clip parameter "
     "on the gpg family"),
]


@pytest.mark.parametrize("cfg, message", REFUSED)
def test_refused_configs_name_what_a_bundle_would_need(cfg, message):
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_nemo_rl(cfg)
    assert str(err.value) == message


def test_sequence_ratios_with_the_token_level_loss_are_an_invalid_config():
    """NeMo-RL asserts the two are exclusive (ClippedPGLossFn.__init__, loss/loss_functions.py:265-268): a config it
    rejects is invalid input (exit 3), not a refusal."""
    from replay_lib.errors import FrameworkConfigError

    with pytest.raises(FrameworkConfigError) as err:
        from_nemo_rl({"loss_fn": {"sequence_level_importance_ratios": True}})
    assert str(err.value) == (
        "nemo-rl config: loss_fn.sequence_level_importance_ratios=True: expected token_level_loss false with it "
        "(NeMo-RL asserts sequence-level ratios are exclusive with the token-level loss, "
        "loss/loss_functions.py:265-268)")
    assert err.value.exit_code == 3


@pytest.mark.parametrize("cfg, message", [
    ({"loss_fn": {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "seq-mask-tis",
                  "truncated_importance_sampling_ratio": 2.0}},
     "nemo-rl config: loss_fn.truncated_importance_sampling_ratio_min=None: expected a value with seq-mask-tis "
     "(NeMo-RL asserts it, loss/loss_functions.py:315-319)"),
    ({"loss_fn": {"force_on_policy_ratio": True, "use_cispo": True}},
     "nemo-rl config: loss_fn.force_on_policy_ratio=True: expected use_cispo false with it (NeMo-RL asserts use_cispo "
     "is incompatible with force_on_policy_ratio, loss/loss_functions.py:271-279)"),
    ({"loss_fn": {"disable_ppo_ratio": True, "use_cispo": True}},
     "nemo-rl config: loss_fn.disable_ppo_ratio=True: expected use_cispo false with it (NeMo-RL asserts use_cispo "
     "is incompatible with disable_ppo_ratio, loss/loss_functions.py:271-279)"),
])
def test_configs_nemo_rl_asserts_against_are_invalid(cfg, message):
    """ClippedPGLossFn.__init__ asserts these (loss/loss_functions.py:271-324): invalid input, exit 3."""
    with pytest.raises(FrameworkConfigError) as err:
        from_nemo_rl(cfg)
    assert (str(err.value), err.value.exit_code) == (message, 3)


def test_the_new_mappings_set_their_knobs():
    """What each mapped key becomes (docs/frameworks/nemo-rl.md)."""
    tis = from_nemo_rl(_config("seq-mask-tis"))
    assert (tis.is_level, tis.is_mode, tis.is_low, tis.is_high, tis.is_keep) == (
        "token", "truncate", None, None, {"geometric": [0.9, 1.1]})
    kl = from_nemo_rl(_config("kl-approx"))
    assert (kl.kl_loss_rollout_weighted, kl.kl_loss_coef, kl.kl_loss_output_clamp) == (True, 0.05, 10.0)
    opd = from_nemo_rl(_config("opd"))
    assert (opd.opd_placement, opd.opd_kl_type, opd.opd_coef, opd.opd_clamp, opd.opd_base,
            opd.masked_token_value) == ("advantage", "k1", 1.0, None, "zero", "zero")
    assert from_nemo_rl(_config("reinforce")).policy_loss == "gpg"
    # force_on_policy_ratio's branch comes first (loss.py:520): with both, the ratio is 1 and the surrogate PPO's
    both = from_nemo_rl({"loss_fn": {"force_on_policy_ratio": True, "disable_ppo_ratio": True}})
    assert (both.force_on_policy_ratio, both.policy_loss) == (True, "ppo")


# The KL term's gradient (loss.grad): NeMo-RL's weight exp(curr − generation) under the on-policy approximation, else
# exp(curr − curr.detach()) (value 1), is not detached (loss/loss_functions.py:477-493: the score-function gradient
# of the sampling probability), detached only where the input clamp holds (utils.py:72-81); sample 3's token 1 lies
# beyond the ±10 output clamp (k3). The KL types k3 (token level), k2 with dual-clip, k1 (sequence level).
GRAD_CONFIGS = ("kl-approx", "kl-approx-k1-seq", "default", "dual-clip-k2", "seq-level-k1")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", GRAD_CONFIGS)
def test_the_on_policy_kl_approximations_gradient_replays_clean(tmp_path, name, precision):
    report = _run(tmp_path, name, precision, seed=2, grad=True)
    status = {st.stage: st.status for st in report.stages}
    assert (status["loss.policy"], status["loss.grad"], report.exit_code) == ("pass", "pass", 0), report.stages


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", GRAD_CONFIGS)
def test_the_kl_weight_detached_is_named_at_loss_grad_with_the_loss_passing(tmp_path, name, precision):
    """The weight detached (its value unchanged, the gradient's w·k part lost: NeMo-RL before #2506, the KL
    term's plain weight exp(curr − curr.detach()) then absent)."""
    report = _run(tmp_path, name, precision, seed=2, bug="kl_weight_detached", grad=True)
    status = {st.stage: st.status for st in report.stages}
    assert (status["loss.policy"], status["loss.grad"], report.exit_code) == ("pass", "fail", 1)
    assert [e.hypothesis for e in report.explanations] == ["grad.kl_weight_detached"]
