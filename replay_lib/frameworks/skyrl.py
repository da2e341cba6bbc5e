"""SkyRL's configuration (``SkyRLConfig``: ``trainer.algorithm.*``, ``generator.*``) → ``RecomputeConfig``.

Source read: NovaSky-AI/SkyRL @ a9564572eb8e (2026-08-21). ``config.py`` below is
``skyrl/train/config/config.py``, ``ppo_utils.py`` is ``skyrl/backends/skyrl_train/utils/ppo_utils.py``,
``worker.py`` is ``skyrl/backends/skyrl_train/workers/worker.py``, ``opc.py`` is
``skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py``.

``cfg`` is the whole config (a dict, OmegaConf or the dataclass) with ``trainer.algorithm`` and
``generator``; a bare ``AlgorithmConfig`` dict (it has ``advantage_estimator`` at its top) is accepted too.

The KL and entropy terms of the loss are aggregated apart from the policy term (``worker.py:1058-1089``):
the KL term is a per-sequence masked mean averaged over the micro-batch (``masked_mean(kl, mask, dim=-1).mean()``,
``worker.py:1077``), i.e. ``kl_loss_agg_mode="seq_mean_token_mean"`` over the mini-batch's samples; the entropy
term a masked token mean over the micro-batch (``masked_mean(entropy, mask)``, ``worker.py:1062``), i.e.
``entropy_agg_mode="token_mean"``. Both are weighted by ``len(micro-batch)/len(mini-batch)``
(``worker.py:1089``), so the mapping is exact when the bundle records one micro-batch per mini-batch on one DP
rank (``loss_seq_count`` = its samples, ``loss_token_count`` = its loss tokens); with several micro-batches the
entropy denominator is each micro-batch's own token count. The KL term is k3 on ``ref − logp`` clamped to ±20,
the value clamped to ±10 (``ppo_utils.py`` ``compute_approx_kl``).

Not encoded: SkyRL pre-divides the advantages by the mini-batch's token count for ``token_mean``
(``ppo_utils.py:1180-1181``): a bundle holding the *raw* advantages (as SkyRL's dump does) replays them with
``loss_agg_mode="token_mean"`` and that count recorded.

Metrics: ``clip_ratio`` (our ``pg_clipfrac``) is each micro-batch's masked token mean whatever ``loss_reduction``
is (``ppo_utils.py:571``: ``masked_mean((-surr2 > -surr1).float(), loss_mask)``), averaged over the micro-batches
(``worker.py:876-898``, ``reduce_metrics``: a plain mean for a key not ending in ``_loss``,
``workers/worker_utils.py:61-90``): ``metric_agg_mode="micro_batch_token_mean"`` from the samples'
``micro_batch_id`` (one micro-batch: the mini-batch's token mean).

Masked tokens: SkyRL's ``response_mask`` is the response indicator (1 on every response token, tool and
observation spans included, 0 on padding only: ``skyrl/train/dataset/preprocess.py:131-137,202``), its
``loss_mask`` the trainable tokens. The GRPO, RLOO and REINFORCE++ advantages are ``× response_mask``
(``ppo_utils.py:1254,1307,1391``), so a loss-mask-0 token *inside* a response holds the computed value:
``masked_token_value="computed"`` (verl's response mask is its loss mask, hence its ``zero``).

KL in the reward (``use_kl_in_reward``, ``grpo`` / ``rloo`` / ``maxrl``): ``kl_in_reward="sequence"`` with
the in-reward KL's own rule ``kl_masked_token_value="zero"`` (see ``KL_IN_REWARD_TYPES`` below); under the adaptive
``kl_ctrl`` the bundle records the step's coefficient as ``kl_loss_coef`` (applied as a fixed one).

Estimators: ``grpo`` (a group of one: mean 0, std 1, ``ppo_utils.py:1378-1380``), ``rloo`` (``(r − mean)·n/(n−1)``,
a group of one gets 0: ``ppo_utils.py:1293-1307``), ``reinforce++`` (discounted returns reset after the response,
``masked_whiten`` over ``response_mask``: ``ppo_utils.py:1244-1254``) and ``gae`` (``ppo_utils.py:1313-1341``).
REINFORCE++ whitens over every response token, tool spans included, and puts the outcome reward on the
response's last token: a bundle whose loss mask has an interior or trailing 0 span must record SkyRL's whitening
statistics (``advantage_whiten_stats``) and end each response on a loss token.

Loss reductions (``ppo_utils.py:1176-1220``): ``token_mean``, ``sequence_mean``, ``seq_mean_token_sum_norm``, and
``token_mean_legacy`` (each micro-batch of ``micro_train_batch_size_per_gpu`` consecutive samples divided by its
own token count, then by the micro-batch count: ``micro_batch_token_mean`` from the samples' ``micro_batch_id``;
exact when the mini-batch is a multiple of the micro-batch size, ``ppo_utils.py:1187``) and ``prompt_mean``
(each prompt's token mean, averaged over the prompts: ``prompt_mean`` over the samples' ``group_index``).
"""

from __future__ import annotations

from typing import Any, Optional

from ..bundle.schema import RecomputeConfig
from ._base import ConfigReader, kl_clamps

FRAMEWORK = "skyrl"
LOSS_REDUCTION = {"token_mean": "token_mean", "sequence_mean": "seq_mean_token_mean",
                  "seq_mean_token_sum_norm": "seq_mean_token_sum_norm",
                  "token_mean_legacy": "micro_batch_token_mean",  # ppo_utils.py:1176-1207
                  # the mean over the mini-batch's prompts of each one's token mean (ppo_utils.py:1209-1218; the
                  # prompts from the uids, trainer.py:954): prompt_mean over the samples' group_index
                  "prompt_mean": "prompt_mean"}
# Reductions refused, with what a replay would need.
REFUSED_REDUCTIONS: dict[str, str] = {}
# SkyRL's estimators → ours (ppo_utils.py:405-441); each one's group-of-one rule.
ESTIMATORS = {"grpo": "grpo", "rloo": "rloo", "reinforce++": "reinforce_plus_plus", "gae": "gae",
              # (r − mean)/(mean + 1e-6), a group of one r itself (ppo_utils.py:1397-1428): its own rule
              "maxrl": "maxrl"}
SINGLETON = {"grpo": "raw",  # ppo_utils.py:1378-1380: mean 0, std 1
             "rloo": "zero"}  # ppo_utils.py:1303-1306: "set the advantage to 0"
REFUSED_ESTIMATORS: dict[str, str] = {}
KL_TYPES = ("k1", "abs", "k2", "k3")  # ppo_utils.py:88-126 compute_approx_kl
# use_kl_in_reward (trainer.py:1409-1436): the token rewards minus max(0, kl_loss_coef)·kl, the KL from
# compute_approx_kl(action_log_probs, base_action_log_probs, loss_mask, kl_estimator_type) — the rollout's
# log-probs against the reference's, 0 at a loss-mask-0 token (ppo_utils.py:122-125) — which GRPO and RLOO sum
# (ppo_utils.py:1284,1367): kl_in_reward="sequence", the KL's own rule kl_masked_token_value="zero" while the
# advantages keep masked_token_value="computed" (× response_mask). k3 is clamped at ±20 in, ±10 out
# (ppo_utils.py:113-118): past |c| = 20 both sides are above 10, so the input clamp never shows: low_var_kl.
KL_IN_REWARD_ESTIMATORS = ("grpo", "rloo", "maxrl")  # each sums token_level_rewards (maxrl: ppo_utils.py:1406)
KL_IN_REWARD_TYPES = {"k1": "k1", "abs": "abs", "k2": "k2", "k3": "low_var_kl"}
KL_IN_REWARD_TOKEN = (
    "the token rewards minus kl_loss_coef·kl (trainer.py:1409-1436) enter {est}'s per-token recursion "
    "(ppo_utils.py:{lines}), which no reference sweep of this mapping checks against SkyRL's code; not mapped "
    "(grpo and rloo, which sum them, are)")
KL_IN_REWARD_TOKEN_LINES = {"reinforce++": "1225-1257", "gae": "1313-1341"}
KL_IN_REWARD_AND_LOSS = ("SkyRL rejects use_kl_in_reward with use_kl_loss (skyrl/train/utils/utils.py:312-314: "
                         "\"mutually exclusive\"); set use_kl_loss=false")
# SkyRL's Clip-Cov (ppo_utils.py:938-999) and KL-Cov (:1001-1053) are verl's formulas on the advantages SkyRL
# pre-scaled by the loss reduction's normalizer, summed (reduce_loss, :1145-1149): the covariance ranks w_i·A and
# KL-Cov's penalty skips the normalizer — the families' advantages="prescaled" (kernels/families/clip_cov.py,
# kl_cov.py). Neither calls compute_off_policy_correction (verl's kl_cov/clip_cov take no rollout weights either).
COV_LOSSES = ("clip_cov", "kl_cov")
# sequence_mask_metric → (its bounds' key prefix, the defaults of its low and high: config.py:803-810)
SEQUENCE_MASKS = {"geometric": ("geo_mask", 0.99, 1.01), "product": ("product_mask", 0.5, 2.0)}
# Sections that act only under their own policy_loss_type / estimator, or outside the recomputed math.
NEUTRAL = ("sapo", "clip_cov", "kl_cov", "cispo", "dppo", "dynamic_sampling", "value_head_prefix", "temperature",
           "zero_variance_filter", "zero_variance_filter_tol", "kl_ctrl", "tis_imp_ratio_cap")


# policy_loss_type values recomputed as a loss family (kernels/families): cross_entropy (ppo_utils.py:1057-1092),
# importance_sampling (:1095-1142), rollout_is (:825-863; the ratio to the rollout log-probs, a hard zero outside
# (1 − eps_clip_low, 1 + eps_clip_high))
FAMILY_LOSSES = ("cross_entropy", "importance_sampling", "rollout_is")


def from_skyrl(cfg: Any, *, where: Optional[str] = None) -> RecomputeConfig:
    """The ``RecomputeConfig`` SkyRL's config ``cfg`` encodes (see the module docstring)."""
    r = ConfigReader(FRAMEWORK, cfg, where)
    a = "trainer.algorithm" if r.has("trainer.algorithm") or not r.has("advantage_estimator") else ""
    p = f"{a}." if a else ""
    est = r.text(f"{p}advantage_estimator", "grpo")  # config.py:823
    if est in REFUSED_ESTIMATORS:
        r.refuse(f"{p}advantage_estimator", est, REFUSED_ESTIMATORS[est])
    if est not in ESTIMATORS:
        r.refuse(f"{p}advantage_estimator", est, f"not mapped ({', '.join(ESTIMATORS)} are)")
    loss_type = r.text(f"{p}policy_loss_type", "regular")  # config.py:853
    if loss_type not in ("regular", "dual_clip", "gspo", "cispo", "sapo", "dppo") + tuple(FAMILY_LOSSES) + COV_LOSSES:
        r.refuse(f"{p}policy_loss_type", loss_type,
                 f"not mapped (regular, dual_clip, gspo, cispo, sapo, dppo, {', '.join(FAMILY_LOSSES)}, "
                 f"{', '.join(COV_LOSSES)} are)")
    reduction = r.text(f"{p}loss_reduction", "token_mean")  # config.py:876
    if reduction in REFUSED_REDUCTIONS:
        r.refuse(f"{p}loss_reduction", reduction, REFUSED_REDUCTIONS[reduction])
    if reduction not in LOSS_REDUCTION:
        r.refuse(f"{p}loss_reduction", reduction, f"not mapped ({', '.join(LOSS_REDUCTION)} are)")
    use_kl_loss = r.flag(f"{p}use_kl_loss", True)  # config.py:833
    kl_loss_coef = r.number(f"{p}kl_loss_coef", 0.001)  # config.py:836
    kl_type = r.text(f"{p}kl_estimator_type", "k3")  # config.py:828
    if use_kl_loss and kl_loss_coef != 0 and kl_type not in KL_TYPES:
        r.refuse(f"{p}kl_estimator_type", kl_type, f"not mapped ({', '.join(KL_TYPES)} are)")
    kl_in_reward = r.flag(f"{p}use_kl_in_reward", False)  # config.py:830
    if kl_in_reward:
        ctrl = r.text(f"{p}kl_ctrl.type", "fixed")  # config.py:693, ppo_utils.py:68-80
        if ctrl not in ("fixed", "adaptive"):
            r.refuse(f"{p}kl_ctrl.type", ctrl, "not one of fixed, adaptive")
        if ctrl == "adaptive":
            r.note(f"{p}kl_ctrl.type=adaptive: a bundle's kl_coef must be its step's coefficient "
                   "(reward_kl_controller.value); kl_loss_coef from the file is its start, right at the first step only")
        # adaptive: the step applies reward_kl_controller.value (trainer.py:1430-1434), updated after it
        # (:1443-1444); the config holds only its start: the bundle records the step's value as kl_loss_coef (the
        # capture writes it there), which the replay applies as a fixed coefficient
        if use_kl_loss:
            r.refuse(f"{p}use_kl_loss", True, KL_IN_REWARD_AND_LOSS)
        if est not in KL_IN_REWARD_ESTIMATORS:
            r.refuse(f"{p}use_kl_in_reward", True, KL_IN_REWARD_TOKEN.format(est=est, lines=KL_IN_REWARD_TOKEN_LINES[est]))
        if kl_type not in KL_IN_REWARD_TYPES:
            r.refuse(f"{p}kl_estimator_type", kl_type, f"not mapped ({', '.join(KL_IN_REWARD_TYPES)} are)")
    use_entropy = r.flag(f"{p}use_entropy_loss", False)  # config.py:838
    entropy_coef = r.number(f"{p}entropy_loss_coef", 0.01)  # config.py:841, used only with use_entropy_loss
    if r.flag(f"{p}use_tis", False):  # config.py:914 (deprecated)
        r.refuse(f"{p}use_tis", True, "deprecated in SkyRL; set off_policy_correction.tis_ratio_type instead")
    fields: dict[str, Any] = dict(
        advantage_estimator=ESTIMATORS[est],
        n_samples_per_prompt=r.integer("generator.n_samples_per_prompt", 5) if a else 1,  # config.py:1225
        grpo_std_normalization=r.flag(f"{p}grpo_norm_by_std", True),  # config.py:892
        grpo_std_eps=1e-6,  # ppo_utils.py:1348
        grpo_std_unbiased=True,  # ppo_utils.py:1383: torch.std
        group_baseline="mean",
        std_zero="eps",
        singleton_group=SINGLETON.get(est),
        gamma=r.number(f"{p}gamma", 1.0),  # config.py:904
        lam=r.number(f"{p}lambd", 1.0),  # config.py:902
        eps_clip=r.number(f"{p}eps_clip_low", 0.2),  # config.py:906
        eps_clip_high=r.number(f"{p}eps_clip_high", 0.2),  # config.py:908
        log_ratio_clamp=20.0,  # ppo_utils.py:567: safe_exp_delta(logp − old, clip=20)
        entropy_coef=0.0,
        use_kl_loss=False,
        kl_loss_coef=0.0,
        normalize_advantages=r.flag(f"{p}advantage_batch_normalize", False),  # config.py:849
        loss_agg_mode=LOSS_REDUCTION[reduction],
        # clip_ratio: each micro-batch's masked token mean (ppo_utils.py:571), averaged over the micro-batches
        # (worker.py:898, worker_utils.py:61-90), whatever loss_reduction is
        metric_agg_mode="micro_batch_token_mean",
        # × response_mask (ppo_utils.py:1254,1307,1391), the response indicator (preprocess.py:131-137): a
        # loss-mask-0 token inside a response keeps its computed value
        masked_token_value="computed",
    )
    if use_kl_loss and kl_loss_coef != 0:  # worker.py:1068-1078: coef · mean_i(masked_mean_t(kl_i))
        fields.update(use_kl_loss=True, kl_loss_coef=kl_loss_coef, kl_loss_type=kl_type,
                      kl_loss_agg_mode="seq_mean_token_mean", **kl_clamps(kl_type, 20.0, 10.0))
    if kl_in_reward:  # trainer.py:1426-1436: rewards − kl·max(0, kl_loss_coef)
        fields.update(kl_in_reward="sequence", kl_coef=max(0.0, kl_loss_coef),
                      kl_penalty_type=KL_IN_REWARD_TYPES[kl_type], kl_masked_token_value="zero")
    if use_entropy and entropy_coef != 0:  # worker.py:1058-1066: loss −= coef · masked_mean(entropy, mask)
        fields.update(entropy_coef=entropy_coef, entropy_agg_mode="token_mean")
    clip_c = r.number(f"{p}clip_ratio_c", 3.0)  # config.py:910
    if loss_type == "dual_clip":  # ppo_utils.py:574-578
        fields["eps_clip_c"] = clip_c
    elif loss_type == "gspo":
        # gspo_policy_loss (ppo_utils.py:663-729): one ratio per sample, exp of the masked mean log-ratio over the
        # loss mask (torch_utils.py:180-184, the count floored at 1), clamped at max 10 (one-sided; ours is
        # symmetric: they differ only where a sample's mean log-ratio is below −10), no dual-clip, the configured
        # loss_reduction and off-policy correction, clip_ratio a token mean (:715) — verl's GSPO in 0.9.1
        fields.update(importance_level="sequence", log_ratio_clamp=10.0)
    elif loss_type == "cispo":
        # compute_policy_loss_cispo: −A·sg(clamp(r, 1 − cispo_eps_clip_low, 1 + cispo_eps_clip_high))·logp, r =
        # exp(clamp(logp − anchor, ±20)), anchor old or rollout (cispo.cispo_anchor); clip_ratio the tokens outside
        # the bounds; the configured loss_reduction and off-policy correction
        anchor = r.text(f"{p}cispo.cispo_anchor", "old")
        if anchor not in ("old", "rollout"):
            r.refuse(f"{p}cispo.cispo_anchor", anchor, "not one of old, rollout")
        if anchor == "rollout" and r.raw(f"{p}off_policy_correction.tis_ratio_type", None) is not None:
            r.refuse(f"{p}cispo.cispo_anchor", anchor, "SkyRL rejects TIS on top of the rollout anchor (it would "
                                                     "double-count the correction)")
        fields.update(eps_clip=r.number(f"{p}cispo.cispo_eps_clip_low", 1.0),
                      eps_clip_high=r.number(f"{p}cispo.cispo_eps_clip_high", 4.0),
                      policy_loss="cispo", policy_loss_params={"anchor": anchor})
        r.neutral(f"{p}eps_clip_low", f"{p}eps_clip_high")
    elif loss_type == "sapo":  # sapo_policy_loss: the gate by the sign of A, the configured loss_reduction
        fields.update(policy_loss="sapo", policy_loss_params={"tau_pos": r.number(f"{p}sapo.tau_pos", 1.0),
                                                              "tau_neg": r.number(f"{p}sapo.tau_neg", 1.05)})
    elif loss_type == "dppo":
        # dppo_policy_loss (ppo_utils.py:866-935): −A·r·keep, r against the rollout's log-probs (the old ones when
        # the run has none, :889: record those as rollout_log_probs then), keep by the TV or binary-KL divergence
        # (config.py:778-788: dppo_type binary_tv, delta_low = delta_high = 0.2)
        dtype = r.text(f"{p}dppo.dppo_type", "binary_tv")
        if dtype not in ("binary_tv", "binary_kl"):
            r.bad(f"{p}dppo.dppo_type", dtype, "binary_tv or binary_kl (config.py:786-788)")
        fields.update(policy_loss="dppo_mu", eps_clip=r.number(f"{p}dppo.delta_low", 0.2),
                      eps_clip_high=r.number(f"{p}dppo.delta_high", 0.2),
                      policy_loss_params={"divergence": dtype.removeprefix("binary_"), "anchor": "rollout"})
        r.neutral(f"{p}eps_clip_low", f"{p}eps_clip_high")
    elif loss_type == "clip_cov":
        # compute_policy_loss_clip_cov (ppo_utils.py:938-999): r = exp(logp − old) (no clamp), the clipped
        # surrogate (eps_clip_low/high) × corr, corr 0 on a torch.randperm draw of max(1, int(clip_ratio·n)) of the
        # micro-batch's unclipped loss tokens whose covariance lies in (clip_cov_lb, clip_cov_ub): the bundle's
        # clip_cov_mask; clip_ratio = masked_mean(corr == 0) (config.py:727-735: 0.0002, 1.0, 5.0)
        fields.update(policy_loss="clip_cov", log_ratio_clamp=None, policy_loss_params={
            "clip_cov_ratio": r.number(f"{p}clip_cov.clip_ratio", 0.0002),
            "clip_cov_lb": r.number(f"{p}clip_cov.clip_cov_lb", 1.0),
            "clip_cov_ub": r.number(f"{p}clip_cov.clip_cov_ub", 5.0), "advantages": "prescaled"})
    elif loss_type == "kl_cov":
        # compute_policy_loss_kl_cov (ppo_utils.py:1001-1053): −A·r + ppo_kl_coef·|Δ| on the top
        # max(1, int(n·kl_cov_frac)) of the micro-batch's loss tokens by cov(A, logp), r = exp(logp − old) (no
        # clamp); clip_ratio reported as 0.0 (no metric: record none) (config.py:739-745: 0.2, 1.0)
        fields.update(policy_loss="kl_cov", log_ratio_clamp=None, policy_loss_params={
            "kl_cov_ratio": r.number(f"{p}kl_cov.kl_cov_frac", 0.2),
            "ppo_kl_coef": r.number(f"{p}kl_cov.ppo_kl_coef", 1.0), "advantages": "prescaled"})
    elif loss_type in FAMILY_LOSSES:
        fields["policy_loss"] = loss_type
        if loss_type == "cross_entropy":  # Σ −logp·m (reduce_loss, ppo_utils.py:1145-1149): no advantage to fold
            fields["loss_agg_mode"] = "token_sum"     # the reduction into (ppo_utils.py:1152-1220)
    if reduction == "seq_mean_token_sum_norm":
        fields["loss_horizon"] = r.integer(f"{p}max_seq_len", None)  # config.py:933
    else:
        r.neutral(f"{p}max_seq_len")
    if est == "gae":
        fields["value_clip"] = r.number(f"{p}value_clip", 0.2)  # config.py:921
    else:
        r.neutral(f"{p}value_clip")
    if loss_type in COV_LOSSES:  # neither loss function applies the off-policy correction (ppo_utils.py:938-1053)
        inert: dict[str, Any] = {}
        _off_policy(r, f"{p}off_policy_correction", inert)
        if inert:
            r.note(f"{p}off_policy_correction: inert under policy_loss_type={loss_type} (its loss function applies "
                   "no correction, ppo_utils.py:938-1053)")
    else:
        _off_policy(r, f"{p}off_policy_correction", fields)
    r.neutral(*(f"{p}{k}" for k in NEUTRAL))
    r.check_unknown([a] if a else None)
    return r.build(fields)


def _off_policy(r: ConfigReader, opc: str, fields: dict[str, Any]) -> None:
    """``off_policy_correction`` (config.py:793-818; opc.py:24-70): ``exp(clamp(Δ, ±20))`` per token or summed per
    sequence, capped above (no lower bound); the outlier, token and sequence masks (opc.py:297-345) as
    ``is_keep`` (bundle/is_keep.py): 0/1 weights of the policy-loss terms, SkyRL's normalizer kept."""
    kind = r.raw(f"{opc}.tis_ratio_type", None)  # config.py:794
    token_cap = r.number(f"{opc}.token_tis_ratio_clip_high", 2.0)  # config.py:797
    seq_cap = r.number(f"{opc}.sequence_tis_ratio_clip_high", 5.0)  # config.py:799
    keep: dict[str, list] = {}
    outlier = [r.raw(f"{opc}.outlier_token_is_threshold_{k}", None) for k in ("low", "high")]  # config.py:811-814
    if any(v is not None for v in outlier):  # either bound alone acts (opc.py:293-296)
        keep["outlier"] = outlier
    # the per-token mask acts only with both bounds set (opc.py:17-20, 297-301: "and"); one bound alone is inert
    token_bounds = {k: r.raw(f"{opc}.token_mask_is_threshold_{k}", None) for k in ("low", "high")}  # config.py:815-818
    if all(v is not None for v in token_bounds.values()):
        keep["token"] = [token_bounds["low"], token_bounds["high"]]
    else:
        for k, v in token_bounds.items():
            if v is not None:
                r.note(f"{opc}.token_mask_is_threshold_{k}={v!r}: inert without token_mask_is_threshold_"
                       f"{'high' if k == 'low' else 'low'} (SkyRL masks tokens only with both bounds, opc.py:17-20, "
                       "297-301)")
    metric = r.raw(f"{opc}.sequence_mask_metric", None)  # config.py:801
    if metric is not None:
        if metric not in SEQUENCE_MASKS:
            r.refuse(f"{opc}.sequence_mask_metric", metric, "not one of geometric, product (opc.py:220-253)")
        prefix, low, high = SEQUENCE_MASKS[metric]
        keep[metric] = [r.number(f"{opc}.{prefix}_low", low), r.number(f"{opc}.{prefix}_high", high)]
    r.neutral(*(f"{opc}.{k}" for k in ("geo_mask_high", "geo_mask_low", "product_mask_high", "product_mask_low")))
    if keep:
        from ..bundle.is_keep import parse_is_keep

        try:
            parse_is_keep(keep)
        except ValueError as exc:
            r.bad(opc, keep, f"mask bounds 0 < low <= high ({str(exc).split(': ', 1)[-1]})")
        if kind == "sequence" and "token" in keep:
            # the sequence TIS ratio sums over the mask the token mask left (opc.py:327, 334-338)
            r.refuse(f"{opc}.tis_ratio_type", kind, "a sequence TIS ratio over the loss mask SkyRL's token mask "
                     "left (opc.py:327-338) is not recomputed (the replay sums it over the recorded mask); use "
                     "token TIS or no token mask")
        fields["is_keep"] = keep
    if kind is None:
        return
    if kind not in ("token", "sequence"):
        r.refuse(f"{opc}.tis_ratio_type", kind, "not one of token, sequence")
    fields.update(is_level=kind, is_mode="truncate", is_low=None, is_high=token_cap if kind == "token" else seq_cap,
                  is_log_clamp=20.0)  # opc.py:51,64: safe_exp_delta(…, clip=20)
