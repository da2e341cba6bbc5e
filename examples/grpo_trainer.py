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
* rewards are normalized by semantic group (``post_process``) once the rollout is in; ``--pr65-bug``
  reproduces PR #65 by normalizing each physical consumer batch instead (one ``group_normalize`` group, with
  the step's ``--std-eps`` and ``--std-biased``);
* the advantage side of SPEC §4.2: ``--estimator`` (grpo, dr_grpo, rloo, reinforce_plus_plus,
  reinforce_plus_plus_baseline, gae with a fixed critic), ``--loo`` (NeMo-RL), ``--std-eps``, ``--std-biased``,
  ``--kl-in-reward sequence|token_returns``, ``--whiten``, ``--gamma``, ``--lam``, ``--uneven-groups``; one bug
  flag per family (:data:`ADVANTAGE_BUGS`: ``--uneven-groups-bug``, ``--stride-groups-bug``, ``--loo-bug``,
  ``--kl-reward-sign-bug``, ``--gae-lambda-bug``, ``--whiten-batch-bug``);
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

The loss side of SPEC §4.2 (``--loss-agg MODE`` with the step's all-reduced counts and the dp size as
``loss_scale``, ``--dual-clip C``, ``--kl-loss TYPE:COEF`` with verl's clamps, ``--tis LEVEL:HIGH`` on the
sampler's own log-probs with ``--icepop LOW`` masking, ``--gspo``, ``--ppo`` with a value head and the clipped
value loss, returns = advantages + values): the step's config records the counts and scale, the step bundle
the rollout and reference log-probs, PPO's values and returns; one bug flag per family (:data:`LOSS_BUG_FLAGS`:
``--token-mean-denominator-bug``, ``--dual-clip-bug``, ``--kl-loss-bug``, ``--tis-bug``, ``--gspo-bug``,
``--value-loss-bug``). Gradient replay (stage ``loss.grad``, ``RELAX_REPLAY_CAPTURE_GRAD=1``): a hook on each
micro-batch's log-probs (and values) records the gradient backward gives them; ``--grad-bug CLASS``
(:data:`GRAD_BUGS`) changes the gradient and leaves every loss value as it was.
``--value-loss-bug``). ``--loss FAMILY`` (``--loss-param NAME=VALUE``) trains with a policy-loss family (cispo,
sapo, geo_mean, dppo_tv, dppo_kl, dro, gpg; ppo by default), each with its bug flag (``--cispo-cap-bug``,
``--sapo-tau-bug``, ``--geo-mean-bug``, ``--dppo-mask-bug``, ``--dro-beta-bug``, ``--gpg-old-logp-bug``).
Issue 34's masks and distillation term: ``--opsm DELTA`` (slime's off-policy sequence masking, anchored on the
old log-probs: ``opsm_delta``, ``opsm_anchor="old"``), ``--top-entropy-quantile Q`` (TRL's entropy mask, the
quantile taken over each micro-batch's loss tokens; with ``--entropy-coef 0``) and ``--opd TYPE:COEF`` (on-policy
distillation from a frozen teacher TinyLM of another initialization, its log-probs of the sampled tokens recorded
as ``teacher_log_probs``; placed as verl places it, a supervised loss term ``COEF·opd_loss`` on the current
log-probs, ``opd_placement="loss"``; slime's advantage placement is not used), each with its bug flag
(``--opsm-anchor-bug``: the sampler's log-probs as the anchor; ``--entropy-quantile-bug``: the threshold at ``Q``
instead of ``1 − Q``; ``--opd-direction-bug``: the estimate on teacher − student).

Every bundle records the sampler's own log-probs of the sampled tokens (``rollout_log_probs``: its tempered
top-k distribution, computed apart from the trainer's full-vocabulary forward; an appended <eos> without support
takes the trainer's value) and the weights version that sampled each token (``policy_versions``): the bundles run
stage ``logprob.mismatch`` (SPEC §4.4).

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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping, Optional, Sequence

import msgspec
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from capture import Provenance, maybe_enable_for_actor
from replay_lib.kernels import (
    LOSS_FIELDS,
    group_normalize,
    discounted_returns,
    gae_advantages,
    group_rule,
    post_process,
    sequence_kl_score,
    token_rewards,
    whiten,
    get_grpo_returns,
    rollout_kl,
    segment_ids,
)
from replay_lib.kernels.families import FAMILIES, token_payloads
from replay_lib.kernels.loss import (AGG_MODES, IS_LEVELS, LossKnobs, agg_divisors, has_clip_lower, opd_estimate,
                                     policy_fields_for, policy_fields_from_sums, policy_token_terms, sample_log_terms, value_fields_from_sums, value_token_terms)
from replay_lib.bundle.schema import RecomputeConfig

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

    def __init__(self, hidden: int = 64, embed: int = 32, layers: int = 2, value_head: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed)
        self.rnn = nn.GRU(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)
        # PPO's critic (--ppo): built last, so the policy's initial weights do not depend on it
        self.value_head = nn.Linear(hidden, 1) if value_head else None

    def forward(self, tokens: torch.Tensor, state: Optional[torch.Tensor] = None):
        out, state = self.rnn(self.embed(tokens), state)
        return self.head(out), state

    def values(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[B, W]``: the value head at every position (the state after reading each token)."""
        out, _ = self.rnn(self.embed(tokens))
        return self.value_head(out).squeeze(-1)


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


def _teacher_batch(samples: Sequence[Sample]):
    """``(batch [B, W], rows, cols, targets)``: the teacher-forced inputs; ``[rows, cols]`` are the positions
    predicting the response tokens ``targets``, concatenated in sample order."""
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
    return batch, torch.tensor(rows), torch.tensor(cols), torch.tensor(targets)


def _forward(model: TinyLM, samples: Sequence[Sample]):
    """Teacher-forced forward: ``(logits [B, W, V], rows, cols, targets)``, where ``logits[rows, cols]``
    are the positions predicting the response tokens ``targets``, concatenated in sample order."""
    batch, rows, cols, targets = _teacher_batch(samples)
    logits, _ = model(batch)
    return logits, rows, cols, targets


def score_values(model: TinyLM, samples: Sequence[Sample]) -> torch.Tensor:
    """The critic's value of every response token's position (``--ppo``), in sample order."""
    batch, rows, cols, _ = _teacher_batch(samples)
    return model.values(batch)[rows, cols]


def rollout_log_probs_of(samples: Sequence[Sample], fallback: torch.Tensor) -> torch.Tensor:
    """What the sampler's own distribution gave each sampled token: its tempered logit over the recorded top-k
    support renormalized (``l_y − logsumexp(l_S)``) — the ``rollout_log_probs`` of the train/rollout importance
    correction. A token without support (an appended <eos>) takes ``fallback`` (the trainer's old log-prob:
    weight 1)."""
    out = []
    for s in samples:
        ids, logits = s.support_ids.to(torch.int64), s.support_logits.float()
        target = torch.tensor(s.response, dtype=torch.int64)
        hit = ids == target[:, None]
        has = hit.any(1)
        masked = logits.masked_fill(ids < 0, float("-inf"))
        lse = torch.logsumexp(masked, 1)
        chosen = (logits * hit).sum(1)
        out.append(torch.where(has, chosen - lse, torch.full_like(lse, float("nan"))))
    flat = torch.cat(out)
    return torch.where(torch.isnan(flat), fallback.float(), flat)


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

    in float32, differentiable, the same arithmetic as ``replay_lib.kernels.support.support_logprobs`` (which the
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
    fields: dict[str, torch.Tensor]  # loss, pg_loss, entropy_loss, pg_clipfrac, ppo_kl (+ pg_clipfrac_lower,
    # kl_loss as the knobs ask; + vf_loss, vf_clipfrac under --ppo): 0-d float64 (``loss`` carries the graph)
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


# The loss-side bugs (one per knob family, SPEC §4.2): what the buggy code does instead.
LOSS_BUGS = ("token_mean_denominator", "dual_clip", "kl_loss", "tis", "gspo", "value_loss", "cispo_cap", "sapo_tau",
             "geo_mean", "dppo_mask", "dro_beta", "gpg_old_logp", "family", "opsm_anchor", "entropy_quantile",
             "opd_direction")
# --loss FAMILY (RecomputeConfig.policy_loss): the policy-loss families, and each one's bug flag
# (not Clip-Cov: its random draw is a payload, clip_cov_mask, this trainer does not record)
LOSS_FAMILIES = ("ppo", *sorted(f for f in FAMILIES if not token_payloads(f)))
FAMILY_OF_BUG = {"cispo_cap": ("cispo",), "sapo_tau": ("sapo",), "geo_mean": ("geo_mean",),
                 "dppo_mask": ("dppo_tv", "dppo_kl"), "dro_beta": ("dro",), "gpg_old_logp": ("gpg",)}


def family_bug_knobs(knobs: LossKnobs, bug: Optional[str]) -> LossKnobs:
    """The knobs a family's buggy loss runs with (the bugs that are another setting of the family)."""
    params = dict(knobs.policy_loss_params)
    if bug == "cispo_cap":  # the other cap: TRL's absolute min(r, ε_high) for verl's relative clamp, or back
        params["cap"] = "absolute" if knobs.param("cap") == "relative" else "relative"
    elif bug == "sapo_tau":  # τ taken by the wrong sign of A
        params.update(tau_pos=knobs.param("tau_neg"), tau_neg=knobs.param("tau_pos"))
    elif bug == "dro_beta":  # the quadratic penalty added instead of subtracted
        params["beta"] = -float(knobs.param("beta"))
    elif bug == "geo_mean":  # the loss mode lost on the way: PPO's clipped surrogate runs instead
        return replace(knobs, policy_loss="ppo", policy_loss_params=())
    elif bug == "opsm_anchor":  # OPSM's sequence KL against the other anchor (TRL's sampling log-probs for slime's old)
        return replace(knobs, opsm_anchor="rollout" if knobs.opsm_anchor == "old" else "old")
    elif bug == "entropy_quantile":  # the entropy mask's threshold at the q quantile where TRL takes 1 − q
        return replace(knobs, top_entropy_quantile=1.0 - knobs.top_entropy_quantile)
    else:
        return knobs
    return replace(knobs, policy_loss_params=tuple(sorted(params.items())))
# The gradient bugs (stage loss.grad, SPEC §4.3): the loss value is unchanged, its gradient is not.
GRAD_BUGS = {
    "kl_no_grad": "(needs --kl-loss) the KL term computed under no_grad: it contributes no gradient (SkyRL#1353)",
    "is_not_detached": "(needs --tis) the importance weight's log taken through the current log-probs, not detached "
                       "(old + logp − logp.detach(): the same value, bit for bit; verl#4105)",
    "ratio_detached": "the policy term evaluated on detached log-probs: the ratio has no gradient (torchforge#571)",
    "zero_coef_nan": "(without --kl-loss) a KL term of coefficient 0 left in the graph whose backward is 0·NaN "
                     "(slime#2258); the config records use_kl_loss with kl_loss_coef=0",
    "scale_twice": "each micro-batch's loss, already a step-level aggregate, divided again by the micro-batch count "
                   "before backward (the accumulation divisor applied twice)",
}


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                entropy: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, *, eps_clip: float,
                eps_clip_high: float, entropy_coef: float, mask_bug: bool = False,
                knobs: Optional[LossKnobs] = None, rollout_log_probs: Optional[torch.Tensor] = None,
                ref_log_probs: Optional[torch.Tensor] = None, bug: Optional[str] = None,
                value: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                grad_bug: Optional[str] = None, teacher_log_probs: Optional[torch.Tensor] = None) -> MicroBatchLoss:
    """One micro-batch's loss: the per-token terms in float32 (``policy_token_terms``, the replay's kernel, with
    the SPEC §4.2 knobs: dual-clip, GSPO's sequence ratio, the importance weight, the KL term), then every
    per-sample sum ``Σ_t x·mask`` in float64 and the fields aggregated from them in float64 (``aggregate``: the
    sum of per-sample means, or a mode over the step's recorded counts; the micro-batches' fields add up to
    the step's) — float32 sums of long responses carry rounding (at ~u·n relative) that would blur a one-token
    difference. ``mask_bug``: the sums leave out each sample's last loss token (while the recorded mask keeps
    it); ``bug``: one of :data:`LOSS_BUGS`; ``value``: ``(values, old_values, returns)`` under ``--ppo``;
    ``grad_bug``: one of :data:`GRAD_BUGS` (the loss value unchanged, its gradient not); ``teacher_log_probs``:
    the frozen teacher's, for on-policy distillation's loss term (``--opd``). One call is one micro-batch: the
    entropy mask's threshold (``--top-entropy-quantile``) is the quantile of its loss tokens' entropies."""
    knobs = knobs or LossKnobs(eps_clip=eps_clip, eps_clip_high=eps_clip_high, entropy_coef=entropy_coef)
    seg = segment_ids(lengths)
    m32 = mask.float()
    if knobs.policy_loss == "kl_cov":  # one call is one micro-batch: KL-Cov's top-k is taken within it
        knobs = replace(knobs, micro_batch=(0,) * lengths.numel())
    used = family_bug_knobs(knobs, bug)
    if bug == "gpg_old_logp":  # GPG's −logp·A on the old log-probs
        log_probs = old_log_probs
    if bug == "dppo_mask":  # the trust-region test of the other sign of A: −pg(−A), its mask and clip indicators
        advantages = -advantages
    if bug == "gspo":  # the sequence ratio from the summed log-ratio (a product of ratios), not its mean
        used = replace(knobs, importance_level="token")
    if grad_bug == "is_not_detached" and rollout_log_probs is not None:
        # the weight's log taken from the current log-probs: old + (logp − logp.detach()) has old's value, bit for
        # bit, and the gradient of logp (verl#4105's class, on-policy)
        rollout_log_probs = rollout_log_probs.float() - (log_probs.float() - log_probs.float().detach())
    sample_terms = sample_log_terms(log_probs.float(), old_log_probs.float(), rollout_log_probs, m32, lengths, used,
                                    advantages=advantages.float(),
                                    entropy=entropy.float().detach() if used.entropy_mask else None)
    if bug == "gspo":
        lr = torch.zeros(lengths.numel()).index_add(0, seg, (log_probs.float() - old_log_probs.float()) * m32)
        sample_terms = dict(sample_terms, seq_log_ratio=lr)
        used = knobs
    if bug == "family":  # the family's typical bug (LOSS_BUG_FLAGS)
        if knobs.policy_loss == "vespo":
            used = replace(knobs, policy_loss_params=(("k_neg", knobs.param("k_pos")), ("k_pos", knobs.param("k_neg")),
                                                      ("lambda_neg", knobs.param("lambda_pos")),
                                                      ("lambda_pos", knobs.param("lambda_neg"))))
        elif knobs.policy_loss in ROLLOUT_FAMILIES:
            rollout_log_probs = old_log_probs
        elif knobs.policy_loss == "importance_sampling":
            advantages = -advantages
    t = policy_token_terms(log_probs.float(), old_log_probs.float(), advantages.float(), used, seg=seg,
                           sample_terms=sample_terms, rollout_log_probs=None if rollout_log_probs is None else (
                               rollout_log_probs.float() if bug != "tis" else 2 * old_log_probs.float()
                               - rollout_log_probs.float()),
                           ref_log_probs=None if ref_log_probs is None else (
                               ref_log_probs.float() if bug != "kl_loss" else 2 * log_probs.float()
                               - ref_log_probs.float()),
                           entropy=entropy.float().detach() if used.entropy_mask else None,
                           teacher_log_probs=teacher_log_probs.float() if used.opd_loss else None)
    if bug == "opd_direction":  # the distillation estimate on teacher − student: the forward direction
        t = dict(t, opd_loss=opd_estimate(teacher_log_probs.float(), log_probs.float(), used))
    pg_losses = t["pg"]
    if grad_bug == "ratio_detached":  # the policy term of detached log-probs: the same value, no gradient
        pg_losses = policy_token_terms(log_probs.float().detach(), old_log_probs.float(), advantages.float(), used,
                                       seg=seg, sample_terms={k: v.detach() for k, v in sample_terms.items()},
                                       rollout_log_probs=None if rollout_log_probs is None else
                                       rollout_log_probs.float().detach(),
                                       ref_log_probs=None if ref_log_probs is None else ref_log_probs.float())["pg"]
    if grad_bug == "kl_no_grad" and "kl_loss" in t:  # SkyRL#1353's class: the KL term computed under no_grad
        t = dict(t, kl_loss=t["kl_loss"].detach())
    if bug == "dppo_mask":
        pg_losses, advantages = -pg_losses, -advantages
    if bug == "family" and knobs.policy_loss == "cross_entropy":  # the term's sign flipped: +logp, nothing else
        pg_losses = -pg_losses
    if bug == "dual_clip":  # the dual-clip bound applied to every advantage, not only negative ones
        plain = policy_token_terms(log_probs.float(), old_log_probs.float(), advantages.float(),
                                   replace(used, eps_clip_c=None, is_level=None, kl_loss_coef=0.0), seg=seg,
                                   sample_terms=sample_terms)
        pg_losses = torch.minimum(plain["pg"], -float(knobs.eps_clip_c) * advantages.float())
        if "is_weight" in t:
            pg_losses = pg_losses * t["is_weight"]
    m = (drop_last_loss_token(mask, lengths) if mask_bug else mask).to(torch.float64)

    def per_sample(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(lengths.numel(), dtype=torch.float64).index_add(0, seg, x.to(torch.float64) * m)

    terms = {"pg_sum": per_sample(pg_losses), "entropy_sum": per_sample(entropy), "kl_sum": per_sample(t["ppo_kl"]),
             "clip_count": per_sample(t["clip"]), "mask_count": per_sample(m)}
    sums = {"pg": terms["pg_sum"], "ent": terms["entropy_sum"], "kl": terms["kl_sum"], "clip": terms["clip_count"],
            "mask": terms["mask_count"]}
    if has_clip_lower(knobs):
        sums["clip_lower"] = per_sample(t["clip_lower"]) if "clip_lower" in t else per_sample(t["clip"] * 0)
    if knobs.kl_loss:
        sums["kl_loss"] = terms["kl_loss_sum"] = per_sample(t["kl_loss"])
    if knobs.opd_loss:  # the distillation term: a loss field of its own, not a per-sample term
        sums["opd_loss"] = per_sample(t["opd_loss"])
    agg = knobs
    if bug == "token_mean_denominator":  # verl#7321's class: the micro-batch's own token count as T
        agg = replace(knobs, loss_token_count=int(m.sum()))
    fields = policy_fields_from_sums(sums, True, entropy_coef, agg)
    if grad_bug == "zero_coef_nan":
        # slime#2258's class: a KL term of coefficient 0 left in the graph; its |r| written sqrt(r·r) on a log-ratio
        # centred at 0 (r − r.detach()): the value 0·0 adds nothing, backward's 0·(0/0) is NaN on every token
        r = log_probs.float() - log_probs.float().detach()
        fields["loss"] = fields["loss"] + 0.0 * torch.sqrt(r * r).to(torch.float64).sum()
    fields = {k: v for k, v in fields.items() if k in policy_fields_for(knobs)}  # what the family reports
    if agg.loss_agg_mode != "sum_of_sample_means":  # the weight each sample entered the loss terms with
        inner, outer = agg_divisors(agg.loss_agg_mode, terms["mask_count"], agg)
        terms["loss_weight"] = agg.loss_scale / (inner * outer)
    if value is not None:
        v, old_v, returns = value
        vt = value_token_terms(v.float(), old_v.float(), returns.float(), knobs.value_clip)
        vf = value_fields_from_sums({"vf": per_sample(vt["vf"]), "clip": per_sample(vt["clip"]), "mask": sums["mask"]},
                                    knobs)
        if bug == "value_loss":  # slime's convention (no ½) under a config that declares verl's
            vf["vf_loss"] = 2 * vf["vf_loss"]
        fields.update(vf)
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
        sampler = TinyLM(args.hidden, args.embed, value_head=args.ppo)
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
                        sampler, digits, group_sizes(args)[p], temperature=args.temperature, top_k=args.top_k, gen=gen,
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
        n_samples_per_prompt=0 if args.uneven_groups else args.n_samples,
        grpo_std_normalization=args.std_normalization, kl_coef=args.kl_coef,
        eps_clip=args.eps_clip, eps_clip_high=args.eps_clip_high, entropy_coef=args.entropy_coef,
        rewards_normalization=True, use_tis=False, tis_clip=2.0,
        tis_clip_low=0.0, calculate_per_token_loss=False,
        use_rollout_logprobs=False, vocab_size=VOCAB, **loss_knobs(args), **advantage_knobs(args),
    )


def advantage_knobs(args) -> dict:
    """The SPEC §4.2 advantage-side knobs of the flags (``--estimator``, ``--loo``, ``--std-eps``, ``--std-biased``,
    ``--kl-in-reward``, ``--whiten``, ``--gamma``, ``--lam``)."""
    out = dict(advantage_estimator=args.estimator, normalize_advantages=bool(args.whiten), grpo_std_eps=args.std_eps,
               grpo_std_unbiased=not args.std_biased, kl_in_reward=args.kl_in_reward, gamma=args.gamma, lam=args.lam)
    if args.loo:  # NeMo-RL's GRPO: leave-one-out baseline (and std), no division where the std is 0
        out.update(group_baseline="leave_one_out", std_zero="skip", singleton_group="zero")
    return out


# The advantage-side bugs (one per family, SPEC §4.2): the flag and what the buggy code does instead.
ADVANTAGE_BUGS = {
    "uneven_groups_bug": "slime#2230's class: uneven groups normalized together over the whole batch (a reshape "
                         "to one row)",
    "stride_groups_bug": "AReaL#1419's class: groups recovered by a fixed stride of --n-samples (wrong once the "
                         "groups are uneven)",
    "loo_bug": "the leave-one-out baseline divides the whole group's sum by n − 1 (the sample itself left in)",
    "kl_reward_sign_bug": "the KL penalty added to the reward instead of subtracted",
    "gae_lambda_bug": "GAE computed with λ = 1 whatever --lam says",
    "whiten_batch_bug": "advantages whitened per consumer batch instead of over the rollout's loss tokens",
}


def group_sizes(args) -> list[int]:
    """The samples drawn per prompt: ``--n-samples`` each, or under ``--uneven-groups`` one more for even and
    one fewer for odd prompts (a rollout keeps its size; the last prompt of an odd count keeps ``n``)."""
    sizes = [args.n_samples] * args.prompts_per_rollout
    if args.uneven_groups:
        for p in range(0, args.prompts_per_rollout - 1, 2):
            sizes[p], sizes[p + 1] = args.n_samples + 1, args.n_samples - 1
    return sizes


def post_process_rewards(args, cfg: RecomputeConfig, raw: torch.Tensor, groups: torch.Tensor, kl: torch.Tensor,
                         mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """reward.post_process as this trainer runs it (the replay's kernels in float32), with the bug flags."""
    kl_coef = -args.kl_coef if args.kl_reward_sign_bug else args.kl_coef
    score = raw
    if args.kl_in_reward == "sequence":
        score = sequence_kl_score(raw, kl, mask, lengths, kl_coef)
    rule = group_rule(cfg)
    if args.uneven_groups_bug:
        groups = torch.zeros_like(groups)
    elif args.stride_groups_bug:
        groups = torch.arange(groups.numel()) // args.n_samples
    if args.loo_bug and rule.baseline == "leave_one_out" and not rule.std:
        _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
        total = torch.zeros(counts.numel()).index_add_(0, inverse, score.float())
        return score.float() - total[inverse] / (counts[inverse] - 1).float()
    return post_process(score, groups, rule)


def critic_values(samples: Sequence[Sample], baseline: float) -> torch.Tensor:
    """A fixed critic for ``--estimator gae`` (the toy has no value head): ``V_t = baseline·(t + 1)/L`` over
    each response, ``baseline`` the previous rollout's mean raw reward."""
    rows = [baseline * torch.arange(1, len(s.response) + 1, dtype=torch.float32) / len(s.response) for s in samples]
    return torch.cat(rows) if rows else torch.zeros(0)


def estimate_advantages(args, rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor,
                        values: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """advantage.estimate as this trainer runs it: ``(advantages, returns)`` (returns for GAE only)."""
    kl_coef = -args.kl_coef if args.kl_reward_sign_bug else args.kl_coef
    token_kl = kl if args.kl_in_reward == "token_returns" else None
    returns = None
    if args.estimator == "gae":
        per_token = token_rewards(rewards, mask, lengths, token_kl, kl_coef)
        advantages, returns = gae_advantages(per_token, values, mask, lengths, args.gamma,
                                             1.0 if args.gae_lambda_bug else args.lam)
    elif args.estimator == "reinforce_plus_plus" or args.kl_in_reward == "token_returns":
        advantages = discounted_returns(token_rewards(rewards, mask, lengths, token_kl, kl_coef), lengths, args.gamma)
    else:
        advantages = get_grpo_returns(rewards, lengths)
    if args.whiten or args.estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        if args.whiten_batch_bug:
            ends = torch.cumsum(lengths, 0)
            parts, start = [], 0
            for first in range(0, lengths.numel(), args.consumer_batch):
                stop = int(ends[min(first + args.consumer_batch, lengths.numel()) - 1])
                parts.append(whiten(advantages[start:stop], mask[start:stop]))
                start = stop
            advantages = torch.cat(parts)
        else:
            advantages = whiten(advantages, mask)
    return advantages, returns


def loss_knobs(args) -> dict:
    """The SPEC §4.2 loss-side knobs of the flags (``--loss-agg``, ``--dual-clip``, ``--kl-loss``, ``--tis``,
    ``--icepop``, ``--gspo``, ``--ppo``); ``{}`` without them (a V1 config). The counts an aggregation mode
    divides by are the step's (``step_counts``)."""
    # written explicitly (V1's values without the flags); kl_loss_type is also the rollout KL's estimator
    out: dict = {"use_kl_loss": False, "kl_loss_coef": 0.0, "eps_clip_c": None, "kl_loss_type": args.kl_loss_type}
    if args.loss_agg != "sum_of_sample_means":
        out["loss_agg_mode"] = args.loss_agg
    if args.dual_clip is not None:
        out["eps_clip_c"] = args.dual_clip
    if args.kl_loss is not None:
        kind, coef = args.kl_loss
        out.update(use_kl_loss=True, kl_loss_coef=coef, kl_loss_type=kind, kl_loss_input_clamp=KL_LOSS_CLAMPS[0],
                   kl_loss_output_clamp=KL_LOSS_CLAMPS[1])
        if kind != args.kl_loss_type:  # the rollout KL keeps its own estimator
            out["kl_penalty_type"] = args.kl_loss_type
    if args.tis is not None:
        level, high = args.tis
        out.update(is_level=level, is_high=high, is_mode="mask" if args.icepop is not None else "truncate",
                   is_low=args.icepop, is_log_clamp=IS_LOG_CLAMP)
    if args.gspo:
        out["importance_level"] = "sequence"
    if args.ppo:
        out["value_clip"] = args.value_clip
        out["vf_coef"] = args.vf_coef  # the value loss's weight in the loss backpropagated (grad_values)
    if getattr(args, "grad_bug", None) == "zero_coef_nan":  # the KL term declared on, with coefficient 0
        out.update(use_kl_loss=True, kl_loss_coef=0.0)
    if args.loss != "ppo":
        out.update(policy_loss=args.loss, policy_loss_params=dict(args.loss_param))
    if args.opsm is not None:  # slime's OPSM: the sequence KL of the old log-probs against the current
        out.update(opsm_delta=args.opsm, opsm_anchor="old")
    if args.top_entropy_quantile is not None:
        out["top_entropy_quantile"] = args.top_entropy_quantile
    if args.opd is not None:  # verl's placement: a supervised loss term on the student's current log-probs
        kind, coef = args.opd
        out.update(opd_placement="loss", opd_kl_type=kind, opd_coef=coef)
    return out


# verl / SkyRL's clamps of the KL term (log-ratio ±20, value ±10) and of an importance weight's log (±20)
KL_LOSS_CLAMPS = (20.0, 10.0)
IS_LOG_CLAMP = 20.0


def step_counts(args, mask: torch.Tensor, lengths: torch.Tensor, world: int) -> dict:
    """The counts an aggregation mode divides by, for one actor step, all-reduced over the data-parallel ranks
    (what a bundle of one rank's shard records, SPEC §4.2): the loss tokens ``T``, the samples with a loss
    token ``N``, the longest response the sampler allows ``L`` (Dr.GRPO's constant), and ``loss_scale`` = the
    dp size (each rank's loss carries ×world: the gradients are averaged over the ranks). ``{}`` for the sum
    of per-sample means (V1)."""
    if args.loss_agg == "sum_of_sample_means":
        return {}
    seg = segment_ids(lengths)
    per_sample = torch.zeros(lengths.numel()).index_add_(0, seg, mask.float())
    counts = torch.tensor([float(mask.sum()), float((per_sample > 0).sum())], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(counts)
    return dict(loss_token_count=int(counts[0]), loss_seq_count=int(counts[1]),
                loss_horizon=args.max_digits + 2 + int(args.append_eos), loss_scale=float(world))


def stored(args, tensor):
    """What the trainer hands to capture: a per-token float tensor as ``--capture-dtype`` keeps it (bfloat16:
    a copy of the float32 values half the size; the bundle then declares float32 compute with coarser payloads,
    whose rounding the replay admits), anything else as it is."""
    if args.capture_dtype == "float32" or not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        return tensor
    return tensor.detach().to(getattr(torch, args.capture_dtype))


def knob_payloads(knobs: LossKnobs, tok: torch.Tensor, ref_log_probs: torch.Tensor,
                  rollout_lp: Optional[torch.Tensor], value) -> dict:
    """What capture records for the knobs (SPEC §4.2): ``ref_log_probs`` for a KL term in the loss,
    ``rollout_log_probs`` for the importance correction, ``values`` / ``old_values`` / ``returns`` for PPO."""
    out = {}
    if knobs.kl_loss:
        out["ref_log_probs"] = ref_log_probs[tok]
    if rollout_lp is not None:
        out["rollout_log_probs"] = rollout_lp[tok]
    if value is not None:
        out.update(values=value[0].detach(), old_values=value[1], returns=value[2])
    return out


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
    model = TinyLM(args.hidden, args.embed, value_head=args.ppo)
    reference = TinyLM(args.hidden, args.embed, value_head=args.ppo)
    reference.load_state_dict(model.state_dict())
    reference.requires_grad_(False)
    teacher = None
    if args.opd is not None:  # on-policy distillation's frozen teacher: another initialization, the RNG untouched
        with torch.random.fork_rng():
            torch.manual_seed(args.seed + 1)
            teacher = TinyLM(args.hidden, args.embed)
        teacher.requires_grad_(False)
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
                if args.pr65_bug:  # PR #65: normalized against the physical transfer batch, with the step's eps/std
                    one_batch = torch.zeros(len(batch), dtype=torch.int64)
                    rewards_parts.append(group_normalize(raw_batch, one_batch, args.std_normalization, args.std_eps,
                                                         unbiased=not args.std_biased))
                samples += batch
            raw = torch.tensor([reward_of(s.digits, s.response) for s in samples])
            groups = torch.tensor([s.group for s in samples])
            if args.pr65_bug:
                rewards = torch.cat(rewards_parts)
                cohorts = batch_ids
            else:
                rewards = None  # post-processed below, once the KL is known (--kl-in-reward sequence)
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
            if rewards is None:
                rewards = post_process_rewards(args, cfg, raw, groups, kl, mask, lengths)
            values = critic_values(samples, result.mean_rewards[-1] if result.mean_rewards else 0.5) \
                if args.estimator == "gae" else None
            advantages, returns = estimate_advantages(args, rewards, kl, mask, lengths, values)
            # SPEC §4.2 inputs: the sampler's own log-probs (importance correction), the critic's values (PPO;
            # the returns are advantages + values: GAE is advantage.estimate's)
            # The sampler's own log-probs are recorded on every run (as verl's calculate_log_probs does): the
            # bundles then run stage logprob.mismatch, the sampler's top-k tempered distribution against the
            # trainer's full-vocabulary forward; the loss reads them only under --tis.
            rollout_lp = rollout_log_probs_of(samples, old_log_probs)
            # the weights version that sampled each token (the rollout worker may lag the trainer)
            versions = torch.cat([torch.full((len(s.response),), int(s.rollout_weight), dtype=torch.int64)
                                  for s in samples])
            old_values = None
            if args.ppo:
                with torch.no_grad():
                    old_values = score_values(model, samples)
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
                    loss_mask=mask, raw_rewards=raw, rewards=rewards, old_log_probs=stored(args, old_log_probs),
                    ref_log_probs=stored(args, ref_log_probs), kl=stored(args, kl),
                    advantages=stored(args, advantages), values=stored(args, values), returns=stored(args, returns),
                    prompts=[s.prompt_text for s in samples],
                    responses=[" ".join(TOKEN_TEXT[t] for t in s.response) for s in samples],
                    labels=[" ".join(map(str, reversed(s.digits))) for s in samples],
                    provenance=provenance, side_channels=side_channels,
                    support_scored=("old_log_probs",) if args.sample_support else None,
                    rollout_log_probs=stored(args, rollout_lp), policy_versions=versions,
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
                step_tok = torch.arange(int(offsets[first]), int(offsets[first + step_size - 1]
                                                                 + lengths[first + step_size - 1]))
                counts = step_counts(args, mask[step_tok], lengths[first:first + step_size], world)
                step_cfg = msgspec.structs.replace(cfg, **counts) if counts else None
                knobs = LossKnobs.of(step_cfg or cfg)
                vf_returns = step_advantages + old_values if old_values is not None else None
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
                    teacher_lp = None
                    if teacher is not None:
                        with torch.no_grad():
                            teacher_lp = score_support(teacher, mb_samples).log_probs if args.sample_support \
                                else score(teacher, mb_samples)[0]
                    value = None
                    if vf_returns is not None:
                        value = (score_values(model, mb_samples), old_values[tok], vf_returns[tok])
                    # RELAX_REPLAY_CAPTURE_GRAD: hooks that keep ∂L/∂log_probs (and ∂L/∂values) of this backward
                    tap = step.grad_tap(log_probs)
                    value_tap = step.grad_tap(value[0]) if value is not None else None
                    mb_loss = policy_loss(
                        log_probs, old_log_probs[tok], step_advantages[tok], entropy, mask[tok], lengths[mb],
                        eps_clip=args.eps_clip, eps_clip_high=args.eps_clip_high, entropy_coef=args.entropy_coef,
                        mask_bug=args.loss_mask_bug, knobs=knobs,
                        rollout_log_probs=rollout_lp[tok] if args.tis is not None or args.loss in ROLLOUT_FAMILIES
                        or args.opsm is not None
                        or (args.loss == "dppo_mu" and dict(args.loss_param).get("anchor", "rollout") == "rollout")
                        else None,
                        ref_log_probs=ref_log_probs[tok] if knobs.kl_loss else None,
                        bug=getattr(args, "loss_bug", None), value=value,  # (set by check_args)
                        grad_bug=args.grad_bug, teacher_log_probs=teacher_lp,
                    )
                    objective = mb_loss.fields["loss"]
                    if value is not None:
                        objective = objective + args.vf_coef * mb_loss.fields["vf_loss"]
                    if args.grad_bug == "scale_twice":
                        objective = objective / len(range(first, first + step_size, args.micro_batch))
                    objective.backward()
                    fields = {name: value.detach() for name, value in mb_loss.fields.items()}
                    for name in LOSS_FIELDS:
                        if name in fields:  # a policy-loss family may report fewer metrics (dro, gpg)
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
                        loss_mask=mask[tok], log_probs=stored(args, log_probs),
                        old_log_probs=stored(args, old_log_probs[tok]), advantages=stored(args, step_advantages[tok]),
                        entropy=stored(args, entropy), raw_rewards=step_raw[mb], rewards=step_rewards[mb],
                        side_channels=channels, loss_terms=mb_loss.terms, pg_losses=stored(args, mb_loss.pg_losses),
                        loss_fields=fields, policy_versions=versions[tok], **{k: stored(args, v) for k, v in knob_payloads(
                            knobs, tok, ref_log_probs, rollout_lp, value).items()},
                        grad_log_probs=tap.gradient() if tap is not None else None,
                        grad_values=value_tap.gradient() if value_tap is not None else None,
                        teacher_log_probs=stored(args, teacher_lp),
                    )
                if world > 1:
                    for p in model.parameters():
                        dist.all_reduce(p.grad)
                        p.grad.div_(world)
                grad_norm = None
                if args.grad_clip > 0:
                    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
                optimizer.step()
                version += 1
                # The reported loss of the step: the sum over micro-batches of their sums of per-sample
                # means, which is exactly loss.policy's reduction over the whole step (capture sums the
                # micro-batches' loss_fields in float64).
                step.finish(config=step_cfg, grad_norm=grad_norm)  # the norm feeds the capture ring's trigger
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


def check_advantage_args(p: argparse.ArgumentParser, args) -> None:
    """The advantage-side flags: the group bugs imply uneven groups; each other bug needs its family."""
    if args.uneven_groups_bug or args.stride_groups_bug:
        args.uneven_groups = True
    if args.uneven_groups and (args.n_samples < 3 or args.prompts_per_rollout < 2):
        p.error("--uneven-groups needs --n-samples >= 3 and --prompts-per-rollout >= 2 (no one-sample groups)")
    for name, value in (("--gamma", args.gamma), ("--lam", args.lam)):
        if not 0.0 <= value <= 1.0:
            p.error(f"{name} must lie in [0, 1]")
    if args.std_eps < 0:
        p.error("--std-eps must be >= 0")
    needs = (("loo_bug", args.estimator == "rloo", "--estimator rloo"),
             ("gae_lambda_bug", args.estimator == "gae", "--estimator gae"),
             ("kl_reward_sign_bug", args.kl_in_reward is not None and args.kl_coef != 0,
              "--kl-in-reward with --kl-coef != 0"),
             ("whiten_batch_bug", args.whiten or args.estimator.startswith("reinforce_plus_plus"),
              "--whiten or a reinforce_plus_plus estimator"))
    for name, ok, what in needs:
        if getattr(args, name) and not ok:
            p.error(f"--{name.replace('_', '-')} needs {what}")


class _Parser(argparse.ArgumentParser):
    """A usage error is its one-line reason (and where the flags are listed), not the whole usage first."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists every flag)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description="Asynchronous GRPO on a toy digit-reversal task (CPU), with replay capture.",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    p.add_argument("--estimator", default="grpo", choices=("grpo", "dr_grpo", "rloo", "reinforce_plus_plus",
                                                           "reinforce_plus_plus_baseline", "gae"),
                   help="advantage estimator (SPEC §4.2); gae uses a fixed critic (previous mean reward, ramped)")
    p.add_argument("--loo", action="store_true",
                   help="NeMo-RL's GRPO: leave-one-out baseline and std, no division where the std is 0")
    p.add_argument("--std-eps", type=float, default=1e-6, metavar="E", help="the group std's eps (TRL: 1e-4)")
    p.add_argument("--std-biased", action="store_true", help="divide by the biased (population) group std")
    p.add_argument("--kl-in-reward", choices=("sequence", "token_returns"), default=None,
                   help="fold --kl-coef × KL into the reward: the score (verl) or per token, as returns (OpenRLHF)")
    p.add_argument("--whiten", action="store_true", help="whiten the advantages over the rollout's loss tokens")
    p.add_argument("--gamma", type=float, default=1.0, help="discount (reinforce_plus_plus, gae, token returns)")
    p.add_argument("--lam", type=float, default=0.95, help="GAE's λ")
    p.add_argument("--uneven-groups", action="store_true",
                   help="draw n + 1 and n − 1 samples for alternate prompts (dynamic sampling's uneven groups)")
    for name, why in ADVANTAGE_BUGS.items():
        p.add_argument("--" + name.replace("_", "-"), action="store_true", help=why)
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
    loss = p.add_argument_group("loss side (SPEC §4.2)")
    loss.add_argument("--loss-agg", default="sum_of_sample_means", choices=AGG_MODES, metavar="MODE",
                      help="loss aggregation: " + ", ".join(AGG_MODES) + " (the counts are the step's, all-reduced)")
    loss.add_argument("--dual-clip", type=float, default=None, metavar="C", help="dual-clip PPO bound c > 1")
    loss.add_argument("--kl-loss", type=_kl_loss, default=None, metavar="TYPE:COEF",
                      help="a KL term in the loss on the current log-probs, e.g. low_var_kl:0.001")
    loss.add_argument("--tis", type=_tis, default=None, metavar="LEVEL:HIGH",
                      help="train/rollout importance correction (" + ", ".join(IS_LEVELS) + "), weights truncated "
                           "at HIGH, e.g. token:2.0")
    loss.add_argument("--icepop", type=float, default=None, metavar="LOW",
                      help="with --tis: mask the tokens whose weight leaves [LOW, HIGH] (IcePop) instead of truncating")
    loss.add_argument("--gspo", action="store_true", help="GSPO: one importance ratio per sample")
    loss.add_argument("--loss", default="ppo", choices=LOSS_FAMILIES, metavar="FAMILY",
                      help=f"the policy-loss family: {', '.join(LOSS_FAMILIES)} (default ppo, the clipped surrogate)")
    loss.add_argument("--loss-param", type=_loss_param, action="append", default=[], metavar="NAME=VALUE",
                      help="a parameter of --loss (sapo tau_pos/tau_neg, dppo_* trunc, dro beta (0.1 by default), "
                           "cispo cap=relative|absolute)")
    loss.add_argument("--opsm", type=float, default=None, metavar="DELTA",
                      help="slime's off-policy sequence masking: a token with A < 0 leaves the policy term when its "
                           "sample's mean old − current log-prob exceeds DELTA")
    loss.add_argument("--top-entropy-quantile", type=float, default=None, metavar="Q",
                      help="TRL's entropy mask: the policy term kept on the tokens whose entropy is at least the "
                           "1 − Q quantile of the micro-batch's loss tokens (0 < Q < 1; needs --entropy-coef 0)")
    loss.add_argument("--opd", type=_kl_loss, default=None, metavar="TYPE:COEF",
                      help="on-policy distillation from a frozen teacher TinyLM (another initialization; its log-probs "
                           "recorded as teacher_log_probs) as verl places it: COEF × the TYPE estimate of student − "
                           "teacher, a loss term (opd_loss), e.g. k3:0.1")
    loss.add_argument("--ppo", action="store_true",
                      help="PPO: a value head with the clipped value loss (returns = advantages + values)")
    loss.add_argument("--value-clip", type=float, default=0.2, help="with --ppo: the value clip range")
    loss.add_argument("--vf-coef", type=float, default=0.5, help="with --ppo: the value loss's weight")
    for bug, needs, what in LOSS_BUG_FLAGS:
        loss.add_argument(f"--{bug.replace('_', '-')}-bug", dest=f"{bug}_bug", action="store_true",
                          help=f"(needs {needs}) {what}")
    loss.add_argument("--grad-bug", choices=tuple(GRAD_BUGS), default=None, metavar="CLASS",
                      help="a gradient bug whose loss value is unchanged (named at loss.grad under "
                           "RELAX_REPLAY_CAPTURE_GRAD=1): " + "; ".join(f"{k}: {v}" for k, v in GRAD_BUGS.items()))
    p.add_argument("--capture-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the per-token tensors handed to capture (bfloat16: copies of the float32 values, "
                        "half the bundle; the replay admits their rounding)")
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


# One bug per loss-side family: (bug, the flag it needs, what the buggy code does).
LOSS_BUG_FLAGS = (
    ("token_mean_denominator", "--loss-agg token_mean", "divide each micro-batch's token sum by its own token count "
                                                        "instead of the step's all-reduced count (verl#7321's class)"),
    ("dual_clip", "--dual-clip", "apply the dual-clip bound to positive advantages too"),
    ("kl_loss", "--kl-loss", "evaluate the KL term on logp − ref reversed (the reverse KL)"),
    ("tis", "--tis", "invert the importance weight: exp(rollout − old)"),
    ("gspo", "--gspo", "take the sequence ratio from the summed log-ratio instead of its mean"),
    ("value_loss", "--ppo", "report the value loss without its ½ (slime's (v − R)² under verl's ½·(v − R)²)"),
    ("cispo_cap", "--loss cispo", "CISPO with the other cap (absolute min(r, ε_high) for relative, or back)"),
    ("sapo_tau", "--loss sapo", "SAPO's τ taken by the wrong sign of A"),
    ("geo_mean", "--loss geo_mean", "PPO's clipped surrogate where GMPO is declared (the loss mode lost)"),
    ("dppo_mask", "--loss dppo_tv or dppo_kl", "DPPO's trust-region test by the wrong sign of A"),
    ("dro_beta", "--loss dro", "DRO's quadratic penalty added instead of subtracted"),
    ("gpg_old_logp", "--loss gpg", "GPG's −logp·A on the old log-probs"),
    ("opsm_anchor", "--opsm", "OPSM's sequence KL taken against the sampler's (rollout) log-probs instead of the old "
                              "ones (TRL's anchor under slime's config)"),
    ("entropy_quantile", "--top-entropy-quantile", "the entropy mask's threshold at the Q quantile instead of 1 − Q "
                                                   "(keeps the low-entropy tokens' share)"),
    ("opd_direction", "--opd", "the distillation estimate taken on teacher − student (the direction swapped)"),
    ("family", "--loss vespo, ipo, rollout_is, importance_sampling, cross_entropy or icepop",
     "the loss family's typical bug: VESPO's (k, λ) by the wrong sign of A, IPO's, rollout_is's and IcePop's ratio to "
     "the old log-probs instead of the rollout ones, importance_sampling's advantages negated, cross_entropy's sign "
     "flipped"),
)
# --loss values beyond the clipped surrogate (issue 34; kernels/families): their policy term, the step's
# aggregation as configured; ipo and rollout_is read the sampler's log-probs (recorded as rollout_log_probs)
FAMILY_LOSSES = ("vespo", "ipo", "rollout_is", "importance_sampling", "cross_entropy", "icepop")
ROLLOUT_FAMILIES = ("ipo", "rollout_is", "icepop")


def _loss_param(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, float(value)
    except ValueError:
        return name, value


def _kl_loss(text: str) -> tuple[str, float]:
    kind, _, coef = text.partition(":")
    kinds = ("k1", "k2", "k3", "low_var_kl")
    if kind not in kinds or not coef:
        raise argparse.ArgumentTypeError(f"expected TYPE:COEF with TYPE one of {', '.join(kinds)}, got {text!r}")
    return kind, float(coef)


def _tis(text: str) -> tuple[str, float]:
    level, _, high = text.partition(":")
    if level not in IS_LEVELS or not high:
        raise argparse.ArgumentTypeError(f"expected LEVEL:HIGH with LEVEL one of {', '.join(IS_LEVELS)}, got {text!r}")
    return level, float(high)


def check_args(p: argparse.ArgumentParser, args) -> None:
    per_rollout = args.prompts_per_rollout * args.n_samples
    check_advantage_args(p, args)
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
    bugs = [bug for bug, _, _ in LOSS_BUG_FLAGS if getattr(args, f"{bug}_bug")]
    if len(bugs) > 1:
        p.error("at most one loss-side --*-bug flag at a time")
    args.loss_bug = bugs[0] if bugs else None
    needs = {"token_mean_denominator": args.loss_agg == "token_mean", "dual_clip": args.dual_clip is not None,
             "kl_loss": args.kl_loss is not None, "tis": args.tis is not None, "gspo": args.gspo,
             "value_loss": args.ppo, **{bug: args.loss in fams for bug, fams in FAMILY_OF_BUG.items()},
             "family": args.loss in FAMILY_LOSSES, "opsm_anchor": args.opsm is not None,
             "entropy_quantile": args.top_entropy_quantile is not None, "opd_direction": args.opd is not None}
    if args.loss_bug and not needs[args.loss_bug]:
        p.error(f"--{args.loss_bug.replace('_', '-')}-bug needs "
                f"{next(n for b, n, _ in LOSS_BUG_FLAGS if b == args.loss_bug)}")
    grad_needs = {"kl_no_grad": (args.kl_loss is not None, "--kl-loss"), "is_not_detached": (args.tis is not None,
                                                                                           "--tis"),
                  "zero_coef_nan": (args.kl_loss is None, "no --kl-loss")}
    if args.grad_bug in grad_needs and not grad_needs[args.grad_bug][0]:
        p.error(f"--grad-bug {args.grad_bug} needs {grad_needs[args.grad_bug][1]}")
    if args.loss == "dro" and not any(name == "beta" for name, _ in args.loss_param):
        args.loss_param.append(("beta", 0.1))
    if args.loss != "ppo" and (args.dual_clip is not None or args.gspo):
        p.error(f"--loss {args.loss} takes neither --dual-clip nor --gspo (they are PPO's)")
    if args.dual_clip is not None and not args.dual_clip > 1:
        p.error("--dual-clip C needs C > 1")
    if args.icepop is not None and args.tis is None:
        p.error("--icepop needs --tis LEVEL:HIGH")
    if args.top_entropy_quantile is not None:
        if not 0.0 < args.top_entropy_quantile < 1.0:
            p.error("--top-entropy-quantile Q needs 0 < Q < 1")
        if args.entropy_coef != 0:
            p.error("--top-entropy-quantile needs --entropy-coef 0 (TRL's entropy bonus then averages over the "
                    "masked tokens only, which the replay refuses)")
        if args.entropy_quantile_bug and args.top_entropy_quantile == 0.5:
            p.error("--entropy-quantile-bug needs --top-entropy-quantile other than 0.5 (1 − 0.5 is 0.5)")
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
