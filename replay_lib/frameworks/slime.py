"""slime's argparse settings → ``RecomputeConfig``.

Source read: THUDM/slime @ 624b824a898a (2026-08-21). ``args.py`` below is ``slime/utils/arguments.py``,
``rollout.py`` is ``slime/ray/rollout.py``, ``loss.py`` is ``slime/backends/megatron_utils/loss.py``.

``args`` may be the ``argparse.Namespace`` slime parsed, a dict of its ``dest`` names (``eps_clip``) or of its
flag names (``--eps-clip`` / ``eps-clip``), or the argv tokens themselves (``["--eps-clip", "0.2",
"--use-kl-loss"]``, as slime's shell scripts hold them). A slime argument dump also holds Megatron's
arguments: only keys whose names are words of the RL math (:data:`SLIME_MATH_WORDS`) are checked against the
keys this mapping knows, and Megatron's few colliding names are listed as neutral.

Not encoded (per-step values a capture records, not configuration): the loss multiplier
``num_microbatches / step_global_batch_size × DP`` (``loss.py:1353-1361``) and the token count of
``--calculate-per-token-loss`` (``loss.py:1317``): ``loss_scale`` stays 1 and the counts stay unset.
"""

from __future__ import annotations

from typing import Any, Optional

from ..bundle.schema import RecomputeConfig
from ._base import ConfigReader, to_plain, word_pattern

FRAMEWORK = "slime"

# Words of slime's own RL arguments (narrower than the generic list: a slime dump also holds Megatron's).
SLIME_MATH_WORDS = (
    "kl", "clip", "adv", "advantage", "advantages", "reward", "rewards", "entropy", "tis", "icepop", "mis",
    "gamma", "lambd", "baseline", "ratio", "estimator", "penalty", "opd", "gspo", "cispo", "sapo",
    "importance", "logprobs", "whiten", "normalize", "normalization", "std", "coef", "loss",
)
_SLIME_MATH = word_pattern(SLIME_MATH_WORDS)

# Keys (slime's or Megatron's) whose names collide with those words but which do not change the recomputed
# math: the bundle records their result (masks, log-probs), or they act outside reward → advantage → loss.
NEUTRAL = (
    "clip_grad", "init_method_std", "normalization", "loss_scale", "initial_loss_scale", "min_loss_scale",
    "loss_scale_window", "moe_aux_loss_coeff", "moe_z_loss_coeff", "mtp_loss_scaling_factor",
    "recompute_loss_function", "loss_mask_type", "mask_offpolicy_in_partial_rollout",
    "min_batch_collection_ratio", "num_critic_only_steps", "use_rollout_entropy", "get_mismatch_metrics",
    "keep_old_actor", "use_critic", "reward_key", "rollout_batch_size", "global_batch_size",
    "rollout_temperature", "opd_type", "opd_teacher_load", "opd_teacher_ckpt_step", "opd_kl_coef",
    "ref_update_interval", "check_for_nan_in_loss_and_grad", "no_check_for_nan_in_loss_and_grad",
    "opsm_delta", "rollout_top_p", "allgather_cp",  # OPSM's threshold (only with use_opsm); log-prob plumbing
)
NEUTRAL_PREFIXES = ("ci_", "eval_", "log_", "wandb_", "tensorboard_", "save_debug_", "load_debug_")

# The ``store_false`` flags of slime's parser and the ``dest`` they set (args.py:1005-1015, 966).
_NEGATED = {
    "disable_grpo_std_normalization": "grpo_std_normalization",
    "disable_rewards_normalization": "rewards_normalization",
    "disable_compute_advantages_and_returns": "compute_advantages_and_returns",
}


def parse_argv(tokens: list[str]) -> dict[str, Any]:
    """slime's argv tokens as ``{dest: value}``: a flag followed by a non-flag token takes it as its value
    (a string, typed when read), a flag alone is ``True``."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        tok = str(tokens[i])
        if not tok.startswith("--"):
            i += 1
            continue
        key, eq, val = tok[2:].partition("=")
        if eq:
            out[key] = val
            i += 1
        elif i + 1 < len(tokens) and not str(tokens[i + 1]).startswith("--"):
            out[key] = tokens[i + 1]
            i += 2
        else:
            out[key] = True
            i += 1
    return out


def _normalize(args: Any) -> dict[str, Any]:
    if isinstance(args, (list, tuple)) and all(isinstance(t, str) for t in args):
        args = parse_argv(list(args))
    tree = to_plain(args)  # a Namespace or a mapping
    if not isinstance(tree, dict):
        return tree  # ConfigReader names what it got
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dest = key.lstrip("-").replace("-", "_")
        if dest in _NEGATED:  # the flag given → the dest False
            on = value if isinstance(value, bool) else str(value).lower() in ("1", "true")
            out.setdefault(_NEGATED[dest], not on)
        else:
            out[dest] = value
    return out


# The MIS example's entry points (examples/train_infer_mismatch_helper/mis.py at 624b824a8, "mis.py" below; its
# settings are mis.yaml's, loaded with --custom-config-path)
MIS_FUNCTIONS = ("compute_mis_weights_with_cp", "compute_mis_weights")
MIS_LEVELS = ("token", "sequence", "geometric")


def _mis(r: ConfigReader, use_tis: bool) -> dict[str, Any]:
    """slime's MIS (mis.py:150-307): without ``use_tis`` only metrics (mis.py:207-209: the weights None, the masks
    unchanged, ``use_rs`` too). With it, the weight ``exp(clamp(Δ at tis_level, ±20))`` (Δ = the trainer's old
    log-probs − the rollout ones: loss.py:987-989, 1067; sequence: the sum over the loss tokens, geometric: their
    mean) is truncated (``clamp(0, upper)``), clipped (``clamp(lower, upper)``, ``lower`` 1/upper when unset:
    mis.py:174) or kept as it is with the tokens outside ``[lower, upper]`` rejected (mode ``mask``); ``use_rs``
    rejects at ``rs_level`` outside ``[rs_lower_bound, rs_upper_bound]`` (the TIS bounds when unset: mis.py:175-176)
    and vetoes a sample with a token below ``rs_veto_threshold``. The rejected tokens leave every term's numerator
    and the normalizers stay (loss.py:1080-1091): ``mis_rs``, ``mis_veto``."""
    keys = ("tis_level", "tis_mode", "tis_lower_bound", "tis_upper_bound", "use_rs", "rs_level", "rs_lower_bound",
            "rs_upper_bound", "rs_veto_threshold", "tis_batch_normalize")
    if not use_tis:
        r.neutral(*keys)
        return {}
    level = r.text("tis_level", "token")  # mis.yaml:9
    mode = r.text("tis_mode", "truncate")  # mis.yaml:16
    upper = r.number("tis_upper_bound", 2.0)  # mis.yaml:26
    lower = r.number("tis_lower_bound", None)  # mis.yaml:22; None → 1/upper (mis.py:174)
    if level not in MIS_LEVELS:
        r.refuse("tis_level", level, "not one of token, sequence, geometric")
    if mode not in ("truncate", "clip", "mask"):
        r.refuse("tis_mode", mode, "not one of truncate, clip, mask")
    if upper is None or not upper > 0:
        r.refuse("tis_upper_bound", upper, "a bound > 0")
    lower = 1.0 / upper if lower is None else lower
    if mode != "truncate" and not 0 < lower < upper:  # mis.py:125, 140 assert lower < upper
        r.refuse("tis_lower_bound", lower, "0 < tis_lower_bound < tis_upper_bound")
    if r.flag("tis_batch_normalize", False):  # mis.py:272-297
        r.refuse("tis_batch_normalize", True, "slime divides each micro-batch's weights by their mean on the rank "
                                              "(mis.py:272-297): one factor per micro-batch, not recomputed")
    fields: dict[str, Any] = {"is_level": level, "is_mode": "truncate", "is_log_clamp": 20.0}  # mis.py:188, 222
    rejects: list[list[Any]] = []
    if mode == "truncate":  # mis.py:103-113
        fields.update(is_low=None, is_high=upper)
    elif mode == "clip":  # mis.py:116-128
        fields.update(is_low=lower, is_high=upper)
    else:  # mis.py:131-147: the weight kept, the tokens outside the bounds rejected
        fields.update(is_low=None, is_high=None)
        rejects.append([level, lower, upper])
    if r.flag("use_rs", False):  # mis.py:243-263
        rs_level = r.text("rs_level", level)
        if rs_level not in MIS_LEVELS:
            r.refuse("rs_level", rs_level, "not one of token, sequence, geometric")
        rs_low = r.number("rs_lower_bound", None)
        rs_high = r.number("rs_upper_bound", None)
        rs_low, rs_high = lower if rs_low is None else rs_low, upper if rs_high is None else rs_high
        if not 0 < rs_low < rs_high:
            r.refuse("rs_lower_bound", rs_low, "0 < rs_lower_bound < rs_upper_bound")
        rejects.append([rs_level, rs_low, rs_high])
        veto = r.number("rs_veto_threshold", None)
        if veto is not None:
            if not veto > 0:
                r.refuse("rs_veto_threshold", veto, "a threshold > 0")
            fields["mis_veto"] = float(veto)
    else:
        r.neutral("rs_level", "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold")
    if rejects:
        fields["mis_rs"] = [(lv, float(lo), float(hi)) for lv, lo, hi in rejects]
    return fields


def from_slime(args: Any, *, where: Optional[str] = None) -> RecomputeConfig:
    """The ``RecomputeConfig`` slime's settings ``args`` encode (see the module docstring)."""
    r = ConfigReader(FRAMEWORK, _normalize(args), where)
    est = r.text("advantage_estimator", "grpo")  # args.py:941-955
    importance_level = "token"
    if est == "gspo":  # GSPO: GRPO advantages, one sequence-level ratio per sample
        estimator, importance_level = "grpo", "sequence"
    elif est == "ppo":
        estimator = "gae"
    elif est in ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        estimator = est
    else:  # cispo, or a name slime does not define
        r.refuse("advantage_estimator", est, "not mapped (grpo, gspo, ppo, reinforce_plus_plus and "
                                             "reinforce_plus_plus_baseline are)")
    loss_type = r.text("loss_type", "policy_loss")  # args.py:914-923
    if loss_type != "policy_loss":
        r.refuse("loss_type", loss_type, "only slime's policy_loss is recomputed")
    for key in ("custom_loss_function_path", "custom_advantage_function_path", "custom_reward_post_process_path",
                "custom_pg_loss_reducer_function_path", "custom_convert_samples_to_train_data_path"):
        value = r.raw(key, None)  # args.py:924-932, 967-979, 1084-1089, 1370-1376: all None by default
        if value:
            r.refuse(key, value, "a custom function's math cannot be recomputed")
    if not r.flag("compute_advantages_and_returns", True):  # args.py:956-965
        r.refuse("compute_advantages_and_returns", False, "the advantages are then not slime's formula")
    extra: dict[str, Any] = {}
    if r.flag("use_opsm", False):  # args.py:1103-1114; loss.py:1010-1017, 1045-1046: pg_loss × the OPSM mask
        # ppo_utils.py:54-92: a token dropped when A < 0 and mean(old − logp) > opsm_delta (old: the trainer's)
        extra.update(opsm_delta=r.number("opsm_delta", 1e-4), opsm_anchor="old")
    if r.flag("use_opd", False):  # args.py:1123-1150; loss.py:663-701, 809-816: A − opd_kl_coef·(old − teacher)
        extra.update(opd_placement="advantage", opd_kl_type="k1", opd_coef=r.number("opd_kl_coef", 1.0),
                     opd_clamp=None)

    eps_clip = r.number("eps_clip", 0.2)  # args.py:899
    eps_clip_high = r.number("eps_clip_high", None)  # args.py:900; None → eps_clip (args.py:1876-1877)
    eps_clip_c = r.number("eps_clip_c", None)  # args.py:901-906: dual-clip off
    kl_coef = r.number("kl_coef", 0.0)  # args.py:908-913 (reward shaping; GRPO ignores it, loss.py:763-767)
    kl_loss_type = r.text("kl_loss_type", "k1")  # args.py:933-939
    use_kl_loss = r.flag("use_kl_loss", False)  # args.py:980-982
    kl_loss_coef = r.number("kl_loss_coef", 0.0)  # args.py:983-988
    if r.flag("use_unbiased_kl", False) and use_kl_loss and kl_loss_coef != 0:  # args.py:989-994
        r.refuse("use_unbiased_kl", True, "the importance-weighted KL estimate is not recomputed")
    use_tis = r.flag("use_tis", False)  # args.py:1060-1065
    tis_clip = r.number("tis_clip", 2.0)  # args.py:1066-1071
    tis_clip_low = r.number("tis_clip_low", 0.0)  # args.py:1072-1077
    is_fields: dict[str, Any] = {}
    custom_tis = r.raw("custom_tis_function_path", None)  # args.py:1078-1082
    tis_name = str(custom_tis).rsplit(":", 1)[-1].rsplit(".", 1)[-1] if custom_tis else None
    if tis_name in MIS_FUNCTIONS:
        is_fields = _mis(r, use_tis)
    elif use_tis:
        is_mode = "truncate"  # loss.py:884-905 vanilla_tis_function: clamp(w, tis_clip_low, tis_clip)
        if custom_tis:
            if tis_name != "icepop_function":
                r.refuse("custom_tis_function_path", custom_tis, "a custom TIS function is not recomputed "
                                                                 "(slime's own icepop_function and the MIS example's "
                                                                 "compute_mis_weights_with_cp are)")
            is_mode = "mask"  # loss.py:908-931 icepop_function: w·1[tis_clip_low ≤ w ≤ tis_clip]
        is_fields = {"is_level": "token", "is_mode": is_mode, "is_low": tis_clip_low, "is_high": tis_clip}
    per_token = r.flag("calculate_per_token_loss", False)  # args.py:879; loss.py:1317,1353-1370

    fields: dict[str, Any] = dict(
        advantage_estimator=estimator,
        n_samples_per_prompt=r.integer("n_samples_per_prompt", 1),  # args.py:699-701
        rewards_normalization=r.flag("rewards_normalization", True),  # args.py:1011-1015 (store_false)
        grpo_std_normalization=r.flag("grpo_std_normalization", True),  # args.py:1005-1010 (store_false)
        grpo_std_eps=1e-6,  # rollout.py:629: rewards / (std + 1e-6)
        grpo_std_unbiased=True,  # rollout.py:628: torch.std (Bessel)
        group_baseline="mean",  # rollout.py:624
        std_zero="eps",
        singleton_group=None,  # the arithmetic: torch.std of one sample is NaN (slime#2230's "nan")
        kl_coef=kl_coef,
        kl_loss_type=kl_loss_type,
        use_kl_loss=use_kl_loss,
        kl_loss_coef=kl_loss_coef,
        kl_loss_input_clamp=None,  # slime clamps neither the log-ratio nor k3 (low_var_kl clamps, as ours)
        kl_loss_output_clamp=None,
        eps_clip=eps_clip,
        eps_clip_high=eps_clip if eps_clip_high is None else eps_clip_high,
        eps_clip_c=eps_clip_c,
        log_ratio_clamp=None,  # slime exponentiates the raw log-ratio
        importance_level=importance_level,
        entropy_coef=r.number("entropy_coef", 0.0),  # args.py:1001
        gamma=r.number("gamma", 1.0),  # args.py:1002
        lam=r.number("lambd", 1.0),  # args.py:1003
        normalize_advantages=r.flag("normalize_advantages", False),  # args.py:1004; loss.py:819-879
        use_rollout_logprobs=r.flag("use_rollout_logprobs", False),  # args.py:1050-1058
        # sum of per-sample means, or a token mean under --calculate-per-token-loss
        loss_agg_mode="token_mean" if per_token else "sum_of_sample_means",
        **is_fields,
        **extra,
    )
    if estimator == "gae":
        fields["value_clip"] = r.number("value_clip", 0.2)  # args.py:907
    else:
        r.neutral("value_clip", "tis_clip", "tis_clip_low")
    for key in NEUTRAL:
        r.neutral(key)
    for key in list(r.flat):
        if key.startswith(NEUTRAL_PREFIXES):
            r.neutral(key)
    r.check_unknown(pattern=_SLIME_MATH)
    return r.build(fields)

