"""verl's trainer configuration (the OmegaConf / YAML dict of ``ppo_trainer``) → ``RecomputeConfig``.

Source read: verl-project/verl @ 1dda039b9c63 (2026-08-22). ``yaml`` below is
``verl/trainer/config/_generated_ppo_trainer.yaml`` (the resolved defaults), ``core_algos.py`` is
``verl/trainer/ppo/core_algos.py``, ``rollout_corr.py`` is ``verl/trainer/ppo/rollout_corr_helper.py``.

Read: ``algorithm.*`` (estimator, std normalization, KL in the reward, rollout correction) and the policy-loss
keys of ``actor_rollout_ref.actor`` (clips, dual-clip, aggregation, KL loss, entropy, ``policy_loss.loss_mode``);
``actor_rollout_ref.rollout.n`` for the group size. Checked for unknown knobs: ``algorithm`` and
``actor_rollout_ref.actor`` minus their engine sections (optimizer, FSDP/Megatron, checkpoint, profiler).

Not encoded (per-step values a capture records): the all-reduced token count of ``token-mean``
(``batch_num_tokens``) and the ``dp_size`` multiplier (``core_algos.py:1140-1207``), so ``loss_token_count``
stays unset and ``loss_scale`` 1. The ``seq-mean-*`` modes divide by a constant of the config, the nominal
``ppo_mini_batch_size · rollout.n``: that is ``loss_seq_count``.

Version semantics (``VERSIONS``; the bundle's ``producer.framework_version``, an unknown one refused by name), read
in verl 0.9.1 as installed (``verl/trainer/ppo/core_algos.py``, ``verl/workers/utils/losses.py``):

* metrics: ``pg_clipfrac``, ``ppo_kl`` and ``pg_clipfrac_lower`` are each micro-batch's masked token mean
  (core_algos.py:1340,1356,1362), reported as the mean over the micro-batches (losses.py:120
  ``AggregationType.MEAN``): ``metric_agg_mode="micro_batch_token_mean"`` from the samples' ``micro_batch_id``.
  The loss terms are divided by the all-reduced ``batch_num_tokens`` and summed over the micro-batches
  (losses.py:62-79 ``AggregationType.SUM``): one token mean over the mini-batch, ``loss_token_count`` and
  ``loss_scale = dp_size`` recorded by the capture;
* GRPO, Dr.GRPO and RLOO advantages are ``score · response_mask`` (core_algos.py:330,636) and the in-reward KL
  ``kld · response_mask``: ``masked_token_value="zero"``;
* GAE always ends in ``masked_whiten`` (core_algos.py:264): ``normalize_advantages=True``;
* GSPO aggregates with the configured ``loss_agg_mode`` (core_algos.py:1601-1605);
* ``bypass_mode`` (``loss_type=ppo_clip``) is the vanilla loss against the rollout log-probs, the bundle's
  ``old_log_probs`` (core_algos.py:2528-2538), with no importance weight;
* ``bypass_mode`` with ``loss_type=reinforce`` is GPG's term ``−A·logp`` times the detached weight of the current
  log-probs against the rollout ones (core_algos.py:2333-2410, 2518-2527): ``policy_loss="gpg"`` with
  ``rollout_correction_anchor="current"``; in bypass mode ``rollout_rs`` also compares the current log-probs;
* the policy-loss families (``policy_loss.loss_mode``, ``RecomputeConfig.policy_loss``): ``cispo`` (1 ± ε,
  core_algos.py:2047-2106), ``sapo`` (``tau_pos``/``tau_neg``, its pg term forced ``seq-mean-token-mean``:
  core_algos.py:1675-1678), ``geo_mean`` (GMPO, ``torch.mean`` over each micro-batch's sequences summed over the
  micro-batches: ``seq_mean_token_sum`` over ``ppo_micro_batch_size_per_gpu``, core_algos.py:1999), ``dppo_tv`` /
  ``dppo_kl`` (``clip_ratio_low/high`` the divergence thresholds, ``clip_ratio_c`` the ratio's truncation),
  ``dro`` (``policy_loss.dro_beta``), ``gpg``. The entropy and KL terms keep ``loss_agg_mode``.
  ``kl_cov`` (the top-k covariance tokens of each micro-batch, core_algos.py:1893-1911: from the samples'
  ``micro_batch_id``). ``clip_cov`` (core_algos.py:1744-1845): Clip-Cov zeroes a ``torch.randperm`` sample of
  tokens (core_algos.py:1808-1828), which the bundle records as the payload ``clip_cov_mask``; the covariance's
  means per micro-batch (``micro_batch_id``).
"""

from __future__ import annotations

from typing import Any, Optional

from ..bundle.schema import RecomputeConfig
from ._base import ConfigReader, framework_version, kl_clamps

FRAMEWORK = "verl"
ACTOR = "actor_rollout_ref.actor"
ALGO = "algorithm"
RC = "algorithm.rollout_correction"

# The verl versions whose semantics this mapping encodes (oldest first; the last is the default).
VERSIONS = ("0.9.1",)
# verl's names → ours (core_algos.py:1140-1205 in 0.9.1: agg_loss).
LOSS_AGG = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean",
            "seq-mean-token-sum": "seq_mean_token_sum", "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
            "token-sum": "token_sum"}
# verl's estimators → ours (core_algos.py:215-870 in 0.9.1); their GRPO-family outputs are × response_mask.
ESTIMATORS = {"grpo": "grpo", "grpo_vectorized": "grpo", "gae": "gae", "rloo": "rloo", "rloo_vectorized": "rloo",
              "reinforce_plus_plus": "reinforce_plus_plus",
              "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline",
              # their own reward.post_process rules (SPEC §4.2): OPO's length-weighted baseline
              # (core_algos.py:640-690), GPG's α·(r − mean) (core_algos.py:771-830), pass@k's best-only gap
              # (core_algos.py:472-530), ReMax's recorded greedy baseline (core_algos.py:735-768; the samples'
              # reward_baseline), GDPO's per-component GRPO sum (core_algos.py:362-468; the samples'
              # reward_components), then masked_whiten (normalize_advantages)
              "opo": "opo", "gpg": "gpg", "grpo_passk": "grpo_passk", "remax": "remax", "gdpo": "gdpo"}
# Estimators refused, with what a bundle would need to record for a replay to recompute them.
REFUSED_ESTIMATORS = {
    "optimal_token_baseline": "the optimal token baseline weights by the policy's sum of squared probabilities "
                              "(core_algos.py:872-988): a bundle would need sum_pi_squared per token",
    "tir_optimal_token_baseline": "the multi-turn optimal token baseline (core_algos.py:991-1122): a bundle would "
                                  "need sum_pi_squared per token",
}
# kl_penalty_forward (core_algos.py:2215-2250); a trailing '+' is a straight-through gradient trick with the
# same forward value (core_algos.py:2199-2203). k3 and low_var_kl are one formula, clamped at ±20 then ±10.
KL_TYPES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "k3": "k3", "low_var_kl": "k3", "abs": "abs"}
# Sections of the actor config that configure the engine, not the loss.
ACTOR_NEUTRAL = ("optim", "fsdp_config", "megatron", "veomni", "torchtitan", "automodel", "checkpoint", "profiler",
                 "_target_", "strategy",
                 "ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz",
                 "ppo_max_token_len_per_gpu", "ppo_epochs", "shuffle", "data_loader_seed", "use_torch_compile",
                 "use_fused_kernels", "use_remove_padding", "rollout_n", "grad_clip", "freeze_vision_tower",
                 "max_concurrent", "memory_limit_mb", "calculate_entropy", "calculate_sum_pi_squared",
                 "use_prefix_grouper", "entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size",
                 "entropy_checkpointing",
                 "ulysses_sequence_parallel_size", "router_replay", "qat", "nccl_timeout")
# policy_loss.* knobs that only act under their own loss_mode (clip_cov, kl_cov, geo_mean, dppo, sapo, ...).
POLICY_LOSS_OTHER_MODES = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef",
                           "dro_beta", "_target_")
# algorithm.* keys that do not change the recomputed math (dynamic sampling chooses which groups a step
# trains on: the bundle holds the chosen ones; the adaptive controller's target and horizon only move the
# coefficient between steps, and the bundle records the step's coefficient as kl_ctrl.kl_coef).
ALGO_NEUTRAL = ("_target_", "filter_groups", "kl_ctrl._target_", "kl_ctrl.horizon", "kl_ctrl.target_kl")


def from_verl(cfg: Any, *, where: Optional[str] = None, version: Optional[str] = None) -> RecomputeConfig:
    """The ``RecomputeConfig`` verl's config ``cfg`` (dict or OmegaConf, the full trainer config) encodes under
    verl ``version`` (the bundle's ``producer.framework_version``; ``None``: the newest of :data:`VERSIONS`)."""
    framework_version(FRAMEWORK, version, VERSIONS, where)
    r = ConfigReader(FRAMEWORK, cfg, where)
    est = r.text(f"{ALGO}.adv_estimator", "gae")  # yaml:864
    if est in REFUSED_ESTIMATORS:
        r.refuse(f"{ALGO}.adv_estimator", est, REFUSED_ESTIMATORS[est])
    if est not in ESTIMATORS:
        r.refuse(f"{ALGO}.adv_estimator", est, f"not mapped (one of {', '.join(ESTIMATORS)})")
    estimator = ESTIMATORS[est]
    mode = r.text(f"{ACTOR}.policy_loss.loss_mode", "vanilla")  # yaml:92
    if r.flag(f"{RC}.bypass_mode", False):  # yaml:858; apply_bypass_mode sets the loss mode (rollout_corr.py:1141-1144)
        mode = "bypass_mode"
    if mode in REFUSED_LOSS_MODES:
        r.refuse(f"{ACTOR}.policy_loss.loss_mode", mode, REFUSED_LOSS_MODES[mode])
    if mode not in ("vanilla", "gspo", "bypass_mode", *FAMILY_LOSS_MODES):
        r.refuse(f"{ACTOR}.policy_loss.loss_mode", mode,
                 f"not mapped (vanilla, gspo, bypass_mode, {', '.join(FAMILY_LOSS_MODES)} are)")
    agg = r.text(f"{ACTOR}.loss_agg_mode", "token-mean")  # yaml:100
    if agg not in LOSS_AGG:
        r.refuse(f"{ACTOR}.loss_agg_mode", agg, f"not one of {', '.join(LOSS_AGG)}")
    loss_agg_mode = LOSS_AGG[agg]
    clip = r.number(f"{ACTOR}.clip_ratio", 0.2)  # yaml:84
    clip_low = r.number(f"{ACTOR}.clip_ratio_low", 0.2)  # yaml:85; None → clip_ratio (core_algos.py:1328)
    clip_high = r.number(f"{ACTOR}.clip_ratio_high", 0.2)  # yaml:86; None → clip_ratio (core_algos.py:1329)
    clip_c = r.number(f"{ACTOR}.clip_ratio_c", 3.0)  # yaml:99; vanilla always applies it (core_algos.py:1356-1361)
    entropy_coef = r.number(f"{ACTOR}.entropy_coeff", 0.0)  # yaml:102
    use_kl_loss = r.flag(f"{ACTOR}.use_kl_loss", False)  # yaml:105
    kl_loss_coef = r.number(f"{ACTOR}.kl_loss_coef", 0.001)  # yaml:108
    kl_loss_type_name = r.text(f"{ACTOR}.kl_loss_type", "low_var_kl")  # yaml:109
    kl_loss_type = _kl_type(r, f"{ACTOR}.kl_loss_type", kl_loss_type_name, use_kl_loss and kl_loss_coef != 0)
    scale_factor = r.integer(f"{ACTOR}.loss_scale_factor", None)  # yaml:101: None → the mask width
    fields: dict[str, Any] = dict(
        advantage_estimator=estimator,
        # verl/trainer/config/rollout/rollout.yaml:127
        n_samples_per_prompt=r.integer("actor_rollout_ref.rollout.n", 1),
        grpo_std_normalization=r.flag(f"{ALGO}.norm_adv_by_std_in_grpo", True),  # yaml:865
        grpo_std_eps=1e-6,  # core_algos.py:272 (epsilon)
        grpo_std_unbiased=True,  # core_algos.py:318: torch.std
        group_baseline="mean",  # core_algos.py:317
        std_zero="eps",
        singleton_group="raw",  # core_algos.py:313-315: mean 0, std 1
        gamma=r.number(f"{ALGO}.gamma", 1.0),  # yaml:862
        lam=r.number(f"{ALGO}.lam", 1.0),  # yaml:863
        eps_clip=clip if clip_low is None else clip_low,
        eps_clip_high=clip if clip_high is None else clip_high,
        log_ratio_clamp=20.0,  # core_algos.py:1338: clamp(logp − old, −20, 20) before exp, also in ppo_kl
        entropy_coef=entropy_coef,
        use_kl_loss=use_kl_loss,
        kl_loss_coef=kl_loss_coef,
        kl_loss_type=kl_loss_type,
        **kl_clamps(kl_loss_type, 20.0, 10.0),  # core_algos.py:2238-2244
        loss_agg_mode=loss_agg_mode,
        # each micro-batch's verl_F.masked_mean (core_algos.py:1340,1356), averaged over the micro-batches
        # (verl/workers/utils/losses.py:120: Metric.from_dict(pg_metrics, AggregationType.MEAN))
        metric_agg_mode="micro_batch_token_mean",
        loss_horizon=scale_factor if loss_agg_mode == "seq_mean_token_sum_norm" else None,
        # GRPO/RLOO: scores.unsqueeze(-1) * response_mask (core_algos.py:330,636); apply_kl_penalty: kld * mask
        masked_token_value="zero",
        # compute_gae_advantage_return ends in verl_F.masked_whiten (core_algos.py:264)
        normalize_advantages=estimator in ("gae", "gdpo"),
    )
    _estimator_inputs(r, est, fields)
    if mode in ("vanilla", "bypass_mode"):
        # bypass_mode with loss_type=ppo_clip is compute_policy_loss_vanilla on old_log_prob := the rollout
        # log-probs (core_algos.py:2528-2538; ray_trainer.py:1575-1579 overwrites old_log_probs with them, so the
        # bundle's old_log_probs are the rollout ones) and no importance weight (rollout_is_weights=None)
        if clip_c is None or clip_c <= 1.0:  # core_algos.py:1333-1336 asserts c > 1
            r.refuse(f"{ACTOR}.clip_ratio_c", clip_c, "verl requires a dual-clip constant > 1")
        fields["eps_clip_c"] = clip_c
    elif mode in FAMILY_LOSS_MODES:
        _family(r, fields, mode, clip_c)
    else:
        # GSPO (0.9.1 core_algos.py:1545-1619): one ratio per sample, its log clamped at max 10 (one-sided; ours is
        # symmetric: the two differ only where a sample's mean log-ratio is below −10), no dual-clip, and the
        # policy term aggregated with the configured loss_agg_mode (core_algos.py:1601-1605).
        fields.update(importance_level="sequence", log_ratio_clamp=10.0, eps_clip_c=None)
        r.neutral(f"{ACTOR}.clip_ratio_c")
    geo_micro = fields.pop("geo_micro", None)
    if geo_micro is not None:  # GMPO: torch.mean over the micro-batch's sequences (core_algos.py:1999)
        fields["loss_seq_count"] = geo_micro
        if loss_agg_mode not in ("token_mean", "token_sum"):
            r.refuse(f"{ACTOR}.loss_agg_mode", agg, "GMPO's own mean is over the micro-batch; the entropy and KL "
                     "terms' seq-mean over the mini-batch is a second sequence count a bundle holds once")
    elif {fields["loss_agg_mode"], fields.get("entropy_agg_mode") or fields["loss_agg_mode"]} - {"token_mean",
                                                                                                 "token_sum"}:
        # the seq-mean modes divide by the nominal global batch size, ppo_mini_batch_size · rollout.n
        # (verl/trainer/ppo/ray_trainer.py:1352-1353,1362; core_algos.py:1181-1203), not by the valid samples
        mini = r.integer(f"{ACTOR}.ppo_mini_batch_size", 256)  # yaml:79
        fields["loss_seq_count"] = mini * fields["n_samples_per_prompt"]
    _kl_in_reward(r, fields)
    _distillation(r, fields)
    _rollout_correction(r, fields, bypass=mode == "bypass_mode", clip_c=clip_c)
    if mode == "geo_mean" and fields.get("is_level"):
        r.refuse(f"{RC}.rollout_is", fields["is_level"], "GMPO weighs each sample by the geometric mean of its "
                 "rollout weights (core_algos.py:1989-1996): not recomputed")
    if r.flag(f"{ALGO}.use_pf_ppo", False):  # yaml:880
        r.refuse(f"{ALGO}.use_pf_ppo", True, "PF-PPO's sample reweighting is not recomputed")
    r.neutral(f"{ALGO}.pf_ppo")
    r.neutral(*(f"{ALGO}.{k}" for k in ALGO_NEUTRAL), *(f"{ACTOR}.{k}" for k in ACTOR_NEUTRAL),
              *(f"{ACTOR}.policy_loss.{k}" for k in POLICY_LOSS_OTHER_MODES))
    # yaml:87-88: only the sapo loss reads them (core_algos.py:1653-1654; read by _family under sapo)
    r.neutral(f"{ACTOR}.tau_pos", f"{ACTOR}.tau_neg")
    r.check_unknown([ALGO, ACTOR])
    return r.build(fields)


# verl's distillation estimators (trainer/distillation/losses.py:379-405 → core_algos.py kl_penalty_forward
# :2228-2245) → ours: its k3 / low_var_kl clamps the log-ratio at ±20 and the value at ±10, as our low_var_kl does
# (the input clamp changes nothing: beyond |r| = 20 the value is at its ±10 clamp either way)
DISTILLATION_KL = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "k3": "low_var_kl",
                   "low_var_kl": "low_var_kl"}
DIST = "distillation.distillation_loss"


def _distillation(r: ConfigReader, fields: dict[str, Any]) -> None:
    """On-policy distillation (``distillation.*``, config/distillation/distillation.yaml; 0.9.1
    trainer/distillation/losses.py:196-300): the supervised form — the policy loss plus ``distillation_loss_coef ·
    agg(clamp(estimate(student, teacher), ±loss_max_clamp))`` with the actor's ``loss_agg_mode`` — is recomputed
    (``opd_placement="loss"``, the ``teacher_log_probs`` payload); the policy-gradient form, the top-k forward KL
    and a run without the task rewards are refused by name."""
    if not r.flag("distillation.enabled", False):
        return
    mode = r.text(f"{DIST}.loss_mode", "k3")
    if mode == "forward_kl_topk":
        r.refuse(f"{DIST}.loss_mode", mode, "the top-k forward KL needs the teacher's top-k token ids and "
                                            "log-probs at every token ([Σ T, k], k = distillation_loss.topk) and "
                                            "the student's log-probs over them; a bundle records one teacher "
                                            "log-prob per token (teacher_log_probs)")
    if mode not in DISTILLATION_KL:
        r.refuse(f"{DIST}.loss_mode", mode, f"not one of {', '.join(DISTILLATION_KL)}, forward_kl_topk")
    if r.flag(f"{DIST}.use_policy_gradient", False):
        r.refuse(f"{DIST}.use_policy_gradient", True, "the distillation loss as a second policy loss with "
                                                      "advantages −KL (losses.py:272-293) is not recomputed")
    if not r.flag(f"{DIST}.use_task_rewards", True):
        r.refuse(f"{DIST}.use_task_rewards", False, "without the task rewards the policy term is dropped "
                                                    "(losses.py:214-219): the loss is the distillation term alone, "
                                                    "which the replay does not separate from pg_loss")
    clamp = r.number(f"{DIST}.loss_max_clamp", None)
    fields.update(opd_placement="loss", opd_kl_type=DISTILLATION_KL[mode],
                  opd_coef=r.number(f"{DIST}.distillation_loss_coef", 1.0), opd_clamp=clamp)


def _estimator_inputs(r: ConfigReader, est: str, fields: dict[str, Any]) -> None:
    """The knobs of the estimators with their own reward.post_process rule (SPEC §4.2).

    * ``grpo_passk`` reads ``norm_adv_by_std_in_grpo`` from the config (core_algos.py:497);
    * ``remax``: ``returns − reward_baselines·mask`` with no discount (core_algos.py:764-766): γ = 1;
    * ``gdpo``: each ``gdpo_reward_keys`` component normalized by ``compute_grpo_outcome_advantage`` at its
      default ``norm_adv_by_std_in_grpo=True`` (compute_advantage passes none, ray_trainer.py:250-263), summed with
      ``gdpo_reward_weights`` (all 1 when unset) and ``masked_whiten``-ed over the response tokens
      (core_algos.py:447-468); verl asserts the keys are set (core_algos.py:413-417)."""
    if est == "remax":
        fields["gamma"] = 1.0
    if est != "gdpo":  # read only by GDPO
        r.neutral(f"{ALGO}.gdpo_reward_keys", f"{ALGO}.gdpo_reward_weights")
        return
    keys = r.raw(f"{ALGO}.gdpo_reward_keys", None)  # algorithm.py:672
    weights = r.raw(f"{ALGO}.gdpo_reward_weights", None)  # algorithm.py:673
    if not isinstance(keys, (list, tuple)) or not keys or not all(isinstance(k, str) for k in keys):
        r.bad(f"{ALGO}.gdpo_reward_keys", keys, "a non-empty list of reward component names (verl asserts it)")
    fields["grpo_std_normalization"] = True
    if weights is not None:
        if not isinstance(weights, (list, tuple)) or len(weights) != len(keys):
            r.bad(f"{ALGO}.gdpo_reward_weights", weights, f"{len(keys)} numbers, one per gdpo_reward_keys entry")
        try:
            fields["reward_component_weights"] = [float(w) for w in weights]
        except (TypeError, ValueError):
            r.bad(f"{ALGO}.gdpo_reward_weights", weights, "numbers")

# verl's loss modes that are a policy-loss family of ours (kernels/families), mode → family
FAMILY_LOSS_MODES = {"cispo": "cispo", "sapo": "sapo", "geo_mean": "geo_mean", "dppo_tv": "dppo_tv",
                     "dppo_kl": "dppo_kl", "dro": "dro", "gpg": "gpg", "kl_cov": "kl_cov", "clip_cov": "clip_cov"}
# loss modes refused, with what a bundle would need to record
REFUSED_LOSS_MODES: dict[str, str] = {}


def _family(r: ConfigReader, fields: dict[str, Any], mode: str, clip_c: Optional[float]) -> None:
    """A policy-loss family's fields (module doc): its parameters, and the aggregation the loss function forces."""
    params: dict[str, Any] = {}
    agg = fields["loss_agg_mode"]
    if mode == "sapo":
        params = {"tau_pos": r.number(f"{ACTOR}.tau_pos", 1.0), "tau_neg": r.number(f"{ACTOR}.tau_neg", 1.05)}
        # the pg term is seq-mean-token-mean whatever loss_agg_mode says; entropy and KL keep loss_agg_mode
        fields.update(loss_agg_mode="seq_mean_token_mean", entropy_agg_mode=agg, kl_loss_agg_mode=agg)
    elif mode in ("dppo_tv", "dppo_kl"):
        params = {"trunc": clip_c}  # config.get("clip_ratio_c", 20.0): the ActorConfig's 3.0 by default
    elif mode == "dro":
        beta = r.number(f"{ACTOR}.policy_loss.dro_beta", None)
        if beta is None or not beta > 0:  # core_algos.py:2030-2032 raises
            r.refuse(f"{ACTOR}.policy_loss.dro_beta", beta, "DRO needs a positive beta")
        params = {"beta": beta}
    elif mode == "kl_cov":  # core_algos.py:1883-1884: the config's values, else 0.0002 and 1.0
        params = {"kl_cov_ratio": r.number(f"{ACTOR}.policy_loss.kl_cov_ratio", 0.0002),  # yaml:97
                  "ppo_kl_coef": r.number(f"{ACTOR}.policy_loss.ppo_kl_coef", 0.1)}  # yaml:98
    elif mode == "clip_cov":  # core_algos.py:1788-1793: the config's values, else 0.0002, 1.0 and 5.0 (yaml:94-96);
        # the random draw is the bundle's clip_cov_mask payload (loss.policy refuses without it)
        params = {"clip_cov_ratio": r.number(f"{ACTOR}.policy_loss.clip_cov_ratio", 0.0002),
                  "clip_cov_lb": r.number(f"{ACTOR}.policy_loss.clip_cov_lb", 1.0),
                  "clip_cov_ub": r.number(f"{ACTOR}.policy_loss.clip_cov_ub", 5.0)}
    if mode in ("geo_mean", "dro", "gpg", "kl_cov", "clip_cov"):
        # no clamp of the log-ratio (core_algos.py:1973, 2034, 1731, 1797)
        fields["log_ratio_clamp"] = None
    if mode == "geo_mean":
        if r.flag(f"{ACTOR}.use_dynamic_bsz", False):
            r.refuse(f"{ACTOR}.use_dynamic_bsz", True, "GMPO's loss is a mean over each micro-batch's sequences: "
                     "dynamic micro-batches have no fixed size to divide by")
        micro = r.integer(f"{ACTOR}.ppo_micro_batch_size_per_gpu", None)
        if micro is None:
            r.refuse(f"{ACTOR}.ppo_micro_batch_size_per_gpu", None, "GMPO's loss is a mean over each micro-batch's "
                     "sequences: set the micro-batch size")
        fields.update(loss_agg_mode="seq_mean_token_sum", entropy_agg_mode=agg, kl_loss_agg_mode=agg,
                      geo_micro=micro)
    fields.update(policy_loss=FAMILY_LOSS_MODES[mode], policy_loss_params=params, eps_clip_c=None)
    r.neutral(f"{ACTOR}.clip_ratio_c")


def _kl_type(r: ConfigReader, path: str, name: str, active: bool) -> str:
    base = name[:-1] if name.endswith("+") else name
    if base in KL_TYPES:
        return KL_TYPES[base]
    if active:
        r.refuse(path, name, f"not mapped (one of {', '.join(KL_TYPES)})")
    return "k1"


def _kl_in_reward(r: ConfigReader, fields: dict[str, Any]) -> None:
    """``use_kl_in_reward``: the score minus ``kl_coef·Σ_t kl_t`` is what the group normalizes
    (verl/trainer/ppo/ray_trainer.py:78-112 apply_kl_penalty, then core_algos.py:304)."""
    on = r.flag(f"{ALGO}.use_kl_in_reward", False)  # yaml:872
    name = r.text(f"{ALGO}.kl_penalty", "kl")  # yaml:873
    ctrl = r.text(f"{ALGO}.kl_ctrl.type", "fixed")  # yaml:876
    coef = r.number(f"{ALGO}.kl_ctrl.kl_coef", 0.001)  # yaml:877
    if not on:
        return
    if ctrl not in ("fixed", "adaptive"):  # get_kl_controller raises NotImplementedError (core_algos.py:193-212)
        r.refuse(f"{ALGO}.kl_ctrl.type", ctrl, "not one of fixed, adaptive")
    if ctrl == "adaptive":
        r.note(f"{ALGO}.kl_ctrl.type=adaptive: a bundle's kl_coef must be its step's coefficient (the controller's "
               f"value, logged as actor/reward_kl_penalty_coeff); {coef!r} from the file is its start, right at the "
               "first step only")
    # adaptive (core_algos.py:153-174 AdaptiveKLController): the coefficient a step applies is the controller's
    # value at that step (apply_kl_penalty's beta, ray_trainer.py:78-112, logged as actor/reward_kl_penalty_coeff),
    # updated after it; the config holds only its start. The bundle records the step's value at
    # algorithm.kl_ctrl.kl_coef (the capture writes it there), which the replay applies as a fixed coefficient.
    kl_type = _kl_type(r, f"{ALGO}.kl_penalty", name, coef != 0)
    est = fields["advantage_estimator"]
    if est == "gdpo":  # GDPO reads the components, not token_level_rewards (core_algos.py:408-430): no KL
        return
    # ReMax and REINFORCE++ take the reverse (discounted) sums of the per-token rewards (core_algos.py:715-727,
    # 764): the KL per token, not summed into the score
    form = "token_returns" if est in ("remax", "reinforce_plus_plus") else "sequence"
    fields.update(kl_in_reward=form, kl_coef=coef, kl_penalty_type=kl_type)


def _rollout_correction(r: ConfigReader, fields: dict[str, Any], *, bypass: bool = False,
                        clip_c: Optional[float] = None) -> None:
    """``algorithm.rollout_correction`` (rollout_corr.py:522-657): token or sequence weights
    ``exp(clamp(Δ, ±20))`` (SAFETY_BOUND, rollout_corr.py:75), TIS ``min(w, C)`` for a number, IcePop
    ``w·1[lo ≤ w ≤ hi]`` for a ``"lo_hi"`` string (rollout_corr.py:93-129), divided by their batch mean under
    ``rollout_is_batch_normalize`` (the step's recorded ``rollout_is_batch_norm_factor``: verl takes it over the
    whole batch, across DP, rollout_corr.py:627-655). In bypass mode the PPO-clip loss takes no weight
    (core_algos.py:2530-2538: ``rollout_is_weights=None``): ``rollout_is`` is read, not applied."""
    level = r.raw(f"{RC}.rollout_is", None)  # yaml:854
    threshold = r.raw(f"{RC}.rollout_is_threshold", 2.0)  # yaml:855
    rs = r.raw(f"{RC}.rollout_rs", None)  # yaml:856
    rs_threshold = r.raw(f"{RC}.rollout_rs_threshold", None)  # yaml:857 (only with rollout_rs)
    if rs:  # rejection sampling (rollout_corr_helper.py:197-413): the rejected tokens leave the loss mask
        from ..bundle.rollout_rs import parse_rollout_rs

        if not isinstance(rs, str) or (rs_threshold is not None and not isinstance(rs_threshold, (str, int, float))):
            r.bad(f"{RC}.rollout_rs", rs, "a comma-separated chain of rejection options with rollout_rs_threshold")
        try:
            parse_rollout_rs(rs, rs_threshold)
        except ValueError as exc:
            knob, _, detail = str(exc).partition(": ")
            r.bad(f"{RC}.{knob}", rs if knob == "rollout_rs" else rs_threshold, detail.removeprefix("expected "))
        fields.update(rollout_rs=rs, rollout_rs_threshold=rs_threshold if isinstance(rs_threshold, str)
                      else float(rs_threshold))
    loss_type = r.text(f"{RC}.loss_type", "ppo_clip")  # yaml:859
    if loss_type not in ("ppo_clip", "reinforce"):  # core_algos.py:2539-2540 raises
        r.refuse(f"{RC}.loss_type", loss_type, "not one of ppo_clip, reinforce")
    batch_norm = r.flag(f"{RC}.rollout_is_batch_normalize", False)  # yaml:860
    reinforce = bypass and loss_type == "reinforce"
    if bypass and (rs or reinforce):
        # bypass_mode computes the correction inside the loss (core_algos.py:2489-2502), from the current
        # log-probs against the rollout ones: old_log_prob=log_prob, rollout_log_prob=old_log_prob (= rollout)
        fields["rollout_correction_anchor"] = "current"
    if reinforce:
        # compute_policy_loss_reinforce (core_algos.py:2333-2410): pg = −A·logp·w, no ratio, no clip (GPG's
        # term), w the detached weight of log_prob − rollout (None without rollout_is: pg = −A·logp)
        fields.update(policy_loss="gpg", log_ratio_clamp=None, eps_clip_c=None)
        if batch_norm and level is not None:
            r.refuse(f"{RC}.rollout_is_batch_normalize", True, "in bypass mode verl normalizes each micro-batch "
                     "inside the loss (one factor per micro-batch, all-reduced over DP): not recorded per micro-batch")
    if level is None or (bypass and not reinforce):
        return
    if level not in ("token", "sequence"):
        r.refuse(f"{RC}.rollout_is", level, "not one of token, sequence")
    if batch_norm:  # divided by the step's mean (rollout_corr.py:627-655): recorded per step as is_batch_norm_factor
        fields["is_batch_normalize"] = True
    low: Optional[float] = None
    if isinstance(threshold, str) and "_" in threshold:
        lo, _, hi = threshold.partition("_")
        try:
            low, high = float(lo), float(hi)
        except ValueError:
            r.bad(f"{RC}.rollout_is_threshold", threshold, "a number or a 'low_high' string")
        mode = "mask"
    else:
        high = r.number(f"{RC}.rollout_is_threshold", 2.0)
        mode = "truncate"
    fields.update(is_level=level, is_mode=mode, is_low=low, is_high=high, is_log_clamp=20.0)
