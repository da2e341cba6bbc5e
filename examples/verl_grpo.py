"""verl's own GRPO code for a few steps on the CPU, captured into replay bundles.

The group normalization, the policy loss, its aggregation and the metrics are verl's (the version the ``[verl]``
extra pins, 0.9.1), called in the order of its trainer; ``capture.integrations.verl`` records what they computed,
so the replay's expected values are verl's, not ours.

What runs as verl's own code:

* ``verl.trainer.ppo.ray_trainer.compute_advantage`` (``adv_estimator=grpo``), called once per rollout by the
  driver after the rewards and the old log-probs, as ``RayPPOTrainer.fit`` does; it calls
  ``core_algos.compute_grpo_outcome_advantage`` with the batch's ``uid`` index;
* ``verl.utils.seqlen_balancing.calculate_workload`` and ``get_seqlen_balanced_partitions``: the batch reordered
  by sequence-length workload before the old log-probs, as ``RayPPOTrainer._balance_batch`` does (one dp rank:
  one partition, sorted by workload and laid out small-large-small);
* ``verl.workers.utils.losses.ppo_loss`` bound to a real ``verl.workers.config.FSDPActorConfig`` (the actor's loss
  function, ``ActorRolloutRefWorker.set_loss_fn``): ``no_padding_2_padding``, ``compute_policy_loss_vanilla``,
  ``agg_loss`` over the global token count, the entropy and KL terms, and the ``Metric`` objects;
* ``verl.trainer.ppo.ray_trainer.apply_kl_penalty`` under ``--kl-in-reward`` (``use_kl_in_reward``, a fixed
  coefficient): the scores minus β·KL(old ‖ ref) per token, the estimator's input;
* ``verl.utils.metric.Metric``: how the step's metrics are aggregated over its micro-batches.

What cannot run on a CPU here, and is driven in verl's order instead (``CPUEngine`` below, a few lines each):

* the FSDP engine (``verl/workers/engine/fsdp/transformer_impl.py``, ``FSDPEngine.forward_backward_batch`` and
  ``optimizer_step``, reached through ``TrainingWorker.train_mini_batch``): it is registered for ``cuda`` and ``npu``
  devices only (``EngineRegistry.register(..., device=["cuda", "npu"])``), runs in a Ray worker group, and its data
  path is ``tensordict``'s nested ``TensorDict``, which is not installed with the ``--no-deps`` verl used here. The
  example keeps its order exactly: per mini-batch (one optimizer step), the gradients zeroed, ``batch_num_tokens``
  = the mini-batch's loss tokens (all-reduced over dp, here 1 rank) and ``dp_size`` set on the data, the mini-batch
  cut into micro-batches of ``ppo_micro_batch_size_per_gpu`` (gradient accumulation), each forward → the loss
  function → ``backward()``, then the gradient clipped to ``grad_clip`` and one AdamW step; the step's ``loss`` is
  the sum of its micro-batches' losses and its metrics are ``Metric``-aggregated (``_postprocess_output``);
* the rollout (vLLM/SGLang server) and the reward manager: a random 2-layer GPT-2 samples the responses on the CPU
  (no downloads) and a Python reward function scores them; the score sits at each response's last token
  (``token_level_scores``) as verl's reward loop places it. Multi-turn (on by default; ``--single-turn`` turns it
  off) makes every response that goes on past its first token a two-turn exchange: its 2nd and 3rd tokens are a
  tool's output (the digit 0), ``response_mask`` 0 there, as verl's agent loop writes them;
* the batch itself: ``DataProto`` / ``TensorDict`` (``tensordict``) are stood in for by ``Batch`` (a dict with
  the ``select`` / ``to_padded_tensor`` that the loss calls) and ``Proto`` (``batch``, ``non_tensor_batch``).
  verl's heavy imports that the called functions never use (ray's cluster, tensordict, vLLM, ...) are stubbed
  when they are not installed, as ``tests/conformance`` does.

Shapes: 4 prompts × ``rollout.n`` 4 = 16 samples per rollout; ``ppo_mini_batch_size`` 2 prompts → 8 samples per
optimizer step, 2 steps per rollout; ``ppo_micro_batch_size_per_gpu`` 2 → 4 micro-batches per step.

Bugs (``--bug``), each a real verl bug class:

* ``stale-group-index``: the GRPO estimator is handed the ``uid`` index of the batch as it was before the
  workload balancing reordered it (the groups taken from the wrong index). First divergence: ``reward.post_process``
  of every rollout bundle — the normalized rewards are not those of the samples' own groups; the actor's steps
  replay clean on the advantages they consumed.
* ``double-scaled-loss``: the actor's loss function divides each micro-batch's loss by the number of micro-batches
  (the loss that is backpropagated and reported), on top of ``agg_loss``'s division by the mini-batch's global
  token count (a loss scale divided twice under gradient accumulation). First divergence: ``loss.policy`` of
  every step bundle (``loss``); ``pg_loss`` as verl reports it is right.

    RELAX_REPLAY_CAPTURE=1 RELAX_REPLAY_CAPTURE_DIR=/tmp/verl-bundles python examples/verl_grpo.py
    trajectory-replay scan /tmp/verl-bundles
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import time
import types
import uuid
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VERL_LOGGING_LEVEL", "ERROR")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

# verl 0.9.1's package imports these at module level; none is called on the paths used here.
VERL_HEAVY = ("ray", "tensordict", "codetiming", "transformers", "flash_attn", "datasets", "orjson", "PIL", "peft",
              "vllm", "sglang", "deepspeed", "torchdata", "qwen_vl_utils", "torchvision", "liger_kernel", "wandb",
              "cachetools", "hydra", "uvicorn", "fastapi", "aiohttp", "zmq", "starlette", "grpc", "pybind11")
BUGS = ("stale-group-index", "double-scaled-loss")
PAD, EOS = 0, 1
DIGITS = list(range(3, 13))  # token 3 + d is the digit d
TOOL = 3  # the digit 0: what the tool answers in a multi-turn response


class _StubType(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubType(name, (), {})

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls


class _StubCallable:
    """A lower-case attribute of a stub: a pass-through decorator whose own attributes are stubs too
    (``ray.remote``, ``ray.actor.ActorHandle`` in an annotation)."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else (lambda fn: fn)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubType(name, (), {}) if name[:1].isupper() else _StubCallable(name)


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _StubType(name, (), {}) if name[:1].isupper() else _StubCallable(name)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def stub_missing(heavy=VERL_HEAVY) -> None:
    """Stub the modules of ``heavy`` that are not installed (an installed one is imported for real)."""
    missing = [m for m in heavy if m not in sys.modules and importlib.util.find_spec(m) is None]
    if missing:
        sys.meta_path.append(_StubFinder(missing))


stub_missing()

from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402
from verl.trainer.ppo import core_algos, ray_trainer  # noqa: E402
from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402
from verl.workers.config.optimizer import FSDPOptimizerConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from capture.integrations.verl import enable_replay_capture  # noqa: E402


class Batch(dict):
    """What verl's loss and trainer functions read of a ``TensorDict`` / ``DataProto.batch``."""

    def select(self, *keys):
        return Batch({k: self[k] for k in keys})

    def to_padded_tensor(self):
        return self

    @property
    def batch_size(self):
        return (len(next(iter(self.values()))),)

    def take(self, index) -> "Batch":
        return Batch({k: v[index] if isinstance(v, torch.Tensor) else v for k, v in self.items()})


class Proto:
    """What ``compute_advantage`` reads of a ``DataProto``."""

    def __init__(self, batch: Batch, non_tensor_batch: dict, meta_info: dict | None = None):
        self.batch, self.non_tensor_batch, self.meta_info = batch, non_tensor_batch, meta_info or {}

    def reorder(self, index: torch.Tensor) -> None:
        self.batch = self.batch.take(index)
        self.non_tensor_batch = {k: v[index.numpy()] for k, v in self.non_tensor_batch.items()}


def trainer_config(args) -> dict:
    """verl's trainer config (the keys that differ from ``_generated_ppo_trainer.yaml``'s defaults)."""
    return {
        "algorithm": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True,
                      "use_kl_in_reward": args.kl_in_reward > 0, "kl_penalty": "kl",
                      "kl_ctrl": {"type": "fixed", "kl_coef": args.kl_in_reward}},
        "actor_rollout_ref": {
            "rollout": {"n": args.n},
            "actor": {"ppo_mini_batch_size": args.mini_batch, "ppo_micro_batch_size_per_gpu": args.micro_batch,
                      "use_dynamic_bsz": False, "ppo_epochs": 1, "shuffle": False, "loss_agg_mode": args.loss_agg_mode,
                      "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                      "entropy_coeff": args.entropy_coeff, "use_kl_loss": args.kl_loss_coef > 0,
                      "kl_loss_coef": args.kl_loss_coef, "kl_loss_type": "low_var_kl", "grad_clip": 1.0,
                      "calculate_entropy": True},
        },
    }


def actor_config(cfg: dict) -> FSDPActorConfig:
    a = cfg["actor_rollout_ref"]["actor"]
    keys = ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_epochs", "shuffle",
            "loss_agg_mode", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "entropy_coeff",
            "use_kl_loss", "kl_loss_coef", "kl_loss_type", "grad_clip", "calculate_entropy")
    return FSDPActorConfig(strategy="fsdp", rollout_n=cfg["actor_rollout_ref"]["rollout"]["n"],
                           optim=FSDPOptimizerConfig(lr=0.05), **{k: a[k] for k in keys})


def make_model(seed: int, hidden: int = 32) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    # no dropout (the actor's forward in train mode scores as the old log-probs' forward did, as Qwen's configs do)
    config = GPT2Config(vocab_size=13, n_positions=32, n_embd=hidden, n_layer=2, n_head=2, bos_token_id=EOS,
                        eos_token_id=EOS, pad_token_id=PAD, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def forward(model, batch: Batch) -> dict:
    """The model's per-token log-probs and entropies in verl's no-padding layout: one value per valid token of each
    sequence (prompt then response), the value at token t scoring token t + 1 (what ``no_padding_2_padding``
    slices, padding.py:97-141)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    token_logp = logp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    valid = mask.bool()
    return {"log_probs": token_logp[valid], "entropy": entropy[valid]}


def response_part(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    from verl.workers.utils.padding import no_padding_2_padding

    out = forward(model, batch)
    return no_padding_2_padding(out["log_probs"], batch), no_padding_2_padding(out["entropy"], batch)


def odd_digits(response: list[int]) -> float:
    """The reward: the odd digits of the response the model wrote, and 0.5 for ending with <eos>."""
    odd = sum(1 for t in response if t in DIGITS and (t - 3) % 2 == 1)
    return float(odd) + (0.5 if response and response[-1] == EOS else 0.0)


def rollout(model, gen: torch.Generator, args, step: int) -> Proto:
    """Sample ``n`` responses to each of ``prompts`` prompts (the rollout server's job, on the CPU here)."""
    prompts = []
    for _ in range(args.prompts):
        length = int(torch.randint(2, 4, (1,), generator=gen))
        prompts.append([DIGITS[int(d)] for d in torch.randint(0, 10, (length,), generator=gen)])
    # ray_trainer.fit: one uid per prompt, then repeat(n, interleave=True)
    uids = np.array([str(uuid.UUID(int=(step << 32) + i)) for i in range(args.prompts)], dtype=object)
    uids = np.repeat(uids, args.n)
    prompts = [p for p in prompts for _ in range(args.n)]
    width = max(map(len, prompts))
    count, horizon = len(prompts), args.response_length
    prompt_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    responses = torch.full((count, horizon), PAD)
    response_mask = torch.zeros(count, horizon, dtype=torch.int64)
    tool = torch.zeros(count, horizon, dtype=torch.bool)
    sampling_logp = torch.zeros(count, horizon)
    done = torch.zeros(count, dtype=torch.bool)
    with torch.no_grad():
        for t in range(horizon):
            ids = torch.cat([prompt_ids, responses[:, :t]], 1)
            mask = torch.cat([prompt_mask, response_mask[:, :t]], 1)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                           use_cache=False).logits[:, -1].float()
            logp = torch.log_softmax(logits, -1)
            token = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
            turn = args.multi_turn and t in (1, 2)
            token = torch.where(torch.tensor(turn) & ~done, torch.full_like(token, TOOL), token)
            token = torch.where(done, torch.full_like(token, PAD), token)
            responses[:, t] = token
            response_mask[:, t] = (~done).long()
            tool[:, t] = turn & ~done
            sampling_logp[:, t] = torch.where(done, 0.0, logp.gather(1, token.unsqueeze(1)).squeeze(1))
            done |= token == EOS
    attention = torch.cat([prompt_mask, response_mask], 1)
    lengths = response_mask.sum(1)
    loss_mask = response_mask * (~tool).long()  # the agent loop's response_mask: 0 on the tool's tokens
    scores = torch.zeros(count, horizon)
    for i in range(count):
        n = int(lengths[i])
        written = [int(x) for x, is_tool in zip(responses[i, :n], tool[i, :n]) if not is_tool]
        scores[i, n - 1] = odd_digits(written)
    batch = Batch(prompts=prompt_ids, responses=responses, input_ids=torch.cat([prompt_ids, responses], 1),
                  attention_mask=attention, response_mask=loss_mask, token_level_scores=scores,
                  rollout_log_probs=sampling_logp * response_mask)
    return Proto(batch, {"uid": uids})


class CPUEngine:
    """``FSDPEngine.train_batch`` in verl's order (engine/base.py:113-129, fsdp/transformer_impl.py:724-830), on
    one CPU rank: zero the gradients, forward/backward every micro-batch, clip, step."""

    def __init__(self, model, lr: float, grad_clip: float, micro_batch: int):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
        self.grad_clip = grad_clip
        self.micro_batch = micro_batch

    def train_batch(self, data: Batch, loss_function):
        self.optimizer.zero_grad()
        output = self.forward_backward_batch(data, loss_function)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=self.grad_clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.optimizer.zero_grad()
        output["metrics"]["grad_norm"] = float(grad_norm)
        return output

    def forward_backward_batch(self, data: Batch, loss_function) -> dict:
        # transformer_impl.py:730-735: the global token count (all-reduced over dp) and dp_size on the data
        data = Batch(data, batch_num_tokens=int(data["response_mask"].sum()), dp_size=1)
        count = len(data["responses"])
        micro = [data.take(slice(i, i + self.micro_batch)) for i in range(0, count, self.micro_batch)]
        losses, metrics = [], {}
        for mb in micro:
            model_output = forward(self.model, mb)
            loss, mb_metrics = loss_function(model_output=model_output, data=mb, dp_group=None)
            loss.backward()
            losses.append(loss.detach().item())
            for k, v in mb_metrics.items():
                metrics.setdefault(k, []).append(v)
        return {"loss": losses, "metrics": metrics}


class Worker:
    """The part of verl's ``TrainingWorker`` (``ActorRolloutRefWorker.actor``) the capture hooks: ``loss_fn`` and
    ``engine``."""

    def __init__(self, engine: CPUEngine, config: FSDPActorConfig):
        self.engine = engine
        self.loss_fn = None
        self.config = config

    def set_loss_fn(self, loss_fn):
        self.loss_fn = loss_fn


def stale_index_estimator(stale: dict):
    """``compute_grpo_outcome_advantage`` handed the uid index of the batch before it was reordered."""
    inner = core_algos.compute_grpo_outcome_advantage

    @functools.wraps(inner)
    def grpo(*args, index, **kwargs):
        return inner(*args, index=stale["uid"], **kwargs)

    return grpo


def double_scaled(loss_fn, micro_batches: int):
    """The actor's loss divided by the gradient-accumulation steps on top of ``agg_loss``'s division by the
    mini-batch's global token count (the legacy actor's ``loss / gradient_accumulation`` kept after the switch to
    global-batch normalization): what is backpropagated and reported is 1/``micro_batches`` of the loss."""

    @functools.wraps(loss_fn)
    def scaled(*args, **kwargs):
        loss, metrics = loss_fn(*args, **kwargs)
        return loss / micro_batches, metrics

    return scaled


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2, help="rollouts (each trained in 2 optimizer steps; default 2)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per rollout (train_batch_size)")
    p.add_argument("--n", type=int, default=4, help="rollout.n: responses per prompt")
    p.add_argument("--mini-batch", type=int, default=2, help="ppo_mini_batch_size (prompts per optimizer step)")
    p.add_argument("--micro-batch", type=int, default=2, help="ppo_micro_batch_size_per_gpu (samples)")
    p.add_argument("--response-length", type=int, default=6)
    p.add_argument("--loss-agg-mode", default="token-mean",
                   choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"))
    p.add_argument("--entropy-coeff", type=float, default=0.0)
    p.add_argument("--kl-loss-coef", type=float, default=0.0, help="use_kl_loss with this coefficient when > 0")
    p.add_argument("--kl-in-reward", type=float, default=0.0,
                   help="use_kl_in_reward with this fixed coefficient when > 0 (verl's apply_kl_penalty)")
    p.add_argument("--single-turn", dest="multi_turn", action="store_false",
                   help="no tool spans in the responses (multi-turn is on by default)")
    p.add_argument("--hidden", type=int, default=32, help="the model's width (bench/bench_verl_capture.py widens it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bug", choices=BUGS, default=None)
    return p.parse_args(argv)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of the trained weights (name, dtype, shape and bytes of every tensor, in name order)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def train(argv=None, env=None) -> dict:
    """Train once; returns the seconds, the weights' digest and the capture's counts (``None`` when it is off)."""
    args = parse_args(argv)
    cfg = trainer_config(args)
    model = make_model(args.seed, args.hidden)
    ref_model = copy.deepcopy(model).eval() if args.kl_loss_coef > 0 or args.kl_in_reward > 0 else None
    actor = actor_config(cfg)
    worker = Worker(CPUEngine(model, lr=0.05, grad_clip=actor.grad_clip, micro_batch=args.micro_batch), actor)
    loss_fn = functools.partial(ppo_loss, config=actor)
    if args.bug == "double-scaled-loss":
        loss_fn = double_scaled(loss_fn, micro_batches=args.mini_batch * args.n // args.micro_batch)
    worker.set_loss_fn(loss_fn)  # ActorRolloutRefWorker.set_loss_fn
    hooks = enable_replay_capture(cfg, env=env)
    if hooks is not None:
        hooks.install_driver(ray_trainer)
        hooks.install_worker(worker)
    stale: dict = {}
    saved_estimator = core_algos.compute_grpo_outcome_advantage
    if args.bug == "stale-group-index":
        core_algos.compute_grpo_outcome_advantage = stale_index_estimator(stale)
    gen = torch.Generator().manual_seed(args.seed)
    mini = args.mini_batch * args.n  # ray_trainer.py:1352-1353
    started = time.perf_counter()
    trainer_seconds = 0.0  # compute_advantage and the actor's update: where the hooks run
    trainer_cpu = 0.0  # the same, in this thread's CPU time (not the writer thread's, not a neighbour's)
    try:
        for step in range(args.steps):
            model.eval()
            data = rollout(model, gen, args, step)
            stale["uid"] = data.non_tensor_batch["uid"].copy()
            # _balance_batch (ray_trainer.py:1182-1246): partitions of equal workload over the dp ranks (1 here),
            # each sorted by workload and laid out small-large-small, the batch reordered by them
            workload = calculate_workload(data.batch["attention_mask"].sum(-1))
            parts = get_seqlen_balanced_partitions(workload, k_partitions=1, equal_size=True)
            for i, part in enumerate(parts):
                part.sort(key=lambda x: (workload[x], x))
                parts[i] = part[::2] + part[1::2][::-1]
            data.reorder(torch.tensor([j for part in parts for j in part]))
            with torch.no_grad():  # compute_log_prob / compute_ref_log_prob
                data.batch["old_log_probs"] = response_part(model, data.batch)[0]
                if ref_model is not None:
                    data.batch["ref_log_prob"] = response_part(ref_model, data.batch)[0]
            if args.kl_in_reward > 0:  # ray_trainer.fit: the scores minus β·KL(old ‖ ref) per token
                data, _ = ray_trainer.apply_kl_penalty(data, kl_ctrl=core_algos.FixedKLController(args.kl_in_reward),
                                                       kl_penalty="kl")
            else:
                data.batch["token_level_rewards"] = data.batch["token_level_scores"]
            began, began_cpu = time.perf_counter(), time.thread_time()
            data = ray_trainer.compute_advantage(data, adv_estimator="grpo", num_repeat=args.n,
                                                 norm_adv_by_std_in_grpo=True, config=cfg["algorithm"])
            # _update_actor → train_mini_batch: the mini-batches in order (shuffle=False, ppo_epochs=1)
            model.train()
            batch = Batch(data.batch, global_batch_size=mini)
            count = len(batch["responses"])
            for start in range(0, count, mini):
                worker.engine.train_batch(batch.take(slice(start, start + mini)), loss_function=worker.loss_fn)
            trainer_seconds += time.perf_counter() - began
            trainer_cpu += time.thread_time() - began_cpu
    finally:
        core_algos.compute_grpo_outcome_advantage = saved_estimator
        if hooks is not None:
            hooks.uninstall()
            hooks.close()
    took = time.perf_counter() - started
    out = {"steps": args.steps, "seconds": took, "trainer_seconds": trainer_seconds,
           "trainer_cpu_seconds": trainer_cpu,
           "weights_sha256": weights_digest(model), "capture": None}
    if hooks is not None:
        stats = hooks.capture.stats
        out["capture"] = {"directory": str(hooks.capture.config.directory), "written": stats.written,
                          "dropped": stats.dropped, "errors": stats.errors + hooks.errors}
    return out


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    done = train(argv)
    head = (f"trained {done['steps']} rollout(s) in {done['seconds']:.1f} s "
            f"(weights sha256 {done['weights_sha256'][:16]})")
    captured = done["capture"]
    if captured is None:
        print(f"{head}; capture off (set RELAX_REPLAY_CAPTURE=1 and RELAX_REPLAY_CAPTURE_DIR)")
        return 0
    print(f"{head}; {captured['written']} bundle(s) written to {captured['directory']} "
          f"({captured['dropped']} dropped, {captured['errors']} error(s))")
    return 0 if captured["errors"] == 0 and captured["dropped"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
