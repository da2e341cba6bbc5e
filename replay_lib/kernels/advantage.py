"""advantage.estimate kernels: GRPO returns (the normalized reward broadcast over the response tokens), per-token
rewards and their discounted returns (KL in the reward, REINFORCE++), GAE, and advantage whitening."""

from __future__ import annotations

from typing import Optional

import torch

from .segments import segment_ids


def get_grpo_returns(rewards: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GRPO advantages: each sample's normalized reward broadcast over its response tokens.
    KL does not enter GRPO advantages."""
    return torch.repeat_interleave(rewards.to(dtype), lengths.to(torch.int64))


class GrpoReturns:
    """:func:`get_grpo_returns` evaluated a slice at a time: ``view[lo:hi]`` is the ``dtype`` advantages of
    tokens ``lo … hi − 1`` (each its sample's reward), without a full-length tensor."""

    def __init__(self, rewards: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        self.rewards = rewards.to(dtype)
        self.ends = torch.cumsum(lengths.to(torch.int64), 0)
        self.dtype = dtype
        self.shape = torch.Size([int(self.ends[-1]) if self.ends.numel() else 0])

    def numel(self) -> int:
        return self.shape[0]

    def __len__(self) -> int:
        return self.shape[0]

    def sample_of(self, lo: int, hi: int) -> torch.Tensor:
        """The sample of each token ``lo … hi − 1`` (an empty sample ends where it starts: skipped)."""
        return torch.searchsorted(self.ends, torch.arange(lo, hi, dtype=torch.int64), right=True)

    def __getitem__(self, index: slice) -> torch.Tensor:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("GrpoReturns takes a contiguous slice")
        lo, hi, _ = index.indices(self.shape[0])
        return self.rewards[self.sample_of(lo, max(lo, hi))]

    def materialize(self) -> torch.Tensor:
        return self[0:self.shape[0]]


# verl's masked_whiten adds this to the variance before its rsqrt
WHITEN_EPS = 1e-8


def last_loss_token(loss_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[n]`` int64: the position (in the concatenated token axis) of each sample's last loss token — where
    the outcome reward is placed (OpenRLHF's ``eos_indices``) — or of its last token when it has none; −1 for
    an empty sample."""
    lengths = lengths.to(torch.int64)
    ends = torch.cumsum(lengths, 0)
    if not lengths.numel() or int(ends[-1]) == 0:
        return ends - 1
    seg = segment_ids(lengths)
    pos = torch.arange(seg.numel(), dtype=torch.int64)
    marked = torch.where(loss_mask.reshape(-1) != 0, pos, torch.full_like(pos, -1))
    last = torch.full((lengths.numel(),), -1, dtype=torch.int64).scatter_reduce(
        0, seg, marked, reduce="amax", include_self=True)
    return torch.where(last >= 0, last, ends - 1)


def token_rewards(scores: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor,
                  kl: Optional[torch.Tensor] = None, kl_coef: float = 0.0,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token rewards ``r_t = mask_t·(1[t = last]·g_i − kl_coef·kl_t)`` (OpenRLHF ``compute_reward`` then
    the action mask; verl's ``token_level_rewards``): each sample's score ``g_i`` on its last loss token, the
    KL penalty (``kl_in_reward="token_returns"``) on every loss token."""
    total = int(lengths.to(torch.int64).sum())
    mask = loss_mask.to(dtype)
    out = torch.zeros(total, dtype=dtype)
    if kl is not None and kl_coef != 0:
        out = out - kl_coef * kl.to(dtype)
    last = last_loss_token(loss_mask, lengths)
    keep = last >= 0
    out.index_add_(0, last[keep], scores.to(dtype)[keep])
    return out * mask


def _padded(values: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``([n, L_max] values right-padded with 0, [n, L_max] bool valid)`` of a concatenated token axis."""
    lengths = lengths.to(torch.int64)
    n = lengths.numel()
    width = int(lengths.max()) if n else 0
    valid = torch.arange(width, dtype=torch.int64).unsqueeze(0) < lengths.unsqueeze(1)
    out = torch.zeros((n, width), dtype=dtype)
    out[valid] = values.to(dtype)
    return out, valid


def discounted_returns(rewards: torch.Tensor, lengths: torch.Tensor, gamma: float = 1.0,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``G_t = r_t + γ·G_{t+1}`` over each sample's tokens, evaluated backwards one token at a time in ``dtype``
    (OpenRLHF ``get_cumulative_returns``, verl ``compute_reinforce_plus_plus_outcome_advantage``'s loop): the
    reverse cumulative sums of ``kl_in_reward="token_returns"`` and REINFORCE++. ``rewards`` are per token
    (:func:`token_rewards`, 0 off the loss mask, so masked tokens carry the return through)."""
    padded, valid = _padded(rewards, lengths, dtype)
    out = torch.zeros_like(padded)
    running = torch.zeros(padded.shape[0], dtype=dtype)
    for t in range(padded.shape[1] - 1, -1, -1):
        running = padded[:, t] + gamma * running
        out[:, t] = running
    return out[valid]


GAE_MASKED_TOKENS = ("skip", "zeroed")


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor,
                   gamma: float, lam: float, dtype: torch.dtype = torch.float32,
                   masked: str = "skip") -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (before any whitening): ``δ_t = r_t + γ·V_next − V_t``, ``A_t = δ_t + γλ·A_next``, returns ``A + V``,
    one token at a time backwards as the frameworks do; ``(advantages, returns)`` in ``dtype``. ``masked`` is
    what a token off the loss mask does:

    * ``skip`` (verl ``compute_gae_advantage_return``, observation tokens): its δ is dropped and the next value
      and advantage are carried through it unchanged;
    * ``zeroed`` (OpenRLHF ``get_advantages_and_returns``): its value and reward are multiplied by the mask (0)
      and the recursion runs over it like any token (``δ_t = γ·V_next`` there, and the loss token before it
      sees a next value of 0); the returns are ``A + V·mask``."""
    if masked not in GAE_MASKED_TOKENS:
        raise ValueError(f"masked: expected one of {', '.join(GAE_MASKED_TOKENS)}, got {masked!r}")
    r, valid = _padded(rewards, lengths, dtype)
    v, _ = _padded(values, lengths, dtype)
    m, _ = _padded(loss_mask, lengths, dtype)
    if masked == "zeroed":
        v, r = v * m, r * m
    adv = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], dtype=dtype)
    last = torch.zeros(r.shape[0], dtype=dtype)
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        candidate = delta + gamma * lam * last
        if masked == "zeroed":
            next_value, last = v[:, t], candidate
        else:
            next_value = v[:, t] * m[:, t] + (1 - m[:, t]) * next_value
            last = candidate * m[:, t] + (1 - m[:, t]) * last
        adv[:, t] = last
    advantages = adv[valid]
    return advantages, advantages + (v[valid] if masked == "zeroed" else values.to(dtype))


WHITEN_VARIANCES = ("unbiased", "biased", "none")
WHITEN_EPS_MODES = ("add", "clamp")


def whiten_stats(values: torch.Tensor, loss_mask: torch.Tensor, dtype: torch.dtype = torch.float32,
                 eps: float = WHITEN_EPS, variance: str = "unbiased",
                 eps_mode: str = "add") -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, divisor)`` of a whitening over the loss tokens.

    ``variance``: ``unbiased`` the Bessel-corrected masked variance (verl ``masked_whiten``), ``biased`` the
    masked variance over ``N`` (OpenRLHF ``compute_advantages_and_returns``), ``none`` no division (divisor 1,
    OpenRLHF ``no_std_norm``). ``eps_mode``: ``add`` (verl: the masked means divide by ``Σ mask + 1e-8``, the
    divisor is ``sqrt(var + eps)``) or ``clamp`` (OpenRLHF: the means divide by ``Σ mask``, the divisor is
    ``sqrt(max(var, eps))``, its ``var.clamp(min=1e-8).rsqrt()``)."""
    if variance not in WHITEN_VARIANCES or eps_mode not in WHITEN_EPS_MODES:
        raise ValueError(f"whitening: expected variance in {WHITEN_VARIANCES} and eps_mode in {WHITEN_EPS_MODES}, "
                         f"got {variance!r}, {eps_mode!r}")
    m = loss_mask.to(dtype)
    v = values.to(dtype)
    count = m.sum()
    denominator = count + eps if eps_mode == "add" else count
    mean = (v * m).sum() / denominator
    if variance == "none":
        return mean, torch.ones((), dtype=dtype)
    var = (((v - mean) ** 2) * m).sum() / denominator
    if variance == "unbiased":
        var = var * (count / (count - 1))
    divisor = torch.sqrt(var + eps) if eps_mode == "add" else torch.sqrt(torch.clamp(var, min=eps))
    return mean, divisor


def whiten(values: torch.Tensor, loss_mask: torch.Tensor, dtype: torch.dtype = torch.float32,
           stats: Optional[tuple[float, float]] = None, variance: str = "unbiased",
           eps_mode: str = "add") -> torch.Tensor:
    """``normalize_advantages``: ``(A − mean)/divisor`` over the step's loss tokens (:func:`whiten_stats` with
    ``variance`` and ``eps_mode``), or with the producer's recorded global ``stats = (mean, divisor)``
    (``advantage_whiten_stats``) when the bundle is one shard of a larger batch."""
    if stats is None:
        mean, divisor = whiten_stats(values, loss_mask, dtype, variance=variance, eps_mode=eps_mode)
    else:
        mean, divisor = torch.tensor(stats[0], dtype=dtype), torch.tensor(stats[1], dtype=dtype)
    return (values.to(dtype) - mean) / divisor
