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
"""

from __future__ import annotations

from typing import Any, Optional

from ..bundle.schema import RecomputeConfig
from ._base import ConfigReader, kl_clamps

FRAMEWORK = "skyrl"
LOSS_REDUCTION = {"token_mean": "token_mean", "sequence_mean": "seq_mean_token_mean",
                  "seq_mean_token_sum_norm": "seq_mean_token_sum_norm"}  # ppo_utils.py:1180-1216
# Sections that act only under their own policy_loss_type / estimator, or outside the recomputed math.
NEUTRAL = ("sapo", "clip_cov", "kl_cov", "cispo", "dppo", "dynamic_sampling", "value_head_prefix", "temperature",
           "zero_variance_filter", "zero_variance_filter_tol", "kl_ctrl", "tis_imp_ratio_cap")


def from_skyrl(cfg: Any, *, where: Optional[str] = None) -> RecomputeConfig:
    """The ``RecomputeConfig`` SkyRL's config ``cfg`` encodes (see the module docstring)."""
    r = ConfigReader(FRAMEWORK, cfg, where)
    a = "trainer.algorithm" if r.has("trainer.algorithm") or not r.has("advantage_estimator") else ""
    p = f"{a}." if a else ""
    est = r.text(f"{p}advantage_estimator", "grpo")  # config.py:823
    if est not in ("grpo", "gae"):
        r.refuse(f"{p}advantage_estimator", est, "not mapped (grpo and gae are)")
    loss_type = r.text(f"{p}policy_loss_type", "regular")  # config.py:853
    if loss_type not in ("regular", "dual_clip"):
        r.refuse(f"{p}policy_loss_type", loss_type, "not mapped (regular and dual_clip are)")
    reduction = r.text(f"{p}loss_reduction", "token_mean")  # config.py:876
    if reduction not in LOSS_REDUCTION:
        r.refuse(f"{p}loss_reduction", reduction, f"not mapped ({', '.join(LOSS_REDUCTION)} are)")
    use_kl_loss = r.flag(f"{p}use_kl_loss", True)  # config.py:833
    kl_loss_coef = r.number(f"{p}kl_loss_coef", 0.001)  # config.py:836
    kl_type = r.text(f"{p}kl_estimator_type", "k3")  # config.py:828
    if use_kl_loss and kl_loss_coef != 0 and kl_type not in ("k1", "k2", "k3"):
        r.refuse(f"{p}kl_estimator_type", kl_type, "not mapped (k1, k2 and k3 are)")  # ppo_utils.py compute_approx_kl
    if r.flag(f"{p}use_kl_in_reward", False):  # config.py:830
        r.refuse(f"{p}use_kl_in_reward", True, "SkyRL's per-token KL reward is not mapped")
    use_entropy = r.flag(f"{p}use_entropy_loss", False)  # config.py:838
    entropy_coef = r.number(f"{p}entropy_loss_coef", 0.01)  # config.py:841, used only with use_entropy_loss
    if r.flag(f"{p}use_tis", False):  # config.py:914 (deprecated)
        r.refuse(f"{p}use_tis", True, "deprecated in SkyRL; set off_policy_correction.tis_ratio_type instead")
    fields: dict[str, Any] = dict(
        advantage_estimator=est,
        n_samples_per_prompt=r.integer("generator.n_samples_per_prompt", 5) if a else 1,  # config.py:1225
        grpo_std_normalization=r.flag(f"{p}grpo_norm_by_std", True),  # config.py:892
        grpo_std_eps=1e-6,  # ppo_utils.py:1348
        grpo_std_unbiased=True,  # ppo_utils.py:1383: torch.std
        group_baseline="mean",
        std_zero="eps",
        singleton_group="raw",  # ppo_utils.py:1378-1380: mean 0, std 1
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
    )
    if use_kl_loss and kl_loss_coef != 0:  # worker.py:1068-1078: coef · mean_i(masked_mean_t(kl_i))
        fields.update(use_kl_loss=True, kl_loss_coef=kl_loss_coef, kl_loss_type=kl_type,
                      kl_loss_agg_mode="seq_mean_token_mean", **kl_clamps(kl_type, 20.0, 10.0))
    if use_entropy and entropy_coef != 0:  # worker.py:1058-1066: loss −= coef · masked_mean(entropy, mask)
        fields.update(entropy_coef=entropy_coef, entropy_agg_mode="token_mean")
    clip_c = r.number(f"{p}clip_ratio_c", 3.0)  # config.py:910
    if loss_type == "dual_clip":  # ppo_utils.py:574-578
        fields["eps_clip_c"] = clip_c
    if reduction == "seq_mean_token_sum_norm":
        fields["loss_horizon"] = r.integer(f"{p}max_seq_len", None)  # config.py:933
    else:
        r.neutral(f"{p}max_seq_len")
    if est == "gae":
        fields["value_clip"] = r.number(f"{p}value_clip", 0.2)  # config.py:921
    else:
        r.neutral(f"{p}value_clip")
    _off_policy(r, f"{p}off_policy_correction", fields)
    r.neutral(*(f"{p}{k}" for k in NEUTRAL))
    r.check_unknown([a] if a else None)
    return r.build(fields)


def _off_policy(r: ConfigReader, opc: str, fields: dict[str, Any]) -> None:
    """``off_policy_correction`` (config.py:793-818; opc.py:24-70): ``exp(clamp(Δ, ±20))`` per token or summed per
    sequence, capped above (no lower bound); every mask option refuses."""
    kind = r.raw(f"{opc}.tis_ratio_type", None)  # config.py:794
    token_cap = r.number(f"{opc}.token_tis_ratio_clip_high", 2.0)  # config.py:797
    seq_cap = r.number(f"{opc}.sequence_tis_ratio_clip_high", 5.0)  # config.py:799
    for key in ("sequence_mask_metric", "outlier_token_is_threshold_low", "outlier_token_is_threshold_high",
                "token_mask_is_threshold_low", "token_mask_is_threshold_high"):  # config.py:801-818: None
        value = r.raw(f"{opc}.{key}", None)
        if value is not None:
            r.refuse(f"{opc}.{key}", value, "SkyRL's IS masks are not mapped")
    r.neutral(*(f"{opc}.{k}" for k in ("geo_mask_high", "geo_mask_low", "product_mask_high", "product_mask_low")))
    if kind is None:
        return
    if kind not in ("token", "sequence"):
        r.refuse(f"{opc}.tis_ratio_type", kind, "not one of token, sequence")
    fields.update(is_level=kind, is_mode="truncate", is_low=None, is_high=token_cap if kind == "token" else seq_cap,
                  is_log_clamp=20.0)  # opc.py:51,64: safe_exp_delta(…, clip=20)
