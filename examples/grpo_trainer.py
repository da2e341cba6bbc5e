"""A small but genuine asynchronous GRPO trainer on the CPU that captures replay bundles.

Task: given a prompt of 2–4 digits, emit them reversed followed by <eos>. The policy is a tiny causal LM
(2-layer GRU over a 14-token vocabulary, random init, no downloads). The reward is rule-based: partial
credit for the right digits and for the right positions, plus 1 for an exact answer.

Asynchrony, as in a fully-async RL job:
* a rollout worker thread samples ``n`` responses per prompt (temperature + top-k) with *stale* weights
  (rollout ``r`` uses the snapshot published ``--max-staleness`` rollouts earlier; both weight versions
  are recorded), and streams the samples to the trainer;
* the trainer consumes them in consumer (transfer) batches of ``--consumer-batch`` samples, which do not
  align with the prompt groups;
* rewards are normalized by semantic group (``group_normalize``) once the rollout is in; ``--pr65-bug``
  reproduces PR #65 by normalizing each physical consumer batch instead (``batch_normalize``);
* old log-probs (actor) and reference log-probs (the frozen initial model) give the rollout KL; the
  advantages are GRPO returns; each rollout is trained for ``--steps-per-rollout`` actor steps of
  micro-batches with gradient accumulation and Adam. With several processes (``torchrun``, gloo) every
  rank generates its own prompts and the gradients are averaged (data parallel).

Sample-support scoring (``--sample-support``, SPEC §7): the sampler draws each token from its top-k support
and records the support ids; the trainer scores the policy, old and reference log-probs of each sampled
token renormalized over that support (``support_log_probs``) and uses them in the KL and the loss; capture
records the support rows and the member logits of the scoring forward, and both bundle kinds declare stage
``logprob.support``. ``--support-full-vocab-bug`` claims support scoring but scores over the whole
vocabulary; ``--append-eos`` appends an <eos> without support to responses cut off at the length limit.

Rewards, KL, advantages and the per-token loss come from ``replay_lib.kernels`` — the same code the replay
uses. The loss is aggregated in float64 (``policy_loss``: per-sample sums and their masked means), and each
micro-batch hands capture its per-sample loss terms, its per-token surrogate and its loss fields, so the step
bundle carries ``expected.json $.loss.policy.per_sample`` (and, with ``RELAX_REPLAY_CAPTURE_TOKEN_TERMS=1``,
the payload ``pg_losses``) and declares float64 accumulation. Capture is configured from the environment
(``RELAX_REPLAY_CAPTURE=1``, ``RELAX_REPLAY_CAPTURE_DIR``…), see examples/README.md.

    python examples/grpo_trainer.py --rollouts 4
    torchrun --nproc-per-node 2 examples/grpo_trainer.py --rollouts 4
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from capture import Provenance, maybe_enable_for_actor
from replay_lib.kernels import (
    LOSS_FIELDS,
    batch_normalize,
    compute_policy_loss,
    get_grpo_returns,
    group_normalize,
    rollout_kl,
    segment_ids,
)
from replay_lib.schema import RecomputeConfig

# ------------------------------------------------------------------------------------------ task

DIGITS = 10
BOS, SEP, EOS, PAD = 10, 11, 12, 13
VOCAB = 14
TOKEN_TEXT = [str(d) for d in range(DIGITS)] + ["<bos>", "<sep>", "<eos>", "<pad>"]


def make_prompts(gen: torch.Generator, count: int, min_digits: int, max_digits: int) -> list[list[int]]:
    lengths = torch.randint(min_digits, max_digits + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, DIGITS, (n,), generator=gen).tolist() for n in lengths]


def prompt_tokens(digits: Sequence[int]) -> list[int]:
    return [BOS, *digits, SEP]


def target_tokens(digits: Sequence[int]) -> list[int]:
    return [*reversed(digits), EOS]


def reward_of(digits: Sequence[int], response: Sequence[int]) -> float:
    """Rule-based reward in [0, 2]: half for the prompt's digits present in the response (as a multiset),
    half for the reversed digits in place, and 1 for an exact answer ending in <eos>."""
    target = target_tokens(digits)
    k = len(digits)
    hits = sum(1 for i in range(min(k, len(response))) if response[i] == target[i])
    pool = list(response)
    present = 0
    for d in digits:
        if d in pool:
            pool.remove(d)
            present += 1
    return 0.5 * present / k + 0.5 * hits / k + (1.0 if list(response) == target else 0.0)


# ----------------------------------------------------------------------------------------- model


class TinyLM(nn.Module):
    """A 2-layer GRU causal language model."""

    def __init__(self, hidden: int = 64, embed: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed)
        self.rnn = nn.GRU(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens: torch.Tensor, state: Optional[torch.Tensor] = None):
        out, state = self.rnn(self.embed(tokens), state)
        return self.head(out), state


@dataclass
class Sample:
    rollout_id: int
    index: int  # position in the rollout's stream on this rank
    group: int  # semantic group (prompt) index, unique across ranks
    digits: list[int]
    prompt_text: str
    response: list[int]
    rollout_weight: int
    support_ids: torch.Tensor  # [T, K] int32: the top-k support each token was drawn from (−1: none)
    support_logits: torch.Tensor  # [T, K] float32: the tempered logits of its members
    truncated: bool = False  # cut off at the length limit (its <eos>, if any, was appended by the loop)


@torch.no_grad()
def sample_group(model: TinyLM, digits: list[int], n: int, *, temperature: float, top_k: int,
                 gen: torch.Generator, append_eos: bool = False
                 ) -> list[tuple[list[int], torch.Tensor, torch.Tensor, bool]]:
    """``n`` responses to one prompt, token by token, from the top-k support at ``temperature``:
    ``(tokens, support ids, support logits, truncated)``. With ``append_eos`` a response cut off at the
    length limit gets an <eos> appended by the loop: the sampler never drew it, so its support row is all
    −1 (padding)."""
    prompt = torch.tensor([prompt_tokens(digits)] * n)
    logits, state = model(prompt)
    last = logits[:, -1]
    max_new = len(digits) + 2
    tokens = torch.zeros(n, max_new, dtype=torch.int64)
    support_ids = torch.zeros(n, max_new, top_k, dtype=torch.int32)
    support_logits = torch.zeros(n, max_new, top_k)
    done = torch.zeros(n, dtype=torch.bool)
    lengths = torch.full((n,), max_new, dtype=torch.int64)
    for t in range(max_new):
        values, ids = torch.topk(last / temperature, top_k, dim=-1)
        choice = torch.multinomial(torch.softmax(values, dim=-1), 1, generator=gen)
        token = ids.gather(1, choice).squeeze(1)
        tokens[:, t] = token
        support_ids[:, t] = ids.to(torch.int32)
        support_logits[:, t] = values
        finished_now = (token == EOS) & ~done
        lengths[finished_now] = t + 1
        done |= finished_now
        if bool(done.all()):
            break
        logits, state = model(token[:, None], state)
        last = logits[:, -1]
    out = []
    for i in range(n):
        T = int(lengths[i])
        response, ids, values = tokens[i, :T].tolist(), support_ids[i, :T].clone(), support_logits[i, :T].clone()
        truncated = not bool(done[i])
        if truncated and append_eos:
            response.append(EOS)
            ids = torch.cat([ids, torch.full((1, top_k), -1, dtype=torch.int32)])
            values = torch.cat([values, torch.zeros(1, top_k)])
        out.append((response, ids, values, truncated))
    return out


def _forward(model: TinyLM, samples: Sequence[Sample]):
    """Teacher-forced forward: ``(logits [B, W, V], rows, cols, targets)``, where ``logits[rows, cols]``
    are the positions predicting the response tokens ``targets``, concatenated in sample order."""
    inputs = [prompt_tokens(s.digits) + s.response[:-1] for s in samples]
    width = max(len(x) for x in inputs)
    batch = torch.full((len(samples), width), PAD, dtype=torch.int64)
    rows, cols, targets = [], [], []
    for i, (x, s) in enumerate(zip(inputs, samples)):
        batch[i, : len(x)] = torch.tensor(x)
        start = len(prompt_tokens(s.digits)) - 1  # the position that predicts the first response token
        rows += [i] * len(s.response)
        cols += range(start, start + len(s.response))
        targets += s.response
    logits, _ = model(batch)
    return logits, torch.tensor(rows), torch.tensor(cols), torch.tensor(targets)


def score(model: TinyLM, samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probs (full vocabulary) and entropies of the response tokens, in sample order."""
    logits, rows, cols, targets = _forward(model, samples)
    log_probs = F.log_softmax(logits.float(), dim=-1)[rows, cols]
    token_log_probs = log_probs.gather(1, targets[:, None]).squeeze(1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return token_log_probs, entropy


def support_log_probs(logits: torch.Tensor, support_ids: torch.Tensor, targets: torch.Tensor,
                      full_log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp_S [N], member logits [N, K])``: each target renormalized over its recorded support,

        logp_S(y) = l_y − m − log Σ_{j∈S} exp(l_j − m),   m = max_{j∈S} l_j

    in float32, differentiable, the same arithmetic as ``replay_lib.support.support_logprobs`` (which the
    replay recomputes from the member logits). Padding slots (id −1) are excluded; a row without support
    (an appended <eos>) takes its ``full_log_probs`` value. Member logits are returned with padding slots 0,
    as recorded."""
    ids = support_ids.to(torch.int64)
    pad = ids < 0
    members = logits.float().gather(1, ids.clamp(min=0))
    out = full_log_probs
    rows = torch.nonzero(~pad.all(1)).reshape(-1)
    if rows.numel():
        # Score only rows with support: an all-padding row would put NaN into the backward pass.
        row_ids = ids[rows]
        masked = members[rows].masked_fill(pad[rows], float("-inf"))
        m = masked.amax(1).detach()  # cancels analytically; detached as in any logsumexp
        slot = (row_ids == targets[rows, None]).to(torch.uint8).argmax(1)
        l_y = masked.gather(1, slot[:, None]).squeeze(1)
        scored = (l_y - m) - (masked - m[:, None]).exp().sum(1).log()
        out = full_log_probs.index_put((rows,), scored)
    return out, members.detach().masked_fill(pad, 0.0)


@dataclass
class SupportScores:
    log_probs: torch.Tensor  # [N] what the trainer uses: logp_S (or full vocabulary with the bug)
    entropy: torch.Tensor  # [N] full-vocabulary entropy (the entropy bonus is unchanged)
    full_log_probs: torch.Tensor  # [N] full-vocabulary log-prob of each sampled token
    support_logits: torch.Tensor  # [N, K] member logits of this forward (padding slots 0)
    support_ids: torch.Tensor  # [N, K] int32, as the sampler recorded them
    targets: torch.Tensor  # [N] int64 sampled token ids


def score_support(model: TinyLM, samples: Sequence[Sample], full_vocab_bug: bool = False) -> SupportScores:
    """Teacher-forced log-probs renormalized over each token's recorded sampler support. ``full_vocab_bug``:
    the log-probs are scored over the whole vocabulary instead (while everything else claims support)."""
    logits, rows, cols, targets = _forward(model, samples)
    logits = logits.float()[rows, cols]
    log_probs = F.log_softmax(logits, dim=-1)
    full = log_probs.gather(1, targets[:, None]).squeeze(1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    support_ids = torch.cat([s.support_ids for s in samples])
    logp_s, members = support_log_probs(logits, support_ids, targets, full)
    return SupportScores(log_probs=full if full_vocab_bug else logp_s, entropy=entropy,
                         full_log_probs=full.detach(), support_logits=members, support_ids=support_ids,
                         targets=targets)


# ---------------------------------------------------------------------------------------- loss


@dataclass
class MicroBatchLoss:
    fields: dict[str, torch.Tensor]  # loss, pg_loss, entropy_loss, pg_clipfrac, ppo_kl: 0-d float64 (``loss``
    # carries the graph)
    terms: dict[str, torch.Tensor]  # per sample, float64: pg_sum, entropy_sum, kl_sum, clip_count, mask_count
    pg_losses: torch.Tensor  # [tokens] float32: the per-token surrogate before aggregation


def drop_last_loss_token(mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``mask`` with each sample's last loss token taken out: the off-by-one of ``--loss-mask-bug``."""
    out = mask.clone()
    start = 0
    for n in lengths.tolist():
        kept = torch.nonzero(out[start:start + n]).reshape(-1)
        if kept.numel():
            out[start + int(kept[-1])] = 0
        start += n
    return out


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                entropy: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, *, eps_clip: float,
                eps_clip_high: float, entropy_coef: float, mask_bug: bool = False) -> MicroBatchLoss:
    """One micro-batch's clipped surrogate: per token in float32 (``compute_policy_loss``, the replay's kernel),
    then every per-sample sum ``Σ_t x·mask`` and the sum of per-sample masked means in float64 — float32
    sums of long responses carry rounding (at ~u·n relative) that would blur a one-token difference.
    ``mask_bug``: the sums leave out each sample's last loss token (while the recorded mask keeps it)."""
    ppo_kl = old_log_probs.float() - log_probs.float()
    pg_losses, clipfrac = compute_policy_loss(ppo_kl, advantages.float(), eps_clip, eps_clip_high)
    seg = segment_ids(lengths)
    m = (drop_last_loss_token(mask, lengths) if mask_bug else mask).to(torch.float64)

    def per_sample(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(lengths.numel(), dtype=torch.float64).index_add(0, seg, x.to(torch.float64) * m)

    terms = {"pg_sum": per_sample(pg_losses), "entropy_sum": per_sample(entropy), "kl_sum": per_sample(ppo_kl),
             "clip_count": per_sample(clipfrac), "mask_count": per_sample(m)}
    denom = terms["mask_count"].clamp_min(1.0)
    pg_loss = (terms["pg_sum"] / denom).sum()
    entropy_loss = (terms["entropy_sum"] / denom).sum()
    fields = {
        "loss": pg_loss - entropy_coef * entropy_loss,
        "pg_loss": pg_loss,
        "entropy_loss": entropy_loss,
        "pg_clipfrac": (terms["clip_count"] / denom).sum(),
        "ppo_kl": (terms["kl_sum"] / denom).sum(),
    }
    return MicroBatchLoss(fields=fields, terms={k: v.detach() for k, v in terms.items()},
                          pg_losses=pg_losses.detach())


# -------------------------------------------------------------------------------- rollout worker


class WeightStore:
    """Weight snapshots published by the trainer, keyed by the rollout they follow (-1 = initial)."""

    def __init__(self):
        self._snapshots: dict[int, tuple[int, dict]] = {}
        self._cond = threading.Condition()
        self.failed: Optional[BaseException] = None

    def publish(self, after_rollout: int, version: int, model: nn.Module) -> None:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with self._cond:
            self._snapshots[after_rollout] = (version, state)
            for old in [k for k in self._snapshots if k < after_rollout - 4]:
                del self._snapshots[old]
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self.failed = exc
            self._cond.notify_all()

    def wait(self, after_rollout: int) -> tuple[int, dict]:
        with self._cond:
            while after_rollout not in self._snapshots:
                if self.failed is not None:
                    raise RuntimeError("trainer stopped") from self.failed
                self._cond.wait()
            return self._snapshots[after_rollout]


_END = object()


def rollout_worker(args, rank: int, store: WeightStore, stream: queue.Queue) -> None:
    """Generates rollouts on stale weights and streams their samples, one at a time."""
    try:
        sampler = TinyLM(args.hidden, args.embed)
        for r in range(args.rollouts):
            version, state = store.wait(max(r - 1 - args.max_staleness, -1))
            sampler.load_state_dict(state)
            gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 10_007 + r)
            prompts = make_prompts(gen, args.prompts_per_rollout, args.min_digits, args.max_digits)
            index = 0
            for p, digits in enumerate(prompts):
                group = rank * args.prompts_per_rollout + p
                text = args.prompt_template.format(digits=" ".join(map(str, digits)))
                for response, ids, logits, truncated in sample_group(
                        sampler, digits, args.n_samples, temperature=args.temperature, top_k=args.top_k, gen=gen,
                        append_eos=args.append_eos):
                    stream.put(Sample(r, index, group, digits, text, response, version, ids, logits, truncated))
                    index += 1
        stream.put(_END)
    except BaseException as exc:  # surface the failure in the trainer instead of hanging it
        stream.put(exc)


# --------------------------------------------------------------------------------------- trainer


@dataclass
class TrainResult:
    model: TinyLM
    step_times: list[float] = field(default_factory=list)  # seconds per actor step (train_one_step)
    step_cpu_times: list[float] = field(default_factory=list)  # CPU seconds of the training thread per step
    loop_time: float = 0.0  # seconds of the whole training loop
    steps: int = 0
    mean_rewards: list[float] = field(default_factory=list)  # per rollout
    capture_stats: object = None
    capture_flushed: bool = True


def recompute_config(args) -> RecomputeConfig:
    """Every knob that changes the math, from the trainer's real settings."""
    return RecomputeConfig(
        advantage_estimator="grpo", n_samples_per_prompt=args.n_samples,
        grpo_std_normalization=args.std_normalization, kl_loss_type=args.kl_loss_type, kl_coef=args.kl_coef,
        eps_clip=args.eps_clip, eps_clip_high=args.eps_clip_high, entropy_coef=args.entropy_coef,
        rewards_normalization=True, use_kl_loss=False, kl_loss_coef=0.0, use_tis=False, tis_clip=2.0,
        tis_clip_low=0.0, calculate_per_token_loss=False, normalize_advantages=False, eps_clip_c=None,
        use_rollout_logprobs=False, vocab_size=VOCAB,
    )


def _take(stream: queue.Queue, count: int) -> list[Sample]:
    out = []
    while len(out) < count:
        item = stream.get()
        if isinstance(item, BaseException):
            raise RuntimeError("rollout worker failed") from item
        if item is _END:
            raise RuntimeError("rollout worker ended early")
        out.append(item)
    return out


def _lengths(samples: Sequence[Sample]) -> torch.Tensor:
    return torch.tensor([len(s.response) for s in samples], dtype=torch.int64)


def _mask(samples: Sequence[Sample], mask_truncated: bool) -> torch.Tensor:
    """1 for every response token; a response cut off at the length limit is masked out (overlong filtering)."""
    rows = []
    for s in samples:
        keep = 0.0 if mask_truncated and s.truncated else 1.0
        rows.append(torch.full((len(s.response),), keep))
    return torch.cat(rows)


def train(args, capture, rank: int = 0, world: int = 1) -> TrainResult:
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = TinyLM(args.hidden, args.embed)
    reference = TinyLM(args.hidden, args.embed)
    reference.load_state_dict(model.state_dict())
    reference.requires_grad_(False)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    cfg = recompute_config(args)
    per_rollout = args.prompts_per_rollout * args.n_samples
    step_size = per_rollout // args.steps_per_rollout

    store = WeightStore()
    stream: queue.Queue = queue.Queue(maxsize=per_rollout * (args.max_staleness + 2))
    store.publish(-1, 0, model)
    worker = threading.Thread(target=rollout_worker, args=(args, rank, store, stream),
                              name="rollout-worker", daemon=True)
    worker.start()
    result = TrainResult(model=model)
    version = 0  # optimizer steps applied to the actor
    previous_rewards = None  # (raw, rewards) of the rollout before, for --stale-advantages-bug
    start = time.perf_counter()
    try:
        for r in range(args.rollouts):
            # Consume the stream in consumer batches that ignore the prompt-group boundaries.
            samples: list[Sample] = []
            rewards_parts: list[torch.Tensor] = []
            batch_ids: list[str] = []
            while len(samples) < per_rollout:
                batch = _take(stream, min(args.consumer_batch, per_rollout - len(samples)))
                if any(s.rollout_id != r for s in batch):
                    raise RuntimeError(f"stream out of order: expected rollout {r}")
                batch_ids.append(f"cb-{r}-{rank}-{len(batch_ids)}")
                raw_batch = torch.tensor([reward_of(s.digits, s.response) for s in batch])
                if args.pr65_bug:  # PR #65: normalized against the physical transfer batch
                    rewards_parts.append(batch_normalize(raw_batch, len(batch), args.std_normalization))
                samples += batch
            raw = torch.tensor([reward_of(s.digits, s.response) for s in samples])
            groups = torch.tensor([s.group for s in samples])
            if args.pr65_bug:
                rewards = torch.cat(rewards_parts)
                cohorts = batch_ids
            else:
                rewards = group_normalize(raw, groups, args.std_normalization)
                cohorts = [f"g-{g}" for g in sorted(set(groups.tolist()))]
            lengths = _lengths(samples)
            mask = _mask(samples, args.mask_truncated)
            old_support = None
            with torch.no_grad():
                if args.sample_support:
                    old_support = score_support(model, samples, args.support_full_vocab_bug)
                    old_log_probs = old_support.log_probs
                    ref_log_probs = score_support(reference, samples, args.support_full_vocab_bug).log_probs
                else:
                    old_log_probs, _ = score(model, samples)
                    ref_log_probs, _ = score(reference, samples)
            kl = rollout_kl(old_log_probs, ref_log_probs, args.kl_coef, args.kl_loss_type)
            advantages = get_grpo_returns(rewards, lengths)
            result.mean_rewards.append(float(raw.mean()))
            rollout_weight = samples[0].rollout_weight
            ids = [f"s-{s.index}" if world == 1 else f"r{rank}-s-{s.index}" for s in samples]
            provenance = Provenance(rollout_weight=rollout_weight, actor_weight=version,
                                    rollout_partition_ids=(f"rp-{r}-{rank}",), consumer_batch_ids=tuple(batch_ids),
                                    normalization_cohort_ids=tuple(cohorts))
            if capture.wants_rollout(r):
                side_channels = {
                    "sampled_token_ids": torch.tensor([t for s in samples for t in s.response], dtype=torch.int32),
                    "support_ids": [s.support_ids for s in samples],
                    "support_logits": [s.support_logits for s in samples],  # the sampler's tempered logits
                }
                if old_support is not None:
                    # The old log-probs were scored over the support: record the member logits of that
                    # forward (the reference forward's are not recorded: one set per bundle).
                    side_channels.update(support_logits=old_support.support_logits,
                                         full_log_probs=old_support.full_log_probs)
                capture.capture_rollout(
                    r, sample_ids=ids, group_index=groups.tolist(), response_lengths=lengths.tolist(),
                    total_lengths=[len(prompt_tokens(s.digits)) + len(s.response) for s in samples],
                    loss_mask=mask, raw_rewards=raw, rewards=rewards, old_log_probs=old_log_probs,
                    ref_log_probs=ref_log_probs, kl=kl, advantages=advantages,
                    prompts=[s.prompt_text for s in samples],
                    responses=[" ".join(TOKEN_TEXT[t] for t in s.response) for s in samples],
                    labels=[" ".join(map(str, reversed(s.digits))) for s in samples],
                    provenance=provenance, side_channels=side_channels,
                    support_scored=("old_log_probs",) if args.sample_support else None,
                )
            offsets = torch.cumsum(lengths, 0) - lengths
            fresh = (raw, rewards, advantages)
            stale = fresh
            if args.stale_advantages_bug and r == 1:  # the bug: step 1:0 reads a cache of rollout 0's values
                stale = (*previous_rewards, get_grpo_returns(previous_rewards[1], lengths))
            previous_rewards = (raw, rewards)
            for step_id in range(args.steps_per_rollout):
                t0, c0 = time.perf_counter(), time.thread_time()
                step_raw, step_rewards, step_advantages = stale if step_id == 0 else fresh
                first = step_id * step_size
                step = capture.begin_step(r, step_id, provenance=Provenance(
                    rollout_weight=rollout_weight, actor_weight=version,
                    rollout_partition_ids=provenance.rollout_partition_ids,
                    consumer_batch_ids=provenance.consumer_batch_ids,
                    normalization_cohort_ids=provenance.normalization_cohort_ids),
                    support_scored=("log_probs",) if args.sample_support else None)
                optimizer.zero_grad(set_to_none=True)
                totals = {name: torch.zeros((), dtype=torch.float64) for name in LOSS_FIELDS}
                for mb_start in range(first, first + step_size, args.micro_batch):
                    mb = list(range(mb_start, min(mb_start + args.micro_batch, first + step_size)))
                    tok = torch.cat([torch.arange(int(offsets[i]), int(offsets[i] + lengths[i])) for i in mb])
                    mb_samples = [samples[i] for i in mb]
                    support = None
                    if args.sample_support:
                        support = score_support(model, mb_samples, args.support_full_vocab_bug)
                        log_probs, entropy = support.log_probs, support.entropy
                    else:
                        log_probs, entropy = score(model, mb_samples)
                    mb_loss = policy_loss(
                        log_probs, old_log_probs[tok], step_advantages[tok], entropy, mask[tok], lengths[mb],
                        eps_clip=args.eps_clip, eps_clip_high=args.eps_clip_high, entropy_coef=args.entropy_coef,
                        mask_bug=args.loss_mask_bug,
                    )
                    mb_loss.fields["loss"].backward()
                    fields = {name: value.detach() for name, value in mb_loss.fields.items()}
                    for name in LOSS_FIELDS:
                        totals[name] += fields[name]
                    channels = None
                    if support is not None and step.captured:
                        channels = {"sampled_token_ids": support.targets, "support_ids": support.support_ids,
                                    "support_logits": support.support_logits,
                                    "full_log_probs": support.full_log_probs}
                    step.add_micro_batch(
                        sample_ids=[ids[i] for i in mb], group_index=[samples[i].group for i in mb],
                        response_lengths=lengths[mb].tolist(),
                        total_lengths=[len(prompt_tokens(samples[i].digits)) + int(lengths[i]) for i in mb],
                        loss_mask=mask[tok], log_probs=log_probs, old_log_probs=old_log_probs[tok],
                        advantages=step_advantages[tok], entropy=entropy, raw_rewards=step_raw[mb],
                        rewards=step_rewards[mb],
                        side_channels=channels, loss_terms=mb_loss.terms, pg_losses=mb_loss.pg_losses,
                        loss_fields=fields,
                    )
                if world > 1:
                    for p in model.parameters():
                        dist.all_reduce(p.grad)
                        p.grad.div_(world)
                if args.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
                optimizer.step()
                version += 1
                # The reported loss of the step: the sum over micro-batches of their sums of per-sample
                # means, which is exactly loss.policy's reduction over the whole step (capture sums the
                # micro-batches' loss_fields in float64).
                step.finish()
                result.step_times.append(time.perf_counter() - t0)
                result.step_cpu_times.append(time.thread_time() - c0)
                result.steps += 1
                if not args.quiet and rank == 0:
                    print(f"rollout {r} step {step_id}: loss={float(totals['loss']):+.4f} "
                          f"clipfrac={float(totals['pg_clipfrac']):.3f} reward={float(raw.mean()):.3f} "
                          f"kl={float(kl.mean()):+.5f} weights {rollout_weight}->{version}", flush=True)
            store.publish(r, version, model)
    except BaseException as exc:
        store.fail(exc)
        raise
    finally:
        result.loop_time = time.perf_counter() - start
    worker.join()
    return result


# ------------------------------------------------------------------------------------------- cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Asynchronous GRPO on a toy digit-reversal task (CPU), with replay capture.")
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--prompts-per-rollout", type=int, default=4, help="prompt groups per rollout and rank")
    p.add_argument("--n-samples", type=int, default=4, help="samples per prompt (group size)")
    p.add_argument("--consumer-batch", type=int, default=6, help="samples per transfer batch (need not divide groups)")
    p.add_argument("--steps-per-rollout", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=3, help="samples per micro-batch")
    p.add_argument("--max-staleness", type=int, default=1, help="rollouts the sampler's weights lag behind")
    p.add_argument("--min-digits", type=int, default=2)
    p.add_argument("--max-digits", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--embed", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0 = off)")
    p.add_argument("--eps-clip", type=float, default=0.2)
    p.add_argument("--eps-clip-high", type=float, default=0.28)
    p.add_argument("--entropy-coef", type=float, default=0.001)
    p.add_argument("--kl-coef", type=float, default=0.05, help="rollout-vs-reference KL coefficient (logged)")
    p.add_argument("--kl-loss-type", default="low_var_kl", choices=("k1", "k2", "k3", "low_var_kl"))
    p.add_argument("--no-std-normalization", dest="std_normalization", action="store_false",
                   help="GRPO without dividing by the group std")
    p.add_argument("--mask-truncated", action="store_true",
                   help="overlong filtering: mask out responses cut off without <eos>")
    p.add_argument("--pr65-bug", action="store_true",
                   help="reproduce PR #65: normalize rewards per consumer batch instead of per prompt group")
    p.add_argument("--loss-mask-bug", action="store_true",
                   help="an off-by-one mask in the loss: each sample's last loss token is left out of its sums "
                        "(the recorded loss mask keeps it)")
    p.add_argument("--stale-advantages-bug", action="store_true",
                   help="the first step of rollout 1 trains on rollout 0's per-sample rewards and advantages (a "
                        "stale cache); each bundle is consistent on its own, only scan's stage link sees it")
    p.add_argument("--sample-support", action="store_true",
                   help="score log-probs over each token's recorded top-k sampler support (policy, old, ref) "
                        "and capture stage logprob.support")
    p.add_argument("--support-full-vocab-bug", action="store_true",
                   help="claim sample-support scoring (implies --sample-support) but score over the whole vocabulary")
    p.add_argument("--append-eos", action="store_true",
                   help="append <eos> to a response cut off at the length limit (no sampler support for it)")
    p.add_argument("--prompt-template", default="Reverse the digits: {digits}",
                   help="text of a prompt (only hashed into bundles, never stored)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--dist-timeout", type=float, default=120.0, help="seconds before a collective gives up")
    p.add_argument("--capture-close-timeout", type=float, default=60.0, help="seconds to flush capture at exit")
    p.add_argument("--quiet", action="store_true")
    return p


def check_args(p: argparse.ArgumentParser, args) -> None:
    per_rollout = args.prompts_per_rollout * args.n_samples
    if min(args.rollouts, args.prompts_per_rollout, args.n_samples, args.consumer_batch,
           args.steps_per_rollout, args.micro_batch) < 1:
        p.error("sizes must be positive")
    if per_rollout % args.steps_per_rollout:
        p.error(f"--steps-per-rollout {args.steps_per_rollout} must divide the {per_rollout} samples of a rollout")
    if not 1 <= args.min_digits <= args.max_digits:
        p.error("need 1 <= --min-digits <= --max-digits")
    if not 1 <= args.top_k <= VOCAB:
        p.error(f"--top-k must lie in [1, {VOCAB}]")
    if args.max_staleness < 0:
        p.error("--max-staleness must be >= 0")
    if args.stale_advantages_bug and args.rollouts < 2:
        p.error("--stale-advantages-bug needs --rollouts >= 2 (step 1:0 reuses rollout 0's advantages)")
    if args.support_full_vocab_bug:
        args.sample_support = True  # the bug claims support scoring
    try:
        args.prompt_template.format(digits="0")
    except (KeyError, IndexError, ValueError) as exc:
        p.error(f"--prompt-template: {exc}")


def run(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None) -> TrainResult:
    """Parse ``argv``, join the process group when launched by torchrun, train, flush capture."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    env = os.environ if env is None else env
    torch.set_num_threads(args.threads)
    distributed = "RANK" in env and "WORLD_SIZE" in env
    if distributed and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.dist_timeout))
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    try:
        capture = maybe_enable_for_actor(
            recompute_config(args), pp_rank=0, pp_size=1, dp_rank=rank, dp_size=world, env=env,
            close_timeout=args.capture_close_timeout, source_dir=Path(__file__).resolve().parent,
        )
    except ValueError as exc:  # a malformed RELAX_REPLAY_CAPTURE* value, or a capture dir an earlier run filled
        raise CaptureRefused(str(exc)) from None
    try:
        result = train(args, capture, rank, world)
    finally:
        flushed = capture.close(timeout=args.capture_close_timeout)
    result.capture_stats = capture.stats
    result.capture_flushed = flushed
    if capture.enabled and not args.quiet:
        s = capture.stats
        print(f"rank {rank} capture: written={s.written} dropped={s.dropped} errors={s.errors} "
              f"abandoned={s.abandoned} bytes={s.bytes_written} flushed={flushed}", flush=True)
    if distributed:
        dist.destroy_process_group()
    return result


class CaptureRefused(Exception):
    """Capture was asked for but cannot start as configured; the job stops before training (exit 2)."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        run(argv)
    except CaptureRefused as exc:
        print(f"grpo_trainer: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
