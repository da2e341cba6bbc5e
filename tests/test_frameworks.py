"""``replay_lib.frameworks``: each framework's own configuration → ``RecomputeConfig``.

The expected knobs are read from the frameworks' code and recipes (cited per test), at the snapshots of
SPEC §8: verl-project/verl @ 1dda039b9c63, THUDM/slime @ 624b824a898a, NovaSky-AI/SkyRL @ a9564572eb8e,
NVIDIA-NeMo/RL @ 7ea279abfbeb, OpenRLHF 0.11.2 (PyPI). Each test lists the fields that differ from
``RecomputeConfig()``, so a default the mapping forgot to encode (or encodes silently) fails it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from replay_lib.cli import main
from replay_lib.errors import FrameworkConfigError, UnsupportedFrameworkConfig
from replay_lib.frameworks import from_nemo_rl, from_openrlhf, from_skyrl, from_slime, from_verl
from replay_lib.frameworks.slime import parse_argv
from replay_lib.bundle.schema import RecomputeConfig

BASE = msgspec.to_builtins(RecomputeConfig())


def changed(cfg: RecomputeConfig) -> dict:
    return {k: v for k, v in msgspec.to_builtins(cfg).items() if BASE.get(k, msgspec.UNSET) != v}  # UNSET: absent


def test_verl_grpo_defaults():
    """verl/trainer/config/_generated_ppo_trainer.yaml: clip_ratio(_low/_high) 0.2 (:84-86), clip_ratio_c 3.0
    (:99) always applied by the vanilla loss (core_algos.py:1356-1361), loss_agg_mode token-mean (:100),
    kl_loss_type low_var_kl (:109, k3 clamped ±20 then ±10, core_algos.py:2238-2244) at 0.001 (:108) but
    use_kl_loss false (:105), norm_adv_by_std_in_grpo (:865); the log-ratio clamp ±20 (core_algos.py:1338); a
    group of one gets mean 0 and std 1 (core_algos.py:313-315); the metrics are masked token means."""
    cfg = from_verl({"algorithm": {"adv_estimator": "grpo"}})
    assert changed(cfg) == {
        "grpo_std_normalization": True, "eps_clip_c": 3.0, "loss_agg_mode": "token_mean",
        "metric_agg_mode": "micro_batch_token_mean", "log_ratio_clamp": 20.0, "kl_loss_type": "k3", "kl_loss_coef": 0.001,
        "kl_loss_input_clamp": 20.0, "kl_loss_output_clamp": 10.0, "singleton_group": "raw",
        "masked_token_value": "zero"}
    assert cfg.use_kl_loss is False  # the KL term is off: its coefficient and type are inert


def test_verl_fully_async_dapo_recipe():
    """verl/experimental/fully_async_policy/shell/dapo_7b_math_fsdp2_4_4.sh:27-45,91-120: grpo, n=16, no KL,
    clip 0.2 / 0.28, clip_ratio_c 10, token-mean, entropy 0; engine and optimizer settings are neutral, the DAPO
    overlong reward buffer lives outside the mapped sections (its result is the recorded score)."""
    cfg = from_verl({
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False, "kl_ctrl": {"kl_coef": 0.0}},
        "actor_rollout_ref": {"rollout": {"n": 16}, "actor": {
            "use_kl_loss": False, "kl_loss_coef": 0.0, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
            "clip_ratio_c": 10.0, "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 40960,
            "optim": {"lr": 1e-6, "lr_warmup_steps": 10, "weight_decay": 0.1}, "ppo_mini_batch_size": 32,
            "fsdp_config": {"param_offload": False, "optimizer_offload": False, "fsdp_size": 2,
                            "strategy": "fsdp2"},
            "entropy_coeff": 0, "grad_clip": 1.0, "loss_agg_mode": "token-mean",
            "ulysses_sequence_parallel_size": 1}},
        "reward": {"reward_manager": {"name": "dapo"},
                   "reward_kwargs": {"overlong_buffer_cfg": {"enable": True, "len": 4096, "penalty_factor": 1.0}}},
    })
    assert changed(cfg) == {
        "n_samples_per_prompt": 16, "grpo_std_normalization": True, "eps_clip_high": 0.28, "eps_clip_c": 10.0,
        "loss_agg_mode": "token_mean", "metric_agg_mode": "micro_batch_token_mean", "log_ratio_clamp": 20.0,
        "kl_loss_type": "k3", "kl_loss_input_clamp": 20.0, "kl_loss_output_clamp": 10.0, "singleton_group": "raw",
        "masked_token_value": "zero"}


def test_verl_0_9_1_semantics():
    """verl 0.9.1 (installed): GAE ends in masked_whiten (core_algos.py:264); GSPO aggregates with the configured
    loss_agg_mode (core_algos.py:1601-1605); rloo(_vectorized), reinforce_plus_plus(_baseline), token-sum
    (core_algos.py:1175-1179) and the abs KL are mapped; an unknown version is refused naming the known ones."""
    actor = "actor_rollout_ref"
    assert from_verl({}).normalize_advantages is True  # gae, verl's default estimator
    assert from_verl({"algorithm": {"adv_estimator": "grpo"}}).normalize_advantages is False
    gspo = from_verl({"algorithm": {"adv_estimator": "grpo"}, actor: {"actor": {
        "policy_loss": {"loss_mode": "gspo"}, "loss_agg_mode": "token-mean", "entropy_coeff": 0.01}}},
        version="0.9.1")
    assert (gspo.importance_level, gspo.loss_agg_mode, gspo.entropy_coef) == ("sequence", "token_mean", 0.01)
    for name, ours in (("rloo", "rloo"), ("rloo_vectorized", "rloo"), ("reinforce_plus_plus", "reinforce_plus_plus"),
                       ("reinforce_plus_plus_baseline", "reinforce_plus_plus_baseline")):
        assert from_verl({"algorithm": {"adv_estimator": name}}).advantage_estimator == ours
    summed = from_verl({actor: {"actor": {"loss_agg_mode": "token-sum", "use_kl_loss": True, "kl_loss_type": "abs"}}})
    assert (summed.loss_agg_mode, summed.loss_seq_count, summed.kl_loss_type, summed.kl_loss_input_clamp) == (
        "token_sum", None, "abs", None)
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_verl({}, version="0.4.0")
    assert str(err.value) == ("verl config: framework_version='0.4.0': not a version this mapping knows "
                              "(known: 0.9.1)")


def test_verl_kl_loss_kl_in_reward_rollout_is_and_gspo():
    """use_kl_loss with low_var_kl at 0.001 (the common recipe); use_kl_in_reward folds kl_coef·Σ kl into the
    score (ray_trainer.py:78-112), with kl_penalty k2 ('mse'); rollout_is token at 2.0 = TIS min(w, 2) on
    exp(clamp(Δ, ±20)) (rollout_corr_helper.py:572-596); a "0.5_2.0" threshold is IcePop; gspo is a sequence
    ratio clamped at 10, no dual-clip, seq-mean-token-mean (core_algos.py:1545-1606)."""
    cfg = from_verl({"algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": True, "kl_penalty": "mse",
                                   "kl_ctrl": {"kl_coef": 0.002},
                                   "rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 2.0}},
                     "actor_rollout_ref": {"actor": {"use_kl_loss": True, "kl_loss_type": "low_var_kl+"}}})
    assert (cfg.kl_in_reward, cfg.kl_coef, cfg.kl_penalty_type) == ("sequence", 0.002, "k2")
    assert (cfg.use_kl_loss, cfg.kl_loss_coef, cfg.kl_loss_type) == (True, 0.001, "k3")
    assert (cfg.is_level, cfg.is_mode, cfg.is_low, cfg.is_high, cfg.is_log_clamp) == ("token", "truncate", None,
                                                                                      2.0, 20.0)
    ice = from_verl({"algorithm": {"adv_estimator": "grpo", "rollout_correction": {
        "rollout_is": "sequence", "rollout_is_threshold": "0.5_2.0"}}})
    assert (ice.is_level, ice.is_mode, ice.is_low, ice.is_high) == ("sequence", "mask", 0.5, 2.0)
    gspo = from_verl({"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"rollout": {"n": 8}, "actor": {
        "policy_loss": {"loss_mode": "gspo"}, "loss_agg_mode": "seq-mean-token-mean", "ppo_mini_batch_size": 32}}})
    assert (gspo.importance_level, gspo.eps_clip_c, gspo.log_ratio_clamp, gspo.loss_agg_mode) == (
        "sequence", None, 10.0, "seq_mean_token_mean")
    # seq-mean modes divide by the nominal ppo_mini_batch_size · n = 32 · 8 (ray_trainer.py:1352-1362)
    assert (gspo.loss_seq_count, gspo.loss_token_count) == (256, None)
    # bypass_mode: vanilla PPO-clip against the rollout log-probs (the bundle's old_log_probs), no IS weight
    # (core_algos.py:2528-2538), whether set as the loss mode or as rollout_correction.bypass_mode
    vanilla = from_verl({"algorithm": {"adv_estimator": "grpo"}})
    for bypass in ({"algorithm": {"adv_estimator": "grpo", "rollout_correction": {
                        "bypass_mode": True, "rollout_is": "token", "rollout_is_threshold": 2.0}}},
                   {"algorithm": {"adv_estimator": "grpo"},
                    "actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "bypass_mode"}}}}):
        assert from_verl(bypass) == vanilla
    norm = from_verl({"actor_rollout_ref": {"actor": {"loss_agg_mode": "seq-mean-token-sum-norm",
                                                      "loss_scale_factor": 4096}}})
    assert (norm.loss_agg_mode, norm.loss_seq_count, norm.loss_horizon) == ("seq_mean_token_sum_norm", 256, 4096)


@pytest.mark.parametrize("cfg, key, why", [
    ({"algorithm": {"adv_estimator": "optimal_token_baseline"}}, "algorithm.adv_estimator",
     "a bundle would need sum_pi_squared per token"),
    ({"algorithm": {"adv_estimator": "my_estimator"}}, "algorithm.adv_estimator", "not mapped"),
    ({"actor_rollout_ref": {"actor": {"loss_agg_mode": "token-max"}}}, "actor_rollout_ref.actor.loss_agg_mode",
     "not one of"),
    ({"algorithm": {"use_kl_in_reward": True, "kl_ctrl": {"type": "pid"}}}, "algorithm.kl_ctrl.type",
     "not one of fixed, adaptive"),
    ({"algorithm": {"rollout_correction": {"bypass_mode": True, "loss_type": "reinforce_plus"}}},
     "algorithm.rollout_correction.loss_type", "not one of ppo_clip, reinforce"),
    ({"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "my_loss"}}}},
     "actor_rollout_ref.actor.policy_loss.loss_mode", "not mapped (vanilla, gspo, bypass_mode, cispo, sapo, geo_mean, "
                                                      "dppo_tv, dppo_kl, dro, gpg, kl_cov, clip_cov are)"),
    ({"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "dro"}}}},
     "actor_rollout_ref.actor.policy_loss.dro_beta", "DRO needs a positive beta"),
    ({"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "geo_mean"}}}},
     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "set the micro-batch size"),
    ({"actor_rollout_ref": {"actor": {"use_kl_loss": True, "kl_loss_type": "k9"}}},
     "actor_rollout_ref.actor.kl_loss_type", "not mapped"),
    ({"algorithm": {"my_adv_scale": 2.0}}, "algorithm.my_adv_scale", "a key the verl mapping does not know"),
    ({"actor_rollout_ref": {"actor": {"policy_loss": {"new_clip_bound": 0.1}}}},
     "actor_rollout_ref.actor.policy_loss.new_clip_bound", "a key the verl mapping does not know"),
])
def test_verl_refuses_by_name(cfg, key, why):
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_verl(cfg)
    assert str(err.value).startswith(f"verl config: {key}=") and why in str(err.value)
    assert err.value.exit_code == 4


def test_unknown_keys_that_are_off_or_not_math_are_accepted():
    """An unknown knob whose value is off (0, None, False, "") cannot change the math; a key whose name holds
    no math word is outside the check (engine, logging)."""
    cfg = from_verl({"algorithm": {"adv_estimator": "grpo", "my_adv_scale": 0, "new_kl_thing": None,
                                   "use_new_reward_norm": False},
                     "actor_rollout_ref": {"actor": {"fancy_logger": "wandb", "seed": 3}}})
    assert cfg.advantage_estimator == "grpo"


def test_slime_reference_script_as_argv():
    """scripts/run-qwen3-4B.sh:49-99 with its model (scripts/models/qwen3-4B.sh:1-17) and Megatron arguments:
    GRPO, n=8, --use-kl-loss at --kl-loss-coef 0.00 (inert), low_var_kl, entropy 0, clip 0.2 / 0.28; slime's
    defaults otherwise: std normalization on (arguments.py:1005-1010), eps 1e-6 (rollout.py:629), the sum of
    per-sample means, no dual-clip, no clamps. Megatron's colliding names (--normalization, --norm-epsilon,
    --weight-decay, --adam-beta1) are neutral."""
    argv = ("--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32 "
            "--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear "
            "--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 "
            "--kv-channels 128 --qk-layernorm --prompt-data /d.jsonl --input-key prompt --label-key label "
            "--apply-chat-template --rollout-shuffle --rm-type deepscaler --num-rollout 3000 "
            "--rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-max-response-len 8192 "
            "--rollout-temperature 1 --global-batch-size 256 --balance-data --eval-interval 20 "
            "--n-samples-per-eval-prompt 16 --eval-max-response-len 16384 --eval-top-p 1 "
            "--tensor-model-parallel-size 2 --sequence-parallel --recompute-granularity full "
            "--use-dynamic-batch-size --max-tokens-per-gpu 9216 --advantage-estimator grpo --use-kl-loss "
            "--kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28 "
            "--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 "
            "--adam-beta2 0.98 --attention-dropout 0.0 --hidden-dropout 0.0 --attention-softmax-in-fp32").split()
    cfg = from_slime(argv)
    assert changed(cfg) == {"n_samples_per_prompt": 8, "grpo_std_normalization": True, "kl_loss_type": "low_var_kl",
                            "eps_clip_high": 0.28, "use_kl_loss": True}
    assert cfg.kl_loss_coef == 0.0  # the flag without a coefficient: the term is exactly zero


def test_config_objects_are_read_like_dicts():
    """slime hands its argparse Namespace, SkyRL its dataclasses, OpenRLHF its hierarchized namespaces."""
    import argparse
    import dataclasses

    ns = argparse.Namespace(advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=0.28, use_kl_loss=True,
                            kl_loss_coef=0.0, grpo_std_normalization=False, n_samples_per_prompt=8)
    assert changed(from_slime(ns)) == {"n_samples_per_prompt": 8, "eps_clip_high": 0.28, "use_kl_loss": True}

    @dataclasses.dataclass
    class Algorithm:
        use_kl_loss: bool = False
        eps_clip_high: float = 0.28

    @dataclasses.dataclass
    class Trainer:
        algorithm: Algorithm = dataclasses.field(default_factory=Algorithm)

    @dataclasses.dataclass
    class SkyRL:
        trainer: Trainer = dataclasses.field(default_factory=Trainer)

    assert from_skyrl(SkyRL()).eps_clip_high == 0.28
    hier = argparse.Namespace(algo=argparse.Namespace(advantage=argparse.Namespace(estimator="group_norm"),
                                                      kl=argparse.Namespace(init_coef=0.0)),
                              rollout=argparse.Namespace(n_samples_per_prompt=4))
    assert (from_openrlhf(hier).advantage_estimator, from_openrlhf(hier).n_samples_per_prompt) == ("grpo", 4)


def test_slime_defaults_gspo_tis_icepop_per_token_and_disable_flags():
    """--eps-clip-high None → --eps-clip (arguments.py:1876-1877); gspo = GRPO advantages with one sequence
    ratio; --use-tis = clamp(w, tis_clip_low 0, tis_clip 2) (loss.py:884-905), icepop_function zeroes outside
    (loss.py:908-931); --calculate-per-token-loss is a token mean; --disable-* flags set their dest false."""
    assert changed(from_slime({})) == {"grpo_std_normalization": True}
    cfg = from_slime({"advantage_estimator": "gspo", "eps_clip": 0.3, "use_tis": True,
                      "calculate_per_token_loss": True, "disable_grpo_std_normalization": True})
    assert changed(cfg) == {"eps_clip": 0.3, "eps_clip_high": 0.3, "importance_level": "sequence",
                            "is_level": "token", "is_low": 0.0, "is_high": 2.0, "loss_agg_mode": "token_mean"}
    ice = from_slime(["--use-tis", "--tis-clip", "1.5", "--tis-clip-low", "0.5", "--custom-tis-function-path",
                      "slime.backends.megatron_utils.loss.icepop_function"])
    assert (ice.is_level, ice.is_mode, ice.is_low, ice.is_high) == ("token", "mask", 0.5, 1.5)
    assert parse_argv(["--eps-clip=0.1", "--x", "--y", "-3"]) == {"eps-clip": "0.1", "x": True, "y": "-3"}


@pytest.mark.parametrize("args, key, why", [
    ({"advantage_estimator": "cispo"}, "advantage_estimator", "not mapped"),
    ({"loss_type": "custom_loss"}, "loss_type", "only slime's policy_loss"),
    ({"custom_reward_post_process_path": "m.py:f"}, "custom_reward_post_process_path", "custom function"),
    ({"use_tis": True, "custom_tis_function_path": "my_tis.py:my_weights"},
     "custom_tis_function_path", "custom TIS"),
    ({"use_kl_loss": True, "kl_loss_coef": 0.01, "use_unbiased_kl": True}, "use_unbiased_kl", "importance"),
    ({"--grpo-reward-clip": 5.0}, "grpo_reward_clip", "a key the slime mapping does not know"),
])
def test_slime_refuses_by_name(args, key, why):
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_slime(args)
    assert str(err.value).startswith(f"slime config: {key}=") and why in str(err.value)


def test_skyrl_default_maps_its_kl_term_and_maps_without_it():
    """SkyRL's default has the KL term on (use_kl_loss true, 0.001, config.py:833,836), averaged per sequence and
    per micro-batch (worker.py:1077,1089) unlike the policy term: kl_loss_agg_mode seq_mean_token_mean (the
    knob itself: tests/test_skyrl_terms.py). Without it: GRPO, n=5
    (config.py:1225), token_mean (config.py:876), clip 0.2/0.2 (config.py:906-908), the log-ratio clamp ±20
    (ppo_utils.py:567), a group of one gets mean 0 / std 1 (ppo_utils.py:1378-1380); dual_clip uses c = 3
    (config.py:910); token TIS caps exp(clamp(Δ, ±20)) at 2 (config.py:797; off_policy_correction_utils.py:51,60)."""
    assert from_skyrl({}).kl_loss_agg_mode == "seq_mean_token_mean"
    cfg = from_skyrl({"trainer": {"algorithm": {"use_kl_loss": False}}})
    assert changed(cfg) == {"n_samples_per_prompt": 5, "grpo_std_normalization": True, "loss_agg_mode": "token_mean",
                            "log_ratio_clamp": 20.0, "singleton_group": "raw",
                            "metric_agg_mode": "micro_batch_token_mean"}
    dual = from_skyrl({"trainer": {"algorithm": {"kl_loss_coef": 0.0, "policy_loss_type": "dual_clip",
                                                 "off_policy_correction": {"tis_ratio_type": "token"}}},
                       "generator": {"n_samples_per_prompt": 8}})
    assert (dual.eps_clip_c, dual.n_samples_per_prompt) == (3.0, 8)
    assert (dual.is_level, dual.is_mode, dual.is_low, dual.is_high, dual.is_log_clamp) == ("token", "truncate", None,
                                                                                          2.0, 20.0)
    # prompt_mean: each prompt's token mean over the samples' group_index (ppo_utils.py:1209-1218)
    prompt = from_skyrl({"trainer": {"algorithm": {"use_kl_loss": False, "loss_reduction": "prompt_mean"}}})
    assert (prompt.loss_agg_mode, prompt.metric_agg_mode) == ("prompt_mean", "micro_batch_token_mean")


def test_nemo_rl_grpo_math_defaults_and_tis():
    """examples/configs/grpo_math_1B.yaml: 16 generations (:4), normalize_rewards + leave-one-out (:8-9), KL
    penalty k3 at 0.01 with clamps 20 / 10 (:80-85), clip 0.2/0.2 (:86-87), token-level loss (:102); the
    leave-one-out std divides only where > 0 (advantage_estimator.py:93-96), a prompt with one sample gets 0
    (utils.py:156-159). use_importance_sampling_correction with type tis clamps to [min default 0, max]
    (loss_functions.py:143-149)."""
    cfg = from_nemo_rl({})
    assert changed(cfg) == {
        "n_samples_per_prompt": 16, "grpo_std_normalization": True, "kl_loss_type": "k3", "use_kl_loss": True,
        "kl_loss_coef": 0.01, "loss_agg_mode": "token_mean", "kl_loss_input_clamp": 20.0,
        "kl_loss_output_clamp": 10.0, "group_baseline": "leave_one_out", "std_zero": "skip",
        "singleton_group": "zero", "kl_loss_score_function": True}  # loss_functions.py:487-490 (loss.grad)
    tis = from_nemo_rl({"loss_fn": {"use_importance_sampling_correction": True, "ratio_clip_max": 0.28,
                                    "truncated_importance_sampling_type": "tis",
                                    "truncated_importance_sampling_ratio": 2.0, "reference_policy_kl_penalty": 0}})
    assert (tis.is_level, tis.is_mode, tis.is_low, tis.is_high, tis.eps_clip_high, tis.use_kl_loss) == (
        "token", "truncate", 0.0, 2.0, 0.28, False)
    with pytest.raises(UnsupportedFrameworkConfig, match=r"grpo.advantage_clip_low=-5.0: NeMo-RL's advantage"):
        from_nemo_rl({"grpo": {"advantage_clip_low": -5.0}})
    # seq-mask-tis is mapped (an untruncated weight and a geometric keep mask); without its lower bound NeMo-RL asserts
    with pytest.raises(FrameworkConfigError, match=r"loss_fn.truncated_importance_sampling_ratio_min=None: expected a "
                                                   r"value with seq-mask-tis"):
        from_nemo_rl({"loss_fn": {"use_importance_sampling_correction": True,
                                  "truncated_importance_sampling_type": "seq-mask-tis"}})


def test_nemo_rl_reinforce_plus_plus_gspo_and_kl_in_reward():
    """Reinforce++ (advantage_estimator.py:233-265): the prompt's mean (no std, no leave-one-out) or, without
    minus_baseline, the raw reward, whitened with the biased variance floored at 1e-8; use_kl_in_reward zeroes the
    loss's KL coefficient (loss_functions.py:240-242) and the GRPO estimator never reads the KL; GSPO
    (sequence_level_importance_ratios with token_level_loss false) takes the sample's ratio and IS weight."""
    base = msgspec.to_builtins(from_nemo_rl({}))
    rpp = from_nemo_rl({"grpo": {"adv_estimator": {"name": "reinforce_plus_plus"}}})
    assert {k: v for k, v in msgspec.to_builtins(rpp).items() if base.get(k) != v} == {
        "advantage_estimator": "reinforce_plus_plus_baseline", "grpo_std_normalization": False,
        "group_baseline": "mean", "whiten_variance": "biased", "whiten_eps_mode": "clamp"}
    assert (rpp.grpo_std_normalization, rpp.group_baseline, rpp.rewards_normalization) == (False, "mean", True)
    raw = from_nemo_rl({"grpo": {"adv_estimator": {"name": "reinforce_plus_plus", "minus_baseline": False}}})
    assert (raw.advantage_estimator, raw.rewards_normalization) == ("reinforce_plus_plus_baseline", False)
    kl = from_nemo_rl({"loss_fn": {"use_kl_in_reward": True}})
    assert (kl.use_kl_loss, kl.kl_loss_coef, kl.kl_in_reward, kl.advantage_estimator) == (False, 0.0, None, "grpo")
    # the on-policy KL weighting is inert where no KL term is computed (loss_functions.py:469)
    for lf in ({"reference_policy_kl_penalty": 0}, {"use_kl_in_reward": True}):
        inert = from_nemo_rl({"loss_fn": {"use_on_policy_kl_approximation": True, **lf}})
        assert (inert.use_kl_loss, inert.kl_loss_coef) == (False, 0.0)
    gspo = from_nemo_rl({"loss_fn": {"sequence_level_importance_ratios": True, "token_level_loss": False,
                                     "use_importance_sampling_correction": True}})
    assert (gspo.importance_level, gspo.loss_agg_mode, gspo.log_ratio_clamp, gspo.is_level) == (
        "sequence", "seq_mean_token_mean", None, "sequence")


def test_yaml_interpolations_resolve_as_omegaconf_would():
    """A YAML read without OmegaConf keeps ``${grpo.normalize_rewards}`` (grpo_math_1B.yaml:41-42) and verl's
    ``${oc.select:path,default}`` / ``${.sibling}`` as strings: they are resolved against the same config."""
    cfg = from_nemo_rl({"grpo": {"normalize_rewards": False, "use_leave_one_out_baseline": True,
                                 "num_generations_per_prompt": "${grpo.group_size}", "group_size": 6,
                                 "adv_estimator": {"normalize_rewards": "${grpo.normalize_rewards}",
                                                   "use_leave_one_out_baseline": "${grpo.use_leave_one_out_baseline}"}}})
    assert (cfg.grpo_std_normalization, cfg.group_baseline, cfg.n_samples_per_prompt) == (False, "leave_one_out", 6)
    verl = from_verl({"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {
        "rollout": {"n": 8}, "actor": {"rollout_n": "${oc.select:actor_rollout_ref.rollout.n,1}",
                                       "clip_ratio_high": "${oc.select:actor_rollout_ref.actor.missing,0.28}",
                                       "clip_ratio_low": "${.clip_ratio}", "clip_ratio": 0.25}}})
    assert (verl.eps_clip, verl.eps_clip_high) == (0.25, 0.28)
    with pytest.raises(FrameworkConfigError, match=r"clip_ratio_c='\$\{oc.env:C\}': expected a number"):
        from_verl({"actor_rollout_ref": {"actor": {"clip_ratio_c": "${oc.env:C}"}}})


def test_openrlhf_dapo_recipe_and_default_kl_in_reward():
    """OpenRLHF 0.11.2 (openrlhf/cli/train_ppo_ray.py): the DAPO recipe — group_norm (std + 1e-9,
    experience_maker.py:274), n=8, k3 KL loss at 1e-3 (a token mean, clamped ±10, models/utils.py:112), clip
    0.2/0.27, token TIS [0.5, 5] (is_correction_level token, mode clip); every loss config carries
    actor.loss_agg_mode. The default KL is k1 in the reward (init_coef 0.01) clamped ±10, and the default
    reward.clip_range ±10: both mapped, never refused."""
    cfg = from_openrlhf({"algo.kl.init_coef": 1e-3, "algo.advantage.gamma": 1.0, "algo.kl.use_loss": True,
                         "algo.kl.estimator": "k3", "algo.advantage.estimator": "group_norm",
                         "algo.dynamic_filtering_enable": True, "algo.dynamic_filtering_range": [0, 1],
                         "actor.eps_clip_low_high": [0.2, 0.27], "actor.model_name_or_path": "m",
                         "rollout.n_samples_per_prompt": 8, "actor.adam.lr": 5e-7, "actor.loss_agg_mode": "token-mean",
                         "algo.advantage.is_correction_level": "token", "algo.advantage.is_correction_mode": "clip",
                         "algo.advantage.is_correction_threshold": [0.5, 5.0]})
    assert changed(cfg) == {
        "n_samples_per_prompt": 8, "grpo_std_normalization": True, "kl_loss_type": "k3", "eps_clip_high": 0.27,
        "use_kl_loss": True, "kl_loss_coef": 0.001, "loss_agg_mode": "token_mean", "metric_agg_mode": "token_mean",
        "kl_loss_agg_mode": "token_mean", "entropy_agg_mode": "token_mean", "log_ratio_clamp": 20.0,
        "kl_loss_output_clamp": 10.0, "is_level": "token", "is_low": 0.5, "is_high": 5.0, "grpo_std_eps": 1e-9,
        "kl_in_reward": "token_returns", "reward_clip_low": -10.0, "reward_clip_high": 10.0}
    default = from_openrlhf({"algo": {"advantage": {"estimator": "group_norm"}}, "rollout": {"n_samples_per_prompt": 8},
                             "actor": {"loss_agg_mode": "seq-mean-token-mean"}})
    assert (default.kl_in_reward, default.kl_coef, default.kl_penalty_type, default.kl_penalty_clamp,
            default.loss_agg_mode) == ("token_returns", 0.01, "k1", 10.0, "seq_mean_token_mean")
    for est, baseline in (("dr_grpo", "mean"), ("rloo", "leave_one_out")):
        mapped = from_openrlhf({"algo.advantage.estimator": est, "rollout.n_samples_per_prompt": 102})
        assert (mapped.advantage_estimator, mapped.group_baseline, mapped.reward_clip_low,
                mapped.reward_clip_high) == (est, baseline, -10.0, 10.0)
    # GSPO: a per-sample ratio and per-sample aggregation (models/loss.py:146-148,168-175), no log-ratio clamp;
    # its ppo_kl and clip_ratio are token means (loss.py:257-258), the KL and entropy terms too
    gspo = from_openrlhf({"algo.advantage.estimator": "group_norm", "rollout.n_samples_per_prompt": 8,
                          "algo.kl.init_coef": 0, "actor.policy_loss_type": "gspo", "actor.entropy_coef": 0.01})
    assert (gspo.importance_level, gspo.loss_agg_mode, gspo.metric_agg_mode, gspo.entropy_agg_mode,
            gspo.log_ratio_clamp) == ("sequence", "seq_mean_token_mean", "token_mean", "token_mean", None)


def test_openrlhf_adaptive_kl_maps_the_recorded_coefficient():
    """algo.kl.target set: the adaptive controller moves the coefficient between steps; the bundle records the
    step's as algo.kl.init_coef, applied as a fixed one (the same config without a target maps alike)."""
    adaptive = from_openrlhf({"algo.advantage.estimator": "rloo", "algo.kl.target": 0.1, "algo.kl.init_coef": 0.037})
    fixed = from_openrlhf({"algo.advantage.estimator": "rloo", "algo.kl.init_coef": 0.037})
    assert adaptive == fixed and adaptive.kl_coef == 0.037


@pytest.mark.parametrize("cfg, message", [
    ({"algo.advantage.estimator": "flash_reinforce"},
     "openrlhf config: algo.advantage.estimator='flash_reinforce': its baseline is the mean reward of the whole "
     "rollout batch (experience_maker.py:273-276), which a bundle of one optimizer step does not hold; record the "
     "centred reward as each sample's normalized reward, or every sample of the rollout batch in one bundle under "
     "one group_index, and map it as dr_grpo"),
    ({"algo.advantage.estimator": "rloo", "algo.advantage.is_correction_level": "seq",
      "algo.advantage.is_correction_gating": "binary_kl"},
     "openrlhf config: algo.advantage.is_correction_gating='binary_kl': at is_correction_level=seq OpenRLHF gates the "
     "sample's mean divergence (loss.py:233-234), which is not recomputed (is_keep's sequence masks read the ratio); "
     "a bundle would need a per-sample divergence keep mask"),
    ({"algo.advantage.estimator": "rloo", "actor.loss_agg_mode": "seq-mean-token-sum"},
     "openrlhf config: actor.loss_agg_mode='seq-mean-token-sum': not one of token-mean, seq-mean-token-mean"),
])
def test_openrlhf_refusals_name_the_key(cfg, message):
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_openrlhf(cfg)
    assert str(err.value) == message


def test_openrlhf_unknown_version_is_one_line_naming_the_known():
    assert from_openrlhf({"algo.advantage.estimator": "rloo"}, version="0.11.2").advantage_estimator == "rloo"
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_openrlhf({"algo.advantage.estimator": "rloo"}, version="0.9.0")
    assert str(err.value) == ("openrlhf config: framework_version='0.9.0': not a version this mapping knows "
                              "(known: 0.11.2)")


@pytest.mark.parametrize("fn, cfg, message", [
    (from_verl, {"actor_rollout_ref": {"actor": {"clip_ratio_c": "ten"}}},
     "verl config: actor_rollout_ref.actor.clip_ratio_c='ten': expected a number"),
    (from_slime, {"use_kl_loss": "yes"}, "slime config: use_kl_loss='yes': expected true or false"),
    (from_nemo_rl, {"grpo": {"num_generations_per_prompt": 2.5}},
     "nemo-rl config: grpo.num_generations_per_prompt=2.5: expected an integer"),
    (from_openrlhf, {"actor": {"eps_clip_low_high": [0.2]}},
     "openrlhf config: actor.eps_clip_low_high=[0.2]: expected two numbers [low, high]"),
    (from_verl, ["not", "a", "mapping"], "verl config: expected a mapping of settings, got list"),
])
def test_malformed_values_are_one_line_errors(fn, cfg, message):
    with pytest.raises(FrameworkConfigError) as err:
        fn(cfg)
    assert str(err.value) == message and err.value.exit_code == 3


def test_config_command_prints_the_mapped_json_in_a_real_process(tmp_path):
    path = tmp_path / "verl.json"
    path.write_text(json.dumps({"algorithm": {"adv_estimator": "grpo"},
                                "actor_rollout_ref": {"actor": {"clip_ratio_high": 0.28, "clip_ratio_c": 10.0}}}))
    proc = subprocess.run([sys.executable, "-m", "replay_lib", "config", "verl", str(path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["eps_clip_high"], doc["eps_clip_c"], doc["loss_agg_mode"]) == (0.28, 10.0, "token_mean")
    assert msgspec.convert(doc, RecomputeConfig) == from_verl(json.loads(path.read_text()))


def test_config_command_errors(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["config", "slime", str(bad)]) == 3
    assert capsys.readouterr().err.strip() == (f"trajectory-replay: error: {bad}: not JSON (Expecting property "
                                               "name enclosed in double quotes at line 1 column 2)")
    refused = tmp_path / "slime.json"
    refused.write_text(json.dumps(["--advantage-estimator", "cispo"]))
    assert main(["config", "slime", str(refused)]) == 4
    assert capsys.readouterr().err.strip() == (f"trajectory-replay: error: {refused}: slime config: "
                                               "advantage_estimator='cispo': not mapped (grpo, gspo, ppo, "
                                               "reinforce_plus_plus and reinforce_plus_plus_baseline are)")
    yaml_file = tmp_path / "nemo.yaml"
    yaml_file.write_text("grpo:\n  num_generations_per_prompt: 4\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # PyYAML absent: the tool does not depend on it
    assert main(["config", "nemo-rl", str(yaml_file)]) == 4
    assert capsys.readouterr().err.strip() == (f"trajectory-replay: error: {yaml_file}: reading YAML needs PyYAML, "
                                               "which is not installed; give the config as JSON (or pip install "
                                               "pyyaml)")
    assert main(["config", "nemo-rl", str(tmp_path / "absent.json")]) == 3
    assert "absent.json" in capsys.readouterr().err


def test_skyrl_gspo_maps_to_the_sequence_ratio_and_another_loss_type_refuses():
    """SkyRL @ a9564572 gspo_policy_loss (ppo_utils.py:663-729): exp of the sample's masked mean log-ratio clamped
    at max 10, no dual-clip, the configured loss_reduction — verl's GSPO; the loss families still refuse by name."""
    algo = "trainer.algorithm"
    cfg = from_skyrl({"trainer": {"algorithm": {"policy_loss_type": "gspo", "loss_reduction": "sequence_mean",
                                                "use_kl_loss": False}}})
    assert (cfg.importance_level, cfg.log_ratio_clamp, cfg.eps_clip_c, cfg.loss_agg_mode, cfg.metric_agg_mode) == (
        "sequence", 10.0, None, "seq_mean_token_mean", "micro_batch_token_mean")
    assert from_skyrl({}).importance_level == "token"
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_skyrl({"trainer": {"algorithm": {"policy_loss_type": "my_loss"}}})
    assert str(err.value) == (f"skyrl config: {algo}.policy_loss_type='my_loss': not mapped (regular, dual_clip, "
                              "gspo, cispo, sapo, dppo, cross_entropy, importance_sampling, rollout_is, clip_cov, "
                              "kl_cov are)")
    dppo = from_skyrl({"trainer": {"algorithm": {"policy_loss_type": "dppo"}}})  # config.py:778-784 defaults
    assert (dppo.policy_loss, dppo.policy_loss_params, dppo.eps_clip, dppo.eps_clip_high) == (
        "dppo_mu", {"divergence": "tv", "anchor": "rollout"}, 0.2, 0.2)


def test_skyrl_kl_in_reward_fixed_and_adaptive_map():
    """use_kl_in_reward (trainer.py:1409-1436): rewards − max(0, kl_loss_coef)·kl, the KL × loss_mask
    (ppo_utils.py:122-125) and the advantages × response_mask; GRPO and RLOO sum the token rewards
    (ppo_utils.py:1284,1367). Under the adaptive controller the coefficient changes every step: the bundle records
    the step's as kl_loss_coef."""
    algo = {"use_kl_in_reward": True, "use_kl_loss": False}
    cfg = from_skyrl({"trainer": {"algorithm": algo}})
    assert (cfg.kl_in_reward, cfg.kl_coef, cfg.kl_penalty_type, cfg.masked_token_value, cfg.kl_masked_token_value,
            cfg.use_kl_loss) == ("sequence", 0.001, "low_var_kl", "computed", "zero", False)
    rloo = from_skyrl({"trainer": {"algorithm": {**algo, "advantage_estimator": "rloo", "kl_estimator_type": "k2",
                                                 "kl_loss_coef": -0.5}}})
    assert (rloo.kl_in_reward, rloo.kl_coef, rloo.kl_penalty_type) == ("sequence", 0.0, "k2")
    # adaptive: the step's coefficient, recorded as kl_loss_coef, applied as a fixed one
    adaptive = from_skyrl({"trainer": {"algorithm": {**algo, "kl_loss_coef": 0.0123,
                                                     "kl_ctrl": {"type": "adaptive", "kl_target": 0.1}}}})
    assert (adaptive.kl_in_reward, adaptive.kl_coef) == ("sequence", 0.0123)
    refusals = {
        "kl_ctrl": ({"kl_ctrl": {"type": "pid"}}, "trainer.algorithm.kl_ctrl.type='pid': not one of fixed, adaptive"),
        "kl_loss": ({"use_kl_loss": True},
                    "trainer.algorithm.use_kl_loss=True: SkyRL rejects use_kl_in_reward with use_kl_loss "
                    "(skyrl/train/utils/utils.py:312-314: \"mutually exclusive\"); set use_kl_loss=false"),
        "reinforce++": ({"advantage_estimator": "reinforce++"},
                        "trainer.algorithm.use_kl_in_reward=True: the token rewards minus kl_loss_coef·kl "
                        "(trainer.py:1409-1436) enter reinforce++'s per-token recursion (ppo_utils.py:1225-1257), "
                        "which no reference sweep of this mapping checks against SkyRL's code; not mapped (grpo and "
                        "rloo, which sum them, are)"),
    }
    for name, (extra, want) in refusals.items():
        with pytest.raises(UnsupportedFrameworkConfig) as err:
            from_skyrl({"trainer": {"algorithm": {**algo, **extra}}})
        assert (str(err.value), err.value.exit_code) == ("skyrl config: " + want, 4), name


@pytest.mark.parametrize("section, keep", [
    ({"sequence_mask_metric": "geometric"}, {"geometric": [0.99, 1.01]}),  # config.py:803-806 defaults
    ({"sequence_mask_metric": "product", "product_mask_low": 0.25}, {"product": [0.25, 2.0]}),  # :807-810
    ({"token_mask_is_threshold_low": 0.5, "token_mask_is_threshold_high": 2.0}, {"token": [0.5, 2.0]}),
    ({"outlier_token_is_threshold_low": 1e-4}, {"outlier": [1e-4, None]}),
    ({"outlier_token_is_threshold_high": 100.0, "sequence_mask_metric": "geometric", "geo_mask_high": 1.05,
      "tis_ratio_type": "token"}, {"outlier": [None, 100.0], "geometric": [0.99, 1.05]}),
])
def test_skyrl_is_masks_map_to_is_keep(section, keep):
    """off_policy_correction's masks (opc.py:297-345 @ a9564572) map to is_keep, the TIS knobs beside them."""
    cfg = from_skyrl({"trainer": {"algorithm": {"off_policy_correction": section}}})
    assert cfg.is_keep == keep
    assert cfg.is_level == section.get("tis_ratio_type")


@pytest.mark.parametrize("section, message, code", [
    ({"sequence_mask_metric": "harmonic"}, "trainer.algorithm.off_policy_correction.sequence_mask_metric='harmonic': "
     "not one of geometric, product (opc.py:220-253)", 4),
    ({"token_mask_is_threshold_low": 0.5, "token_mask_is_threshold_high": 2.0, "tis_ratio_type": "sequence"},
     "trainer.algorithm.off_policy_correction.tis_ratio_type='sequence': a sequence TIS ratio over the loss mask "
     "SkyRL's token mask left (opc.py:327-338) is not recomputed (the replay sums it over the recorded mask); use "
     "token TIS or no token mask", 4),
    ({"sequence_mask_metric": "geometric", "geo_mask_low": 1.2}, "trainer.algorithm.off_policy_correction="
     "{'geometric': [1.2, 1.01]}: expected mask bounds 0 < low <= high (low 1.2 is above high 1.01)", 3),
])
def test_skyrl_is_masks_refused_or_invalid_in_one_line(section, message, code):
    with pytest.raises((UnsupportedFrameworkConfig, FrameworkConfigError)) as err:
        from_skyrl({"trainer": {"algorithm": {"off_policy_correction": section}}})
    assert (str(err.value), err.value.exit_code) == ("skyrl config: " + message, code)


@pytest.mark.parametrize("bound, other", [("high", "low"), ("low", "high")])
def test_skyrl_token_mask_with_one_bound_is_inert(bound, other):
    """SkyRL applies the per-token mask only when both thresholds are set (opc.py:17-20, 297-301): one bound alone
    maps to the config without it, with a note saying so."""
    from replay_lib.frameworks._base import ConfigReader

    notes: list = []
    original = ConfigReader.note
    ConfigReader.note = lambda self, text: (notes.append(text), original(self, text))[1]
    try:
        got = from_skyrl({"trainer": {"algorithm": {"off_policy_correction": {
            f"token_mask_is_threshold_{bound}": 5.0}}}})
    finally:
        ConfigReader.note = original
    assert got == from_skyrl({"trainer": {"algorithm": {}}})
    assert notes == [f"trainer.algorithm.off_policy_correction.token_mask_is_threshold_{bound}=5.0: inert without "
                     f"token_mask_is_threshold_{other} (SkyRL masks tokens only with both bounds, opc.py:17-20, "
                     "297-301)"]


def test_skyrl_estimators_reductions_metrics_and_masked_tokens():
    """NovaSky-AI/SkyRL @ a9564572 (skyrl/backends/skyrl_train/utils/ppo_utils.py, workers/worker.py): clip_ratio is
    each micro-batch's masked token mean (ppo_utils.py:571) averaged over the micro-batches (worker.py:898,
    worker_utils.py:61-90) whatever loss_reduction is; rloo gives a group of one 0 (ppo_utils.py:1303-1306);
    reinforce++ is ours; token_mean_legacy is the mean of per-micro-batch token means (ppo_utils.py:1184-1196);
    the advantages are × response_mask, the response indicator (preprocess.py:131-137), so interior
    loss-mask-0 tokens keep their computed value."""
    algo = "trainer"
    for reduction, mode in (("token_mean", "token_mean"), ("sequence_mean", "seq_mean_token_mean"),
                            ("token_mean_legacy", "micro_batch_token_mean")):
        cfg = from_skyrl({algo: {"algorithm": {"loss_reduction": reduction}}})
        assert (cfg.loss_agg_mode, cfg.metric_agg_mode) == (mode, "micro_batch_token_mean")
    norm = from_skyrl({algo: {"algorithm": {"loss_reduction": "seq_mean_token_sum_norm", "max_seq_len": 512}}})
    assert (norm.loss_agg_mode, norm.loss_horizon, norm.metric_agg_mode) == (
        "seq_mean_token_sum_norm", 512, "micro_batch_token_mean")
    rloo = from_skyrl({algo: {"algorithm": {"advantage_estimator": "rloo"}}})
    assert (rloo.advantage_estimator, rloo.singleton_group, rloo.masked_token_value) == ("rloo", "zero", "computed")
    grpo = from_skyrl({})
    assert (grpo.advantage_estimator, grpo.singleton_group, grpo.masked_token_value) == ("grpo", "raw", "computed")
    rpp = from_skyrl({algo: {"algorithm": {"advantage_estimator": "reinforce++", "gamma": 0.9}}})
    assert (rpp.advantage_estimator, rpp.gamma, rpp.singleton_group) == ("reinforce_plus_plus", 0.9, None)
    maxrl = from_skyrl({algo: {"algorithm": {"advantage_estimator": "maxrl"}}})
    assert (maxrl.advantage_estimator, maxrl.grpo_std_eps, maxrl.masked_token_value) == ("maxrl", 1e-6, "computed")
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_skyrl({algo: {"algorithm": {"advantage_estimator": "my_estimator"}}})
    assert str(err.value) == ("skyrl config: trainer.algorithm.advantage_estimator='my_estimator': not mapped "
                              "(grpo, rloo, reinforce++, gae, maxrl are)")


def test_config_command_says_which_keys_came_from_the_file(tmp_path, capsys):
    """stdout stays the mapped JSON; stderr lists the keys the mapping read, from the file or at the defaults, and
    an empty file (``verl {}``) is said to give every default (it silently gave verl's default estimator, gae)."""
    path = tmp_path / "verl.json"
    path.write_text(json.dumps({"algorithm": {"adv_estimator": "grpo"},
                                "actor_rollout_ref": {"actor": {"clip_ratio_high": 0.28}}}))
    assert main(["config", "verl", str(path)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["eps_clip_high"] == 0.28
    lines = err.splitlines()
    # 27 at the defaults: distillation.enabled (on-policy distillation, off) among them
    assert lines[0] == f"verl keys read from {path}: 2 set by the file, 27 at verl's defaults"
    assert [ln.split()[:2] for ln in lines[1:3]] == [["file", "algorithm.adv_estimator"],
                                                     ["file", "actor_rollout_ref.actor.clip_ratio_high"]]
    assert lines[1].endswith("= 'grpo'") and lines[2].endswith("= 0.28")
    assert all(ln.split()[0] == "default" for ln in lines[3:]) and len(lines) == 3 + 27
    assert any(ln.split()[1] == "distillation.enabled" and ln.endswith("= False") for ln in lines)
    assert any(ln.split()[1] == "actor_rollout_ref.actor.clip_ratio_c" and ln.endswith("= 3.0") for ln in lines)
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    assert main(["config", "verl", str(empty)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["advantage_estimator"] == "gae"
    assert err.splitlines()[1] == (f"none of the keys the verl mapping reads is in {empty}: every knob above is "
                                   f"verl's default (check the file's nesting, e.g. algorithm.adv_estimator)")
    assert "default  algorithm.adv_estimator" in err and "= 'gae'" in err


def test_slime_opsm_and_opd_map_to_their_knobs():
    # OPSM (utils/ppo_utils.py:54-92, loss.py:1010-1046): old − current, opsm_delta default 1e-4 (arguments.py:1110)
    cfg = from_slime(["--use-opsm", "--opsm-delta", "0.001"])
    assert (cfg.opsm_delta, cfg.opsm_anchor) == (0.001, "old")
    assert from_slime(["--use-opsm"]).opsm_delta == 1e-4
    # OPD (backends/megatron_utils/loss.py:663-701): A − opd_kl_coef·(old − teacher), in the advantages
    cfg = from_slime({"use_opd": True, "opd_type": "sglang", "opd_kl_coef": 0.5})
    assert (cfg.opd_placement, cfg.opd_kl_type, cfg.opd_coef) == ("advantage", "k1", 0.5)
    assert from_slime({"use_opd": True, "opd_type": "sglang"}).opd_coef == 1.0


def test_skyrl_tinker_losses_and_rollout_is_map_to_their_families():
    # cross_entropy sums −logp (ppo_utils.py:1057-1092, reduce_loss :1145-1149); importance_sampling and rollout_is
    # take the configured reduction, as the clipped loss does (SkyRL folds it into the advantages)
    algo = {"use_kl_loss": False, "loss_reduction": "sequence_mean"}
    ce = from_skyrl({"trainer": {"algorithm": dict(algo, policy_loss_type="cross_entropy")}})
    assert (ce.policy_loss, ce.loss_agg_mode) == ("cross_entropy", "token_sum")
    for kind in ("importance_sampling", "rollout_is"):
        cfg = from_skyrl({"trainer": {"algorithm": dict(algo, policy_loss_type=kind, eps_clip_low=0.1)}})
        assert (cfg.policy_loss, cfg.loss_agg_mode, cfg.eps_clip) == (kind, "seq_mean_token_mean", 0.1)


def test_config_command_says_an_adaptive_coefficient_must_be_the_steps(tmp_path, capsys):
    """An adaptive KL controller maps, the file's coefficient read as the step's: the config command says the
    bundle must hold the step's value (the file's is the controller's start)."""
    path = tmp_path / "verl.json"
    path.write_text(json.dumps({"algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": True,
                                              "kl_ctrl": {"type": "adaptive", "kl_coef": 0.002}}}))
    assert main(["config", "verl", str(path)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["kl_coef"] == 0.002
    assert err.splitlines()[-1] == (
        "algorithm.kl_ctrl.type=adaptive: a bundle's kl_coef must be its step's coefficient (the controller's value, "
        "logged as actor/reward_kl_penalty_coeff); 0.002 from the file is its start, right at the first step only")


def test_verl_rollout_rs_maps_and_a_bad_chain_is_one_line():
    """verl's rejection sampling (rollout_corr_helper.py:197-413) maps to the recompute knobs; a chain or threshold
    verl itself rejects (no threshold, an unknown option, a k2 bound with '_') is a malformed config (exit 3)."""
    from replay_lib.errors import FrameworkConfigError

    cfg = from_verl({"algorithm": {"rollout_correction": {"rollout_rs": "token_k1,seq_mean_k3",
                                                          "rollout_rs_threshold": "0.5_2.0,0.01"}}})
    assert (cfg.rollout_rs, cfg.rollout_rs_threshold) == ("token_k1,seq_mean_k3", "0.5_2.0,0.01")
    cfg = from_verl({"algorithm": {"rollout_correction": {"rollout_rs": "seq_max_k2", "rollout_rs_threshold": 0.1}}})
    assert (cfg.rollout_rs, cfg.rollout_rs_threshold) == ("seq_max_k2", 0.1)
    for rc, message in (({"rollout_rs": "seq_mean_k1"},
                         "rollout_rs_threshold=None: expected a threshold with rollout_rs (required), got None"),
                        ({"rollout_rs": "token_k4", "rollout_rs_threshold": 1.0},
                         "rollout_rs='token_k4': expected options among token_k1, "),
                        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_0.2"},
                         "rollout_rs_threshold='0.1_0.2': expected one positive number for token_k2, got '0.1_0.2'")):
        with pytest.raises(FrameworkConfigError) as err:
            from_verl({"algorithm": {"rollout_correction": rc}})
        assert str(err.value).startswith("verl config: algorithm.rollout_correction.rollout_rs") and \
            message in str(err.value), str(err.value)
        assert err.value.exit_code == 3


def test_skyrl_kl_cov_maps_with_skyrls_prescaled_advantages():
    """SkyRL's KL-Cov is verl's formula on the advantages pre-scaled by the loss reduction, summed
    (tests/conformance/test_skyrl_cov.py replays it): the family's advantages="prescaled"."""
    cfg = from_skyrl({"trainer": {"algorithm": {"policy_loss_type": "kl_cov", "kl_cov": {"kl_cov_frac": 0.1}}}})
    assert (cfg.policy_loss, cfg.policy_loss_params) == (
        "kl_cov", {"kl_cov_ratio": 0.1, "ppo_kl_coef": 1.0, "advantages": "prescaled"})
