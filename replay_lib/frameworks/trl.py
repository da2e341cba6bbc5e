"""TRL's ``GRPOConfig`` → :class:`~replay_lib.bundle.schema.RecomputeConfig`.

Read from TRL 1.16.0 (``trl/trainer/grpo_trainer.py`` and ``trl/trainer/grpo_config.py`` of the release on the
package index; the line numbers below are of that release):

* group normalization (``_generate_and_score_completions``): the weighted sum of the reward functions
  (``:2763``), the group mean over ``view(-1, num_generations)`` (``:2765``), the Bessel-corrected ``nanstd``
  (``:2770``; ``trl/trainer/utils.py:1037-1044``), ``(r − mean) / (std + 1e-4)`` unless ``scale_rewards="none"``
  (``:2787``); ``scale_rewards="batch"`` takes the std over the whole generation batch (``:2774-2778``):
  ``grpo_std_scope="batch"``, exact where a step bundle holds that whole batch (one process and
  ``steps_per_generation = gradient_accumulation_steps``).
* the surrogate (``_compute_loss``): ``coef_1 = exp(logp − old)`` per token, or per sequence as
  ``exp(Σ_t (logp − old)·m / max(Σ_t m, 1))`` under ``importance_sampling_level="sequence"`` (``:3087``);
  ``coef_2 = clamp(coef_1, 1 − epsilon, 1 + epsilon_high)`` (``:3113``, ``epsilon_high`` defaults to
  ``epsilon``, ``:945-946``), ``delta`` caps ``coef_1`` at ``delta`` (``:3115-3116``, two-sided clipping: the
  replay's dual-clip with ``eps_clip_c = delta`` when ``delta ≥ 1 + epsilon_high``), ``per_token_loss =
  −min(coef_1·A, coef_2·A)`` (``:3120``); vLLM's importance ratio multiplies it (``:3147``), then ``beta · k3``
  with ``k3 = exp(ref − logp) − (ref − logp) − 1`` on the *current* log-probs is added (``:3101,3150``), times
  the unclipped ``coef_1`` when ``use_bias_correction_kl`` (TRL's default, ``:3104-3105``:
  ``kl_loss_ratio_weighted``).
* the aggregation of one micro-batch (``:3153-3173``), summed over an optimizer step's
  ``gradient_accumulation_steps`` (GAS) micro-batches of ``per_device_train_batch_size`` (B) sequences:

  ============ =================================================== ===========================================
  ``loss_type``  TRL's micro-batch loss                              the step, as SPEC §4.2 names it
  ============ =================================================== ===========================================
  ``dapo``     Σ x·m / (num_items_in_batch / P · GAS / SPG)          ``token_mean``, T = num_items_in_batch
                                                                     (recorded per step), loss_scale = P·SPG/GAS
  ``grpo``     mean over B of per-sequence means / GAS               ``seq_mean_token_mean``, N = B·GAS
  ``bnpo``     Σ x·m / max(Σ m, 1) over the micro-batch / GAS        ``token_mean`` over the local batch:
                                                                     T = its tokens (GAS 1), else
                                                                     ``micro_batch_token_mean``
  ``dr_grpo``  Σ x·m / (B · max_completion_length) / GAS             ``seq_mean_token_sum_norm``, N = B·GAS,
                                                                     L = max_completion_length
  ============ =================================================== ===========================================

  (P = processes, SPG = ``steps_per_generation``; ``num_items_in_batch`` is the loss-mask token count of the
  whole generation batch gathered over the processes, ``:2498``.) The per-step token counts are data, not
  configuration: ``from_trl`` leaves ``loss_token_count`` unset and the live capture
  (``capture.integrations.trl``) records it in every step bundle.

The entropy bonus (``entropy_coef``, ``:3196-3211``) is ``− entropy_coef · Σ_b (Σ H·m / max(Σ m, 1))_b / GAS``
whatever the loss type: ``entropy_agg_mode="micro_batch_token_mean"``, unscaled (so refused with a ``dapo`` loss
whose ``loss_scale`` is not 1). The mapping reads TRL 1.16.0 (``VERSIONS``; another ``framework_version`` is
refused by name).

What cannot be recomputed is refused by name (:class:`~replay_lib.errors.UnsupportedFrameworkConfig`, exit 4):
another loss type than those mapped above, ``scale_rewards="batch"`` over several processes
or generation batches that span several steps (the batch std),
``multi_objective_aggregation="normalize_then_sum"`` over several processes, ``delta < 1 + epsilon_high``,
``top_entropy_quantile < 1`` with ``entropy_coef`` (the bonus over the masked tokens), VESPO with vLLM's importance
correction, ``use_adaptive_entropy`` (a coefficient that changes per
step), ``entropy_coef`` with a scaled ``dapo`` loss, and a step that straddles two generation batches. Any
other key whose name looks like a knob of the math and whose value is on refuses too
(``ConfigReader.check_unknown``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

from ..bundle.schema import RecomputeConfig
from ._base import ConfigReader, framework_version

FRAMEWORK = "TRL"
VERSIONS = ("1.16.0",)  # the release read (oldest first); capture.integrations.trl refuses another
# TRL's std epsilon (grpo_trainer.py:2787) and its one KL estimator (k3, :3101).
TRL_STD_EPS = 1e-4
LOSS_MODES = {"dapo": "token_mean", "grpo": "seq_mean_token_mean", "bnpo": "token_mean",
              "dr_grpo": "seq_mean_token_sum_norm",
              "vespo": "token_mean", "luspo": "seq_mean_token_sum"}  # VESPO and LUSPO: issue 34
_VLLM_IS_MODES = {"token_truncate": ("token", "truncate"), "token_mask": ("token", "mask"),
                  "sequence_truncate": ("sequence", "truncate"), "sequence_mask": ("sequence", "mask")}

# GRPOConfig keys (beyond transformers.TrainingArguments) that do not change the recomputed math: the bundle
# records their result (sampled tokens, log-probs, masks) or they only concern generation, vLLM, the reference
# model's refresh, logging or tools.
NEUTRAL_KEYS = (
    "model_init_kwargs", "trust_remote_code", "disable_dropout", "cast_lm_head_to_fp32", "num_generations_eval",
    "ds3_gather_for_generation", "shuffle_dataset", "pad_to_multiple_of", "temperature", "top_p", "top_k",
    "min_p", "generation_kwargs", "chat_template_kwargs", "repetition_penalty", "cache_implementation",
    "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
    "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size", "reward_weights",
    "mask_truncated_completions", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
    "max_tool_calling_iterations", "log_completions", "log_multimodal", "num_completions_to_print",
    "log_unique_prompts", "log_completions_hub_repo", "use_transformers_continuous_batching",
    "transformers_continuous_batching_config", "use_transformers_paged",
    # loss-type parameters of the loss types refused below
    "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
    "vespo_lambda_neg", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
)
# transformers.TrainingArguments keys whose names hold a math word but that act on the optimizer or evaluation,
# outside the recomputed stages (used when transformers is not importable; otherwise every TrainingArguments
# field is neutral).
TRAINING_ARGUMENTS_MATH_NAMED = ("weight_decay", "adam_epsilon", "max_grad_norm", "prediction_loss_only",
                                 "greater_is_better", "label_smoothing_factor", "adam_beta1", "adam_beta2",
                                 "warmup_ratio", "lr_scheduler_kwargs")


@functools.lru_cache(maxsize=1)
def _training_argument_keys() -> tuple[str, ...]:
    try:
        from transformers import TrainingArguments
    except ImportError:  # a dict mapped without transformers installed
        return TRAINING_ARGUMENTS_MATH_NAMED
    return tuple(f.name for f in dataclasses.fields(TrainingArguments)) + TRAINING_ARGUMENTS_MATH_NAMED


def from_trl(config: Any, *, num_processes: int = 1, where: Optional[str] = None,
             version: Optional[str] = None) -> RecomputeConfig:
    """The :class:`RecomputeConfig` of a TRL ``GRPOConfig`` (or its ``to_dict()``), for a run on
    ``num_processes`` processes (the data-parallel world TRL's ``dapo`` denominator divides by).

    The per-step counts (``loss_token_count`` for ``dapo`` and ``bnpo``) are left unset: they are recorded by
    the capture. Raises ``UnsupportedFrameworkConfig`` (exit 4) naming the first key it cannot recompute and
    ``FrameworkConfigError`` (exit 3) for a value of the wrong type."""
    framework_version(FRAMEWORK, version, VERSIONS, where)
    cfg = ConfigReader(FRAMEWORK, config, where)
    cfg.neutral(*NEUTRAL_KEYS, *_training_argument_keys())
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}")

    n = cfg.integer("num_generations", 8)
    batch = cfg.integer("per_device_train_batch_size", 8)
    gas = cfg.integer("gradient_accumulation_steps", 1)
    spg = cfg.integer("steps_per_generation", None)
    generation_batch = cfg.integer("generation_batch_size", None)
    if spg is None:  # GRPOConfig.__post_init__ (grpo_config.py:1098-1112)
        spg = gas if generation_batch is None else generation_batch // (batch * num_processes)
    iterations = cfg.integer("num_iterations", 1)
    # A step's micro-batches come from one generation batch only when each generation's SPG × num_iterations
    # micro-batches are a whole number of steps and no step repeats a micro-batch (SPG ≥ GAS).
    if spg < gas or (spg * iterations) % gas:
        cfg.refuse("steps_per_generation", spg,
                   f"with gradient_accumulation_steps={gas} and num_iterations={iterations} an optimizer step "
                   "trains on micro-batches of several generation batches, which one step bundle cannot hold "
                   "(needs steps_per_generation ≥ gradient_accumulation_steps and steps_per_generation × "
                   "num_iterations a multiple of it)")

    fields: dict[str, Any] = {"advantage_estimator": "grpo", "n_samples_per_prompt": n,
                              "grpo_std_eps": TRL_STD_EPS, "grpo_std_unbiased": True, "kl_coef": 0.0,
                              "kl_loss_type": "k3"}
    fields.update(_rewards(cfg, whole_batch=num_processes == 1 and spg == gas, num_processes=num_processes,
                           spg=spg, gas=gas))
    fields.update(_loss(cfg, batch=batch, gas=gas, spg=spg, num_processes=num_processes))
    fields.update(_kl(cfg))
    fields.update(_vllm_importance(cfg))
    fields.update(_masks(cfg))
    if fields.get("policy_loss") == "vespo" and fields.get("is_level") is not None:
        cfg.refuse("loss_type", "vespo", "with vLLM's importance correction TRL folds the ratio into VESPO's "
                                         "sequence weight (:2993-2997), which is not recomputed")
    _refuse_rest(cfg)
    cfg.check_unknown()
    return cfg.build(fields)


def _rewards(cfg: ConfigReader, *, whole_batch: bool, num_processes: int, spg: int, gas: int) -> dict[str, Any]:
    scale = cfg.raw("scale_rewards", "group")
    scale = {True: "group", False: "none"}.get(scale, scale)  # grpo_config.py:1078
    if scale == "batch" and not whole_batch:
        cfg.refuse("scale_rewards", scale, f"the group mean divided by the std of the whole generation batch, "
                                          f"gathered over every process (:2774-2778), is recomputed only when a step "
                                          f"holds that whole batch (one process, steps_per_generation = "
                                          f"gradient_accumulation_steps; here {num_processes} process(es), "
                                          f"{spg} and {gas}); a bundle would need that batch std recorded")
    if scale not in ("group", "none", "batch"):
        cfg.refuse("scale_rewards", scale, "expected group, batch or none")
    aggregation = cfg.text("multi_objective_aggregation", "sum_then_normalize")
    if aggregation not in ("sum_then_normalize", "normalize_then_sum"):
        cfg.refuse("multi_objective_aggregation", aggregation, "expected sum_then_normalize or normalize_then_sum")
    out: dict[str, Any] = {"grpo_std_normalization": scale != "none"}
    if aggregation == "normalize_then_sum":
        # :2790-2799: each reward function's output (the samples' reward_components, in reward_funcs order)
        # (r − group mean)/(nanstd + 1e-4) whatever scale_rewards, Σ w·A (reward_weights, all 1 when unset), then
        # (A − mean)/(nanstd + 1e-4) over the whole generation batch, gathered over every process
        if not whole_batch:
            cfg.refuse("multi_objective_aggregation", aggregation,
                       f"the weighted sum standardized over the whole generation batch, gathered over every process "
                       f"(:2790-2799), is recomputed only when a step holds that whole batch (one process, "
                       f"steps_per_generation = gradient_accumulation_steps; here {num_processes} process(es), {spg} "
                       f"and {gas}); a bundle would need that batch's mean and std recorded")
        weights = cfg.raw("reward_weights", None)  # grpo_config.py: None = 1 each
        out.update(advantage_estimator="gdpo", grpo_std_normalization=True, reward_components_standardize=True,
                   reward_components_standardize_eps=TRL_STD_EPS)
        if weights is not None:
            if not isinstance(weights, (list, tuple)) or not all(
                    isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights):
                cfg.bad("reward_weights", weights, "a list of numbers, one per reward function")
            out["reward_component_weights"] = [float(w) for w in weights]
        return out
    if scale == "batch":  # nanstd(rewards) over the step's (= the generation batch's) samples, Bessel, + 1e-4
        out["grpo_std_scope"] = "batch"
    return out


# TRL's loss types that are a policy-loss family of ours (kernels/families), with the loss type whose aggregation
# each shares (:3153-3173: cispo divides like dapo, sapo like grpo)
FAMILY_LOSS_TYPES = {"cispo": ("cispo", "dapo"), "sapo": ("sapo", "grpo")}


def _loss(cfg: ConfigReader, *, batch: int, gas: int, spg: int, num_processes: int) -> dict[str, Any]:
    loss_type = cfg.text("loss_type", "dapo")
    family = None
    if loss_type in FAMILY_LOSS_TYPES:
        family, loss_type = FAMILY_LOSS_TYPES[loss_type]
    if loss_type not in LOSS_MODES:
        cfg.refuse("loss_type", loss_type, f"only {', '.join([*LOSS_MODES, *FAMILY_LOSS_TYPES])} are recomputed")
    out: dict[str, Any] = {"loss_agg_mode": LOSS_MODES[loss_type]}
    if loss_type == "vespo":
        # −φ(w)·A·logp (:3125-3136, get_gamma_weights :2969-3018), aggregated as dapo (:3168)
        out["policy_loss"] = "vespo"
        out["policy_loss_params"] = {name: cfg.number(f"vespo_{name}", default)
                                     for name, default in (("k_pos", 2.0), ("lambda_pos", 3.0), ("k_neg", 3.0),
                                                           ("lambda_neg", 2.0))}
    else:
        cfg.neutral("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
    if loss_type == "luspo":
        # the clipped surrogate (:3112-3123), the loss (Σ_t x·m).mean() over the micro-batch / GAS (:3175-3183):
        # each sequence's token sum, averaged over the step's B·GAS sequences
        out["loss_seq_count"] = batch * gas
    if loss_type in ("dapo", "vespo"):
        out["loss_scale"] = num_processes * spg / gas
    elif loss_type == "bnpo":
        if gas != 1:  # Σ_b (Σ x·m / max(Σ m, 1))_b / GAS over the step's GAS micro-batches (:3158-3162)
            out["loss_agg_mode"] = "micro_batch_token_mean"
    elif loss_type in ("grpo", "dr_grpo"):  # every micro-batch holds B sequences
        out["loss_seq_count"] = batch * gas
        if loss_type == "dr_grpo":
            out["loss_horizon"] = cfg.integer("max_completion_length", 512)
    eps = cfg.number("epsilon", 0.2)
    high = cfg.number("epsilon_high", None)
    out["eps_clip"] = eps
    out["eps_clip_high"] = eps if high is None else high
    delta = cfg.number("delta", None)
    if family is not None:
        _family(cfg, out, family)
    elif delta is not None:
        # coef_1 = clamp(coef_1, max=delta) before −min(coef_1·A, coef_2·A) (:3115-3120). With delta ≥ 1 + ε_high
        # this is dual-clip with c = delta: for A < 0, |A|·max(min(r, δ), clip(r)) = |A|·min(max(r, clip(r)), δ);
        # for A ≥ 0, min(r, δ, clip(r)) = min(r, clip(r)) since clip(r) ≤ 1 + ε_high ≤ δ.
        if delta <= 1:
            cfg.refuse("delta", delta, "at or below 1 the cap clips the ratio below the unclipped 1 on both sides "
                                       "(TRL recommends delta > 1 + epsilon); not recomputed")
        if delta < 1 + out["eps_clip_high"]:
            # below 1 + ε_high the cap is the clip of A > 0 (−A·min(r, δ, clip(r)) = −A·min(r, δ) for δ > 1) and
            # A < 0 keeps |A|·max(min(r, δ), clip(r)) = |A|·clip(r, 1 − ε_low, 1 + ε_high): the clipped surrogate
            # with ε_high' = δ − 1 and dual-clip c = 1 + ε_high (max(r, clip(r, 1 − ε_low, δ)) capped at 1 + ε_high)
            out["eps_clip_c"] = 1 + out["eps_clip_high"]
            out["eps_clip_high"] = delta - 1
        else:
            out["eps_clip_c"] = delta
    level = cfg.text("importance_sampling_level", "token")
    if level not in ("token", "sequence"):
        cfg.refuse("importance_sampling_level", level, "expected token or sequence")
    if family is not None and level != "token":
        cfg.refuse("importance_sampling_level", level, f"loss_type={family} on the sequence ratio is not recomputed "
                                                       "(its token form is)")
    out["importance_level"] = level
    coef = cfg.number("entropy_coef", 0.0)
    if coef != 0:
        # loss −= entropy_coef · Σ_b (Σ H·m / max(Σ m, 1))_b / GAS, whatever the loss type (:3196-3211): the mean
        # over the step's micro-batches of each one's token mean of the entropy, never scaled like the policy term
        if out.get("loss_scale", 1.0) != 1.0:
            cfg.refuse("entropy_coef", coef, f"with loss_type=dapo on {num_processes} process(es), "
                                             f"steps_per_generation={spg} and gradient_accumulation_steps={gas} the "
                                             f"policy term is scaled by {out['loss_scale']:g} and the entropy bonus "
                                             "is not; the replay scales every loss term alike (it maps when "
                                             "processes × steps_per_generation = gradient_accumulation_steps)")
        out.update(entropy_coef=coef, entropy_agg_mode="micro_batch_token_mean")
    return out


def _family(cfg: ConfigReader, out: dict[str, Any], family: str) -> None:
    """``cispo``: ``−min(coef_1, epsilon_high)·A·logp``, the cap absolute (:3109-3111); ``sapo``: the gate
    ``σ(τ·(coef_1 − 1))·4/τ`` with ``τ = sapo_temperature_pos`` where ``A > 0``, ``_neg`` elsewhere (:3121-3124).
    ``delta`` acts only on the clipped surrogate's branch (:3115-3116): read, not applied."""
    if family == "cispo":
        params: dict[str, Any] = {"cap": "absolute"}
    else:
        params = {"tau_pos": cfg.number("sapo_temperature_pos", 1.0), "tau_neg": cfg.number("sapo_temperature_neg", 1.05)}
    out.update(policy_loss=family, policy_loss_params=params)


def _kl(cfg: ConfigReader) -> dict[str, Any]:
    beta = cfg.number("beta", 0.0)
    correction = cfg.flag("use_bias_correction_kl", True)
    if beta == 0:
        return {"use_kl_loss": False, "kl_loss_coef": 0.0}
    # k3 on the current log-probs, no clamp (:3099-3102); use_bias_correction_kl (TRL's default) multiplies it
    # by coef_1, the unclipped importance ratio (per token, or the sequence's under importance_sampling_level=
    # "sequence"), before delta caps coef_1 (:3104-3105, 3115)
    return {"use_kl_loss": True, "kl_loss_coef": beta, "kl_loss_input_clamp": None, "kl_loss_output_clamp": None,
            **({"kl_loss_ratio_weighted": True} if correction else {})}


def _vllm_importance(cfg: ConfigReader) -> dict[str, Any]:
    use_vllm = cfg.flag("use_vllm", False)
    correction = cfg.flag("vllm_importance_sampling_correction", True)
    mode = cfg.text("vllm_importance_sampling_mode", "sequence_mask")
    low = cfg.number("vllm_importance_sampling_clip_min", None)
    high = cfg.number("vllm_importance_sampling_clip_max", 3.0)
    cap = cfg.number("vllm_importance_sampling_cap", None)
    if cap is not None:  # the deprecated name of clip_max (grpo_config.py:1143-1150)
        high = cap
    if not (use_vllm and correction):
        return {"is_level": None}
    if mode not in _VLLM_IS_MODES:
        cfg.refuse("vllm_importance_sampling_mode", mode, f"expected one of {', '.join(_VLLM_IS_MODES)}")
    level, is_mode = _VLLM_IS_MODES[mode]
    # sequence_*: exp(Σ_t Δ) (grpo_trainer.py:2669-2674), the SPEC's summed 'sequence' level;
    # truncate clamps (:2681), mask zeroes outside [min, max] (:2698-2701).
    return {"is_level": level, "is_mode": is_mode, "is_low": low, "is_high": high}


def _masks(cfg: ConfigReader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    quantile = cfg.number("top_entropy_quantile", 1.0)
    if quantile < 1.0:
        # get_high_entropy_mask (:1380-1415): entropy ≥ quantile(the micro-batch's loss-token entropies gathered
        # over the processes, 1 − q), the loss × the mask (:3143-3144); the scope is each sample's micro_batch_id
        if cfg.number("entropy_coef", 0.0) != 0:
            cfg.refuse("top_entropy_quantile", quantile, "with entropy_coef the bonus averages over the masked "
                                                         "tokens only (:3193), which is not recomputed")
        out["top_entropy_quantile"] = quantile
    threshold = cfg.number("off_policy_mask_threshold", None)
    if threshold is not None:
        # get_off_policy_mask (:2945-2967), the loss × the mask (:3140-3141): kept when A ≥ 0 or the mean of
        # sampling − current over the completion ≤ the threshold; sampling = vLLM's log-probs, else old (:3074)
        out.update(opsm_delta=threshold, opsm_anchor="rollout" if cfg.flag("use_vllm", False) else "old")
    return out


def _refuse_rest(cfg: ConfigReader) -> None:
    # use_adaptive_entropy: the step applies entropy_coef, or 0 where the previous window's entropy is above
    # entropy_target (apply_coef, grpo_trainer.py:3206-3209), and moves it after the step (:3216-3240); the bundle
    # records the coefficient its step applied as entropy_coef (the capture writes it there), mapped as above
    if cfg.flag("use_adaptive_entropy", False):
        cfg.note("use_adaptive_entropy=True: a bundle's entropy_coef must be the coefficient its step applied (0 while "
                 "the previous window's entropy is above entropy_target); the file's entropy_coef is the start")
    aux = cfg.number("router_aux_loss_coef", None)
    if aux:
        cfg.refuse("router_aux_loss_coef", aux, "the router auxiliary loss TRL adds to the loss is not recomputed")
