"""OpenRLHF's ``train_ppo_ray`` arguments → ``RecomputeConfig``.

Source read: OpenRLHF/OpenRLHF @ 3c3be6234e0c (2026-08-13). ``cli.py`` below is ``openrlhf/cli/train_ppo_ray.py``,
``exp.py`` is ``openrlhf/trainer/ppo_utils/experience_maker.py``, ``loss.py`` is ``openrlhf/models/loss.py``,
``utils.py`` is ``openrlhf/models/utils.py``.

``args`` is the hierarchized namespace (``args.algo.kl.init_coef``), a nested dict, or a flat dict of the
dotted flag names (``{"algo.kl.init_coef": 0.01}``, as argparse stores them before ``hierarchize``).

OpenRLHF's default run puts a k1 KL penalty into the per-token reward (``init_coef=0.01``, ``use_loss`` off,
``exp.py:205-214``; ``utils.py:98-126``) and clamps that estimate at ±10 (``utils.py:95``): mapped as
``kl_in_reward="token_returns"`` for k3 (whose ±10 clamp is ``low_var_kl``'s); k1 and k2 refuse, because the
replay's in-reward estimators have no clamp. The reward at the last token is clipped to ``reward.clip_range``
(``utils.py:108-109``, default ±10, ``cli.py:437``): accepted where it provably cannot bind (``group_norm``:
a z-score of n samples is at most (n − 1)/√n in magnitude), refused by name otherwise.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from ..bundle.schema import RecomputeConfig
from ._base import ConfigReader

FRAMEWORK = "openrlhf"
ESTIMATORS = {"group_norm": "grpo", "dr_grpo": "dr_grpo", "rloo": "rloo", "gae": "gae"}  # exp.py:264-270
# Sections outside the recomputed math: engines, models, data, checkpoints, logging, optimizers.
SECTIONS = ("actor", "algo", "reward")
NEUTRAL = ("actor.model_name_or_path", "actor.optim", "actor.muon", "actor.adam", "actor.lr_scheduler",
           "actor.lr_warmup_ratio", "actor.min_lr_ratio", "actor.max_norm", "actor.aux_loss_coef",
           "actor.num_nodes", "actor.num_gpus_per_node", "actor.gradient_checkpointing_enable", "actor.freezing_steps",
           "reward.num_nodes", "reward.num_gpus_per_node", "reward.model_name_or_path", "reward.remote_url",
           "reward.offload", "reward.normalize_enable", "reward.overlong_penalty_factor", "algo.kl.horizon",
           "algo.advantage.no_std_norm",
           "algo.dynamic_filtering_enable", "algo.dynamic_filtering_range")


def from_openrlhf(args: Any, *, where: Optional[str] = None) -> RecomputeConfig:
    """The ``RecomputeConfig`` OpenRLHF's arguments ``args`` encode (see the module docstring)."""
    r = ConfigReader(FRAMEWORK, args, where)
    est = r.text("algo.advantage.estimator", "gae")  # cli.py:477-483
    if est not in ESTIMATORS:
        r.refuse("algo.advantage.estimator", est, f"not mapped ({', '.join(ESTIMATORS)} are)")
    n = r.integer("rollout.n_samples_per_prompt", 1)  # cli.py:413-415
    if r.flag("reward.normalize_enable", False):  # cli.py:395-397
        r.refuse("reward.normalize_enable", True, "running reward normalization is not recomputed")
    for key in ("reward.overlong_buffer_len", "reward.stop_properly_penalty_coef"):  # cli.py:493-500: None
        value = r.raw(key, None)
        if value is not None:
            r.refuse(key, value, "length penalties on the reward are not recomputed")
    loss_type = r.text("actor.policy_loss_type", "ppo")  # cli.py:420
    if loss_type not in ("ppo", "gspo"):
        r.refuse("actor.policy_loss_type", loss_type, "not one of ppo, gspo")
    eps = r.number("actor.eps_clip", 0.2)  # cli.py:387
    low_high = r.raw("actor.eps_clip_low_high", None)  # cli.py:388; None → (eps, eps) (cli.py:594-595)
    if low_high is None:
        eps_low, eps_high = eps, eps
    elif isinstance(low_high, (list, tuple)) and len(low_high) == 2:
        eps_low = r.number("actor.eps_clip_low_high.0", low_high[0])
        eps_high = r.number("actor.eps_clip_low_high.1", low_high[1])
    else:
        r.bad("actor.eps_clip_low_high", low_high, "two numbers [low, high]")
    entropy = r.number("actor.entropy_coef", None)  # cli.py:431-436: None = not computed
    fields: dict[str, Any] = dict(
        advantage_estimator=ESTIMATORS[est],
        n_samples_per_prompt=n,
        grpo_std_normalization=est == "group_norm",
        grpo_std_eps=1e-9,  # exp.py:270
        grpo_std_unbiased=True,  # exp.py:270: torch.std
        group_baseline="leave_one_out" if est == "rloo" else "mean",  # exp.py:264-268
        eps_clip=eps_low,
        eps_clip_high=eps_high,
        eps_clip_c=r.number("actor.dual_clip", None),  # cli.py:389; loss.py:184-193
        entropy_coef=0.0 if entropy is None else entropy,
        gamma=r.number("algo.advantage.gamma", 1.0),  # cli.py:392 (set to 1 for the group estimators, exp.py:293-300)
        lam=r.number("algo.advantage.lambd", 1.0),  # cli.py:391
        loss_agg_mode="token_mean",  # loss.py:29-32 (token_level_loss=True, loss.py:126)
    )
    if loss_type == "ppo":
        fields["log_ratio_clamp"] = 20.0  # loss.py:168
    else:  # GSPO: per-sample ratio exp(mean Δ), unclamped, per-sample aggregation (loss.py:142-144,170-177)
        fields.update(importance_level="sequence", log_ratio_clamp=None, loss_agg_mode="seq_mean_token_mean")
        if entropy:  # the entropy term keeps the token mean (ppo_actor.py:345-352)
            r.refuse("actor.entropy_coef", entropy, "under gspo the policy term is a per-sample mean but the "
                                                    "entropy term a token mean; one loss cannot mix two modes here")
    if est == "gae":  # whitened over the step's tokens (exp.py:315-328), critic value clip (cli.py:390)
        if r.flag("algo.advantage.no_std_norm", False):
            r.refuse("algo.advantage.no_std_norm", True, "mean-only whitening is not recomputed")
        fields.update(normalize_advantages=True, value_clip=r.number("critic.value_clip", 0.5))
    _kl(r, fields, est, loss_type)
    _is_correction(r, fields, loss_type)
    _reward_clip(r, est, n, fields)
    r.neutral(*NEUTRAL)
    r.check_unknown(SECTIONS)
    return r.build(fields)


def _kl(r: ConfigReader, fields: dict[str, Any], est: str, loss_type: str) -> None:
    use_loss = r.flag("algo.kl.use_loss", False)  # cli.py:484-486
    coef = r.number("algo.kl.init_coef", 0.01)  # cli.py:419
    kind = r.text("algo.kl.estimator", "k1")  # cli.py:421-429
    target = r.raw("algo.kl.target", None)  # cli.py:417: None = fixed coefficient
    if coef <= 0:  # no reference model (cli.py:93-103); compute_reward treats β ≤ 0 as 0 (utils.py:105-106)
        return
    if target is not None:
        r.refuse("algo.kl.target", target, "an adaptive KL coefficient changes every step; only fixed is mapped")
    if kind not in ("k1", "k2", "k3"):
        r.refuse("algo.kl.estimator", kind, "not one of k1, k2, k3")
    if use_loss:  # ppo_actor.py:319-337: aggregated like the policy term, output clamped ±10 (utils.py:95)
        if loss_type == "gspo":
            r.refuse("algo.kl.use_loss", True, "under gspo the policy term is a per-sample mean but the KL term a "
                                               "token mean; one loss cannot mix two modes here")
        fields.update(use_kl_loss=True, kl_loss_coef=coef, kl_loss_type=kind, kl_loss_input_clamp=None,
                      kl_loss_output_clamp=10.0)
        return
    if kind != "k3":
        r.refuse("algo.kl.estimator", kind, "OpenRLHF clamps the in-reward KL estimate at ±10 (openrlhf/models/"
                                            "utils.py:95); only k3, whose clamp is low_var_kl's, maps")
    if est == "gae":
        r.refuse("algo.kl.init_coef", coef, "KL-shaped token rewards under GAE are not mapped")
    fields.update(kl_in_reward="token_returns", kl_coef=coef, kl_penalty_type="low_var_kl")


def _is_correction(r: ConfigReader, fields: dict[str, Any], loss_type: str) -> None:
    """vLLM IS correction (loss.py:195-218): ``w = exp(old − rollout)``, no log clamp; ``tis`` clamps to
    [low, high], ``icepop`` zeroes outside them."""
    on = r.flag("algo.advantage.is_correction_enable", False)  # cli.py:257
    bounds = r.raw("algo.advantage.is_correction_threshold", [0.5, 5.0])  # cli.py:258-263
    kind = r.text("algo.advantage.is_correction_type", "tis")  # cli.py:264-270
    if not on:
        return
    if loss_type == "gspo":
        r.refuse("algo.advantage.is_correction_enable", True, "under gspo OpenRLHF takes the ratio against the "
                                                              "rollout log-probs instead (loss.py:172-173)")
    if not (isinstance(bounds, (list, tuple)) and len(bounds) == 2):
        r.bad("algo.advantage.is_correction_threshold", bounds, "two numbers [low, high]")
    low = r.number("algo.advantage.is_correction_threshold.0", bounds[0])
    high = r.number("algo.advantage.is_correction_threshold.1", bounds[1])
    if kind == "tis":
        fields.update(is_level="token", is_mode="truncate", is_low=low, is_high=high)
    elif kind == "icepop":
        fields.update(is_level="token", is_mode="mask", is_low=low, is_high=high)
    else:
        r.refuse("algo.advantage.is_correction_type", kind, "not mapped (tis and icepop are)")


def _reward_clip(r: ConfigReader, est: str, n: int, fields: dict[str, Any]) -> None:
    """``reward.clip_range`` clamps each sample's (normalized) reward before the returns (utils.py:108-109)."""
    clip = r.raw("reward.clip_range", [-10.0, 10.0])  # cli.py:437
    if clip is None or (isinstance(clip, (list, tuple)) and len(clip) == 0):
        return
    if not (isinstance(clip, (list, tuple)) and len(clip) == 2):
        r.bad("reward.clip_range", clip, "two numbers [low, high]")
    lo = r.number("reward.clip_range.0", clip[0])
    hi = r.number("reward.clip_range.1", clip[1])
    if est == "group_norm" and n > 1 and min(-lo, hi) >= (n - 1) / math.sqrt(n):
        return  # |z| ≤ (n − 1)/√n for an unbiased z-score of n values: the clip never binds
    r.refuse("reward.clip_range", [lo, hi], f"the reward clip of {est} with n={n} may bind and is not recomputed")
