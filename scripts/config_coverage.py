"""How many of the configs each framework *registers* the mappings refuse, measured from the frameworks' own code.

    python scripts/config_coverage.py [--framework verl ...] [--markdown FILE] [--json FILE]

A **config** is one registered value of one choice axis applied to the framework's defaults, one factor at a time
(every other key at its default), plus a few realistic combinations (the recipes each framework ships or documents).
Where the framework is installed here its choices are read from its code: verl 0.9.1 (``ADV_ESTIMATOR_REGISTRY``,
``POLICY_LOSS_REGISTRY``, the ``loss_agg_mode`` branches of ``agg_loss``, the KL types of ``kl_penalty_forward``,
the controllers of ``get_kl_controller``; defaults from ``verl/trainer/config/_generated_ppo_trainer.yaml``),
OpenRLHF 0.11.2 (the ``choices=`` of the real ``train_ppo_ray`` argument parser, built by running the statements of
its ``__main__`` block up to ``parse_args``; defaults from ``parse_args([])``) and TRL 1.16 (the string values the
trainer and ``GRPOConfig`` compare each attribute with; every config built as a real ``GRPOConfig``). SkyRL @
a9564572 and NeMo-RL @ 7ea279ab do not install here: their lists are written below with their file:line.

Each config is mapped with ``replay_lib.frameworks`` and classified:

* ``mapped``: the mapping returns a ``RecomputeConfig``;
* ``refused``: ``UnsupportedFrameworkConfig`` (exit 4), with its message;
* a registered policy surrogate other than the PPO clipped one (CISPO, SAPO, GMPO, DPPO, clip_cov, kl_cov, DRO,
  GPG, LUSPO, VESPO, …) is a policy-loss family (``replay_lib.kernels.families``): mapped or refused like any other
  config (until the families landed it was counted apart, as ``loss family``);
* ``framework error``: the framework's own code rejects the config (verl's ``kl_penalty="full"`` raises
  ``NotImplementedError``; a ``GRPOConfig`` that raises): not a runnable config, counted apart.

The refused fraction is refused / (mapped + refused). ``--markdown`` writes the refusals as a table (framework,
key=value, reason, what a bundle would need, the last two from the refusal message).
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import importlib.util
import inspect
import json
import os
import re
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from replay_lib.errors import FrameworkConfigError, UnsupportedFrameworkConfig  # noqa: E402

MAPPED, REFUSED, FAMILY, FRAMEWORK_ERROR = "mapped", "refused", "loss family", "framework error"
INSTALLED = ("verl", "openrlhf", "trl")  # read from their installed code
FROM_SOURCE = ("skyrl", "nemo-rl")  # read from their source at a pinned commit (lists below)
ALL = INSTALLED + FROM_SOURCE
NAMES = {"verl": "verl 0.9.1", "openrlhf": "OpenRLHF 0.11.2", "trl": "TRL 1.16", "skyrl": "SkyRL @ a9564572",
         "nemo-rl": "NeMo-RL @ 7ea279ab"}


class Unavailable(Exception):
    """The framework is not installed (or not the version read) here."""


@dataclasses.dataclass
class Config:
    label: str  # "key=value[, key=value]" as the framework spells it
    build: Callable[[], Any]  # the config object the mapping reads
    family: bool = False  # a policy-loss family (the next issue)
    kind: str = "axis"  # "axis" (one factor at a time) or "combination"
    rejected: str = ""  # why the framework's own code rejects it (from source: it is not run here)


@dataclasses.dataclass
class Result:
    framework: str
    label: str
    kind: str
    status: str
    message: str = ""

    @property
    def path_value(self) -> str:
        """The ``key=value`` the refusal names (the mapping's own spelling), else the config's label."""
        m = re.match(r"^(?:.*?config): (.+?): ", self.message)
        return m.group(1) if m else self.label

    @property
    def why(self) -> str:
        m = re.match(r"^(?:.*?config): .+?=.*?: (.*)$", self.message)
        return m.group(1) if m else self.message


def _set(cfg: dict, path: str, value: Any) -> dict:
    node = cfg
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return cfg


def _label(overrides: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in overrides.items())


def _string_constants(fn_or_source: Any, subject: str) -> list[str]:
    """The string constants the code compares ``subject`` (a name or an attribute name) with, in order."""
    source = fn_or_source if isinstance(fn_or_source, str) else textwrap.dedent(inspect.getsource(fn_or_source))
    out: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        left = node.left
        name = left.attr if isinstance(left, ast.Attribute) else left.id if isinstance(left, ast.Name) else None
        if name != subject:
            continue
        for comp in node.comparators:
            for c in comp.elts if isinstance(comp, (ast.Tuple, ast.List, ast.Set)) else [comp]:
                if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value not in out:
                    out.append(c.value)
    return out


# ---------------------------------------------------------------------------------------------------------- verl

VERL_PPO_CLIP = ("vanilla", "gspo", "bypass_mode")  # bypass_mode: PPO-clip (its default) against rollout log-probs


def _import_verl() -> Any:
    if importlib.util.find_spec("verl") is None:
        raise Unavailable("verl is not installed (pip install --no-deps verl==0.9.1 and the [conformance] extra)")
    spec = importlib.util.spec_from_file_location("_coverage_stubs", ROOT / "tests" / "conformance" / "conftest.py")
    stubs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stubs)
    stubs.install_stubs(stubs.VERL_HEAVY)
    try:
        import verl
        from verl.trainer.ppo import core_algos
    except ImportError as exc:
        raise Unavailable(f"verl is not importable here ({exc})") from None
    if getattr(verl, "__version__", None) != "0.9.1":
        raise Unavailable(f"verl {getattr(verl, '__version__', None)} installed; this reads verl 0.9.1")
    return core_algos


def verl_configs() -> list[Config]:
    core = _import_verl()
    import torch
    from omegaconf import OmegaConf

    yaml = Path(core.__file__).resolve().parents[1] / "config" / "_generated_ppo_trainer.yaml"
    base = OmegaConf.to_container(OmegaConf.load(yaml), resolve=True)
    A, ACT = "algorithm", "actor_rollout_ref.actor"
    # verl asserts a micro-batch size unless use_dynamic_bsz (workers/config/actor.py:199-209: ActorConfig's
    # __post_init__); the generated yaml leaves both null, so every run sets one: 8, as examples/grpo_trainer does
    base["actor_rollout_ref"]["actor"]["ppo_micro_batch_size_per_gpu"] = 8

    def cfg(overrides: dict, family: bool = False, kind: str = "axis") -> Config:
        def build() -> dict:
            c = copy.deepcopy(base)
            for k, v in overrides.items():
                _set(c, k, v)
            return c
        return Config(_label(overrides) or "(defaults)", build, family, kind)

    def kl_runs(name: str) -> bool:
        try:
            core.kl_penalty(torch.zeros(1), torch.zeros(1), name)
        except NotImplementedError:
            return False
        return True

    kl_types = _string_constants(core.kl_penalty_forward, "kl_penalty")  # core_algos.py:2216-2251
    out = [cfg({})]
    # GDPO runs only with its reward components named (verl asserts gdpo_reward_keys, core_algos.py:413-417)
    gdpo_keys = {f"{A}.gdpo_reward_keys": ["accuracy_reward", "format_reward"]}
    out += [cfg({f"{A}.adv_estimator": e, **(gdpo_keys if e == "gdpo" else {})}) for e in core.ADV_ESTIMATOR_REGISTRY]
    out += [cfg({f"{ACT}.policy_loss.loss_mode": m}, family=m not in VERL_PPO_CLIP)
            for m in core.POLICY_LOSS_REGISTRY]
    out += [cfg({f"{ACT}.loss_agg_mode": m}) for m in _string_constants(core.agg_loss, "loss_agg_mode")]
    # the KL loss: each type, and its '+' straight-through form (kl_penalty strips it, core_algos.py:2200-2203)
    out += [cfg({f"{ACT}.use_kl_loss": True, f"{ACT}.kl_loss_type": t}) for t in kl_types]
    out += [cfg({f"{ACT}.use_kl_loss": True, f"{ACT}.kl_loss_type": t + "+"}) for t in kl_types]
    out += [cfg({f"{A}.use_kl_in_reward": True, f"{A}.kl_penalty": t}) for t in kl_types]
    out += [cfg({f"{A}.use_kl_in_reward": True, f"{A}.kl_ctrl.type": t})
            for t in _string_constants(core.get_kl_controller, "type")]
    out += [cfg({f"{A}.adv_estimator": "grpo", f"{A}.norm_adv_by_std_in_grpo": False})]
    combos = [
        # examples/grpo_trainer/run_qwen2-7b.sh: GRPO with the low-variance KL loss
        {f"{A}.adv_estimator": "grpo", "actor_rollout_ref.rollout.n": 5, f"{ACT}.use_kl_loss": True,
         f"{ACT}.kl_loss_coef": 0.001, f"{ACT}.kl_loss_type": "low_var_kl", f"{ACT}.entropy_coeff": 0},
        # DAPO (recipe/dapo): clip-higher, token-mean, no KL
        {f"{A}.adv_estimator": "grpo", "actor_rollout_ref.rollout.n": 16, f"{ACT}.clip_ratio_low": 0.2,
         f"{ACT}.clip_ratio_high": 0.28, f"{ACT}.loss_agg_mode": "token-mean"},
        # Dr. GRPO (docs/algo/grpo.md)
        {f"{A}.adv_estimator": "grpo", f"{A}.norm_adv_by_std_in_grpo": False,
         f"{ACT}.loss_agg_mode": "seq-mean-token-sum-norm"},
        # GSPO (examples/gspo_trainer)
        {f"{A}.adv_estimator": "grpo", f"{ACT}.policy_loss.loss_mode": "gspo", f"{ACT}.clip_ratio_low": 0.0003,
         f"{ACT}.clip_ratio_high": 0.0004, f"{ACT}.loss_agg_mode": "seq-mean-token-mean"},
        # PPO with the in-reward KL (examples/ppo_trainer)
        {f"{A}.adv_estimator": "gae", f"{A}.use_kl_in_reward": True, f"{A}.kl_penalty": "kl"},
        # REINFORCE++ with the k3+ KL loss
        {f"{A}.adv_estimator": "reinforce_plus_plus", f"{ACT}.use_kl_loss": True, f"{ACT}.kl_loss_type": "k3+"},
        # RLOO with the in-reward KL (examples/rloo_trainer)
        {f"{A}.adv_estimator": "rloo", f"{A}.use_kl_in_reward": True, f"{A}.kl_penalty": "kl"},
    ]
    out += [cfg(c, kind="combination") for c in combos]
    for c in out:  # DRO without its beta: verl raises (core_algos.py:2028-2030, dro_beta null in actor.yaml:80)
        if c.label == f"{ACT}.policy_loss.loss_mode=dro":
            c.rejected = ("verl raises ValueError: policy_loss.dro_beta must be a positive value when using DRO "
                          "(core_algos.py:2028-2030; dro_beta defaults to null, actor.yaml:80)")
    for c in out:  # a KL type verl's own code raises NotImplementedError for
        for key in (f"{ACT}.kl_loss_type", f"{A}.kl_penalty"):
            m = re.search(re.escape(key) + r"=([^,]+)", c.label)
            if m and not kl_runs(m.group(1)):
                c.kind = "unimplemented"
    return out


# ------------------------------------------------------------------------------------------------------ OpenRLHF

def openrlhf_parser() -> argparse.ArgumentParser:
    """OpenRLHF's ``train_ppo_ray`` parser, built by its own statements (the ``__main__`` block up to
    ``parse_args``; the module's stdlib imports run first, nothing of ray or deepspeed is imported)."""
    try:
        spec = importlib.util.find_spec("openrlhf.cli.train_ppo_ray")
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        raise Unavailable("openrlhf is not installed (pip install --no-deps openrlhf==0.11.2)")
    from importlib.metadata import version

    if version("openrlhf") != "0.11.2":
        raise Unavailable(f"openrlhf {version('openrlhf')} installed; this reads 0.11.2")
    path = spec.origin
    tree = ast.parse(Path(path).read_text(), path)
    scope: dict[str, Any] = {"__name__": "openrlhf_train_ppo_ray_parser"}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if all(n.split(".")[0] in sys.stdlib_module_names for n in names):
                exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), scope)
    main = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    body = []
    for stmt in main.body:
        if "parse_args" in ast.unparse(stmt):
            break
        body.append(stmt)
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), scope)
    return scope["parser"]


def openrlhf_configs() -> list[Config]:
    parser = openrlhf_parser()
    base = vars(parser.parse_args([]))
    choices = {a.dest: list(a.choices) for a in parser._actions if a.choices}
    # cli/train_ppo_ray.py:651-657 asserts n_samples_per_prompt > 1 for these
    grouped = ("rloo", "reinforce_baseline", "group_norm", "dr_grpo")

    def cfg(overrides: dict, kind: str = "axis") -> Config:
        label = _label(overrides) or "(defaults)"
        over = dict(overrides)
        if over.get("algo.advantage.estimator", base["algo.advantage.estimator"]) in grouped:
            over.setdefault("rollout.n_samples_per_prompt", 8)
        return Config(label, lambda: {**base, **over}, kind=kind)

    math_axes = ("algo.advantage.estimator", "actor.policy_loss_type", "actor.loss_agg_mode", "algo.kl.estimator")
    out = [cfg({})]
    for dest in math_axes:
        out += [cfg({dest: v}) for v in choices[dest]]
    out += [cfg({"algo.kl.use_loss": True, "algo.kl.estimator": v}) for v in choices["algo.kl.estimator"]]
    out += [cfg({"algo.advantage.is_correction_level": v}) for v in choices["algo.advantage.is_correction_level"]]
    # a divergence gate takes a single upper bound (PolicyLoss raises on the default [0.5, 5], models/loss.py:171-172;
    # the parser's help: "a single HIGH for an upper bound only (a trust-region delta)")
    delta = {"binary_kl": [0.01], "tv": [0.1]}
    for dest in ("algo.advantage.is_correction_mode", "algo.advantage.is_correction_gating"):
        out += [cfg({"algo.advantage.is_correction_level": "token", dest: v,
                     **({"algo.advantage.is_correction_threshold": delta[v]} if v in delta else {})})
                for v in choices[dest]]
    # store_true switches and the knobs that turn a term on (cli.py:414-416, 436-438, 458-473, 526-541)
    out += [cfg(o) for o in (
        {"algo.kl.use_loss": True}, {"algo.kl.init_coef": 0.0}, {"algo.kl.target": 0.1},
        {"algo.kl.use_loss": True, "algo.kl.unbiased_gradient": True}, {"algo.advantage.no_std_norm": True},
        {"reward.normalize_enable": True}, {"actor.dual_clip": 3.0}, {"actor.entropy_coef": 0.01},
        {"reward.overlong_buffer_len": 1024.0}, {"reward.stop_properly_penalty_coef": 0.0},
    )]
    combos = [
        # examples/scripts/train_grpo_ray_hybrid_engine.sh-style GRPO: group_norm, the k3 KL loss
        {"algo.advantage.estimator": "group_norm", "rollout.n_samples_per_prompt": 8, "algo.kl.use_loss": True,
         "algo.kl.estimator": "k3", "algo.kl.init_coef": 1e-3},
        # Dr. GRPO without KL
        {"algo.advantage.estimator": "dr_grpo", "rollout.n_samples_per_prompt": 8, "algo.kl.init_coef": 0.0},
        # REINFORCE++ (examples/scripts/train_reinforce_llama_ray.sh): the in-reward k2 KL
        {"algo.advantage.estimator": "reinforce", "algo.kl.estimator": "k2", "algo.kl.init_coef": 0.01},
        # REINFORCE++-baseline with the k2 KL loss
        {"algo.advantage.estimator": "reinforce_baseline", "rollout.n_samples_per_prompt": 8,
         "algo.kl.use_loss": True, "algo.kl.estimator": "k2", "algo.kl.init_coef": 1e-3},
        # GSPO
        {"algo.advantage.estimator": "group_norm", "rollout.n_samples_per_prompt": 8,
         "actor.policy_loss_type": "gspo", "actor.eps_clip_low_high": [3e-4, 4e-4], "algo.kl.init_coef": 0.0},
        # DAPO-style: clip-higher, dynamic filtering, the overlong penalty
        {"algo.advantage.estimator": "group_norm", "rollout.n_samples_per_prompt": 8,
         "actor.eps_clip_low_high": [0.2, 0.28], "algo.dynamic_filtering_enable": True,
         "algo.dynamic_filtering_range": [0.0, 1.0], "algo.kl.init_coef": 0.0},
        # vLLM TIS correction on RLOO
        {"algo.advantage.estimator": "rloo", "rollout.n_samples_per_prompt": 8,
         "algo.advantage.is_correction_level": "token", "algo.advantage.is_correction_mode": "clip"},
    ]
    out += [cfg(c, kind="combination") for c in combos]
    return out


# ----------------------------------------------------------------------------------------------------------- TRL

TRL_PPO_CLIP = ("dapo", "grpo", "bnpo", "dr_grpo")  # the others of loss_type are loss families


def trl_configs() -> list[Config]:
    try:
        import trl
        from trl import GRPOConfig
    except ImportError as exc:
        raise Unavailable(f"TRL is not installed ({exc})") from None
    if trl.__version__ != "1.16.0":
        raise Unavailable(f"TRL {trl.__version__} installed; this reads 1.16.0")
    sources = "\n".join(Path(importlib.util.find_spec(m).origin).read_text()
                        for m in ("trl.trainer.grpo_trainer", "trl.trainer.grpo_config"))
    values = {k: _string_constants(sources, k) for k in (
        "loss_type", "scale_rewards", "importance_sampling_level", "multi_objective_aggregation",
        "vllm_importance_sampling_mode")}
    out_dir = tempfile.mkdtemp(prefix="coverage-trl-")

    def cfg(overrides: dict, family: bool = False, kind: str = "axis") -> Config:
        def build() -> Any:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return GRPOConfig(output_dir=out_dir, report_to=[], use_cpu=True, bf16=False, **overrides)
        return Config(_label(overrides) or "(defaults)", build, family, kind)

    out = [cfg({})]
    out += [cfg({"loss_type": v}, family=v not in TRL_PPO_CLIP) for v in values["loss_type"]]
    for key in ("scale_rewards", "importance_sampling_level", "multi_objective_aggregation"):
        out += [cfg({key: v}) for v in values[key]]
    out += [cfg({"use_vllm": True, "vllm_importance_sampling_mode": v})
            for v in values["vllm_importance_sampling_mode"]]
    out += [cfg(o) for o in (
        {"use_vllm": True, "vllm_importance_sampling_correction": False},
        {"beta": 0.04}, {"beta": 0.04, "use_bias_correction_kl": False}, {"delta": 1.5}, {"delta": 1.1},
        {"epsilon_high": 0.28}, {"top_entropy_quantile": 0.2}, {"entropy_coef": 0.01},
        {"use_adaptive_entropy": True, "entropy_coef": 0.01}, {"off_policy_mask_threshold": 0.5},
        {"gradient_accumulation_steps": 4},
    )]
    combos = [
        # DeepSeek-R1 style GRPO: beta 0.001, the per-sequence loss
        {"loss_type": "grpo", "beta": 0.001},
        # Dr. GRPO (TRL docs): unscaled rewards, the constant normalizer
        {"loss_type": "dr_grpo", "scale_rewards": "none"},
        # GSPO (TRL docs): sequence-level ratios
        {"importance_sampling_level": "sequence", "loss_type": "grpo", "epsilon": 3e-4, "epsilon_high": 4e-4},
        # DAPO: clip-higher, truncated completions masked
        {"loss_type": "dapo", "epsilon_high": 0.28, "mask_truncated_completions": True},
        # bnpo with gradient accumulation
        {"loss_type": "bnpo", "gradient_accumulation_steps": 4},
        # vLLM with the TIS correction, token-level truncation
        {"use_vllm": True, "vllm_importance_sampling_mode": "token_truncate", "beta": 0.01},
        # PPO-Lite (batch-scaled rewards)
        {"scale_rewards": "batch", "loss_type": "dapo"},
    ]
    out += [cfg(c, kind="combination") for c in combos]
    return out


# --------------------------------------------------------------------------------------------------------- SkyRL
# NovaSky-AI/SkyRL @ a9564572eb8e (not installable here). P = skyrl/backends/skyrl_train/utils/ppo_utils.py,
# C = skyrl/train/config/config.py.

SKYRL_ESTIMATORS = ("grpo", "gae", "rloo", "reinforce++", "maxrl")  # P:406-411, P:430-441 repopulate_registry
SKYRL_POLICY_LOSSES = ("regular", "dual_clip", "gspo", "cispo", "clip_cov", "kl_cov", "sapo", "cross_entropy",
                       "importance_sampling", "dppo", "rollout_is")  # P:446-457, P:498-512
SKYRL_PPO_CLIP = ("regular", "dual_clip", "gspo")  # P:555-588 ppo_policy_loss, P:663-729 gspo_policy_loss
SKYRL_REDUCTIONS = ("token_mean", "token_mean_legacy", "sequence_mean", "seq_mean_token_sum_norm",
                    "prompt_mean")  # P:1180-1218 reduce_loss
SKYRL_KL_TYPES = ("k1", "abs", "k2", "k3")  # P:104-118 compute_approx_kl
SKYRL_KL_CTRL = ("fixed", "adaptive")  # P:74-76 get_kl_controller; C:693
SKYRL_TIS_TYPES = ("token", "sequence")  # C:794
SKYRL_SEQUENCE_MASKS = ("product", "geometric")  # C:801


def skyrl_configs() -> list[Config]:
    def cfg(overrides: dict, family: bool = False, kind: str = "axis") -> Config:
        def build() -> dict:
            c: dict = {"trainer": {"algorithm": {}}, "generator": {}}  # every other key at C's default
            for k, v in overrides.items():
                _set(c, f"trainer.algorithm.{k}" if not k.startswith("generator.") else k, v)
            return c
        return Config(_label(overrides) or "(defaults)", build, family, kind)

    out = [cfg({})]
    out += [cfg({"advantage_estimator": e}) for e in SKYRL_ESTIMATORS]
    out += [cfg({"policy_loss_type": p}, family=p not in SKYRL_PPO_CLIP) for p in SKYRL_POLICY_LOSSES]
    # seq_mean_token_sum_norm requires max_seq_len set (C:927-933)
    out += [cfg({"loss_reduction": r, **({"max_seq_len": 4096} if r == "seq_mean_token_sum_norm" else {})})
            for r in SKYRL_REDUCTIONS]
    out += [cfg({"kl_estimator_type": t}) for t in SKYRL_KL_TYPES]  # use_kl_loss is on by default (C:833)
    # use_kl_in_reward excludes use_kl_loss (C:830-835); kl_ctrl acts only with it (C:824-826)
    out += [cfg({"use_kl_in_reward": True, "use_kl_loss": False, "kl_ctrl.type": t}) for t in SKYRL_KL_CTRL]
    out += [cfg({"off_policy_correction.tis_ratio_type": t}) for t in SKYRL_TIS_TYPES]
    out += [cfg({"off_policy_correction.sequence_mask_metric": m}) for m in SKYRL_SEQUENCE_MASKS]
    out += [cfg(o) for o in (
        {"use_kl_loss": False}, {"grpo_norm_by_std": False}, {"advantage_batch_normalize": True},
        {"use_entropy_loss": True}, {"off_policy_correction.token_mask_is_threshold_high": 5.0},
    )]
    combos = [
        # Dr. GRPO (docs/algorithms/dapo-and-dr-grpo)
        {"grpo_norm_by_std": False, "loss_reduction": "seq_mean_token_sum_norm", "max_seq_len": 4096,
         "use_kl_loss": False},
        # DAPO: clip-higher, token_mean, no KL, dynamic sampling
        {"eps_clip_high": 0.28, "loss_reduction": "token_mean", "use_kl_loss": False,
         "dynamic_sampling.type": "filter"},
        # GSPO with sequence_mean (the reduction gspo_policy_loss recommends, P:687-698)
        {"policy_loss_type": "gspo", "loss_reduction": "sequence_mean", "eps_clip_low": 3e-4,
         "eps_clip_high": 4e-4, "use_kl_loss": False},
        # PPO: GAE, dual clip
        {"advantage_estimator": "gae", "policy_loss_type": "dual_clip", "use_kl_loss": False},
        # RLOO with the k2 KL loss, token TIS
        {"advantage_estimator": "rloo", "kl_estimator_type": "k2", "off_policy_correction.tis_ratio_type": "token"},
    ]
    out += [cfg(c, kind="combination") for c in combos]
    return out


# ------------------------------------------------------------------------------------------------------- NeMo-RL
# NVIDIA-NeMo/RL @ 7ea279abfbeb (not installable here). G = nemo_rl/algorithms/grpo.py, L =
# nemo_rl/algorithms/loss/loss_functions.py (ClippedPGLossConfig), U = nemo_rl/algorithms/utils.py.

NEMO_ESTIMATORS = ("gdpo", "grpo", "opd", "reinforce_plus_plus")  # G:2266-2297
NEMO_KL_TYPES = ("k1", "k2", "k3")  # U:83-89; L:131
NEMO_TIS_TYPES = ("tis", "icepop", "seq-mask-tis")  # L:146, L:296-300
# ClippedPGLossConfig's switches (L:113-164): key → a policy-loss family (the next issue)?
NEMO_SWITCHES = {"disable_ppo_ratio": True,  # L:113: the REINFORCE surrogate
                 "token_level_loss": False,  # L:114 (default True: the value set is False)
                 "sequence_level_importance_ratios": False,  # L:119
                 "use_kl_in_reward": False,  # L:135
                 "use_on_policy_kl_approximation": False,  # L:153
                 "force_on_policy_ratio": False,  # L:158
                 "use_cispo": True}  # L:160: CISPO


def nemo_rl_configs() -> list[Config]:
    def cfg(overrides: dict, family: bool = False, kind: str = "axis") -> Config:
        def build() -> dict:
            c: dict = {"grpo": {}, "loss_fn": {}}  # every other key at the defaults of L and grpo_math_1B.yaml
            for k, v in overrides.items():
                _set(c, k, v)
            return c
        return Config(_label(overrides) or "(defaults)", build, family, kind)

    out = [cfg({})]
    out += [cfg({"grpo.adv_estimator.name": e}) for e in NEMO_ESTIMATORS]
    out += [cfg({"loss_fn.reference_policy_kl_type": t}) for t in NEMO_KL_TYPES]
    out += [cfg({"loss_fn.use_importance_sampling_correction": True})]
    # icepop and seq-mask-tis need ratio_min (ClippedPGLossFn.__init__ asserts it, L:315-319): the reference
    # bounds NeMo-RL's comment gives (L:585-590: icepop 0.5–5, seq-mask-tis 0.999–1.002)
    tis_bounds = {"tis": {"loss_fn.truncated_importance_sampling_ratio": 2.0},
                  "icepop": {"loss_fn.truncated_importance_sampling_ratio": 5.0,
                             "loss_fn.truncated_importance_sampling_ratio_min": 0.5},
                  "seq-mask-tis": {"loss_fn.truncated_importance_sampling_ratio": 1.002,
                                   "loss_fn.truncated_importance_sampling_ratio_min": 0.999}}
    out += [cfg({"loss_fn.use_importance_sampling_correction": True,
                 "loss_fn.truncated_importance_sampling_type": t, **tis_bounds[t]}) for t in NEMO_TIS_TYPES]
    out += [cfg({f"loss_fn.{k}": k != "token_level_loss"}, family=fam) for k, fam in NEMO_SWITCHES.items()]
    out += [cfg(o) for o in (
        {"loss_fn.reference_policy_kl_penalty": 0.0}, {"loss_fn.ratio_clip_c": 3.0},
        {"loss_fn.positive_example_nll_weight": 0.1}, {"grpo.normalize_rewards": False},
        {"grpo.use_leave_one_out_baseline": False},
    )]
    combos = [
        # DAPO (examples/configs/recipes): clip-higher, no KL, token-level loss
        {"loss_fn.ratio_clip_max": 0.28, "loss_fn.reference_policy_kl_penalty": 0.0},
        # GSPO: sequence-level ratios and a per-sequence loss
        {"loss_fn.sequence_level_importance_ratios": True, "loss_fn.token_level_loss": False},
        # async GRPO: the IS correction with TIS
        {"loss_fn.use_importance_sampling_correction": True, "loss_fn.truncated_importance_sampling_type": "tis",
         "loss_fn.truncated_importance_sampling_ratio": 2.0},
        # Reinforce++ (grpo_math_1B.yaml:40): its KL in the reward
        {"grpo.adv_estimator.name": "reinforce_plus_plus", "loss_fn.use_kl_in_reward": True,
         "loss_fn.reference_policy_kl_penalty": 0.0},
        # Dr. GRPO: no std, mean baseline
        {"grpo.normalize_rewards": False, "grpo.use_leave_one_out_baseline": False},
    ]
    out += [cfg(c, kind="combination") for c in combos]
    for c in out:  # ClippedPGLossFn.__init__ asserts it (loss/loss_functions.py:265-268)
        if c.label == "loss_fn.sequence_level_importance_ratios=True":
            c.rejected = ("NeMo-RL asserts sequence-level importance ratios are exclusive with the token-level loss "
                          "(token_level_loss defaults true; loss/loss_functions.py:265-268)")
    return out


ENUMERATORS = {"verl": verl_configs, "openrlhf": openrlhf_configs, "trl": trl_configs, "skyrl": skyrl_configs,
               "nemo-rl": nemo_rl_configs}


# ------------------------------------------------------------------------------------------------ classification

def classify(framework: str, configs: list[Config]) -> list[Result]:
    from replay_lib.frameworks import mapping

    fn = mapping(framework)
    results = []
    seen: set[str] = set()
    for c in configs:
        if c.label in seen:
            continue
        seen.add(c.label)
        if c.kind == "unimplemented":
            results.append(Result(framework, c.label, "axis", FRAMEWORK_ERROR,
                                  f"{NAMES[framework]} raises NotImplementedError for it"))
            continue
        if c.rejected:
            results.append(Result(framework, c.label, c.kind, FRAMEWORK_ERROR, c.rejected))
            continue
        try:
            obj = c.build()
        except (ValueError, TypeError) as exc:  # the framework's own validation rejects it
            results.append(Result(framework, c.label, c.kind, FRAMEWORK_ERROR, str(exc).splitlines()[0]))
            continue
        try:
            fn(obj)
        except UnsupportedFrameworkConfig as exc:
            results.append(Result(framework, c.label, c.kind, REFUSED, str(exc)))
            continue
        except FrameworkConfigError as exc:  # exit 3 on a config the framework accepts: a mapping defect
            raise RuntimeError(f"{framework} {c.label}: the mapping calls a valid config invalid: {exc}") from exc
        results.append(Result(framework, c.label, c.kind, MAPPED))
    return results


def collect(frameworks=ALL) -> dict[str, Any]:
    """``{framework: [Result, ...] | "unavailable: why"}``."""
    out: dict[str, Any] = {}
    for fw in frameworks:
        try:
            configs = ENUMERATORS[fw]()
        except Unavailable as exc:
            out[fw] = f"unavailable: {exc}"
            continue
        out[fw] = classify(fw, configs)
    return out


def counts(results: list[Result]) -> dict[str, Any]:
    n = {s: sum(r.status == s for r in results) for s in (MAPPED, REFUSED, FAMILY, FRAMEWORK_ERROR)}
    n["registered"] = len(results)
    counted = n[MAPPED] + n[REFUSED]
    n["refused_fraction"] = n[REFUSED] / counted if counted else 0.0
    return n


def needs(why: str) -> str:
    """What a bundle would need, as the refusal message says it ('a bundle would need …', 'record …'); a message
    naming no record means a formula the replay does not have."""
    for pattern in (r"(?:a bundle|a replay) would need (.+?)(?:$|; |\. )", r"((?:record|map it|map the) .+?)$"):
        m = re.search(pattern, why)
        if m:
            text = m.group(1).rstrip(".")
            return text[:-1] if text.endswith(")") and text.count(")") > text.count("(") else text
    return "no record maps it: the replay needs its formula"


def markdown(collected: dict[str, Any]) -> str:
    lines = ["| framework | key=value | reason | what a bundle would need |", "|---|---|---|---|"]
    for fw, results in collected.items():
        if isinstance(results, str):
            continue
        for r in results:
            if r.status == REFUSED:
                lines.append(f"| {NAMES[fw]} | `{r.label}` | {_cell(r.why)} | {_cell(needs(r.why))} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def report(collected: dict[str, Any]) -> str:
    out = []
    total = {MAPPED: 0, REFUSED: 0, FAMILY: 0, FRAMEWORK_ERROR: 0}
    for fw, results in collected.items():
        out.append(f"== {NAMES[fw]}")
        if isinstance(results, str):
            out.append(f"   {results}")
            continue
        width = max(len(r.label) for r in results)
        for r in results:
            tail = f"  {r.message}" if r.status in (REFUSED, FRAMEWORK_ERROR) else ""
            out.append(f"   {r.label:<{width}}  {r.status}{' (combination)' if r.kind == 'combination' else ''}"
                       f"{tail}")
        n = counts(results)
        for s in total:
            total[s] += n[s]
        out.append(f"   {NAMES[fw]}: {n['registered']} configs: {n[MAPPED]} mapped, {n[REFUSED]} refused "
                   f"({100 * n['refused_fraction']:.1f}% of mapped + refused, policy-loss families included), "
                   f"{n[FRAMEWORK_ERROR]} rejected by the framework itself")
    counted = total[MAPPED] + total[REFUSED]
    frac = total[REFUSED] / counted if counted else 0.0
    out.append(f"TOTAL: {total[MAPPED]} mapped, {total[REFUSED]} refused: {100 * frac:.1f}% refused "
               f"(rejected by the framework: {total[FRAMEWORK_ERROR]})")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--framework", action="append", choices=ALL, help="one framework (repeatable; default all)")
    p.add_argument("--markdown", type=Path, help="write the refusals as a Markdown table to this file")
    p.add_argument("--json", type=Path, help="write every config's classification as JSON to this file")
    args = p.parse_args(argv)
    collected = collect(tuple(args.framework or ALL))
    print(report(collected))
    if args.markdown:
        args.markdown.write_text(markdown(collected))
    if args.json:
        args.json.write_text(json.dumps(
            {fw: r if isinstance(r, str) else {"counts": counts(r), "configs": [dataclasses.asdict(x) for x in r]}
             for fw, r in collected.items()}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
