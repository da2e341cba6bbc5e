"""OpenRLHF's ``train_ppo_ray`` arguments → ``RecomputeConfig``.

Version followed: OpenRLHF 0.11.2 (the PyPI release). ``cli.py`` below is ``openrlhf/cli/train_ppo_ray.py``,
``exp.py`` is ``openrlhf/trainer/ppo_utils/experience_maker.py``, ``loss.py`` is ``openrlhf/models/loss.py``,
``utils.py`` is ``openrlhf/models/utils.py``, ``actor.py`` is ``openrlhf/trainer/ray/ppo_actor.py`` (line numbers
of 0.11.2).

``args`` is the hierarchized namespace (``args.algo.kl.init_coef``, what ``cli.py:627-630`` builds), a nested
dict, or a flat dict of the dotted flag names (``{"algo.kl.init_coef": 0.01}``, as argparse stores them).

What OpenRLHF computes, and how it maps:

* Advantages are built from per-token rewards ``r_t = mask_t·(1[t = last]·g_i − β·kl_t)`` (``utils.py:131-160``
  ``compute_reward``, ``exp.py:283-290``): ``kl_in_reward="token_returns"`` whatever β (0 when the KL is off or in
  the loss). ``gae`` (the default) runs GAE over them with the critic's values (``exp.py:292-299``,
  ``get_advantages_and_returns`` ``exp.py:343-388``): values and rewards × the action mask, the recursion over
  every token (``gae_masked_tokens="zeroed"``), γ and λ as configured. Every other estimator takes their
  cumulative returns (``exp.py:300-317``, ``get_cumulative_returns`` ``exp.py:390-421``), γ forced to 1 except
  for ``reinforce``, so a masked tail and a fully masked sample get 0, as OpenRLHF writes them.
* ``gae``, ``reinforce`` and ``reinforce_baseline`` are then whitened over the step's loss tokens
  (``exp.py:324-338``): the plain masked mean, the biased variance floored at 1e-8 (``var.clamp(min=1e-8)
  .rsqrt()``) → ``normalize_advantages``, ``whiten_variance="biased"``, ``whiten_eps_mode="clamp"``; with
  ``algo.advantage.no_std_norm`` only the mean is taken out (``whiten_variance="none"``).
* ``g_i``: the group-normalized reward (``exp.py:268-278``), clamped to ``reward.clip_range`` (default ±10,
  ``cli.py:474``; ``utils.py:141-142``) → ``reward_clip_low/high``.
* The in-reward KL (``init_coef > 0`` and not ``use_loss``, ``exp.py:205-214``): ``compute_approx_kl``'s k1/k2/k3
  value clamped at ±10 (``utils.py:69-130``, ``:113``) → ``kl_penalty_type`` + ``kl_penalty_clamp=10`` (k3's input clamp
  at −10 cannot change a value the ±10 output clamp keeps).
* The loss (``loss.py:116-259`` ``PolicyLoss``, built at ``actor.py:76-86``): ``actor.loss_agg_mode``
  token-mean / seq-mean-token-mean (GSPO is always per sample, ``loss.py:151-152``); the KL and entropy terms
  are always token means (``aggregate_loss``'s default, ``actor.py:331,347``); ``ppo_kl`` and ``clip_ratio``
  are each micro-batch's token mean (``loss.py:257-258``) weighted by its tokens (``actor.py:197-219``): the
  step's token mean, whatever the loss's mode.
"""

from __future__ import annotations

from typing import Any, Optional

from ..bundle.schema import RecomputeConfig
from ._base import ConfigReader, framework_version

FRAMEWORK = "openrlhf"
VERSIONS = ("0.11.2",)  # oldest first
# exp.py:262-278 (the baselines), 292-317 (GAE or the cumulative returns)
ESTIMATORS = {"group_norm": "grpo", "dr_grpo": "dr_grpo", "rloo": "rloo", "gae": "gae",
              "reinforce": "reinforce_plus_plus", "reinforce_baseline": "reinforce_plus_plus_baseline"}
WHITENED = ("gae", "reinforce", "reinforce_baseline")  # exp.py:324-338
AGG_MODES = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean"}  # cli.py:440-447
KL_CLAMP = 10.0  # utils.py:113
# Sections outside the recomputed math: engines, models, data, checkpoints, logging, optimizers.
SECTIONS = ("actor", "algo", "reward")
NEUTRAL = ("actor.model_name_or_path", "actor.optim", "actor.muon", "actor.adam", "actor.lr_scheduler",
           "actor.lr_warmup_ratio", "actor.min_lr_ratio", "actor.max_norm", "actor.aux_loss_coef",
           "actor.num_nodes", "actor.num_gpus_per_node", "actor.gradient_checkpointing_enable",
           "actor.gradient_checkpointing_reentrant", "actor.freezing_steps", "actor.freeze_visual_encoder",
           "reward.num_nodes", "reward.num_gpus_per_node", "reward.model_name_or_path", "reward.remote_url",
           "reward.offload", "reward.overlong_penalty_factor", "algo.kl.horizon",
           "algo.dynamic_filtering_enable", "algo.dynamic_filtering_range")


def from_openrlhf(args: Any, *, where: Optional[str] = None, version: Optional[str] = None) -> RecomputeConfig:
    """The ``RecomputeConfig`` OpenRLHF's arguments ``args`` encode (see the module docstring); ``version``:
    the OpenRLHF version the bundle records (None: the newest known)."""
    framework_version(FRAMEWORK, version, VERSIONS, where)
    r = ConfigReader(FRAMEWORK, args, where)
    est = r.text("algo.advantage.estimator", "gae")  # cli.py:514-522
    n = r.integer("rollout.n_samples_per_prompt", 1)  # cli.py:432-434
    # the reward model's (and the critic's) own output normalization, (x − mean)/std inside their forward
    # (models/model.py:237-238, 309-310; launcher.py:164, ppo_critic.py:196): the bundle records their outputs
    # (raw_reward, the values payload) after it, so nothing is left to recompute
    r.flag("reward.normalize_enable", False)  # cli.py:414-416
    shaping = _length_penalties(r)
    loss_type = r.text("actor.policy_loss_type", "ppo")  # cli.py:439
    if loss_type not in ("ppo", "gspo"):
        r.refuse("actor.policy_loss_type", loss_type, "not one of ppo, gspo")
    agg = r.text("actor.loss_agg_mode", "token-mean")  # cli.py:440-447
    if agg not in AGG_MODES:
        r.refuse("actor.loss_agg_mode", agg, f"not one of {', '.join(AGG_MODES)}")
    eps = r.number("actor.eps_clip", 0.2)  # cli.py:406
    low_high = r.raw("actor.eps_clip_low_high", None)  # cli.py:407; None → (eps, eps) (cli.py:633-634)
    if low_high is None:
        eps_low, eps_high = eps, eps
    elif isinstance(low_high, (list, tuple)) and len(low_high) == 2:
        eps_low = r.number("actor.eps_clip_low_high.0", low_high[0])
        eps_high = r.number("actor.eps_clip_low_high.1", low_high[1])
    else:
        r.bad("actor.eps_clip_low_high", low_high, "two numbers [low, high]")
    entropy = r.number("actor.entropy_coef", None)  # cli.py:468-473: None = not computed
    gamma = r.number("algo.advantage.gamma", 1.0)  # cli.py:411; forced to 1 but for gae, reinforce (exp.py:308-310)
    lam = r.number("algo.advantage.lambd", 1.0)  # cli.py:410: GAE only
    no_std = r.flag("algo.advantage.no_std_norm", False)  # cli.py:526-531: the whitened estimators only
    if est == "flash_reinforce":
        r.refuse("algo.advantage.estimator", est, "its baseline is the mean reward of the whole rollout batch "
                 "(experience_maker.py:273-276), which a bundle of one optimizer step does not hold; record "
                 "the centred reward as each sample's normalized reward, or every sample of the rollout batch "
                 "in one bundle under one group_index, and map it as dr_grpo")
    if est not in ESTIMATORS:
        r.refuse("algo.advantage.estimator", est, f"not mapped ({', '.join(ESTIMATORS)} are)")
    fields: dict[str, Any] = dict(
        advantage_estimator=ESTIMATORS[est],
        n_samples_per_prompt=n,
        grpo_std_normalization=est == "group_norm",
        grpo_std_eps=1e-9,  # exp.py:274
        grpo_std_unbiased=True,  # exp.py:274: torch.std
        group_baseline="leave_one_out" if est == "rloo" else "mean",  # exp.py:268-272
        kl_in_reward="token_returns",  # exp.py:283-317: GAE or cumulative returns of compute_reward's rewards
        gamma=gamma if est in ("gae", "reinforce") else 1.0,  # exp.py:308-310
        eps_clip=eps_low,
        eps_clip_high=eps_high,
        eps_clip_c=r.number("actor.dual_clip", None),  # cli.py:408; loss.py:203-214
        entropy_coef=0.0 if entropy is None else entropy,
        entropy_agg_mode="token_mean",  # actor.py:346-351: aggregate_loss's token mean
        loss_agg_mode=AGG_MODES[agg],  # actor.py:80; loss.py:11-39
        metric_agg_mode="token_mean",  # loss.py:257-258, actor.py:200-219 (whatever the loss's mode)
    )
    if est == "gae":  # exp.py:292-299, 343-388
        fields.update(lam=lam, gae_masked_tokens="zeroed")
    if est in WHITENED:  # exp.py:324-338
        fields.update(normalize_advantages=True, whiten_variance="none" if no_std else "biased",
                      whiten_eps_mode="clamp")
    if loss_type == "ppo":
        fields["log_ratio_clamp"] = 20.0  # loss.py:187
    else:  # GSPO: per-sample ratio exp(mean Δ), unclamped, per-sample aggregation (loss.py:151-152,188-197)
        fields.update(importance_level="sequence", log_ratio_clamp=None, loss_agg_mode="seq_mean_token_mean")
    _kl(r, fields)
    _is_correction(r, fields, loss_type)
    _reward_clip(r, fields)
    r.neutral(*NEUTRAL)
    r.check_unknown(SECTIONS)
    fields.update(shaping)
    return r.build(fields)


def _length_penalties(r: ConfigReader) -> dict[str, Any]:
    """``apply_length_penalties`` (trainer/ppo_utils/length_penalty.py:109-145, called before the group baselines,
    experience_maker.py:246-247): the DAPO overlong penalty against ``rollout.max_new_tokens`` (or
    ``data.max_len`` when unset, :127), then the ProRL stop-properly penalty on the samples the bundle records
    ``truncated`` (finish_reason "length"); OpenRLHF asserts ``max_new_tokens >= overlong_buffer_len`` (:37-39) and a
    coefficient in [0, 1] or negative (:83-86)."""
    out: dict[str, Any] = {}
    buffer = r.number("reward.overlong_buffer_len", None)  # cli.py:532-534
    factor = r.number("reward.overlong_penalty_factor", 1.0)  # cli.py:535
    coef = r.number("reward.stop_properly_penalty_coef", None)  # cli.py:536-541
    if buffer is not None:
        top = r.integer("rollout.max_new_tokens", None) or r.integer("data.max_len", 2048)  # cli.py:398-404
        if not buffer > 0 or top < buffer:
            r.bad("reward.overlong_buffer_len", buffer, f"a number > 0 and <= max_new_tokens ({top})")
        out.update(overlong_buffer_len=float(buffer), overlong_penalty_factor=float(factor),
                   overlong_max_tokens=int(top))
    if coef is not None:
        if coef > 1:
            r.bad("reward.stop_properly_penalty_coef", coef, "a number in [0, 1] or negative")
        out["truncated_reward_coef"] = float(coef)
    return out


def _kl(r: ConfigReader, fields: dict[str, Any]) -> None:
    use_loss = r.flag("algo.kl.use_loss", False)  # cli.py:523-525
    coef = r.number("algo.kl.init_coef", 0.01)  # cli.py:438
    kind = r.text("algo.kl.estimator", "k1")  # cli.py:448-456
    target = r.raw("algo.kl.target", None)  # cli.py:436: None = fixed coefficient
    # only the KL loss's gradient (actor.py:319-327; utils.py:115-128): its value is the estimator's
    r.flag("algo.kl.unbiased_gradient", False)
    if coef <= 0:  # compute_reward treats β ≤ 0 as 0 (utils.py:138-139); the KL loss term is 0 (actor.py:328-330)
        return
    if target is not None:
        r.note(f"algo.kl.target={target!r} (adaptive): a bundle's kl_coef must be its step's coefficient; "
               f"algo.kl.init_coef={coef!r} from the file is its start, right at the first step only")
    # target set: the adaptive controller (ppo_utils/kl_controller.py AdaptiveKLController) moves the coefficient
    # between steps; the step applies its value, which the bundle records as algo.kl.init_coef (the capture writes
    # it there) and the replay applies as a fixed coefficient
    if kind not in ("k1", "k2", "k3"):
        r.refuse("algo.kl.estimator", kind, "not one of k1, k2, k3")
    if use_loss:  # actor.py:318-338: a token mean whatever loss_agg_mode (aggregate_loss's default), ±10 clamp
        fields.update(use_kl_loss=True, kl_loss_coef=coef, kl_loss_type=kind, kl_loss_input_clamp=None,
                      kl_loss_output_clamp=KL_CLAMP, kl_loss_agg_mode="token_mean")
        return
    fields.update(kl_coef=coef, kl_penalty_type=kind, kl_penalty_clamp=KL_CLAMP)  # exp.py:205-214, 284-290


def _is_correction(r: ConfigReader, fields: dict[str, Any], loss_type: str) -> None:
    """vLLM IS correction (loss.py:216-250): ``w = exp(old − rollout)``, no log clamp; at token level ``clip``
    clamps ``w`` to [low, high] (TIS) and ``mask`` zeroes it outside (IcePop); with ``binary_kl`` / ``tv``
    gating ``w`` untruncated, zeroed where the sampled-token divergence is outside [0, delta] (``is_keep``)."""
    level = r.text("algo.advantage.is_correction_level", "off")  # cli.py:260-267
    mode = r.text("algo.advantage.is_correction_mode", "mask")  # cli.py:268-275
    gating = r.text("algo.advantage.is_correction_gating", "ratio")  # cli.py:276-283
    bounds = r.raw("algo.advantage.is_correction_threshold", [0.5, 5.0])  # cli.py:284-289, 639-642
    if level == "off":
        return
    if loss_type == "gspo":
        r.refuse("algo.advantage.is_correction_level", level, "under gspo OpenRLHF takes the ratio against the "
                                                              "rollout log-probs instead (loss.py:191-192)")
    if gating not in ("ratio", "binary_kl", "tv"):
        r.refuse("algo.advantage.is_correction_gating", gating, "not one of ratio, binary_kl, tv")
    if level not in ("token", "seq"):
        r.refuse("algo.advantage.is_correction_level", level, "not one of off, token, seq")
    if isinstance(bounds, (list, tuple)) and len(bounds) == 1:  # a single HIGH (cli.py:640-641)
        bounds = [0.0, bounds[0]]
    if not (isinstance(bounds, (list, tuple)) and len(bounds) == 2):
        r.bad("algo.advantage.is_correction_threshold", bounds, "[high] or [low, high]")
    low = r.number("algo.advantage.is_correction_threshold.0", bounds[0])
    high = r.number("algo.advantage.is_correction_threshold.1", bounds[1])
    if level == "seq":
        # loss.py:219-239: the sample's statistic — the ratio's geometric mean exp(masked_mean(old − rollout)), or a
        # divergence's plain mean — gates the whole sample (mask only: clip raises, loss.py:166-169); a kept
        # sample's tokens keep their own untruncated weight exp(old − rollout)
        if mode == "clip":
            r.bad("algo.advantage.is_correction_mode", mode, "mask with is_correction_level=seq (OpenRLHF raises: clip "
                  "requires is_correction_level=token, models/loss.py:166-169)")
        if gating != "ratio":
            r.refuse("algo.advantage.is_correction_gating", gating, "at is_correction_level=seq OpenRLHF gates the "
                     "sample's mean divergence (loss.py:233-234), which is not recomputed (is_keep's sequence masks "
                     "read the ratio); a bundle would need a per-sample divergence keep mask")
        # the geometric sequence mask of is_keep: a bound of 0 (a single threshold) is no bound
        fields.update(is_level="token", is_mode="truncate", is_low=None, is_high=None,
                      is_keep={"geometric": [low if low > 0 else None, high]})
        return
    if gating != "ratio":
        # loss.py:224-239: the gate reads the sampled-token binary KL or TV between p = exp(rollout) and
        # q = exp(old), both clamped to [1e-6, 1 − 1e-6]; a token outside [low, high] is dropped, a kept one keeps
        # its own untruncated weight exp(old − rollout): the untruncated token weight × is_keep's divergence gate.
        # PolicyLoss raises on clip with a divergence and on a lower bound > 0 (loss.py:166-172)
        if mode == "clip":
            r.bad("algo.advantage.is_correction_mode", mode, "mask with a divergence gate (OpenRLHF raises: clip "
                  "requires is_correction_gating=ratio, models/loss.py:166-169)")
        if low > 0:
            r.bad("algo.advantage.is_correction_threshold", bounds, "a single upper bound (a trust-region delta) "
                  f"with is_correction_gating={gating} (OpenRLHF raises otherwise, models/loss.py:171-172)")
        if high < 0:
            r.refuse("algo.advantage.is_correction_threshold", bounds, "a negative divergence bound drops every "
                     "token but the ones rounding made negative, which is not recomputed")
        # a negative low keeps a divergence rounded below 0 as well: no lower bound
        fields.update(is_level="token", is_mode="truncate", is_low=None, is_high=None,
                      is_keep={gating: [None if low < 0 else low, high]})
        return
    if mode == "clip":
        fields.update(is_level="token", is_mode="truncate", is_low=low, is_high=high)
    elif mode == "mask":
        fields.update(is_level="token", is_mode="mask", is_low=low, is_high=high)
    else:
        r.refuse("algo.advantage.is_correction_mode", mode, "not one of mask, clip")


def _reward_clip(r: ConfigReader, fields: dict[str, Any]) -> None:
    """``reward.clip_range`` clamps each sample's (normalized) reward before the returns (utils.py:141-142)."""
    clip = r.raw("reward.clip_range", [-10.0, 10.0])  # cli.py:474
    if clip is None or (isinstance(clip, (list, tuple)) and len(clip) == 0):
        return
    if not (isinstance(clip, (list, tuple)) and len(clip) == 2):
        r.bad("reward.clip_range", clip, "two numbers [low, high]")
    lo = r.number("reward.clip_range.0", clip[0])
    hi = r.number("reward.clip_range.1", clip[1])
    if lo > hi:
        r.bad("reward.clip_range", [lo, hi], "low <= high")
    fields.update(reward_clip_low=lo, reward_clip_high=hi)
