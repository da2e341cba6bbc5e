"""SkyRL's semantics as the producer, from a reference written from its code (SkyRL cannot be pip-installed
here): NovaSky-AI/SkyRL @ a9564572, ``skyrl/backends/skyrl_train/utils/ppo_utils.py`` (below ``ppo_utils.py``),
``skyrl/backends/skyrl_train/workers/worker.py`` (``worker.py``), ``workers/worker_utils.py`` and
``skyrl/train/dataset/preprocess.py``. Each function below is that code's formula in float64 torch, cited by line;
none calls ``replay_lib.kernels``.

Random GRPO / RLOO / REINFORCE++ steps with trailing padding, interior masked spans (tool tokens inside a response:
loss mask 0, response mask 1), a fully masked sample and several micro-batches below the mini-batch, with float32
and bf16 inputs; each bundle is mapped by ``from_skyrl`` and must replay with 0 divergences; an injected bug must be
named at its stage."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, AdvantageWhitenStats, BundleIndex,
                                      ComparisonPolicy, Identity, Manifest, SampleRecord, StageId, stage_contracts)
from replay_lib.demo import producer
from replay_lib.frameworks import from_skyrl

F64 = torch.float64
N, GROUPS = 4, 2
B = N * GROUPS
WIDTH = 24
STAGES = [StageId.SAMPLE, StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_ESTIMATE, StageId.LOSS_POLICY]

# name → (trainer.algorithm, micro_train_batch_size_per_gpu)
CONFIGS = {
    "grpo-token-mean-k3": ({}, 3),
    "grpo-dual-clip-sequence-mean": ({"policy_loss_type": "dual_clip", "loss_reduction": "sequence_mean",
                                      "eps_clip_high": 0.28}, 3),
    "grpo-seq-sum-norm-abs": ({"loss_reduction": "seq_mean_token_sum_norm", "max_seq_len": WIDTH,
                               "kl_estimator_type": "abs", "kl_loss_coef": 0.01}, 3),
    "drgrpo-sequence-mean-k2": ({"grpo_norm_by_std": False, "loss_reduction": "sequence_mean",
                                 "kl_estimator_type": "k2"}, 3),
    "rloo-token-mean-legacy": ({"advantage_estimator": "rloo", "loss_reduction": "token_mean_legacy",
                                "use_kl_loss": False}, 4),
    "reinforce++-token-mean-k1": ({"advantage_estimator": "reinforce++", "kl_estimator_type": "k1"}, 3),
    "grpo-gspo-sequence-mean": ({"policy_loss_type": "gspo", "loss_reduction": "sequence_mean",
                                 "eps_clip_low": 0.03, "eps_clip_high": 0.04}, 3),
    # use_kl_in_reward excludes use_kl_loss (skyrl/train/utils/utils.py:312-314)
    "grpo-kl-in-reward-k3": ({"use_kl_in_reward": True, "use_kl_loss": False, "kl_loss_coef": 0.05}, 3),
    "maxrl-token-mean": ({"advantage_estimator": "maxrl"}, 3),
    "maxrl-kl-in-reward-k3": ({"advantage_estimator": "maxrl", "use_kl_in_reward": True, "use_kl_loss": False,
                               "kl_loss_coef": 0.05}, 3),
    "rloo-kl-in-reward-k1": ({"advantage_estimator": "rloo", "use_kl_in_reward": True, "use_kl_loss": False,
                              "kl_estimator_type": "k1", "kl_loss_coef": 0.1}, 4),
    # off_policy_correction's masks (opc.py @ a9564572): 0/1 factors of the loss terms, the normalizer kept
    "grpo-geometric-mask": ({"off_policy_correction": {"sequence_mask_metric": "geometric", "geo_mask_low": 0.97,
                                                       "geo_mask_high": 1.03}}, 3),
    "grpo-product-and-token-masks": ({"off_policy_correction": {
        "sequence_mask_metric": "product", "token_mask_is_threshold_low": 0.7, "token_mask_is_threshold_high": 1.4}},
        3),
    "grpo-outlier-mask-token-tis": ({"loss_reduction": "sequence_mean", "off_policy_correction": {
        "outlier_token_is_threshold_low": 0.8, "tis_ratio_type": "token"}}, 3),
    "gspo-geometric-mask": ({"policy_loss_type": "gspo", "loss_reduction": "sequence_mean", "eps_clip_low": 0.03,
                             "eps_clip_high": 0.04, "off_policy_correction": {"sequence_mask_metric": "geometric",
                                                                              "geo_mask_low": 0.97,
                                                                              "geo_mask_high": 1.03}}, 3),
    "grpo-prompt-mean": ({"loss_reduction": "prompt_mean"}, 3),
    "rloo-prompt-mean-geometric-mask": ({"advantage_estimator": "rloo", "loss_reduction": "prompt_mean",
                                         "off_policy_correction": {"sequence_mask_metric": "geometric",
                                                                   "geo_mask_low": 0.97, "geo_mask_high": 1.03}}, 4),
    # DPPO (ppo_utils.py:866-935): anchored on the rollout, the divergence mask by the sign of A
    "grpo-dppo-tv": ({"policy_loss_type": "dppo", "dppo": {"delta_low": 0.05, "delta_high": 0.04}}, 3),
    "grpo-dppo-kl-sequence-mean": ({"policy_loss_type": "dppo", "loss_reduction": "sequence_mean", "dppo": {
        "dppo_type": "binary_kl", "delta_low": 0.01, "delta_high": 0.008}}, 3),
}


def skyrl_config(name: str) -> dict:
    algo, micro = CONFIGS[name]
    return {"trainer": {"algorithm": algo, "micro_train_batch_size_per_gpu": micro,
                        "policy_mini_batch_size": GROUPS},
            "generator": {"n_samples_per_prompt": N}}


# ------------------------------------------------------------------------- the reference, from SkyRL's code


def masked_mean(x, mask, dim=None):
    """torch_utils.py:180-184: ``(x·mask).sum(dim) / mask.sum(dim).clamp(min=1)``."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def grpo(scores, response_mask, index, norm_by_std=True, eps=1e-6):
    """ppo_utils.py:1344-1394 compute_grpo_outcome_advantage: per uid, (s − mean)/(std + eps) (torch.std,
    unbiased), a group of one: mean 0, std 1; ``scores.unsqueeze(-1) * response_mask`` (:1391)."""
    out = scores.clone()
    for g in set(index):
        rows = [i for i in range(len(index)) if index[i] == g]
        s = scores[rows]
        mean, std = (s.mean(), s.std()) if len(rows) > 1 else (torch.tensor(0.0, dtype=F64), torch.tensor(1.0, dtype=F64))
        out[rows] = (s - mean) / (std + eps) if norm_by_std else s - mean
    return out.unsqueeze(-1) * response_mask, out


def rloo(scores, response_mask, index):
    """ppo_utils.py:1260-1310 compute_rloo_outcome_advantage: (s − mean)·n/(n − 1); a group of one gets 0."""
    out = scores.clone()
    for g in set(index):
        rows = [i for i in range(len(index)) if index[i] == g]
        n = len(rows)
        out[rows] = (scores[rows] - scores[rows].mean()) * n / (n - 1) if n > 1 else 0.0
    return out.unsqueeze(-1) * response_mask, out


def maxrl(scores, response_mask, index, eps=1e-6):
    """ppo_utils.py:1397-1428 compute_maxrl_advantage: per uid, (s − mean)/(mean + eps); a group of one keeps s
    (mean 0); ``scores.unsqueeze(-1) * response_mask``."""
    out = scores.clone()
    for g in set(index):
        rows = [i for i in range(len(index)) if index[i] == g]
        s = scores[rows]
        out[rows] = (s - s.mean()) / (s.mean() + eps) if len(rows) > 1 else s
    return out.unsqueeze(-1) * response_mask, out


def masked_whiten(values, mask):
    """ppo_utils.py:129-153 masked_var (unbiased) and masked_whiten: (v − mean)·rsqrt(var + 1e-8)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask) * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8), (float(mean), float(torch.sqrt(var + 1e-8)))


def reinforce_pp(token_rewards, response_mask, gamma=1.0):
    """ppo_utils.py:1225-1257: returns G_t = r_t + γ·G_{t+1}, reset after the response (× response_mask[:, t]),
    whitened over the response mask, × response_mask."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], dtype=F64)
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * response_mask[:, t]
    adv, stats = masked_whiten(returns, response_mask)
    return adv * response_mask, stats


def approx_kl(logp, base, loss_mask, kind):
    """ppo_utils.py:88-126 compute_approx_kl: k1 logp − base, abs |·|, k2 ½(·)², k3 exp(c) − c − 1 with
    c = clamp(base − logp, ±20), clamped ±10; masked positions → 0."""
    if kind == "k1":
        kld = logp - base
    elif kind == "abs":
        kld = (logp - base).abs()
    elif kind == "k2":
        kld = 0.5 * (logp - base).square()
    else:
        c = torch.clamp(base - logp, -20, 20)
        kld = torch.clamp(torch.exp(c) - c - 1, -10, 10)
    return torch.where(loss_mask.bool(), kld * loss_mask, 0.0)


def reward_kl_penalty(token_rewards, old, ref, loss_mask, algo):
    """skyrl/train/trainer.py:1409-1436 apply_reward_kl_penalty (kl_ctrl fixed: FixedKLController.value is
    kl_loss_coef, ppo_utils.py:62-70): kl = compute_approx_kl(action_log_probs, base_action_log_probs, loss_mask,
    kl_estimator_type) — 0 at loss-mask-0 tokens — and rewards − kl·max(0, kl_loss_coef)."""
    kl = approx_kl(old, ref, loss_mask, algo.get("kl_estimator_type", "k3"))
    return token_rewards - kl * max(0.0, algo.get("kl_loss_coef", 0.001)), kl


def loss_reduction(adv, loss_mask, reduction, micro, max_seq_len):
    """ppo_utils.py:1152-1222 apply_loss_reduction_to_advantages_minibatch (one mini-batch)."""
    b = adv.shape[0]
    if reduction == "token_mean":
        return adv / loss_mask.sum().clamp(min=1)
    if reduction == "token_mean_legacy":
        out = torch.zeros_like(adv)
        k = b // micro
        for i in range(k):
            sl = slice(i * micro, (i + 1) * micro)
            out[sl] = adv[sl] / loss_mask[sl].sum().clamp(min=1) / k
        return out
    if reduction == "sequence_mean":
        return adv / (b * loss_mask.sum(dim=-1, keepdim=True).clamp(min=1))
    if reduction == "seq_mean_token_sum_norm":
        return adv / (b * max_seq_len)
    if reduction == "prompt_mean":  # :1209-1218, the prompts' boundaries from the uids (preprocess.py:286)
        out = torch.zeros_like(adv)
        bounds = [(g * N, (g + 1) * N) for g in range(GROUPS)]  # the N samples of each prompt, consecutive
        for start, end in bounds:
            out[start:end] = adv[start:end] / (len(bounds) * loss_mask[start:end].sum().clamp(min=1))
        return out
    raise ValueError(reduction)


def off_policy_correction(old, rollout, loss_mask, oc):
    """opc.py:257-348 compute_off_policy_correction @ a9564572: the ratio exp(clamp(old − rollout, ±20)); the
    outlier mask drops a sample with any loss token above its high / below its low bound (:75-134, applied when
    either is set, :293-296, :315-320); the token mask keeps low ≤ ratio ≤ high (:137-188, only with both bounds,
    :297-301, :322-328); the token TIS ratio min(ratio, cap) (:24-72, :333-338); the sequence mask over the mask
    left so far: geometric exp(clamp(Σ Δ·m / max(Σ m, 1), ±20)), product exp(clamp(Σ Δ·m, ±20)), dropped when
    > high or < low (:191-254, :340-346). ``(tis or None, the new loss mask)``."""
    if rollout is None or not oc:
        return None, loss_mask
    delta = old - rollout
    ratio = torch.exp(torch.clamp(delta, -20.0, 20.0))
    lo, hi = oc.get("outlier_token_is_threshold_low"), oc.get("outlier_token_is_threshold_high")
    if lo is not None or hi is not None:
        over = (ratio > hi) & (loss_mask > 0) if hi is not None else torch.zeros_like(ratio, dtype=torch.bool)
        under = (ratio < lo) & (loss_mask > 0) if lo is not None else torch.zeros_like(ratio, dtype=torch.bool)
        loss_mask = loss_mask * ((~over & ~under) | (loss_mask == 0)).all(dim=-1, keepdim=True).to(F64)
    lo, hi = oc.get("token_mask_is_threshold_low"), oc.get("token_mask_is_threshold_high")
    if lo is not None and hi is not None:
        loss_mask = loss_mask * (((ratio >= lo) & (ratio <= hi)) | (loss_mask == 0)).to(F64)
    tis = None
    if oc.get("tis_ratio_type") == "token":
        tis = torch.clamp(ratio, max=oc.get("token_tis_ratio_clip_high", 2.0))
    metric = oc.get("sequence_mask_metric")
    if metric is not None:
        total = (delta * loss_mask).sum(dim=-1, keepdim=True)
        if metric == "geometric":
            stat = torch.exp(torch.clamp(total / loss_mask.sum(dim=-1, keepdim=True).clamp(min=1.0), -20.0, 20.0))
            lo, hi = oc.get("geo_mask_low", 0.99), oc.get("geo_mask_high", 1.01)
        else:
            stat = torch.exp(torch.clamp(total, -20.0, 20.0))
            lo, hi = oc.get("product_mask_low", 0.5), oc.get("product_mask_high", 2.0)
        loss_mask = loss_mask * (~(stat > hi) & ~(stat < lo)).to(F64)
    return tis, loss_mask


def ppo_policy_loss(logp, old, adv, loss_mask, algo, rollout=None):
    """ppo_utils.py:557-588: ratio exp(clamp(Δ, ±20)) (safe_exp_delta, torch_utils.py:187-192), the clipped
    surrogate, clip_ratio = masked_mean(−surr2 > −surr1) over the micro-batch, dual-clip where A < 0,
    reduce_loss Σ loss·mask (:1145-1149)."""
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    surr1 = ratio * adv
    surr2 = ratio.clamp(1 - algo.get("eps_clip_low", 0.2), 1 + algo.get("eps_clip_high", 0.2)) * adv
    loss = -torch.min(surr1, surr2)
    clip_ratio = masked_mean((-surr2 > -surr1).to(F64), loss_mask)
    if algo.get("policy_loss_type") == "dual_clip":
        loss = torch.where(adv < 0, torch.min(-adv * algo.get("clip_ratio_c", 3.0), loss), loss)
    tis, loss_mask = off_policy_correction(old, rollout, loss_mask, algo.get("off_policy_correction"))  # :580-584
    if tis is not None:
        loss = loss * tis
    return (loss * loss_mask).sum(), float(clip_ratio)


def gspo_policy_loss(logp, old, adv, loss_mask, algo, rollout=None):
    """ppo_utils.py:663-729: log s_i = masked_mean(Δ, loss_mask, dim=−1) (torch_utils.py:180-184), the token's
    log-weight sg[log s_i] + logp − sg[logp] (= log s_i forward) clamped at max 10, the clipped surrogate (no
    dual-clip), clip_ratio = masked_mean(−surr2 > −surr1) over the micro-batch, reduce_loss Σ loss·mask."""
    log_s = ((logp - old) * loss_mask).sum(-1, keepdim=True) / loss_mask.sum(-1, keepdim=True).clamp(min=1.0)
    ratio = torch.exp(torch.clamp(log_s.expand_as(logp), max=10.0))
    surr1 = ratio * adv
    surr2 = ratio.clamp(1 - algo.get("eps_clip_low", 0.2), 1 + algo.get("eps_clip_high", 0.2)) * adv
    loss = -torch.min(surr1, surr2)
    clip_ratio = float(masked_mean((-surr2 > -surr1).to(F64), loss_mask))
    tis, loss_mask = off_policy_correction(old, rollout, loss_mask, algo.get("off_policy_correction"))  # :721-725
    if tis is not None:
        loss = loss * tis
    return (loss * loss_mask).sum(), clip_ratio


def dppo_policy_loss(logp, old, adv, loss_mask, algo, rollout=None):
    """ppo_utils.py:866-935 @ a9564572: μ = the rollout's log-probs, else the old ones (:889); r = exp(clamp(logp −
    μ, ±20)); the mask drops A > 0 with p − p_μ > δ_high and A < 0 with −(p − p_μ) > δ_low (binary_tv, :899-902),
    or A > 0, p > p_μ, D > δ_high and A < 0, p < p_μ, D > δ_low with D = p_μ(μ − logp) + (1 − p_μ)·log((1 − p_μ +
    1e-8)/(1 − p + 1e-8)) (binary_kl, :904-912); loss −r·A·mask; clip_ratio = masked_mean(mask == 0) (:918); the
    off-policy correction (:921-925); reduce_loss Σ loss·mask."""
    cfg = algo.get("dppo", {})
    kind, lo, hi = cfg.get("dppo_type", "binary_tv"), cfg.get("delta_low", 0.2), cfg.get("delta_high", 0.2)
    mu = rollout if rollout is not None else old
    ratio = torch.exp(torch.clamp(logp - mu, -20.0, 20.0))
    p, pm = torch.exp(logp), torch.exp(mu)
    diff = p - pm
    mask = torch.ones_like(adv)
    if kind == "binary_tv":
        mask[(adv > 0) & (diff > hi)] = 0.0
        mask[(adv < 0) & (-diff > lo)] = 0.0
    else:
        kl = pm * (mu - logp) + (1 - pm) * torch.log((1 - pm + 1e-8) / (1 - p + 1e-8))
        mask[(adv > 0) & (diff > 0) & (kl > hi)] = 0.0
        mask[(adv < 0) & (diff < 0) & (kl > lo)] = 0.0
    loss = -(ratio * adv * mask)
    clip_ratio = float(masked_mean((mask == 0).to(F64), loss_mask))
    tis, loss_mask = off_policy_correction(old, rollout, loss_mask, algo.get("off_policy_correction"))
    if tis is not None:
        loss = loss * tis
    return (loss * loss_mask).sum(), clip_ratio


def train_step(algo, micro, logp, old, ref, scaled_adv, loss_mask, rollout=None):
    """worker.py:876-898 forward_backward over micro-batches of ``micro`` samples (drop_last False), each
    worker.py:913-1110 _forward_backward_micro on one DP rank: loss = policy + kl_coef·kl·(len(mb)/len(batch))
    with kl = masked_mean(kl, mask, dim=-1).mean() (:1068-1089); reduce_metrics (worker_utils.py:61-90) sums the
    ``*_loss`` keys and averages the others (clip_ratio) over the micro-batches."""
    use_kl = algo.get("use_kl_loss", True)
    coef = algo.get("kl_loss_coef", 0.001)
    pg = kl_term = 0.0
    clips = []
    for start in range(0, B, micro):
        sl = slice(start, min(start + micro, B))
        weight = (sl.stop - sl.start) / B
        loss_fn = {"gspo": gspo_policy_loss, "dppo": dppo_policy_loss}.get(algo.get("policy_loss_type"),
                                                                           ppo_policy_loss)
        policy, clip = loss_fn(logp[sl], old[sl], scaled_adv[sl], loss_mask[sl], algo,
                               rollout[sl] if rollout is not None else None)
        pg += float(policy)
        clips.append(clip)
        if use_kl:
            kl = approx_kl(logp[sl], ref[sl], loss_mask[sl], algo.get("kl_estimator_type", "k3"))
            kl_term += float(masked_mean(kl, loss_mask[sl], dim=-1).mean()) * weight
    out = {"pg_loss": pg, "pg_clipfrac": sum(clips) / len(clips), "loss": pg + (coef * kl_term if use_kl else 0.0)}
    if use_kl:
        out["kl_loss"] = kl_term  # the KL term as it enters the loss: Σ_b w_b·kl_b
    return out


# ------------------------------------------------------------------------------------------- the step


def _step(seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, WIDTH, (B,), generator=g)
    response_mask = (torch.arange(WIDTH)[None, :] < lengths[:, None]).to(F64)  # preprocess.py:131-137,202
    loss_mask = response_mask.clone()
    for i in range(B):  # an interior tool span in every other response (the last token stays a model token)
        if i % 2 == 0 and int(lengths[i]) > 8:
            start = int(torch.randint(1, int(lengths[i]) - 5, (1,), generator=g))
            loss_mask[i, start:start + 3] = 0
    loss_mask[5] = 0  # a fully masked sample (its score still counts in its group)

    def stored(x):  # the inputs as the bundle stores them (bf16: rounded), then read in float64
        return x.to(dtype).to(F64)

    old = stored(-torch.rand(B, WIDTH, generator=g) * 2)
    logp = stored(old + torch.randn(B, WIDTH, generator=g, dtype=F64) * 0.3)
    logp[1, 2] = stored(old[1, 2] + 1.6)  # past the clip bounds on either sign
    ref = stored(logp + torch.randn(B, WIDTH, generator=g, dtype=F64) * 0.2)
    scores = torch.randint(0, 3, (B,), generator=g).to(F64)
    return lengths, response_mask, loss_mask, old, logp, ref, scores


def write_skyrl_bundle(path, name: str, seed: int, dtype: torch.dtype, bug: str = "") -> str:
    algo, micro = CONFIGS[name]
    lengths, response_mask, loss_mask, old, logp, ref, scores = _step(seed, dtype)
    raw = scores  # the reward function's score, what the bundle records as raw_reward
    index = [i // N for i in range(B)]
    est = algo.get("advantage_estimator", "grpo")
    stats = kl = None
    if algo.get("use_kl_in_reward"):  # the score on the last token (token-level rewards), then the KL penalty
        token_rewards = torch.zeros(B, WIDTH, dtype=F64)
        token_rewards[torch.arange(B), lengths - 1] = scores
        token_rewards, kl = reward_kl_penalty(token_rewards, old, ref, loss_mask, algo)
        if bug == "kl-unmasked":  # the KL kept at loss-mask-0 tokens: not SkyRL
            kl = torch.where(response_mask.bool(), approx_kl(old, ref, response_mask,
                                                             algo.get("kl_estimator_type", "k3")), 0.0)
        scores = token_rewards.sum(dim=-1)  # ppo_utils.py:1284 (rloo), 1367 (grpo)
    if est == "grpo":
        adv, normalized = grpo(scores, response_mask, index, algo.get("grpo_norm_by_std", True))
    elif est == "rloo":
        adv, normalized = rloo(scores, response_mask, index)
    elif est == "maxrl":
        adv, normalized = maxrl(scores, response_mask, index)
    else:  # the score on the response's last token (the generator's token-level rewards)
        token_rewards = torch.zeros(B, WIDTH, dtype=F64)
        token_rewards[torch.arange(B), lengths - 1] = scores
        adv, stats = reinforce_pp(token_rewards, response_mask)
        normalized = scores
    if bug == "zeroed-span":  # advantages × loss mask, as verl writes them: not SkyRL
        adv = adv * loss_mask
    scaled = loss_reduction(-adv if bug == "loss-sign" else adv, loss_mask, algo.get("loss_reduction", "token_mean"),
                            micro, algo.get("max_seq_len"))
    rollout = None
    if "off_policy_correction" in algo or algo.get("policy_loss_type") == "dppo":  # the rollout's log-probs, near the old ones (a generator of its own)
        g = torch.Generator().manual_seed(seed + 1000)
        rollout = (old + torch.randn(B, WIDTH, generator=g, dtype=F64) * 0.12).to(dtype).to(F64)
    policy = train_step(algo, micro, logp, old, ref, scaled, loss_mask, rollout)

    cfg = from_skyrl(skyrl_config(name))
    counts = dict(loss_token_count=int(loss_mask.sum()), loss_seq_count=B)
    if stats is not None:  # SkyRL whitens over every response token: the bundle records its statistics
        counts["advantage_whiten_stats"] = AdvantageWhitenStats(mean=stats[0], std=stats[1])
    if bug == "no-keep":  # the mapping without the off-policy correction's keep masks
        counts["is_keep"] = msgspec.UNSET
    if bug == "one-rule":  # the mapping without the in-reward KL's own rule: masked_token_value for both
        counts["kl_masked_token_value"] = msgspec.UNSET
    cfg = msgspec.structs.replace(cfg, **counts)
    mb_of = {i: f"mb-{i // micro}" for i in range(B)}  # worker.py:869-872, sample-based micro-batches
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=index[i], response_length=int(lengths[i]),
                            total_length=int(lengths[i]) + 7, loss_mask=[int(v) for v in loss_mask[i, :lengths[i]]],
                            raw_reward=float(raw[i]), micro_batch_id=mb_of[i]) for i in range(B)]
    bundle_index = BundleIndex(bundle_id=f"skyrl-{name}", samples=samples, config=cfg, identity=Identity(
        actor_step_id=ActorStepId(rollout_id=1, step_id=0), micro_batch_ids=sorted(set(mb_of.values()))))
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=f"skyrl-{name}", producer=producer(),
                        stage_contracts=stage_contracts(STAGES + ([StageId.ADVANTAGE_KL] if kl is not None
                                                                  else [])), payloads={}, comparison_policy=ComparisonPolicy(),
                        redaction={})
    expected = {"reward.post_process": {"rewards": [float(v) for v in normalized]}, "loss.policy": policy}
    writer = BundleWriter(path, manifest, bundle_index, expected)
    valid = response_mask.bool()
    payloads = {"log_probs": logp, "old_log_probs": old, "advantages": adv}
    if cfg.use_kl_loss or kl is not None:
        payloads["ref_log_probs"] = ref
    if kl is not None:
        payloads["kl"] = kl
    if rollout is not None:
        payloads["rollout_log_probs"] = rollout
    for pname, values in payloads.items():
        writer.write_payload(pname, values[valid].to(dtype))
    return writer.finalize(ranks=[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_skyrl_step_replays_clean(tmp_path, cli, name, dtype):
    bundle = write_skyrl_bundle(tmp_path / "b", name, seed=7, dtype=dtype)
    code, out, err = cli("replay", bundle, "--format", "json")
    report = json.loads(out)
    assert (code, err, report["first_divergent_stage"]) == (0, "", None), out
    ran = {s["stage"]: s["status"] for s in report["stages"]}
    assert ran["advantage.estimate"] == ran["loss.policy"] == "pass", ran


def test_the_micro_batches_and_the_interior_spans_are_exercised():
    """The sweep is not vacuous: clip_ratio's mean of per-micro-batch token means differs from the mini-batch's
    token mean, and the advantages at interior loss-mask-0 tokens are not 0."""
    algo, micro = CONFIGS["grpo-token-mean-k3"]
    lengths, response_mask, loss_mask, old, logp, ref, scores = _step(7, torch.float32)
    adv, _ = grpo(scores, response_mask, [i // N for i in range(B)])
    policy = train_step(algo, micro, logp, old, ref, loss_reduction(adv, loss_mask, "token_mean", micro, None),
                        loss_mask)
    _, token_clip = ppo_policy_loss(logp, old, adv, loss_mask, algo)
    assert abs(policy["pg_clipfrac"] - token_clip) > 1e-3
    interior = (response_mask == 1) & (loss_mask == 0)
    assert int(interior.sum()) > 3 and bool((adv[interior] != 0).any())


@pytest.mark.parametrize("bug, stage, name", [("loss-sign", "loss.policy", "grpo-token-mean-k3"),
                                             ("zeroed-span", "advantage.estimate", "grpo-token-mean-k3"),
                                             ("kl-unmasked", "advantage.kl", "grpo-kl-in-reward-k3")])
def test_skyrl_injected_bug_is_named_at_its_stage(tmp_path, cli, bug, stage, name):
    bundle = write_skyrl_bundle(tmp_path / "b", name, seed=7, dtype=torch.float32, bug=bug)
    code, out, err = cli("replay", bundle, "--format", "json")
    assert (code, json.loads(out)["first_divergent_stage"]) == (1, stage), out + err


def test_kl_in_reward_needs_its_own_masked_token_rule(tmp_path, cli):
    """The in-reward KL is 0 at the interior spans while the advantages there are not: mapped with one rule for
    both (kl_masked_token_value unset), the clean values diverge at advantage.kl at exactly those tokens."""
    bundle = write_skyrl_bundle(tmp_path / "b", "grpo-kl-in-reward-k3", seed=7, dtype=torch.float32, bug="one-rule")
    lengths, _, loss_mask, *_ = _step(7, torch.float32)
    inside = torch.arange(WIDTH)[None, :] < lengths[:, None]
    masked = (inside & (loss_mask == 0)).sum(-1)
    code, out, err = cli("replay", bundle, "--format", "json")
    report = json.loads(out)
    assert (code, report["first_divergent_stage"]) == (1, "advantage.kl"), out + err
    kl = next(s for s in report["stages"] if s["stage"] == "advantage.kl")
    assert kl["reason"] == (f"kl mismatch in {int(masked.sum())} token(s) of {int((masked > 0).sum())} sample(s)")
    assert int(masked.sum()) > 3


OPC = [name for name, (algo, _) in CONFIGS.items() if "off_policy_correction" in algo]


@pytest.mark.parametrize("name", OPC)
def test_the_off_policy_masks_drop_tokens_and_the_replay_needs_them(tmp_path, cli, name):
    """Not vacuous: each mask config drops loss tokens (and, but for the token mask alone, whole samples) in
    SkyRL's reference, and the same bundle without ``is_keep`` diverges at loss.policy (exit 1)."""
    algo, _ = CONFIGS[name]
    lengths, response_mask, loss_mask, old, logp, ref, scores = _step(7, torch.float32)
    g = torch.Generator().manual_seed(7 + 1000)
    rollout = (old + torch.randn(B, WIDTH, generator=g, dtype=F64) * 0.12).to(torch.float32).to(F64)
    _, kept = off_policy_correction(old, rollout, loss_mask, algo["off_policy_correction"])
    assert 0 < int(kept.sum()) < int(loss_mask.sum())
    assert int(((loss_mask.sum(-1) > 0) & (kept.sum(-1) == 0)).sum()) >= 1
    assert from_skyrl(skyrl_config(name)).is_keep
    bundle = write_skyrl_bundle(tmp_path / "b", name, seed=7, dtype=torch.float32, bug="no-keep")
    code, out, err = cli("replay", bundle, "--stage", "loss.policy", "--format", "json")
    report = json.loads(out)
    assert (code, report["first_divergent_stage"]) == (1, "loss.policy"), out


@pytest.mark.parametrize("name", ["grpo-dppo-tv", "grpo-dppo-kl-sequence-mean"])
def test_dppo_masks_some_tokens_of_each_sign(name):
    """Not vacuous: SkyRL's DPPO mask drops tokens of both advantage signs and keeps most."""
    algo, micro = CONFIGS[name]
    lengths, response_mask, loss_mask, old, logp, ref, scores = _step(7, torch.float32)
    g = torch.Generator().manual_seed(7 + 1000)
    rollout = (old + torch.randn(B, WIDTH, generator=g, dtype=F64) * 0.12).to(torch.float32).to(F64)
    index = [i // N for i in range(B)]
    adv, _ = grpo(scores, response_mask, index)
    cfg = algo["dppo"]
    p, pm = torch.exp(logp), torch.exp(rollout)
    if cfg.get("dppo_type", "binary_tv") == "binary_tv":
        drop_pos, drop_neg = (adv > 0) & (p - pm > cfg["delta_high"]), (adv < 0) & (pm - p > cfg["delta_low"])
    else:
        kl = pm * (rollout - logp) + (1 - pm) * torch.log((1 - pm + 1e-8) / (1 - p + 1e-8))
        drop_pos = (adv > 0) & (p > pm) & (kl > cfg["delta_high"])
        drop_neg = (adv < 0) & (p < pm) & (kl > cfg["delta_low"])
    on = loss_mask > 0
    assert int((drop_pos & on).sum()) > 0 and int((drop_neg & on).sum()) > 0
    assert int(((drop_pos | drop_neg) & on).sum()) < int(on.sum()) // 2


def test_prompt_mean_differs_from_token_mean_here():
    """Not vacuous: the prompts' loss-token counts differ, so prompt_mean is not token_mean on these steps."""
    lengths, response_mask, loss_mask, old, logp, ref, scores = _step(7, torch.float32)
    per_prompt = loss_mask.reshape(GROUPS, N, WIDTH).sum(dim=(1, 2))
    assert float(per_prompt[0]) != float(per_prompt[1])
