"""NeMo-RL's GRPO configuration (the ``grpo:`` and ``loss_fn:`` sections of its YAML) → ``RecomputeConfig``.

Source read: NVIDIA-NeMo/RL @ 7ea279abfbeb (2026-08-22). ``yaml`` below is ``examples/configs/grpo_math_1B.yaml``
(the base nearly every GRPO recipe inherits), ``loss.py`` is ``nemo_rl/algorithms/loss/loss_functions.py``
(``ClippedPGLossConfig``, whose defaults equal the YAML's), ``adv.py`` is
``nemo_rl/algorithms/advantage_estimator.py``, ``utils.py`` is ``nemo_rl/algorithms/utils.py``.

GRPO here is a leave-one-out baseline and the leave-one-out Bessel std over the other samples of the prompt,
divided only where that std is > 0 (``adv.py:82-98``; ``utils.py:104-198``); a prompt with one valid sample gets
baseline = reward, so advantage 0 (``utils.py:156-159``).

Not encoded (per-step values): ``global_valid_toks`` / ``global_valid_seqs``, the all-reduced denominators of
the loss (``loss.py:673-692``).
"""

from __future__ import annotations

from typing import Any, Optional

from ..bundle.schema import RecomputeConfig
from ._base import ConfigReader

FRAMEWORK = "nemo-rl"
G = "grpo"
L = "loss_fn"
# grpo.* keys outside the recomputed math: schedule, validation, rollout turns, dynamic sampling (chooses the
# groups a step trains on), overlong filtering and the logprob-error mask (both change masks the bundle holds).
GRPO_NEUTRAL = ("num_prompts_per_step", "max_rollout_turns", "max_num_epochs", "max_num_steps", "val_period",
                "val_start_at", "val_at_start", "val_at_end", "max_val_samples", "val_num_generations_per_prompt",
                "stop_at_validation_metric", "stop_at_validation_threshold", "val_batch_size", "seed",
                "use_dynamic_sampling", "dynamic_sampling_max_gen_batches", "batch_multiplier", "async_grpo",
                "overlong_filtering", "seq_logprob_error_threshold", "reward_shaping.overlong_buffer_length",
                "reward_shaping.overlong_buffer_penalty", "reward_shaping.max_response_length",
                "reward_shaping.stop_properly_penalty_coef", "reward_scaling.source_min", "reward_scaling.source_max",
                "reward_scaling.target_min", "reward_scaling.target_max", "adv_estimator.minus_baseline",
                "adv_estimator.reward_weights", "skip_reference_policy_logprobs_calculation")


def from_nemo_rl(cfg: Any, *, where: Optional[str] = None) -> RecomputeConfig:
    """The ``RecomputeConfig`` NeMo-RL's master config ``cfg`` (with ``grpo`` and ``loss_fn``) encodes."""
    r = ConfigReader(FRAMEWORK, cfg, where)
    name = r.text(f"{G}.adv_estimator.name", "grpo")  # yaml:40; adv.py:47
    if name not in ("grpo", "reinforce_plus_plus", "gdpo", "opd"):
        r.refuse(f"{G}.adv_estimator.name", name, "not mapped (grpo, reinforce_plus_plus, gdpo and opd are)")
    kl_in_reward = r.flag(f"{L}.use_kl_in_reward", False)  # loss.py:135
    normalize = r.flag(f"{G}.normalize_rewards", True)  # yaml:8
    loo = r.flag(f"{G}.use_leave_one_out_baseline", True)  # yaml:9
    # the estimator's own copies interpolate the two above (yaml:41-42; adv.py:49-50)
    normalize = r.flag(f"{G}.adv_estimator.normalize_rewards", normalize)
    loo = r.flag(f"{G}.adv_estimator.use_leave_one_out_baseline", loo)
    for key in ("advantage_clip_low", "advantage_clip_high", "invalid_tool_call_advantage",
                "malformed_thinking_advantage"):  # yaml:15-16,52,54: null
        value = r.raw(f"{G}.{key}", None)
        if value is not None:
            r.refuse(f"{G}.{key}", value, "NeMo-RL's advantage clipping and penalties are not recomputed")
    for key in ("reward_shaping.enabled", "reward_scaling.enabled"):  # yaml:31,45: false
        if r.flag(f"{G}.{key}", False):
            r.refuse(f"{G}.{key}", True, "reward shaping and scaling are not recomputed")
    # CISPO (loss_functions.py, ClippedPGLossFn ``if self.use_cispo``): −A·sg(clamp(r, 1 − ratio_clip_min,
    # 1 + ratio_clip_max))·logp on the unclamped token ratio; NeMo-RL asserts it without dual-clip and without
    # sequence-level ratios
    cispo = r.flag(f"{L}.use_cispo", False)  # loss.py:160
    if cispo and r.number(f"{L}.ratio_clip_c", None) is not None:
        r.refuse(f"{L}.ratio_clip_c", r.number(f"{L}.ratio_clip_c", None), "NeMo-RL rejects dual-clip with use_cispo")
    # force_on_policy_ratio (loss.py:158): prev_logprobs := the current log-probs, detached (loss.py:399-402), so
    # the ratio is 1 and unclipped (520-525) and the IS weight exp(curr − gen); the step's prev_logprobs are a
    # zero placeholder (grpo.py:2493-2510, 3238-3249), which the loss then never reads
    force = r.flag(f"{L}.force_on_policy_ratio", False)
    # disable_ppo_ratio (loss.py:113): ratios := curr_logprobs, unclamped (loss.py:540-543), so
    # max(−A·logp, −A·logp) = −A·logp: the GPG surrogate (kernels.families.gpg), the IS weight still exp(prev − gen)
    reinforce = r.flag(f"{L}.disable_ppo_ratio", False) and not force  # force's branch comes first (loss.py:520)
    for flag, on in (("force_on_policy_ratio", force), ("disable_ppo_ratio", reinforce)):
        if on and cispo:  # ClippedPGLossFn.__init__ asserts both (loss.py:271-279)
            r.bad(f"{L}.{flag}", True, f"use_cispo false with it (NeMo-RL asserts use_cispo is incompatible with "
                                       f"{flag}, loss/loss_functions.py:271-279)")
    nll = r.number(f"{L}.positive_example_nll_weight", 0.0)  # loss.py:164
    if nll != 0:
        r.refuse(f"{L}.positive_example_nll_weight", nll, "NeMo-RL adds μ × the mean of −log π over the loss "
                 "tokens of the samples whose reward is > 0, each micro-batch divided by its own count of those "
                 "tokens (loss_functions.py:720-735), to loss; not recomputed: a bundle would need each sample's "
                 "raw reward and micro_batch_id with an NLL loss term, and the term recorded apart in loss.policy")
    kl_coef = r.number(f"{L}.reference_policy_kl_penalty", 0.01)  # loss.py:128; yaml:80
    if kl_in_reward:
        # the loss's KL coefficient is 0 (loss.py:240-242); the GRPO estimator never reads the KL (adv.py:69-98),
        # REINFORCE++ subtracts β·kl at each token of the broadcast advantage before whitening (adv.py:248-259)
        if name == "reinforce_plus_plus" and kl_coef != 0:
            r.refuse(f"{L}.use_kl_in_reward", True, "NeMo-RL's REINFORCE++ subtracts reference_policy_kl_penalty × "
                     "calculate_kl(prev_logprobs, reference) at each token of the broadcast advantage, without "
                     "a discounted sum, before whitening (advantage_estimator.py:248-265); not recomputed: a bundle "
                     "would need a per-token in-reward KL mode (no returns), or the KL-shaped advantages recorded "
                     "with reference_policy_kl_penalty 0")
        kl_coef = 0.0
    # use_on_policy_kl_approximation (loss.py:153): the KL × exp(curr − generation_logprobs), NaN/±inf → 0, inside
    # calculate_kl: after the input clamp, before the output clamp (loss.py:469-491; utils.py:72-101)
    kl_rollout = r.flag(f"{L}.use_on_policy_kl_approximation", False) and kl_coef != 0
    kl_type = r.text(f"{L}.reference_policy_kl_type", "k3")  # loss.py:131; yaml:83
    if kl_type not in ("k1", "k2", "k3") and kl_coef != 0:
        r.refuse(f"{L}.reference_policy_kl_type", kl_type, "not one of k1, k2, k3")
    token_level = r.flag(f"{L}.token_level_loss", True)  # loss.py:114; yaml:102
    # GSPO: exp of the masked mean log-ratio of the sample, unclamped, then clipped like the token ratio
    # (loss.py:526-541); the IS weight becomes exp(Σ_t (prev − gen)·mask) of the sample (loss.py:568-576)
    sequence_ratio = r.flag(f"{L}.sequence_level_importance_ratios", False)  # loss.py:119
    if sequence_ratio and token_level:
        r.bad(f"{L}.sequence_level_importance_ratios", True, "token_level_loss false with it (NeMo-RL asserts "
              "sequence-level ratios are exclusive with the token-level loss, loss/loss_functions.py:265-268)")
    fields: dict[str, Any] = dict(
        advantage_estimator="grpo",
        n_samples_per_prompt=r.integer(f"{G}.num_generations_per_prompt", 16),  # yaml:4
        grpo_std_normalization=normalize,
        group_baseline="leave_one_out" if loo else "mean",  # adv.py:82-88
        importance_level="sequence" if sequence_ratio else "token",
        grpo_std_eps=1e-6,  # adv.py:92
        grpo_std_unbiased=True,  # utils.py:189-196: × num_valid / (num_valid − 1)
        std_zero="skip",  # adv.py:93-96: divide only where std > 0
        singleton_group="zero",  # utils.py:156-159
        eps_clip=r.number(f"{L}.ratio_clip_min", 0.2),  # loss.py:122; yaml:86
        eps_clip_high=r.number(f"{L}.ratio_clip_max", 0.2),  # loss.py:123; yaml:87
        eps_clip_c=r.number(f"{L}.ratio_clip_c", None),  # loss.py:125; yaml:88
        log_ratio_clamp=None,  # loss.py:527: curr − prev exponentiated unclamped
        use_kl_loss=kl_coef != 0,
        kl_loss_coef=kl_coef,
        kl_loss_type=kl_type if kl_type in ("k1", "k2", "k3") else "k1",
        # utils.py:72-99 clamps the log-ratio and the estimate for every type
        kl_loss_input_clamp=r.number(f"{L}.kl_input_clamp_value", 20.0),  # loss.py:132; yaml:84
        kl_loss_output_clamp=r.number(f"{L}.kl_output_clamp_value", 10.0),  # loss.py:133; yaml:85
        loss_agg_mode="token_mean" if token_level else "seq_mean_token_mean",  # loss.py:506-515, 678-692
        # adv.py:98: advantages.expand(mask.shape), never × the mask: a tool span holds the sample's value
        masked_token_value="computed",
        entropy_coef=0.0,  # NeMo-RL's entropy is a metric only
    )
    if force:
        fields.update(force_on_policy_ratio=True)
    if kl_rollout:
        fields.update(kl_loss_rollout_weighted=True)
    elif kl_coef != 0:  # loss.py:487-490: exp(curr − curr.detach()): value 1, the score function's gradient (#2506)
        fields.update(kl_loss_score_function=True)
    if reinforce:
        if r.number(f"{L}.ratio_clip_c", None) is not None:
            r.refuse(f"{L}.ratio_clip_c", r.number(f"{L}.ratio_clip_c", None), "NeMo-RL dual-clips −A·logp under "
                     "disable_ppo_ratio (loss.py:555-563), which the GPG surrogate does not: not recomputed; a "
                     "bundle would need a dual-clip parameter on the gpg family")
        # with sequence_level_importance_ratios the surrogate stays −A·logp per token (the ratio branch is skipped,
        # loss.py:520-543); only the IS weight is the sample's (loss.py:568-576, _importance below)
        fields.update(policy_loss="gpg", policy_loss_params={}, importance_level="token")
    if name == "reinforce_plus_plus":
        # adv.py:233-265: r − the prompt's mean (minus_baseline, no std, no leave-one-out; one sample: 0) or r,
        # broadcast (never × the mask), whitened over the mask's tokens: mean over Σmask, the biased variance,
        # rsqrt(max(var, 1e-8))
        fields.update(advantage_estimator="reinforce_plus_plus_baseline", grpo_std_normalization=False,
                      group_baseline="mean", whiten_variance="biased", whiten_eps_mode="clamp",
                      rewards_normalization=r.flag(f"{G}.adv_estimator.minus_baseline", True))  # adv.py:54
    if name == "opd":
        # adv.py:551-600 OPDAdvantageEstimator: sg(teacher − prev)·mask — no reward, no baseline; the distillation
        # estimate k1(prev − teacher) subtracted from 0 (kernels.loss.opd_advantages), 0 at mask-0 tokens; the
        # step's teacher log-probs padded with 0 to the train width (grpo.py:2227-2246)
        fields.update(opd_placement="advantage", opd_kl_type="k1", opd_coef=1.0, opd_clamp=None, opd_base="zero",
                      masked_token_value="zero")
    if name == "gdpo":
        # adv.py:116-190: each reward/<name> component (sorted by name) by the GRPO rule above (its baseline and
        # std, divided only where std > 0), Σ w·A (reward_weights, all 1 when unset), then (A − mean)/std over the
        # step's samples (torch.std, unbiased; centred only where it is 0), broadcast unmasked; the samples'
        # reward_components record the components in that order
        weights = r.raw(f"{G}.adv_estimator.reward_weights", None)  # adv.py:52
        fields.update(advantage_estimator="gdpo", reward_components_standardize=True)
        if weights is not None:
            if not isinstance(weights, (list, tuple)) or not all(
                    isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights):
                r.bad(f"{G}.adv_estimator.reward_weights", weights, "a list of numbers, one per reward component")
            fields["reward_component_weights"] = [float(w) for w in weights]
    if cispo:
        if sequence_ratio:
            r.refuse(f"{L}.sequence_level_importance_ratios", True, "NeMo-RL rejects sequence-level ratios with "
                                                                    "use_cispo")
        fields.update(policy_loss="cispo", policy_loss_params={})
    _importance(r, fields, sequence_ratio)
    r.neutral(*(f"{G}.{k}" for k in GRPO_NEUTRAL))
    r.check_unknown([G, L])
    return r.build(fields)


def _importance(r: ConfigReader, fields: dict[str, Any], sequence_ratio: bool) -> None:
    """``use_importance_sampling_correction``: ``w = exp(prev − gen)`` per token, untruncated, or ``tis``
    (clamp to [min (default 0), max]) / ``icepop`` (zero outside [min, max]) (loss.py:137-149, 564-676)."""
    on = r.flag(f"{L}.use_importance_sampling_correction", False)  # loss.py:140; yaml:93
    kind = r.raw(f"{L}.truncated_importance_sampling_type", None)  # loss.py:146; yaml:97
    high = r.number(f"{L}.truncated_importance_sampling_ratio", None)  # loss.py:147; yaml:98
    low = r.number(f"{L}.truncated_importance_sampling_ratio_min", None)  # loss.py:149; yaml:100
    if not on:
        return
    level = "sequence" if sequence_ratio else "token"
    if kind is None:
        fields.update(is_level=level, is_mode="truncate", is_low=None, is_high=None)
    elif kind == "tis":
        fields.update(is_level=level, is_mode="truncate", is_low=0.0 if low is None else low, is_high=high)
    elif kind == "icepop":
        fields.update(is_level=level, is_mode="mask", is_low=low, is_high=high)
    elif kind == "seq-mask-tis":
        # loss.py:637-665: each token's own untruncated weight exp(prev − gen), × 0 for the whole sample where the
        # geometric mean exp(mean_t(prev − gen)) over its token mask is outside [ratio_min, ratio] (both kept at
        # the bound): the token weight with is_keep's geometric sequence mask (bundle/is_keep.py). NeMo-RL asserts
        # ratio_min set and token-level ratios (loss.py:315-324)
        if low is None:
            r.bad(f"{L}.truncated_importance_sampling_ratio_min", None, "a value with seq-mask-tis (NeMo-RL asserts "
                  "it, loss/loss_functions.py:315-319)")
        if sequence_ratio:
            r.bad(f"{L}.sequence_level_importance_ratios", True, "false with seq-mask-tis (NeMo-RL asserts it, "
                  "loss/loss_functions.py:320-324)")
        # a geometric mean is > 0: a ratio_min ≤ 0 bounds nothing (is_keep's null side)
        fields.update(is_level="token", is_mode="truncate", is_low=None, is_high=None,
                      is_keep={"geometric": [low if low > 0 else None, high]})
    else:
        r.refuse(f"{L}.truncated_importance_sampling_type", kind, "not mapped (tis, icepop and seq-mask-tis are)")
