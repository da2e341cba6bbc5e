"""OpenRLHF 0.11.2 as the producer: its own functions compute every expected value, ``from_openrlhf`` maps its own
argparse namespace, and the replay must find no divergence on a clean bundle and name an injected bug.

Called (OpenRLHF 0.11.2, the PyPI release, ``pip install --no-deps openrlhf==0.11.2``):

* ``openrlhf/cli/train_ppo_ray.py`` (its ``__main__`` block, lines 197-740): the parser, ``hierarchize`` and the
  validation, run on a list of command lines; the run stops at ``train(args)``'s first call (``ray.is_initialized``).
* ``openrlhf/models/utils.py`` ``compute_approx_kl`` (the in-reward KL and the KL loss).
* ``openrlhf/trainer/ppo_utils/experience_maker.py`` ``RemoteExperienceMaker.compute_advantages_and_returns``
  (lines 237-340: the group baselines, ``compute_reward`` with ``reward.clip_range``, GAE over the critic's
  values (``get_advantages_and_returns``, lines 343-388) or the cumulative returns, and the whitening of
  ``gae`` / ``reinforce`` / ``reinforce_baseline`` over the step's tokens, lines 324-338).
* ``openrlhf/utils/loss_utils.py`` ``iter_grad_accum_global_norm`` (the step's normalizers per micro-batch).
* ``openrlhf/models/loss.py`` ``PolicyLoss`` and ``aggregate_loss`` (the loss, ``clip_ratio``, ``ppo_kl``), built
  as ``openrlhf/trainer/ray/ppo_actor.py:76-86`` builds it; the step's values merged as ``ppo_train`` merges them
  (``ppo_actor.py:193-256``: the loss terms summed over the micro-batches after DeepSpeed's ``1/gas``, each metric
  weighted by its micro-batch's tokens).

Only the heavy modules the called paths never use are stubbed (``ray``, ``deepspeed``, the Ray actors, the vLLM
engines); the stubs are removed from ``sys.modules`` once the functions are loaded.
"""

from __future__ import annotations

import runpy
import shlex
import sys
import types
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, Identity, Manifest, ProducerInfo,
                                      SampleRecord, StageId, stage_contracts)
from replay_lib.errors import UnsupportedFrameworkConfig
from replay_lib.frameworks import from_openrlhf
from replay_lib.run.runner import replay

from producers import comparison_policy

VERSION = "0.11.2"
STAGES = (StageId.SAMPLE, StageId.REWARD_RAW, StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_KL,
          StageId.ADVANTAGE_ESTIMATE, StageId.LOSS_POLICY)


# ------------------------------------------------------------------------------------------ OpenRLHF's code

class _Stop(Exception):
    """Raised by the ``ray`` stub at ``train(args)``'s first line: the namespace is complete by then."""


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def _package(name: str, path: Path) -> types.ModuleType:
    """``name`` as a namespace over its real directory, without running its ``__init__`` (which imports the
    model classes and DeepSpeed)."""
    module = types.ModuleType(name)
    module.__path__ = [str(path)]
    return module


@dataclass
class OpenRLHF:
    parse: Any
    compute_approx_kl: Any
    compute_reward: Any
    aggregate_loss: Any
    PolicyLoss: Any
    maker: Any
    iter_grad_accum_global_norm: Any


@pytest.fixture(scope="module")
def openrlhf():
    yield from load()


def load():
    """OpenRLHF's functions, loaded under the stubs (a generator: the stubs leave ``sys.modules`` after it)."""
    import openrlhf as root

    base = Path(root.__file__).parent
    before = dict(sys.modules)
    captured: list = []

    def is_initialized():
        raise _Stop

    stubs = {
        "ray": _stub("ray", is_initialized=is_initialized, remote=lambda *a, **k: (lambda f: f)),
        "ray.util": _stub("ray.util"),
        "ray.util.placement_group": _stub("ray.util.placement_group", placement_group=None),
        "deepspeed": _stub("deepspeed"),
        "openrlhf.models": _package("openrlhf.models", base / "models"),
        "openrlhf.trainer": _package("openrlhf.trainer", base / "trainer"),
        "openrlhf.trainer.ray": _stub("openrlhf.trainer.ray", create_vllm_engines=None, __path__=[]),
        "openrlhf.trainer.ray.launcher": _stub("openrlhf.trainer.ray.launcher", RayActorGroup=object,
                                               ReferenceModelActor=object, RewardModelActor=object),
        "openrlhf.trainer.ray.ppo_actor": _stub("openrlhf.trainer.ray.ppo_actor", PolicyModelActor=object),
        "openrlhf.trainer.ray.ppo_critic": _stub("openrlhf.trainer.ray.ppo_critic", CriticModelActor=object),
    }
    try:
        sys.modules.update(stubs)
        from openrlhf.models.loss import PolicyLoss, aggregate_loss
        from openrlhf.models.utils import compute_approx_kl, compute_reward
        from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
        from openrlhf.utils import config as config_module
        from openrlhf.utils.loss_utils import iter_grad_accum_global_norm

        real_hierarchize = config_module.hierarchize

        def hierarchize(args):
            out = real_hierarchize(args)
            captured.append(out)
            return out

        script = str(base / "cli" / "train_ppo_ray.py")

        def parse(command: str):
            """The namespace ``train_ppo_ray.py``'s ``__main__`` block hands to ``train`` for ``command``."""
            captured.clear()
            argv = sys.argv
            saved = dict(sys.modules)
            sys.modules.update(stubs)
            config_module.hierarchize = hierarchize
            sys.argv = ["train_ppo_ray.py", *shlex.split(command)]
            try:
                runpy.run_path(script, run_name="__main__")
            except _Stop:
                pass
            finally:
                sys.argv = argv
                config_module.hierarchize = real_hierarchize
                for name in set(sys.modules) - set(saved):
                    del sys.modules[name]
                sys.modules.update(saved)
            assert captured, "train_ppo_ray.py did not reach train(args)"
            return captured[-1]

        yield OpenRLHF(parse=parse, compute_approx_kl=compute_approx_kl, compute_reward=compute_reward,
                       aggregate_loss=aggregate_loss,
                       PolicyLoss=PolicyLoss, maker=RemoteExperienceMaker,
                       iter_grad_accum_global_norm=iter_grad_accum_global_norm)
    finally:
        # Only the stubs and OpenRLHF's own modules leave: a real package first imported here (transformers) stays
        # whole — deleting half of its modules breaks its lazy imports for every later test in this process.
        for name in list(sys.modules):
            if name not in before and (name in stubs or name.split(".")[0] in ("openrlhf", "ray", "deepspeed")):
                del sys.modules[name]
        sys.modules.update(before)


# ---------------------------------------------------------------------------------------------- the step


BASE = "--actor.model_name_or_path m --reward.remote_url http://rm --rollout.batch_size 4 --train.batch_size 16"
N4 = BASE + " --rollout.n_samples_per_prompt 4"
GRPO = N4 + " --algo.advantage.estimator group_norm"
# The configs the framework registers: its defaults on the group estimators, the KL in the reward with each
# estimator, the KL as a loss, the aggregation modes, GSPO, dual-clip, asymmetric clips, entropy, IS correction.
COMMANDS = {
    "grpo-default": GRPO,
    "grpo-k2": GRPO + " --algo.kl.estimator k2",
    "grpo-k3-coef0.1": GRPO + " --algo.kl.estimator k3 --algo.kl.init_coef 0.1",
    "grpo-no-kl": GRPO + " --algo.kl.init_coef 0",
    "grpo-kl-loss-k3": GRPO + " --algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef 0.001",
    "grpo-kl-loss-k2-unbiased": GRPO + " --algo.kl.use_loss --algo.kl.estimator k2 --algo.kl.unbiased_gradient",
    "grpo-seq-mean": GRPO + " --actor.loss_agg_mode seq-mean-token-mean --algo.kl.init_coef 0",
    "grpo-dapo": GRPO + " --actor.eps_clip_low_high 0.2 0.28 --algo.kl.use_loss --algo.kl.estimator k3 "
                        "--algo.kl.init_coef 0.001 --algo.advantage.is_correction_level token "
                        "--algo.advantage.is_correction_mode clip",
    "grpo-icepop": GRPO + " --algo.advantage.is_correction_level token --algo.kl.init_coef 0",
    "grpo-dual-clip-entropy": GRPO + " --actor.dual_clip 3 --actor.entropy_coef 0.01",
    # the trust-region gates (loss.py:224-239): the sampled-token binary KL or TV between rollout and train policy,
    # a single upper bound (a delta; cli.py:639-642 makes it [0, delta]), kept tokens keep exp(old − rollout)
    "grpo-binary-kl": GRPO + " --algo.advantage.is_correction_level token --algo.advantage.is_correction_gating "
                             "binary_kl --algo.advantage.is_correction_threshold 0.02 --algo.kl.init_coef 0",
    # the sequence mask (loss.py:219-239): the sample's geometric-mean ratio gates it, kept tokens keep their weight
    "grpo-seq-mask": GRPO + " --algo.advantage.is_correction_level seq --algo.advantage.is_correction_threshold 0.8 "
                            "1.25 --algo.kl.init_coef 0",
    "rloo-seq-mask-delta": BASE + " --algo.advantage.estimator rloo --rollout.n_samples_per_prompt 4 "
                                  "--algo.advantage.is_correction_level seq --algo.advantage.is_correction_threshold 1.2",
    "grpo-tv-kl-loss": GRPO + " --algo.advantage.is_correction_level token --algo.advantage.is_correction_gating tv "
                              "--algo.advantage.is_correction_threshold 0.1 --algo.kl.use_loss --algo.kl.estimator k3 "
                              "--algo.kl.init_coef 0.001",
    "dr_grpo": BASE + " --algo.advantage.estimator dr_grpo --rollout.n_samples_per_prompt 4",
    "dr_grpo-clip1": BASE + " --algo.advantage.estimator dr_grpo --rollout.n_samples_per_prompt 4 "
                            "--reward.clip_range -0.25 0.25",
    "rloo": BASE + " --algo.advantage.estimator rloo --rollout.n_samples_per_prompt 4",
    "rloo-k3-seq-mean": BASE + " --algo.advantage.estimator rloo --rollout.n_samples_per_prompt 4 "
                               "--algo.kl.estimator k3 --actor.loss_agg_mode seq-mean-token-mean",
    "gspo": GRPO + " --actor.policy_loss_type gspo --algo.kl.init_coef 0",
    "gspo-kl-loss-entropy": GRPO + " --actor.policy_loss_type gspo --algo.kl.use_loss --algo.kl.estimator k3 "
                                   "--actor.entropy_coef 0",
    # OpenRLHF's default estimator (GAE over the critic's values) and the whitened ones (exp.py:324-338)
    "gae-default": N4,
    "gae-gamma-lambd": N4 + " --algo.advantage.gamma 0.99 --algo.advantage.lambd 0.95 --algo.kl.estimator k3",
    "gae-no-std-norm": N4 + " --algo.advantage.no_std_norm --algo.kl.init_coef 0 --algo.advantage.lambd 0.9",
    "gae-kl-loss": N4 + " --algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef 0.001 "
                        "--algo.advantage.lambd 0.95",
    "reinforce": N4 + " --algo.advantage.estimator reinforce --algo.advantage.gamma 0.98",
    "reinforce-no-std-norm": N4 + " --algo.advantage.estimator reinforce --algo.advantage.no_std_norm",
    "reinforce_baseline": N4 + " --algo.advantage.estimator reinforce_baseline",
    # the length penalties (length_penalty.py, applied by compute_advantages_and_returns itself) and the reward
    # model's own normalization (neutral: the bundle records its output)
    "grpo-overlong": GRPO + " --rollout.max_new_tokens 10 --reward.overlong_buffer_len 4 "
                            "--reward.overlong_penalty_factor 0.5",
    "rloo-stop-properly": BASE + " --algo.advantage.estimator rloo --rollout.n_samples_per_prompt 4 "
                                 "--reward.stop_properly_penalty_coef 0.3",
    "grpo-overlong-stop-fixed": GRPO + " --data.max_len 9 --reward.overlong_buffer_len 3 "
                                       "--reward.stop_properly_penalty_coef -0.5",
    "grpo-normalize-enable": GRPO + " --reward.normalize_enable",
    "reinforce_baseline-k2-clip": N4 + " --algo.advantage.estimator reinforce_baseline --algo.kl.estimator k2 "
                                       "--reward.clip_range -0.25 0.25",
}
WHITENED = ("gae", "reinforce", "reinforce_baseline")
PRECISIONS = ("float32", "bfloat16")
GROUPS, N = 3, 4
MICRO = 3  # micro-batches of the one optimizer step (below the mini-batch)


def _batch(seed: int, precision: str) -> dict:
    """``[B, L]`` right-padded inputs: random lengths (trailing padding), interior masked spans (tool output
    inside a response), one fully masked sample, a masked tail; log-ratios wide enough to clip, to hit the KL
    clamp and the IS bounds; rewards wide enough for a tight ``reward.clip_range`` to bind."""
    g = torch.Generator().manual_seed(seed)
    b = GROUPS * N
    lengths = torch.randint(3, 12, (b,), generator=g)
    width = int(lengths.max())
    valid = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    mask = valid.clone()
    mask[1, 1:3] = False  # an interior tool span
    mask[5, 0] = False
    mask[6] = False  # a fully masked sample
    mask[7, int(lengths[7]) - 1] = False  # a masked tail
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32

    def lp(scale: float, base: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = torch.randn(b, width, generator=g) * scale
        return (x if base is None else base.float() + x).to(dtype)

    old = (-torch.rand(b, width, generator=g) * 3).to(dtype)
    logp = lp(0.3, old)
    rollout = lp(0.4, old)
    ref = lp(0.8, old)
    ref[2, 0] = old[2, 0] - 12.0  # k1 beyond the ±10 clamp
    ref[3, 1] = old[3, 1] + 13.0  # k3 beyond it
    # k1 within float32 rounding of the clamp edge (r = old − ref ≈ ±10 in float32 and in float64 differently)
    ref[2, 1] = (old[2, 1].double() - 10.0 - 2e-7).to(dtype)
    ref[8, 0] = (old[8, 0].double() + 10.0 + 2e-7).to(dtype)
    raw = torch.randint(0, 2, (b,), generator=g).float() + torch.rand(b, generator=g) * 0.2
    raw[4:8] = raw[4]  # one group of equal rewards
    entropy = (torch.rand(b, width, generator=g) * 2).to(dtype)
    values = (torch.randn(b, width, generator=g) * 0.5 + 0.3).to(dtype)  # the critic's, for GAE
    # samples_generator.py:272-273: response_length is the span of the action mask's ones; 277: truncated
    span = torch.tensor([int(torch.nonzero(m)[-1] - torch.nonzero(m)[0] + 1) if m.any() else 0 for m in mask])
    truncated = torch.rand(b, generator=g) < 0.4
    return dict(lengths=lengths, valid=valid, mask=mask.float(), old=old, logp=logp, rollout=rollout, ref=ref,
                raw=raw, entropy=entropy, values=values, width=width, span=span, truncated=truncated)


def _produce(fw: OpenRLHF, args, s: dict, bug: Optional[str] = None) -> dict:
    """Everything OpenRLHF computes for the step, with its own functions; ``bug``: one injected change."""
    b = s["mask"].shape[0]
    mask = s["mask"]
    use_loss, coef = args.algo.kl.use_loss, args.algo.kl.init_coef
    ref = s["ref"]
    if coef > 0 and not use_loss:  # experience_maker.py:205-214
        kl = fw.compute_approx_kl(s["old"], ref, kl_estimator=args.algo.kl.estimator)
    else:
        kl = torch.zeros(b, s["width"])
    micro = [list(range(i, b, MICRO)) for i in range(MICRO)]  # experiences in a shuffled prompt order

    estimator = args.algo.advantage.estimator

    def advantages(action_mask: torch.Tensor, kl_values: torch.Tensor, raw: torch.Tensor):
        exps = [types.SimpleNamespace(rewards=raw[ix].clone(), index=ix, kl=kl_values[ix], action_mask=action_mask[ix],
                                      values=s["values"][ix, :action_mask.shape[1]] if estimator == "gae" else None,
                                      info={}, response_length=s["span"][ix], truncated=s["truncated"][ix])
                for ix in micro]
        maker = types.SimpleNamespace(strategy=types.SimpleNamespace(args=args),
                                      kl_ctl=types.SimpleNamespace(value=coef),
                                      advantage_estimator=args.algo.advantage.estimator)
        maker.get_cumulative_returns = partial(fw.maker.get_cumulative_returns, maker)
        maker.get_advantages_and_returns = partial(fw.maker.get_advantages_and_returns, maker)
        fw.maker.compute_advantages_and_returns(maker, exps)
        out = torch.zeros(b, action_mask.shape[1])
        for ix, e in zip(micro, exps):
            out[ix] = e.advantages.float()
        return out

    def normalized(raw: torch.Tensor) -> torch.Tensor:
        """The reward each sample's returns start from (normalized, clipped): the same code on one unmasked
        token; for the whitened estimators (whose one-token advantages are whitened) their baseline's branch
        (reinforce_baseline's is dr_grpo's, exp.py:269-270; gae and reinforce have none) and then
        ``compute_reward``'s clamp on its own."""
        if estimator not in WHITENED:
            return advantages(torch.ones(b, 1), torch.zeros(b, 1), raw)[:, 0]
        if estimator == "reinforce_baseline":
            args.algo.advantage.estimator = "dr_grpo"
            try:
                return advantages(torch.ones(b, 1), torch.zeros(b, 1), raw)[:, 0]
            finally:
                args.algo.advantage.estimator = estimator
        return fw.compute_reward(raw.clone(), 0.0, torch.zeros(b, 1), action_mask=torch.ones(b, 1),
                                 reward_clip_range=args.reward.clip_range)[:, 0]

    raw = s["raw"]
    adv = advantages(mask, kl, raw)
    reward = normalized(raw)
    if bug == "advantage_sign":
        adv = -adv
    if bug == "kl_sign":  # the recorded in-reward KL negated
        kl = -kl
    if bug == "reward_unclipped":  # the recorded reward taken before reward.clip_range
        clip, args.reward.clip_range = args.reward.clip_range, None
        reward = normalized(raw)
        args.reward.clip_range = clip
    if bug == "mask_shift":  # the returns of a mask shifted one token right
        shifted = torch.zeros_like(mask)
        shifted[:, 1:] = mask[:, :-1]
        adv = advantages(shifted * s["valid"], kl, raw)

    gating = args.algo.advantage.is_correction_gating
    threshold = args.algo.advantage.is_correction_threshold
    if bug == "gate_off":  # the gate never applied: every token keeps its weight exp(old − rollout)
        gating, threshold = "ratio", [0.0, float("inf")]
    level = args.algo.advantage.is_correction_level
    if bug == "seq_as_token":  # each token gated by its own ratio instead of the sample's geometric mean
        level = "token"
    loss_fn = fw.PolicyLoss(clip_eps_low=args.actor.eps_clip_low_high[0], clip_eps_high=args.actor.eps_clip_low_high[1],
                            dual_clip=args.actor.dual_clip, token_level_loss=args.actor.loss_agg_mode == "token-mean",
                            policy_loss_type=args.actor.policy_loss_type,
                            is_correction_level=level,
                            is_correction_mode=args.algo.advantage.is_correction_mode,
                            is_correction_gating=gating,
                            is_correction_threshold=threshold)
    batches = [dict(ix=ix, action_mask=mask[ix]) for ix in micro]
    strategy = types.SimpleNamespace()
    totals = {k: torch.zeros(()) for k in ("pg_loss", "kl_loss", "entropy_loss")}
    metric_sums = {"pg_clipfrac": 0.0, "ppo_kl": 0.0}
    tokens = 0.0
    adv_used = adv.to(s["logp"].dtype) if s["logp"].dtype == torch.bfloat16 else adv
    for mb, info in fw.iter_grad_accum_global_norm(batches, strategy, MICRO, lambda e: e["action_mask"]):
        ix, m = mb["ix"], mb["action_mask"]
        loss, clip_ratio, ppo_kl, _, _ = loss_fn(s["logp"][ix], s["old"][ix], adv_used[ix], action_mask=m,
                                                 rollout_log_probs=s["rollout"][ix], **info)
        totals["pg_loss"] = totals["pg_loss"] + loss.float() / MICRO  # DeepSpeed's 1/gas
        if use_loss and coef > 0:
            kl_t = fw.compute_approx_kl(s["logp"][ix], ref[ix], log_probs_old=s["old"][ix],
                                        kl_estimator=args.algo.kl.estimator,
                                        unbiased_gradient=args.algo.kl.unbiased_gradient)
            totals["kl_loss"] = totals["kl_loss"] + fw.aggregate_loss(kl_t, m, **info).float() / MICRO
        if args.actor.entropy_coef is not None:
            totals["entropy_loss"] = totals["entropy_loss"] + fw.aggregate_loss(s["entropy"][ix], m, **info).float() / MICRO
        n_tokens = float(m.sum())  # ppo_actor.py:197-219: each metric weighted by its micro-batch's tokens
        metric_sums["pg_clipfrac"] += float(clip_ratio) * n_tokens
        metric_sums["ppo_kl"] += float(ppo_kl) * n_tokens
        tokens += n_tokens
    loss_fields = {"pg_loss": float(totals["pg_loss"]), "pg_clipfrac": metric_sums["pg_clipfrac"] / tokens,
                   "ppo_kl": metric_sums["ppo_kl"] / tokens}
    if args.actor.entropy_coef is not None:  # None: not computed (ppo_actor.py:299, 346)
        loss_fields["entropy_loss"] = float(totals["entropy_loss"])
    if use_loss and coef > 0:
        loss_fields["kl_loss"] = float(totals["kl_loss"])
    return dict(kl=kl, adv=adv, reward=reward, loss=loss_fields)


def _write(path: Path, cfg, s: dict, out: dict, precision: str) -> Path:
    lengths = s["lengths"].tolist()
    valid = s["valid"]

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x[valid].contiguous()

    mask = s["mask"]
    micro_of = {i: k for k, ix in enumerate([list(range(i, mask.shape[0], MICRO)) for i in range(MICRO)]) for i in ix}
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=i // N, response_length=n, total_length=n + 16,
                            loss_mask=[int(v) for v in mask[i, :n].tolist()], raw_reward=float(s["raw"][i]),
                            reward=float(out["reward"][i]), micro_batch_id=f"mb-{micro_of[i]}",
                            **({"truncated": bool(s["truncated"][i])} if isinstance(cfg.truncated_reward_coef, float)
                               else {}))
               for i, n in enumerate(lengths)]
    tokens = int(mask.sum())
    seqs = int((mask.sum(-1) > 0).sum())
    import msgspec

    config = msgspec.structs.replace(cfg, loss_token_count=tokens, loss_seq_count=seqs)
    index = BundleIndex(bundle_id=path.name, identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0),
                                                               micro_batch_ids=[f"mb-{k}" for k in range(MICRO)]),
                        samples=samples, config=config)
    declared = {"compute": precision, "accumulate": "float32"}
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=path.name,
                        producer=ProducerInfo(commit=f"openrlhf=={VERSION}", torch_version=torch.__version__),
                        stage_contracts=stage_contracts(STAGES), payloads={},
                        comparison_policy=comparison_policy(declared), redaction={})
    expected = {"reward.raw": {"raw_rewards": s["raw"].tolist()},
                "reward.post_process": {"rewards": out["reward"].tolist()}, "loss.policy": out["loss"]}
    writer = BundleWriter(path, manifest, index, expected)
    for name, key in (("old_log_probs", "old"), ("log_probs", "logp"), ("ref_log_probs", "ref"),
                      ("rollout_log_probs", "rollout"), ("entropy", "entropy")):
        writer.write_payload(name, flat(s[key]))
    writer.write_payload("kl", flat(out["kl"]).float())
    writer.write_payload("advantages", flat(out["adv"]).float())
    if cfg.advantage_estimator == "gae":
        writer.write_payload("values", flat(s["values"]))
    return writer.finalize(ranks=[0])


def _run(fw: OpenRLHF, tmp: Path, name: str, precision: str, seed: int, bug: Optional[str] = None):
    args = fw.parse(COMMANDS[name])
    cfg = from_openrlhf(args, version=VERSION)
    s = _batch(seed, precision)
    out = _produce(fw, args, s, bug)
    path = _write(tmp / f"{name}-{precision}-{seed}-{bug}", cfg, s, out, precision)
    return replay(path)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_clean_bundle_replays_clean(openrlhf, tmp_path, name, precision):
    report = _run(openrlhf, tmp_path, name, precision, seed=sorted(COMMANDS).index(name))
    failing = [(st.stage, st.reason) for st in report.stages if st.status == "fail"]
    assert failing == [] and report.exit_code == 0


# An injected bug, named at its stage: (config, bug, the stage that fails first, the reason's start).
BUGS = [
    ("grpo-default", "advantage_sign", "advantage.estimate", "advantage mismatch"),
    ("rloo", "mask_shift", "advantage.estimate", "advantage mismatch"),
    ("grpo-k2", "kl_sign", "advantage.kl", "kl mismatch"),
    ("dr_grpo-clip1", "reward_unclipped", "reward.post_process", "normalized reward mismatch"),
    ("gae-default", "advantage_sign", "advantage.estimate", "advantage mismatch"),
    ("gae-gamma-lambd", "mask_shift", "advantage.estimate", "advantage mismatch"),
    ("reinforce_baseline-k2-clip", "reward_unclipped", "reward.post_process", "normalized reward mismatch"),
    ("grpo-binary-kl", "gate_off", "loss.policy", "loss field mismatch: pg_loss"),
    ("grpo-seq-mask", "seq_as_token", "loss.policy", "loss field mismatch: pg_loss"),
    ("grpo-tv-kl-loss", "gate_off", "loss.policy", "loss field mismatch: pg_loss"),
]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name, bug, stage, reason", BUGS)
def test_injected_bug_is_named_at_its_stage(openrlhf, tmp_path, name, bug, stage, reason, precision):
    report = _run(openrlhf, tmp_path, name, precision, seed=sorted(COMMANDS).index(name), bug=bug)
    failing = [st for st in report.stages if st.status == "fail"]
    assert report.exit_code == 1
    assert failing[0].stage == stage and failing[0].reason.startswith(reason)


def test_gspo_ppo_kl_is_a_token_mean(openrlhf, tmp_path):
    """OpenRLHF's GSPO loss is a per-sample mean, its ppo_kl and clip_ratio token means (loss.py:257-258): judged
    as the loss's per-sample mean (the mapping's old metric mode), the recorded ppo_kl diverges."""
    import msgspec

    args = openrlhf.parse(COMMANDS["gspo"])
    cfg = from_openrlhf(args, version=VERSION)
    assert (cfg.loss_agg_mode, cfg.metric_agg_mode) == ("seq_mean_token_mean", "token_mean")
    s = _batch(5, "float32")
    out = _produce(openrlhf, args, s)
    clean = replay(_write(tmp_path / "token", cfg, s, out, "float32"))
    assert clean.exit_code == 0
    per_sample = msgspec.structs.replace(cfg, metric_agg_mode="seq_mean_token_mean")
    wrong = replay(_write(tmp_path / "seq", per_sample, s, out, "float32"))
    loss = next(st for st in wrong.stages if st.stage == "loss.policy")
    assert (wrong.exit_code, loss.status) == (1, "fail")
    assert {d.field for d in loss.divergences} >= {"ppo_kl"}


def test_the_configs_openrlhf_registers_are_mapped_or_refused_by_name(openrlhf):
    """Every command line of the sweep parses with OpenRLHF's own parser and maps (the default, GAE, included);
    flash_reinforce, whose baseline is the whole rollout batch's mean, is refused by name."""
    for name, command in COMMANDS.items():
        from_openrlhf(openrlhf.parse(command), version=VERSION)
    default = from_openrlhf(openrlhf.parse(BASE + " --rollout.n_samples_per_prompt 2"), version=VERSION)
    assert (default.advantage_estimator, default.gae_masked_tokens, default.normalize_advantages,
            default.whiten_variance, default.whiten_eps_mode, default.gamma, default.lam) == (
        "gae", "zeroed", True, "biased", "clamp", 1.0, 1.0)
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_openrlhf(openrlhf.parse(N4 + " --algo.advantage.estimator flash_reinforce"), version=VERSION)
    assert str(err.value).startswith("openrlhf config: algo.advantage.estimator='flash_reinforce': its baseline "
                                     "is the mean reward of the whole rollout batch")


# The replay's earlier semantics, each refuted by OpenRLHF's own output on a clean bundle: verl's GAE, which
# carries the value and advantage through a mask-0 token (the batch's interior spans: samples 1 and 5; the
# whitening then moves every loss token), and verl's Bessel-corrected whitening with ε added. Every sample with
# a loss token (11 of 12: sample 6 is fully masked) fails.
@pytest.mark.parametrize("name, knobs, reason", [
    # (with γ = λ = 1 both GAEs telescope to Σr − V_t: the sweep's γ = 0.99, λ = 0.95 tells them apart)
    ("gae-gamma-lambd", {"gae_masked_tokens": "skip"}, "advantage mismatch in 85 token(s) of 11 sample(s)"),
    # (84: at one loss token of gae-default the two whitenings differ by less than its bound)
    ("gae-default", {"whiten_variance": "unbiased", "whiten_eps_mode": "add"},
     "advantage mismatch in 84 token(s) of 11 sample(s)"),
    ("reinforce", {"whiten_variance": "unbiased", "whiten_eps_mode": "add"},
     "advantage mismatch in 85 token(s) of 11 sample(s)"),
    ("reinforce-no-std-norm", {"whiten_variance": "biased"}, "advantage mismatch in 85 token(s) of 11 sample(s)"),
])
def test_the_replays_former_gae_and_whitening_diverge_on_openrlhf_output(openrlhf, tmp_path, name, knobs, reason):
    import msgspec

    args = openrlhf.parse(COMMANDS[name])
    cfg = from_openrlhf(args, version=VERSION)
    s = _batch(11, "float32")
    out = _produce(openrlhf, args, s)
    assert replay(_write(tmp_path / "clean", cfg, s, out, "float32")).exit_code == 0
    wrong = replay(_write(tmp_path / "wrong", msgspec.structs.replace(cfg, **knobs), s, out, "float32"))
    stage = next(st for st in wrong.stages if st.stage == "advantage.estimate")
    assert (wrong.exit_code, stage.status, stage.reason) == (1, "fail", reason)


def test_without_the_kl_clamp_the_clamped_tokens_diverge(openrlhf, tmp_path):
    """The k1 estimates beyond ±10 (and those within rounding of the edge) pass only with kl_penalty_clamp."""
    import msgspec

    args = openrlhf.parse(COMMANDS["grpo-default"])
    cfg = from_openrlhf(args, version=VERSION)
    s = _batch(3, "float32")
    out = _produce(openrlhf, args, s)
    unclamped = replay(_write(tmp_path / "b", msgspec.structs.replace(cfg, kl_penalty_clamp=None), s, out, "float32"))
    kl = next(st for st in unclamped.stages if st.stage == "advantage.kl")
    assert (kl.status, kl.mismatches) == ("fail", 2)


def test_clamp_knobs_out_of_range_are_schema_errors():
    from replay_lib.bundle.schema import RecomputeConfig

    with pytest.raises(ValueError, match=r"^kl_penalty_clamp: expected null or a finite value > 0, got 0.0$"):
        RecomputeConfig(kl_penalty_clamp=0.0)
    with pytest.raises(ValueError, match=r"^reward_clip_low, reward_clip_high: expected both null or finite low <= "
                                         r"high, got \[1.0, -1.0\]$"):
        RecomputeConfig(reward_clip_low=1.0, reward_clip_high=-1.0)


@pytest.mark.parametrize("knob, value, expected", [
    ("whiten_variance", "population", "one of unbiased, biased, none"),
    ("whiten_eps_mode", "max", "one of add, clamp"),
    ("gae_masked_tokens", "carry", "one of skip, zeroed"),
])
def test_an_unknown_whitening_or_gae_mode_is_one_line_exit_3(openrlhf, tmp_path, cli, knob, value, expected):
    import msgspec

    args = openrlhf.parse(COMMANDS["gae-default"])
    cfg = msgspec.structs.replace(from_openrlhf(args, version=VERSION), **{knob: value})
    s = _batch(2, "float32")
    path = _write(tmp_path / "b", cfg, s, _produce(openrlhf, args, s), "float32")
    for command in ("validate", "replay"):
        code, out, err = cli(command, path)
        assert (code, out) == (3, ""), (command, out, err)
        assert err == f"trajectory-replay: error: {path / 'index.json'}: $.config.{knob}={value!r}: expected {expected}\n"


@pytest.mark.parametrize("name, knob", [("grpo-overlong", "overlong_buffer_len"),
                                        ("rloo-stop-properly", "truncated_reward_coef"),
                                        ("grpo-overlong-stop-fixed", "truncated_reward_coef"),
                                        ("grpo-overlong-stop-fixed", "overlong_buffer_len")])
def test_without_a_length_penalty_the_rewards_diverge(openrlhf, tmp_path, name, knob):
    """OpenRLHF's own length penalties change the rewards of this step: a replay without one diverges at
    reward.post_process (the clean bundle passes above)."""
    import msgspec

    args = openrlhf.parse(COMMANDS[name])
    cfg = from_openrlhf(args, version=VERSION)
    s = _batch(7, "float32")
    out = _produce(openrlhf, args, s)
    assert replay(_write(tmp_path / "clean", cfg, s, out, "float32")).exit_code == 0
    wrong = replay(_write(tmp_path / "wrong", msgspec.structs.replace(cfg, **{knob: msgspec.UNSET}), s, out,
                          "float32"))
    assert (wrong.exit_code, wrong.first_divergent_stage) == (1, "reward.post_process")


def test_divergence_gates_map_to_the_untruncated_weight_and_a_keep_gate(openrlhf, tmp_path):
    """``is_correction_gating`` binary_kl / tv (loss.py:224-239): the token keeps exp(old − rollout) untruncated
    where the sampled-token divergence is within [0, delta] (a single threshold is [0, delta], cli.py:639-642), else
    0 → ``is_keep={gating: [0, delta]}`` over an untruncated token weight. Without the gate (the ratio-only
    mapping) OpenRLHF's own loss on the same step diverges at loss.policy; a lower bound > 0 is a config OpenRLHF
    raises for (loss.py:171-172), so it is invalid input (exit 3), not a refusal."""
    import msgspec

    from replay_lib.errors import FrameworkConfigError

    args = openrlhf.parse(COMMANDS["grpo-binary-kl"])
    cfg = from_openrlhf(args, version=VERSION)
    assert (cfg.is_level, cfg.is_mode, cfg.is_low, cfg.is_high, cfg.is_keep) == (
        "token", "truncate", None, None, {"binary_kl": [0.0, 0.02]})
    s = _batch(3, "float32")
    out = _produce(openrlhf, args, s)
    assert replay(_write(tmp_path / "gate", cfg, s, out, "float32")).exit_code == 0
    ungated = replay(_write(tmp_path / "ungated", msgspec.structs.replace(cfg, is_keep=None), s, out, "float32"))
    loss = next(st for st in ungated.stages if st.stage == "loss.policy")
    assert (ungated.exit_code, loss.status, loss.reason) == (1, "fail", "loss field mismatch: pg_loss")
    band = GRPO + (" --algo.advantage.is_correction_level token --algo.advantage.is_correction_gating tv "
                   "--algo.advantage.is_correction_threshold 0.5 5")
    with pytest.raises(ValueError, match="takes an upper bound only"):
        openrlhf.PolicyLoss(is_correction_level="token", is_correction_gating="tv", is_correction_threshold=[0.5, 5])
    with pytest.raises(FrameworkConfigError) as err:
        from_openrlhf(openrlhf.parse(band), version=VERSION)
    assert str(err.value) == (
        "openrlhf config: algo.advantage.is_correction_threshold=[0.5, 5.0]: expected a single upper bound (a "
        "trust-region delta) with is_correction_gating=tv (OpenRLHF raises otherwise, models/loss.py:171-172)")
    assert err.value.exit_code == 3


def test_a_divergence_gate_is_decided_in_the_producers_format(openrlhf, tmp_path):
    """OpenRLHF evaluates the gate in the log-probs' dtype: in bfloat16 ``1 − 1e-6`` rounds to 1, a probability
    clamped there makes the binary KL NaN and the token is dropped, and the statistic's rounding moves tokens across
    the delta. The replay evaluates the gate in the declared compute format; evaluated in float64 instead, the
    clean bfloat16 bundle diverges."""
    name = "grpo-binary-kl"
    args = openrlhf.parse(COMMANDS[name])
    cfg = from_openrlhf(args, version=VERSION)
    s = _batch(sorted(COMMANDS).index(name), "bfloat16")
    out = _produce(openrlhf, args, s)
    path = _write(tmp_path / "bf16", cfg, s, out, "bfloat16")
    assert replay(path).exit_code == 0
    # the same bundle declared float32: the gate in float32 keeps the tokens OpenRLHF's bfloat16 gate dropped
    f32 = _write(tmp_path / "as-f32", cfg, s, out, "float32")
    wrong = replay(f32)
    loss = next(st for st in wrong.stages if st.stage == "loss.policy")
    assert (wrong.exit_code, loss.status, loss.reason) == (1, "fail", "loss field mismatch: pg_loss")


def test_the_sequence_mask_maps_to_the_geometric_keep_mask(openrlhf):
    """``is_correction_level=seq`` (loss.py:219-239): the sample kept where exp(masked_mean(old − rollout)) is within
    [low, high], its tokens keeping exp(old − rollout) → is_keep's geometric sequence mask over the untruncated
    token weight; a single threshold is [0, delta], whose 0 is no bound."""
    band = from_openrlhf(openrlhf.parse(COMMANDS["grpo-seq-mask"]), version=VERSION)
    assert (band.is_level, band.is_mode, band.is_low, band.is_high, band.is_keep) == (
        "token", "truncate", None, None, {"geometric": [0.8, 1.25]})
    delta = from_openrlhf(openrlhf.parse(COMMANDS["rloo-seq-mask-delta"]), version=VERSION)
    assert delta.is_keep == {"geometric": [None, 1.2]}
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_openrlhf(openrlhf.parse(GRPO + " --algo.advantage.is_correction_level seq --algo.advantage."
                                            "is_correction_gating tv --algo.advantage.is_correction_threshold 0.1"),
                      version=VERSION)
    assert str(err.value) == (
        "openrlhf config: algo.advantage.is_correction_gating='tv': at is_correction_level=seq OpenRLHF gates the "
        "sample's mean divergence (loss.py:233-234), which is not recomputed (is_keep's sequence masks read the "
        "ratio); a bundle would need a per-sample divergence keep mask")
