"""Conformance of the advantage-side kernels (SPEC §4.2) with each framework's own formula, read from its source.

Every reference below is written here from the framework's code (cited by repository, commit, file and line),
in float64 torch, and never calls ``replay_lib.kernels``; the kernels run in float64 too (the replay's form) and
must agree to ~1e-12. Inputs are random groups with a one-sample group and a zero-std group where the framework's
rules for them are part of the formula.

Sources (the commits read):
* verl volcengine/verl@b178a3c — ``verl/trainer/ppo/core_algos.py``, ``verl/utils/torch_functional.py``,
  ``verl/trainer/ppo/ray_trainer.py``
* NeMo-RL NVIDIA-NeMo/RL@7ea279a — ``nemo_rl/algorithms/advantage_estimator.py``, ``nemo_rl/algorithms/utils.py``
* OpenRLHF OpenRLHF/OpenRLHF@3c3be62 — ``openrlhf/trainer/ppo_utils/experience_maker.py``, ``openrlhf/models/utils.py``
* TRL huggingface/trl@f2cd577 — ``trl/trainer/grpo_trainer.py``, ``trl/trainer/utils.py``
* slime THUDM/slime@624b824 — ``slime/ray/rollout.py``, ``slime/utils/ppo_utils.py``
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from replay_lib.kernels import (discounted_returns, gae_advantages, get_grpo_returns, group_rule, post_process,
                                sequence_kl_score, token_rewards, whiten)
from replay_lib.bundle.schema import AdvantageWhitenStats, RecomputeConfig

F64 = torch.float64
TIGHT = dict(rel=1e-12, abs=1e-12)


def scores_and_groups(seed: int = 0, with_singleton: bool = True):
    """Rewards in groups of 4 (one group of equal rewards) plus, optionally, a one-sample group."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.rand(16, generator=gen, dtype=F64)
    raw[4:8] = 0.5  # a zero-std group
    groups = torch.arange(16) // 4
    if with_singleton:
        raw = torch.cat([raw, torch.tensor([0.7], dtype=F64)])
        groups = torch.cat([groups, torch.tensor([4])])
    return raw, groups


def padded(lengths, values):
    """[n, L] right-padded rows of a concatenated token axis, and the [n, L] response mask of the padding."""
    n, width = len(lengths), max(lengths)
    out = torch.zeros(n, width, dtype=F64)
    mask = torch.zeros(n, width, dtype=F64)
    start = 0
    for i, length in enumerate(lengths):
        out[i, :length] = values[start:start + length]
        mask[i, :length] = 1
        start += length
    return out, mask


def flat(rows, lengths):
    return torch.cat([rows[i, :n] for i, n in enumerate(lengths)])


def kernel_post(raw, groups, **config):
    return post_process(raw, groups, group_rule(RecomputeConfig(**config)), dtype=F64)


# ---------------------------------------------------------------------------------------------- verl


def verl_grpo(scores, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """verl core_algos.py:267-330 compute_grpo_outcome_advantage: per uid, a group of one gets mean 0 and std 1
    (:315-316), else torch.mean and the unbiased torch.std (:320); (s − mean)/(std + eps) (:325) or s − mean (:327)."""
    scores = scores.clone()
    id2score = defaultdict(list)
    for i in range(len(scores)):
        id2score[int(index[i])].append(scores[i])
    mean, std = {}, {}
    for k, vals in id2score.items():
        if len(vals) == 1:
            mean[k], std[k] = torch.tensor(0.0, dtype=F64), torch.tensor(1.0, dtype=F64)
        else:
            t = torch.stack(vals)
            mean[k], std[k] = t.mean(), t.std()
    for i in range(len(scores)):
        k = int(index[i])
        scores[i] = (scores[i] - mean[k]) / (std[k] + epsilon) if norm_adv_by_std_in_grpo else scores[i] - mean[k]
    return scores


def verl_rloo(scores, index):
    """verl core_algos.py:477-526 compute_rloo_outcome_advantage: a group of one keeps its score (mean 0, :512, and
    only groups of more than one are rescaled); else s·n/(n − 1) − mean·n/(n − 1) (:520)."""
    scores = scores.clone()
    id2score = defaultdict(list)
    for i in range(len(scores)):
        id2score[int(index[i])].append(scores[i])
    id2mean = {k: torch.stack(v).mean() if len(v) > 1 else torch.tensor(0.0, dtype=F64) for k, v in id2score.items()}
    for i in range(len(scores)):
        n = len(id2score[int(index[i])])
        if n > 1:
            m = id2mean[int(index[i])]
            scores[i] = scores[i] * n / (n - 1) - m * n / (n - 1)
    return scores


def verl_masked_whiten(values, mask):
    """verl torch_functional.py:287-340: masked mean (sum / (Σmask + 1e-8)), Bessel-corrected masked variance
    (:317), (v − mean)·rsqrt(var + 1e-8) (:336)."""
    # (masked_var takes its mean with masked_mean as well, :306-308)
    count = mask.sum()
    mean = (values * mask).sum() / (count + 1e-8)
    var = (((values - mean) ** 2) * mask).sum() / (count + 1e-8) * (count / (count - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def test_verl_grpo_with_its_singleton_rule():
    raw, groups = scores_and_groups()
    want = verl_grpo(raw, groups)
    got = kernel_post(raw, groups, grpo_std_normalization=True, singleton_group="raw")
    assert got.tolist() == pytest.approx(want.tolist(), **TIGHT)
    assert float(got[-1]) == pytest.approx(0.7 / (1 + 1e-6), rel=1e-15)  # the singleton: mean 0, std 1


def test_verl_grpo_without_std_is_dr_grpo():
    raw, groups = scores_and_groups()
    want = verl_grpo(raw, groups, norm_adv_by_std_in_grpo=False)
    got = kernel_post(raw, groups, advantage_estimator="dr_grpo", singleton_group="raw")
    assert got.tolist() == pytest.approx(want.tolist(), **TIGHT)


def test_verl_rloo():
    raw, groups = scores_and_groups()
    want = verl_rloo(raw, groups)
    got = kernel_post(raw, groups, advantage_estimator="rloo", singleton_group="raw")
    assert got.tolist() == pytest.approx(want.tolist(), **TIGHT)


def test_verl_reinforce_plus_plus_baseline():
    """verl core_algos.py:425-473: the group mean subtracted (a group of one: mean 0, :462; :468), broadcast over the
    response tokens, masked_whiten and × mask (:471)."""
    raw, groups = scores_and_groups()
    lengths = [3 + (i % 4) for i in range(len(raw))]
    id2score = defaultdict(list)
    for i in range(len(raw)):
        id2score[int(groups[i])].append(raw[i])
    centred = torch.stack([raw[i] - (torch.stack(id2score[int(groups[i])]).mean()
                                     if len(id2score[int(groups[i])]) > 1 else 0.0) for i in range(len(raw))])
    rows, mask = padded(lengths, torch.repeat_interleave(centred, torch.tensor(lengths)))
    want = flat(verl_masked_whiten(rows * mask, mask) * mask, lengths)
    post = kernel_post(raw, groups, advantage_estimator="reinforce_plus_plus_baseline", singleton_group="raw")
    loss_mask = torch.ones(sum(lengths))
    got = whiten(get_grpo_returns(post, torch.tensor(lengths), dtype=F64), loss_mask, dtype=F64)
    assert got.tolist() == pytest.approx(want.tolist(), **TIGHT)


def test_verl_reinforce_plus_plus():
    """verl core_algos.py:583-618: token_level_rewards (the score on the last response token), the backward loop
    G = r_t + γ·G (:610) reset after the response (:613), masked_whiten (:615) × mask."""
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 3, 7, 4]
    scores = torch.rand(4, generator=gen, dtype=F64)
    width = max(lengths)
    token_level = torch.zeros(4, width, dtype=F64)
    mask = torch.zeros(4, width, dtype=F64)
    for i, n in enumerate(lengths):
        token_level[i, n - 1] = scores[i]
        mask[i, :n] = 1
    gamma = 0.9
    returns = torch.zeros_like(token_level)
    running = torch.zeros(4, dtype=F64)
    for t in reversed(range(width)):
        running = token_level[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    want_returns = flat(returns, lengths)
    want = flat(verl_masked_whiten(returns, mask) * mask, lengths)
    ones = torch.ones(sum(lengths))
    got_returns = discounted_returns(token_rewards(scores, ones, torch.tensor(lengths), dtype=F64),
                                     torch.tensor(lengths), gamma, dtype=F64)
    assert got_returns.tolist() == pytest.approx(want_returns.tolist(), **TIGHT)
    assert whiten(got_returns, ones, dtype=F64).tolist() == pytest.approx(want.tolist(), **TIGHT)


def test_verl_gae_with_observation_tokens():
    """verl core_algos.py:215-262 compute_gae_advantage_return: δ = r_t + γ·V_next − V_t (:250), A = δ + γλ·A_next
    (:251), observation tokens skipped (:254-255), returns = A + V (:260), then masked_whiten (:261)."""
    gen = torch.Generator().manual_seed(4)
    lengths = [6, 4, 5]
    width = max(lengths)
    values = torch.randn(3, width, generator=gen, dtype=F64)
    rewards = torch.zeros(3, width, dtype=F64)
    mask = torch.zeros(3, width, dtype=F64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    mask[0, 2] = 0  # an observation (tool output) token inside a response
    mask[2, 1] = 0
    for i, n in enumerate(lengths):
        last = max(t for t in range(n) if mask[i, t])
        rewards[i, last] = float(torch.rand(1, generator=gen))
    gamma, lam = 0.99, 0.9
    nextvalues = torch.zeros(3, dtype=F64)
    lastgaelam = torch.zeros(3, dtype=F64)
    reversed_adv = []
    for t in reversed(range(width)):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        candidate = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = candidate * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        reversed_adv.append(lastgaelam)
    adv = torch.stack(reversed_adv[::-1], dim=1)
    want_returns = flat(adv + values, lengths)
    want = flat(verl_masked_whiten(adv, mask), lengths)
    m = flat(mask, lengths)
    got_adv, got_returns = gae_advantages(flat(rewards, lengths), flat(values, lengths), m, torch.tensor(lengths),
                                          gamma, lam, dtype=F64)
    assert got_returns.tolist() == pytest.approx(want_returns.tolist(), **TIGHT)
    got = whiten(got_adv, m, dtype=F64)
    keep = m != 0  # verl whitens every position; the loss reads (and the replay compares) the loss tokens
    assert got[keep].tolist() == pytest.approx(want[keep].tolist(), **TIGHT)


def test_verl_kl_in_reward_changes_the_grpo_scores():
    """verl ray_trainer.py:70-98 apply_kl_penalty: kld × response_mask (:95), token_level_rewards =
    token_level_scores − β·kld (:98); GRPO then sums them per response (core_algos.py:305, .sum(dim=-1))."""
    raw, groups = scores_and_groups(with_singleton=False)
    lengths = [2 + i % 3 for i in range(len(raw))]
    gen = torch.Generator().manual_seed(5)
    kl = torch.randn(sum(lengths), generator=gen, dtype=F64) * 0.1
    loss_mask = (torch.rand(sum(lengths), generator=gen) > 0.2).to(F64)
    beta = 0.05
    rows_kl, _ = padded(lengths, kl)
    rows_mask, _ = padded(lengths, loss_mask)
    token_level_scores = torch.zeros_like(rows_kl)
    for i, n in enumerate(lengths):
        token_level_scores[i, n - 1] = raw[i]
    token_level_rewards = token_level_scores - beta * (rows_kl * rows_mask)
    want = verl_grpo(token_level_rewards.sum(dim=-1), groups)
    score = sequence_kl_score(raw, kl, loss_mask, torch.tensor(lengths), beta, dtype=F64)
    got = kernel_post(score, groups, grpo_std_normalization=True, kl_in_reward="sequence", kl_coef=beta)
    assert got.tolist() == pytest.approx(want.tolist(), **TIGHT)


# -------------------------------------------------------------------------------------------- NeMo-RL


def nemo_baseline_and_std(prompts, rewards):
    """NeMo-RL utils.py:104-197 calculate_baseline_and_std_per_prompt (leave_one_out_baseline=True, all valid):
    the baseline matrix 1 − I (:150); at most one valid response: baseline = reward (:156-159); num_valid = n − 1
    (:161); baseline and E[r²] over the others; std = sqrt((E[r²] − b²)·(m/(m − 1))).nan_to_num(0) (:179-195)."""
    baseline = torch.zeros_like(rewards)
    std = torch.zeros_like(rewards)
    for p in torch.unique(prompts):
        idx = torch.nonzero(prompts == p).reshape(-1)
        if idx.numel() <= 1:
            baseline[idx] = rewards[idx]
            continue
        matrix = 1 - torch.eye(idx.numel(), dtype=F64)
        m = torch.tensor(float(idx.numel() - 1), dtype=F64)
        b = matrix @ rewards[idx] / m
        sq = matrix @ rewards[idx] ** 2 / m
        baseline[idx] = b
        std[idx] = ((sq - b * b) * (m / (m - 1))).sqrt().nan_to_num(0)
    return baseline, std


def test_nemo_rl_leave_one_out_grpo():
    """NeMo-RL advantage_estimator.py:72-99 GRPOAdvantageEstimator: (rewards − baseline) (:88), divided by std + 1e-6
    only where std > 0 (:92-95)."""
    gen = torch.Generator().manual_seed(6)
    rewards = (torch.rand(20, generator=gen) > 0.5).to(F64)  # 0/1 rewards, NeMo-RL's math verifier
    rewards[8:12] = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=F64)  # one sample's others have std 0
    rewards = torch.cat([rewards, torch.tensor([1.0], dtype=F64)])  # a one-sample group
    prompts = torch.cat([torch.arange(20) // 4, torch.tensor([5])])
    baseline, std = nemo_baseline_and_std(prompts, rewards)
    want = rewards - baseline
    nz = std > 0
    want[nz] = want[nz] / (std[nz] + 1e-6)
    got = kernel_post(rewards, prompts, grpo_std_normalization=True, group_baseline="leave_one_out", std_zero="skip",
                      singleton_group="zero")
    assert got.tolist() == pytest.approx(want.tolist(), **TIGHT)
    assert float(got[11]) == -1.0 and float(got[-1]) == 0.0  # others' std 0: not divided; singleton: 0


# ------------------------------------------------------------------------------------------- OpenRLHF


def test_openrlhf_group_norm_and_rloo():
    """OpenRLHF experience_maker.py: rloo baseline (Σr − r)/(n − 1) (:265); group_norm (r − mean)/(std + 1e-9)
    with torch.std, unbiased (:270)."""
    raw, groups = scores_and_groups(with_singleton=False)
    r = raw.reshape(-1, 4)
    want_norm = ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-9)).reshape(-1)
    want_rloo = (r - (r.sum(-1, keepdim=True) - r) / 3).reshape(-1)
    got_norm = kernel_post(raw, groups, grpo_std_normalization=True, grpo_std_eps=1e-9)
    got_rloo = kernel_post(raw, groups, advantage_estimator="rloo")
    assert got_norm.tolist() == pytest.approx(want_norm.tolist(), **TIGHT)
    assert got_rloo.tolist() == pytest.approx(want_rloo.tolist(), **TIGHT)


def openrlhf_compute_reward(r, kl_coef, kl, action_mask):
    """OpenRLHF models/utils.py:98-126 compute_reward: −kl_coef·kl (:111), the score scattered to the last action
    token, eos = L − 1 − argmax(fliplr(mask)) (:121-122), their sum (:124)."""
    kl_reward = -kl_coef * kl
    eos = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    last_reward = torch.zeros_like(kl).scatter_(dim=1, index=eos, src=r.unsqueeze(1).to(kl.dtype))
    return last_reward + kl_reward


def test_openrlhf_kl_in_reward_token_returns():
    """OpenRLHF experience_maker.py:380-410 get_cumulative_returns: rewards × action_mask (:404), then
    G = r_t + γ·G backwards (:408), on compute_reward's per-token rewards."""
    gen = torch.Generator().manual_seed(7)
    lengths = [5, 3, 6, 4]
    scores = torch.rand(4, generator=gen, dtype=F64)
    kl = torch.randn(sum(lengths), generator=gen, dtype=F64) * 0.05
    rows_kl, mask = padded(lengths, kl)
    mask[1, 2] = 0  # a truncated last token
    gamma, kl_coef = 0.97, 0.01
    rewards = openrlhf_compute_reward(scores, kl_coef, rows_kl, mask) * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros(4, dtype=F64)
    for t in reversed(range(rewards.size(1))):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    want = flat(returns, lengths)
    m = flat(mask, lengths)
    got = discounted_returns(token_rewards(scores, m, torch.tensor(lengths), kl, kl_coef, dtype=F64),
                             torch.tensor(lengths), gamma, dtype=F64)
    assert got.tolist() == pytest.approx(want.tolist(), **TIGHT)


def test_openrlhf_whitening_through_recorded_stats():
    """OpenRLHF experience_maker.py:315-328: mean over the action tokens (:320), the *biased* variance (:322),
    rstd = clamp(var, 1e-8).rsqrt() (:323). Its statistics differ from verl's masked_whiten (Bessel, var + 1e-8), so
    a bundle records them (advantage_whiten_stats: mean and the divisor 1/rstd) and the replay whitens with them."""
    gen = torch.Generator().manual_seed(8)
    adv = torch.randn(40, generator=gen, dtype=F64)
    mask = (torch.rand(40, generator=gen) > 0.3).to(F64)
    num = mask.sum()
    mean = (adv * mask).sum() / num
    var = ((adv - mean).pow(2) * mask).sum() / num
    rstd = var.clamp(min=1e-8).rsqrt()
    want = (adv - mean) * rstd
    stats = AdvantageWhitenStats(mean=float(mean), std=float(1 / rstd))
    got = whiten(adv, mask, dtype=F64, stats=(stats.mean, stats.std))
    assert got.tolist() == pytest.approx(want.tolist(), **TIGHT)


def test_openrlhf_gae_on_trailing_masks():
    """OpenRLHF experience_maker.py:333-377 get_advantages_and_returns: values and rewards × action_mask (:368),
    V_next = values[t + 1] (:371), δ (:372), A = δ + γλ·A (:373), returns = A + V (:376). With the padding's
    mask (trailing zeros) it equals verl's loop, which the kernel follows."""
    gen = torch.Generator().manual_seed(9)
    lengths = [4, 6, 3]
    values_flat = torch.randn(sum(lengths), generator=gen, dtype=F64)
    values, mask = padded(lengths, values_flat)
    scores = torch.rand(3, generator=gen, dtype=F64)
    rewards = openrlhf_compute_reward(scores, 0.0, torch.zeros_like(values), mask)
    gamma, lam = 0.95, 0.9
    v, r = mask * values, mask * rewards
    last = torch.zeros(3, dtype=F64)
    out = []
    for t in reversed(range(r.size(1))):
        nextvalues = v[:, t + 1] if t < r.size(1) - 1 else 0.0
        delta = r[:, t] + gamma * nextvalues - v[:, t]
        last = delta + gamma * lam * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    m = flat(mask, lengths)
    got_adv, got_ret = gae_advantages(token_rewards(scores, m, torch.tensor(lengths), dtype=F64), values_flat, m,
                                      torch.tensor(lengths), gamma, lam, dtype=F64)
    assert got_adv.tolist() == pytest.approx(flat(adv, lengths).tolist(), **TIGHT)
    assert got_ret.tolist() == pytest.approx(flat(adv + v, lengths).tolist(), **TIGHT)


# ------------------------------------------------------------------------------------------------ TRL


def test_trl_group_scaling_eps_1e4():
    """TRL grpo_trainer.py:2685-2707: nanmean per group of num_generations (:2685), nanstd (:2690; utils.py:857-879:
    Bessel-corrected, count/(count − 1)), advantages = (r − mean)/(std + 1e-4) (:2705, :2707)."""
    raw, groups = scores_and_groups(with_singleton=False)
    r = raw.view(-1, 4)
    mean = torch.nanmean(r, dim=1, keepdim=True)
    count = torch.sum(~torch.isnan(r), dim=1, keepdim=True)
    std = torch.sqrt(torch.nanmean((r - mean) ** 2, dim=1, keepdim=True) * count / (count - 1))
    want = ((r - mean) / (std + 1e-4)).reshape(-1)
    got = kernel_post(raw, groups, grpo_std_normalization=True, grpo_std_eps=1e-4)
    assert got.tolist() == pytest.approx(want.tolist(), **TIGHT)


# ---------------------------------------------------------------------------------------------- slime


def test_slime_group_norm_and_its_singleton():
    """slime rollout.py:615-629 _post_process_rewards: reshape(-1, n_samples_per_prompt) (:620), mean subtracted,
    unbiased std, / (std + 1e-6) (:628-629). A group of one: torch.std of one value is NaN, so the reward is NaN
    (singleton_group="nan")."""
    raw, groups = scores_and_groups(with_singleton=False)
    r = raw.reshape(-1, 4)
    r = r - r.mean(dim=-1, keepdim=True)
    want = (r / (r.std(dim=-1, keepdim=True) + 1e-6)).flatten()
    got = kernel_post(raw, groups, grpo_std_normalization=True, singleton_group="nan")
    assert got.tolist() == pytest.approx(want.tolist(), **TIGHT)
    one = torch.tensor([[0.7]], dtype=F64)
    with pytest.warns(UserWarning, match="degrees of freedom"):  # torch's own word for it
        assert torch.isnan((one - one.mean(dim=-1, keepdim=True)) / (one.std(dim=-1, keepdim=True) + 1e-6)).all()
    assert torch.isnan(kernel_post(torch.tensor([0.7], dtype=F64), torch.tensor([0]), grpo_std_normalization=True,
                                   singleton_group="nan")).all()


def test_slime_reinforce_plus_plus_returns():
    """slime ppo_utils.py:371-445 get_reinforce_plus_plus_returns: −kl_coef·kl·mask, the score added on the last
    loss token (nonzero()[-1]), discounted returns G = r_t + γ·G (chunked_discounted_returns, :610-)."""
    gen = torch.Generator().manual_seed(10)
    lengths = [4, 6, 5]
    kl = torch.randn(sum(lengths), generator=gen, dtype=F64) * 0.05
    mask = torch.ones(sum(lengths), dtype=F64)
    mask[3] = 0  # sample 0's last token is not a loss token
    scores = torch.rand(3, generator=gen, dtype=F64)
    gamma, kl_coef = 0.99, 0.02
    want = []
    start = 0
    for i, n in enumerate(lengths):
        m = mask[start:start + n]
        row = -kl_coef * (kl[start:start + n] * m)
        row[m.nonzero(as_tuple=True)[0][-1]] += scores[i]
        g = torch.zeros(n, dtype=F64)
        running = 0.0
        for t in reversed(range(n)):
            running = row[t] + gamma * running
            g[t] = running
        want.append(g)
        start += n
    got = discounted_returns(token_rewards(scores, mask, torch.tensor(lengths), kl, kl_coef, dtype=F64),
                             torch.tensor(lengths), gamma, dtype=F64)
    assert got.tolist() == pytest.approx(torch.cat(want).tolist(), **TIGHT)
