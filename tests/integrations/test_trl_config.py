"""``replay_lib.frameworks.trl.from_trl``: TRL's GRPOConfig → RecomputeConfig.

The expected values are read from TRL 1.16.0's own code (huggingface/trl, ``trl/trainer/grpo_trainer.py`` and
``trl/trainer/grpo_config.py`` of the release the ``[trl]`` extra pins): the denominators of ``_compute_loss``
(``grpo_trainer.py:3153-3173``), the std epsilon of ``_generate_and_score_completions`` (``:2787``), the clip
bounds (``:945-946, 3113``), the KL (``:3101-3105``), vLLM's importance ratio (``:2662-2701``) and
``GRPOConfig.__post_init__``'s ``steps_per_generation`` (``grpo_config.py:1098-1112``). Dict inputs run without
TRL installed; the GRPOConfig-object tests skip (with the reason) when it is not.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import msgspec
import pytest
from msgspec.structs import replace as msgspec_replace

from replay_lib.errors import EXIT_INVALID, EXIT_UNSUPPORTED, FrameworkConfigError, UnsupportedFrameworkConfig
from replay_lib.frameworks.trl import from_trl

REPO = Path(__file__).resolve().parents[2]


def _base(**kw) -> dict:
    """A GRPOConfig's math-bearing keys at TRL's defaults (grpo_config.py), overridden by ``kw``."""
    return {"loss_type": "dapo", "num_generations": 8, "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 1, "steps_per_generation": None, "generation_batch_size": None,
            "num_iterations": 1, "epsilon": 0.2, "epsilon_high": None, "beta": 0.0, "use_bias_correction_kl": True,
            "scale_rewards": "group", "importance_sampling_level": "token", "max_completion_length": 512,
            "multi_objective_aggregation": "sum_then_normalize", "top_entropy_quantile": 1.0, "entropy_coef": 0.0,
            "use_vllm": False, "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_max": 3.0,
            "vllm_importance_sampling_clip_min": None, "reward_weights": [1.0, 0.5], **kw}


def test_dapo_default_is_a_global_token_mean_with_trl_std_eps():
    # dapo (the default, grpo_config.py:801): Σ x·m / (num_items_in_batch / P · GAS / SPG): token_mean with the
    # count recorded per step (None here) and loss_scale = P·SPG/GAS = 2·4/2 = 4.0 for 2 processes, GAS 2,
    # SPG 4. Group normalization: num_generations 8, unbiased std, eps 1e-4 (:2787), no KL in the reward.
    cfg = from_trl(_base(gradient_accumulation_steps=2, steps_per_generation=4), num_processes=2)
    assert (cfg.loss_agg_mode, cfg.loss_token_count, cfg.loss_scale) == ("token_mean", None, 4.0)
    assert (cfg.advantage_estimator, cfg.n_samples_per_prompt, cfg.grpo_std_normalization) == ("grpo", 8, True)
    assert (cfg.grpo_std_eps, cfg.grpo_std_unbiased, cfg.kl_coef) == (1e-4, True, 0.0)
    # epsilon_high None → epsilon (grpo_trainer.py:946)
    assert (cfg.eps_clip, cfg.eps_clip_high, cfg.importance_level) == (0.2, 0.2, "token")
    assert (cfg.use_kl_loss, cfg.is_level) == (False, None)


def test_spg_defaults_to_gradient_accumulation_steps():
    # grpo_config.py:1098-1100: neither generation_batch_size nor steps_per_generation → SPG = GAS = 3, so
    # loss_scale = 1·3/3 = 1.0; with generation_batch_size 48 over B=8 × 1 process, SPG = 48 // 8 = 6 → 6/3 = 2.0.
    assert from_trl(_base(gradient_accumulation_steps=3)).loss_scale == 1.0
    assert from_trl(_base(gradient_accumulation_steps=3, generation_batch_size=48)).loss_scale == 2.0


@pytest.mark.parametrize("loss_type, mode, n, horizon", [
    ("grpo", "seq_mean_token_mean", 4 * 2, None),  # mean over B of per-sequence means / GAS: N = B·GAS = 8
    ("dr_grpo", "seq_mean_token_sum_norm", 4 * 2, 6),  # Σ x·m / (B·max_completion_length) / GAS: N=8, L=6
])
def test_sequence_modes_record_b_times_gas(loss_type, mode, n, horizon):
    cfg = from_trl(_base(loss_type=loss_type, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         max_completion_length=6))
    assert (cfg.loss_agg_mode, cfg.loss_seq_count, cfg.loss_horizon, cfg.loss_scale) == (mode, n, horizon, 1.0)


def test_bnpo_is_a_local_token_mean_or_a_mean_of_micro_batch_token_means():
    # bnpo: Σ x·m / max(Σ m, 1) over the micro-batch / GAS (grpo_trainer.py:3158-3162): one token mean when
    # GAS = 1; with GAS 2 the step is the mean of its two micro-batches' token means (their micro_batch_id).
    assert from_trl(_base(loss_type="bnpo")).loss_agg_mode == "token_mean"
    cfg = from_trl(_base(loss_type="bnpo", gradient_accumulation_steps=2))
    assert (cfg.loss_agg_mode, cfg.loss_token_count, cfg.loss_scale) == ("micro_batch_token_mean", None, 1.0)


def test_beta_maps_to_k3_in_the_loss_without_clamps():
    # per_token_loss += beta · (exp(ref − logp) − (ref − logp) − 1) on the current log-probs (:3101, :3150),
    # no clamp; with use_bias_correction_kl (TRL's default True) the KL is multiplied by coef_1 (:3104-3105).
    cfg = from_trl(_base(beta=0.04, use_bias_correction_kl=False))
    assert (cfg.use_kl_loss, cfg.kl_loss_coef, cfg.kl_loss_type) == (True, 0.04, "k3")
    assert (cfg.kl_loss_input_clamp, cfg.kl_loss_output_clamp, cfg.kl_coef) == (None, None, 0.0)
    assert not cfg.kl_loss_ratio_weighted
    default = from_trl(_base(beta=0.04))
    assert default.kl_loss_ratio_weighted is True
    assert msgspec_replace(default, kl_loss_ratio_weighted=False) == msgspec_replace(cfg, kl_loss_ratio_weighted=False)
    # beta 0: the correction flag is neutral (no KL term at all)
    assert from_trl(_base(beta=0.0, use_bias_correction_kl=True)).use_kl_loss is False
    assert not from_trl(_base(beta=0.0, use_bias_correction_kl=True)).kl_loss_ratio_weighted


@pytest.mark.parametrize("delta, eps_high", [(1.5, None), (1.28, 0.28), (4.0, 0.28)])
def test_delta_is_dual_clip_at_delta(delta, eps_high):
    # coef_1 = clamp(coef_1, max=delta) before −min(coef_1·A, coef_2·A) (:3115-3120): with delta ≥ 1 + ε_high
    # it caps only negative advantages' loss at −delta·A, verl's dual-clip with c = delta
    cfg = from_trl(_base(delta=delta, epsilon_high=eps_high))
    assert cfg.eps_clip_c == delta


def test_delta_at_or_below_one_is_refused():
    # below 1 + epsilon_high delta maps (tests/test_trl_delta.py); at or below 1 it clips on both sides
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_trl(_base(delta=1.0, epsilon_high=0.28))
    assert str(err.value) == ("TRL config: delta=1.0: at or below 1 the cap clips the ratio below the unclipped 1 on "
                              "both sides (TRL recommends delta > 1 + epsilon); not recomputed")


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_entropy_coef_is_a_mean_of_micro_batch_token_means(loss_type):
    # loss −= entropy_coef · Σ_b (Σ H·m / max(Σ m, 1))_b / GAS whatever the loss type (:3196-3211)
    cfg = from_trl(_base(loss_type=loss_type, entropy_coef=0.01, gradient_accumulation_steps=2))
    assert (cfg.entropy_coef, cfg.entropy_agg_mode) == (0.01, "micro_batch_token_mean")


def test_entropy_coef_with_a_scaled_dapo_loss_is_refused():
    # dapo on 2 processes: the policy term is × P·SPG/GAS = 2, the entropy bonus is not
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_trl(_base(entropy_coef=0.01), num_processes=2)
    assert str(err.value).startswith("TRL config: entropy_coef=0.01: with loss_type=dapo on 2 process(es), "
                                     "steps_per_generation=1 and gradient_accumulation_steps=1 the policy term is "
                                     "scaled by 2 and the entropy bonus is not")


def test_version_other_than_the_read_release_is_refused():
    assert from_trl(_base(), version="1.16.0") == from_trl(_base())
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_trl(_base(), version="1.17.0")
    assert str(err.value) == ("TRL config: framework_version='1.17.0': not a version this mapping knows "
                              "(known: 1.16.0)")


def test_scale_rewards_and_sequence_level_and_clip_high():
    cfg = from_trl(_base(scale_rewards="none", importance_sampling_level="sequence", epsilon_high=0.28))
    assert (cfg.grpo_std_normalization, cfg.importance_level, cfg.eps_clip_high) == (False, "sequence", 0.28)
    # the booleans GRPOConfig accepts (grpo_config.py:1078): True = group, False = none
    assert from_trl(_base(scale_rewards=True)).grpo_std_normalization is True
    assert from_trl(_base(scale_rewards=False)).grpo_std_normalization is False


def test_scale_rewards_batch_maps_where_a_step_holds_the_generation_batch():
    # one process, SPG = GAS: the step's samples are the whole generation batch whose nanstd TRL divides by
    cfg = from_trl(_base(scale_rewards="batch", gradient_accumulation_steps=2))
    assert (cfg.grpo_std_normalization, cfg.grpo_std_scope, cfg.grpo_std_unbiased, cfg.grpo_std_eps) == (
        True, "batch", True, 1e-4)
    # scale_rewards="group" leaves the knob unset (not written: a bundle byte-identical to one without it)
    assert "grpo_std_scope" not in msgspec.json.decode(msgspec.json.encode(from_trl(_base())))
    for kw, where in (({"num_processes": 2}, "here 2 process(es), 1 and 1"),
                      ({"steps_per_generation": 4}, "here 1 process(es), 4 and 1")):
        extra = {k: v for k, v in kw.items() if k != "num_processes"}
        with pytest.raises(UnsupportedFrameworkConfig) as err:
            from_trl(_base(scale_rewards="batch", **extra), num_processes=kw.get("num_processes", 1))
        assert str(err.value) == (
            "TRL config: scale_rewards='batch': the group mean divided by the std of the whole generation batch, "
            "gathered over every process (:2774-2778), is recomputed only when a step holds that whole batch (one "
            "process, steps_per_generation = gradient_accumulation_steps; " + where + "); a bundle would need that "
            "batch std recorded")
        assert err.value.exit_code == EXIT_UNSUPPORTED


@pytest.mark.parametrize("mode, level, is_mode", [("sequence_mask", "sequence", "mask"),
                                                 ("token_truncate", "token", "truncate")])
def test_vllm_importance_correction(mode, level, is_mode):
    # Δ = old − sampling per token, summed per sequence for sequence_* (exp of the sum, :2669-2674), clamped
    # (truncate, :2681) or zeroed outside [min, max] (mask, :2698-2701); clip_max 3.0 is TRL's default.
    cfg = from_trl(_base(use_vllm=True, vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=0.5))
    assert (cfg.is_level, cfg.is_mode, cfg.is_low, cfg.is_high) == (level, is_mode, 0.5, 3.0)
    # without vLLM the correction flag (default True) is neutral
    assert from_trl(_base(use_vllm=False)).is_level is None


@pytest.mark.parametrize("key, value, message", [
    ("loss_type", "sft", "loss_type='sft': only dapo, grpo, bnpo, dr_grpo, vespo, luspo, cispo, sapo are recomputed"),
    ("some_new_reward_scale", 2.0, "some_new_reward_scale=2.0: a key the TRL mapping does not know"),
])
def test_refusals_name_the_key(key, value, message):
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_trl(_base(**{key: value}))
    assert str(err.value).startswith("TRL config: ") and message in str(err.value)
    assert err.value.exit_code == EXIT_UNSUPPORTED


def test_adaptive_entropy_maps_the_coefficient_the_step_applied():
    """use_adaptive_entropy: the step applies entropy_coef (or 0 above entropy_target, grpo_trainer.py:3206-3209);
    the bundle records that coefficient as entropy_coef, mapped like a static one."""
    adaptive = from_trl(_base(use_adaptive_entropy=True, entropy_coef=0.02))
    assert adaptive == from_trl(_base(entropy_coef=0.02)) and adaptive.entropy_coef == 0.02
    assert from_trl(_base(use_adaptive_entropy=True, entropy_coef=0.0)).entropy_coef == 0.0


def test_a_step_across_generation_batches_is_refused():
    # GAS 4, SPG 2: one optimizer step trains on two generation batches (grpo_trainer.py:1536-1546)
    with pytest.raises(UnsupportedFrameworkConfig, match=r"^TRL config: steps_per_generation=2: "):
        from_trl(_base(gradient_accumulation_steps=4, steps_per_generation=2))
    # SPG 3, GAS 2, 2 iterations: 6 micro-batches per generation = 3 whole steps → accepted
    assert from_trl(_base(gradient_accumulation_steps=2, steps_per_generation=3, num_iterations=2)).loss_scale == 1.5


def test_wrong_types_are_invalid_input_and_neutral_keys_pass():
    with pytest.raises(FrameworkConfigError, match=r"^TRL config: epsilon='wide': expected a number$") as err:
        from_trl(_base(epsilon="wide"))
    assert err.value.exit_code == EXIT_INVALID
    # optimizer and generation keys with math-looking names change nothing the replay recomputes
    cfg = from_trl(_base(weight_decay=0.1, max_grad_norm=1.0, temperature=0.7, top_k=20))
    assert cfg == from_trl(_base())


def test_grpoconfig_object_and_its_dict_map_alike():
    trl = pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[trl]')")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trl.GRPOConfig(output_dir=str(REPO / "no-such-dir"), use_cpu=True, report_to=[],
                              per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2,
                              loss_type="dr_grpo", max_completion_length=6, epsilon_high=0.28)
    cfg = from_trl(args)
    # post_init: SPG = GAS = 2 (grpo_config.py:1098-1100); dr_grpo: N = 4·2 = 8, L = 6
    assert (cfg.loss_agg_mode, cfg.loss_seq_count, cfg.loss_horizon) == ("seq_mean_token_sum_norm", 8, 6)
    assert (cfg.n_samples_per_prompt, cfg.eps_clip_high, cfg.grpo_std_eps) == (4, 0.28, 1e-4)
    assert from_trl(args.to_dict()) == cfg


# --------------------------------------------------------------------- issue 34: VESPO, LUSPO and the masks


def test_vespo_maps_to_its_family_with_its_parameters_and_the_dapo_aggregation():
    # −φ(w)·A·logp (grpo_trainer.py:3125-3136), aggregated as dapo (:3168): token_mean, loss_scale = P·SPG/GAS
    cfg = from_trl(_base(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5, gradient_accumulation_steps=2,
                         steps_per_generation=4), num_processes=2)
    assert (cfg.policy_loss, cfg.loss_agg_mode, cfg.loss_scale) == ("vespo", "token_mean", 4.0)
    assert cfg.policy_loss_params == {"k_pos": 1.5, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.5}
    # vLLM's importance ratio is folded into VESPO's weight by TRL: refused by name
    with pytest.raises(UnsupportedFrameworkConfig, match="loss_type='vespo': with vLLM's importance correction"):
        from_trl(_base(loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode="token_truncate"))


def test_luspo_is_the_clipped_surrogate_with_each_sequence_token_sum_averaged():
    # (per_token_loss·mask).sum(-1).mean() / GAS (:3175-3183): seq_mean_token_sum over the step's B·GAS sequences
    cfg = from_trl(_base(loss_type="luspo", importance_sampling_level="sequence", per_device_train_batch_size=4,
                         gradient_accumulation_steps=2, steps_per_generation=2))
    assert (cfg.policy_loss, cfg.loss_agg_mode, cfg.loss_seq_count, cfg.importance_level) == (
        "ppo", "seq_mean_token_sum", 8, "sequence")


def test_the_entropy_mask_and_the_off_policy_mask_map_to_their_knobs():
    cfg = from_trl(_base(top_entropy_quantile=0.2))
    assert cfg.top_entropy_quantile == 0.2
    # sampling log-probs are vLLM's (rollout_log_probs) with vLLM, else the old ones (:3074)
    assert (from_trl(_base(off_policy_mask_threshold=0.5)).opsm_delta,
            from_trl(_base(off_policy_mask_threshold=0.5)).opsm_anchor) == (0.5, "old")
    assert from_trl(_base(off_policy_mask_threshold=0.5, use_vllm=True)).opsm_anchor == "rollout"
    with pytest.raises(UnsupportedFrameworkConfig, match="top_entropy_quantile=0.2: with entropy_coef"):
        from_trl(_base(top_entropy_quantile=0.2, entropy_coef=0.01, loss_type="grpo"))
