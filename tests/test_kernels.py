"""The GRPO kernels against numbers derived by hand (SPEC §4).

Every expected value here is written out from the formula, not recomputed by the code under test.
float32 values that are exact in binary (±0.5, 0.125, −2.0 …) are compared with ``==``; the others with a
relative tolerance of a few float32 ulps.
"""

from __future__ import annotations

import math

import pytest
import torch

from replay_lib.kernels import (
    LOSS_FIELDS,
    batch_normalize,
    compute_approx_kl,
    compute_policy_loss,
    get_grpo_returns,
    group_normalize,
    policy_loss_fields,
    policy_loss_terms,
    rollout_kl,
    segment_ids,
    segment_offsets,
    sum_of_sample_mean,
)
from replay_lib.kernels.loss import surrogate_terms
from replay_lib.kernels.segments import ChunkSums

F32 = dict(rel=2e-7, abs=1e-7)


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# ------------------------------------------------------------------------------------- segments


def test_segment_ids_and_offsets_skip_zero_length_samples():
    lengths = torch.tensor([2, 0, 3, 1])
    assert segment_ids(lengths).tolist() == [0, 0, 2, 2, 2, 3]
    assert segment_offsets(lengths).tolist() == [0, 2, 2, 5]


def test_chunk_sums_add_each_samples_part_of_a_chunk_including_empty_and_cut_samples():
    # samples of 2, 0, 3, 1 and 0 tokens: tokens 0-1 are sample 0, 2-4 sample 2, 5 sample 3; chunks [0, 3), [3, 6)
    # cut sample 2 in two (token 2 in the first, tokens 3-4 in the second); the empty samples get nothing
    lengths = torch.tensor([2, 0, 3, 1, 0])
    rows = torch.tensor([[1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
                         [0.5, 0.25, 0.0, -1.0, 3.0, 0.125]], dtype=torch.float64)
    totals = torch.zeros((2, 5), dtype=torch.float64)
    sums = ChunkSums(lengths, segment_offsets(lengths))
    for lo, hi in ((0, 3), (3, 6)):
        sums.add(totals, lo, hi, rows[:, lo:hi])
    assert totals.tolist() == [[3.0, 0.0, 28.0, 32.0, 0.0], [0.75, 0.0, 2.0, 0.125, 0.0]]
    # without empty samples the chunk's samples are a slice of the totals: one chunk per sample edge, and one
    # chunk inside a sample
    lengths = torch.tensor([1, 4, 1])
    totals = torch.zeros((1, 3), dtype=torch.float64)
    sums = ChunkSums(lengths, segment_offsets(lengths))
    for lo, hi in ((0, 2), (2, 4), (4, 6)):
        sums.add(totals, lo, hi, rows[:1, lo:hi])
    assert totals.tolist() == [[1.0, 2.0 + 4.0 + 8.0 + 16.0, 32.0]]


def test_the_surrogate_negates_the_advantage_once_with_the_written_out_formulas_bits():
    # −r·A and −clip(r)·A as two negations of the ratio (the formula as verl writes it), against one of A:
    # products are sign-symmetric, so every bit agrees (signed zeros and infinities too)
    gen = torch.Generator().manual_seed(3)
    ppo_kl = torch.cat([torch.randn(4096, generator=gen, dtype=torch.float64) * 0.3,
                        torch.tensor([0.0, -0.0, 50.0, -800.0, 800.0], dtype=torch.float64)])
    adv = torch.cat([torch.randn(4096, generator=gen, dtype=torch.float64),
                     torch.tensor([0.0, -0.0, 1.0, -2.0, 1.0], dtype=torch.float64)])
    ratio = (-ppo_kl).exp()
    written1, written2 = -ratio * adv, -ratio.clamp(0.8, 1.28) * adv
    for dtype in (torch.float64, torch.float32):
        pg, clip, r = policy_loss_terms(ppo_kl.to(dtype), adv.to(dtype), 0.2, 0.28)
        ratio_d = (-ppo_kl.to(dtype)).exp()
        w1, w2 = -ratio_d * adv.to(dtype), -ratio_d.clamp(0.8, 1.28) * adv.to(dtype)
        assert torch.equal(pg.view(torch.int64 if dtype == torch.float64 else torch.int32),
                           torch.maximum(w1, w2).view(torch.int64 if dtype == torch.float64 else torch.int32))
        assert torch.equal(clip, (w2 > w1).to(dtype)) and torch.equal(r, ratio_d)
    assert torch.equal(surrogate_terms(ratio, adv, 0.2, 0.28)[0], torch.maximum(written1, written2))


# ------------------------------------------------------------------------------ reward.post_process


def test_pr65_group_normalization_by_semantic_group():
    # groups [0,0,1,1], raw [1,3,10,12]: group means 2 and 11 → [1−2, 3−2, 10−11, 12−11]
    out = group_normalize(t([1, 3, 10, 12]), torch.tensor([0, 0, 1, 1]), std_normalization=False)
    assert out.dtype == torch.float32
    assert out.tolist() == [-1.0, 1.0, -1.0, 1.0]


def test_pr65_bug_normalizes_against_the_physical_batch():
    # one transfer batch of 4: mean (1+3+10+12)/4 = 6.5 → [−5.5, −3.5, 3.5, 5.5]
    out = batch_normalize(t([1, 3, 10, 12]), batch_size=4, std_normalization=False)
    assert out.tolist() == [-5.5, -3.5, 3.5, 5.5]
    # a batch of 2 happens to coincide with the groups here
    assert batch_normalize(t([1, 3, 10, 12]), batch_size=2, std_normalization=False).tolist() == [-1, 1, -1, 1]


def test_groups_are_keyed_by_group_index_not_by_position():
    # interleaved groups: g0 = {1, 3}, g1 = {10, 12}
    out = group_normalize(t([1, 10, 3, 12]), torch.tensor([0, 1, 0, 1]), std_normalization=False)
    assert out.tolist() == [-1.0, -1.0, 1.0, 1.0]


def test_std_normalization_uses_the_unbiased_std_plus_eps():
    # [1, 3]: centered ±1, unbiased var = (1 + 1) / 1 = 2, std = √2 → ∓1 / (√2 + 1e-6)
    out = group_normalize(t([1, 3, 10, 12]), torch.tensor([0, 0, 1, 1]), std_normalization=True)
    v = 1.0 / (math.sqrt(2.0) + 1e-6)  # 0.70710628…
    assert out.tolist() == pytest.approx([-v, v, -v, v], **F32)
    # [0, 0, 4, 4]: mean 2, centered ±2, var = 16/3, std = 2.3094011 → ±2 / (std + 1e-6) = ±0.8660250
    out = group_normalize(t([0, 0, 4, 4]), torch.tensor([5, 5, 5, 5]), std_normalization=True)
    w = 2.0 / (math.sqrt(16.0 / 3.0) + 1e-6)
    assert w == pytest.approx(0.8660250, abs=1e-7)
    assert out.tolist() == pytest.approx([-w, -w, w, w], **F32)


def test_all_equal_rewards_give_exactly_zero():
    # mean of equal values must not leave a rounding residue (0.1 is not exact in float32)
    for std in (False, True):
        out = group_normalize(t([0.1, 0.1, 0.1, 7.3, 7.3]), torch.tensor([0, 0, 0, 1, 1]), std_normalization=std)
        assert out.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0]
        assert not torch.signbit(out).any()


def test_singleton_group_with_std_normalization_is_nan_not_an_exception():
    # unbiased std of one value divides by n − 1 = 0: undefined, NaN (the comparison reports it)
    out = group_normalize(t([4.0, 1.0, 3.0]), torch.tensor([0, 1, 1]), std_normalization=True)
    assert math.isnan(out[0].item())
    v = 1.0 / (math.sqrt(2.0) + 1e-6)
    assert out[1:].tolist() == pytest.approx([-v, v], **F32)
    # without std normalization a singleton is simply centred to 0
    assert group_normalize(t([4.0]), torch.tensor([0]), std_normalization=False).tolist() == [0.0]


def test_empty_reward_vector():
    assert group_normalize(t([]), torch.tensor([], dtype=torch.int64), std_normalization=True).numel() == 0


# ------------------------------------------------------------------------------------- advantage.kl


LOGP = [0.0, -1.0, -0.5, 0.25]
BASE = [0.0, -0.5, -1.0, -0.25]  # r = logp − base = [0, −0.5, 0.5, 0.5]


def test_k1_is_the_log_ratio():
    assert compute_approx_kl(t(LOGP), t(BASE), "k1").tolist() == [0.0, -0.5, 0.5, 0.5]


def test_k2_is_half_the_squared_log_ratio():
    assert compute_approx_kl(t(LOGP), t(BASE), "k2").tolist() == [0.0, 0.125, 0.125, 0.125]


def test_k3_is_exp_of_minus_r_minus_one_plus_r():
    # r = −0.5: e^0.5 − 1 − 0.5 = 0.1487212707; r = 0.5: e^−0.5 − 1 + 0.5 = 0.1065306597
    out = compute_approx_kl(t(LOGP), t(BASE), "k3").tolist()
    assert out[0] == 0.0
    assert out[1:] == pytest.approx([0.1487212707, 0.1065306597, 0.1065306597], rel=1e-6, abs=1e-7)


def test_low_var_kl_is_k3_clamped_to_plus_minus_ten():
    # r = −2: e^2 − 3 = 4.3890561 (inside); r = −3: e^3 − 4 = 16.0855369 → 10;
    # r = −20: e^20 − 21 ≈ 4.85e8 → 10; r = 20: e^−20 + 19 ≈ 19.0 → 10
    logp = t([-2.0, -3.0, -20.0, 20.0])
    base = t([0.0, 0.0, 0.0, 0.0])
    assert compute_approx_kl(logp, base, "k3").tolist()[:2] == pytest.approx([4.3890561, 16.0855369], rel=1e-6)
    assert compute_approx_kl(logp, base, "low_var_kl").tolist() == pytest.approx([4.3890561, 10.0, 10.0, 10.0], rel=1e-6)
    # below the clamp low_var_kl equals k3 exactly
    assert compute_approx_kl(t(LOGP), t(BASE), "low_var_kl").tolist() == compute_approx_kl(t(LOGP), t(BASE), "k3").tolist()


def test_unknown_kl_type_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"unknown kl_loss_type 'k4'.*k1, k2, k3, low_var_kl"):
        compute_approx_kl(t(LOGP), t(BASE), "k4")


def test_rollout_kl_is_zero_without_a_reference_when_kl_coef_is_zero():
    out = rollout_kl(t([-1.0, -2.0, -3.0]), None, kl_coef=0.0, kl_loss_type="k3")
    assert out.dtype == torch.float32 and out.tolist() == [0.0, 0.0, 0.0]


def test_rollout_kl_needs_a_reference_when_kl_coef_is_set():
    with pytest.raises(ValueError, match="ref_log_probs is required when kl_coef != 0"):
        rollout_kl(t([-1.0]), None, kl_coef=0.1, kl_loss_type="k1")
    # the coefficient does not scale the per-token estimate
    assert rollout_kl(t(LOGP), t(BASE), kl_coef=0.1, kl_loss_type="k2").tolist() == [0.0, 0.125, 0.125, 0.125]


# -------------------------------------------------------------------------------- advantage.estimate


def test_grpo_returns_broadcast_each_reward_over_its_response():
    out = get_grpo_returns(t([-1, 1, -1, 1]), torch.tensor([3, 2, 4, 3]))
    assert out.tolist() == [-1, -1, -1, 1, 1, -1, -1, -1, -1, 1, 1, 1]
    # a zero-length response contributes no token
    assert get_grpo_returns(t([2.0, 3.0, 4.0]), torch.tensor([0, 2, 1])).tolist() == [3.0, 3.0, 4.0]


# ---------------------------------------------------------------------------------------- loss.policy


def test_policy_loss_unclipped_and_clipped_tokens():
    # ppo_kl = old − logp; ratio = e^{−ppo_kl}
    # token 0: ratio e^0.5 = 1.6487213, A = −1: l1 = 1.6487, l2 = 1.2 → pg = 1.6487, not clipped
    # token 1: ratio e^0.5, A = +1: l1 = −1.6487, l2 = −1.2 → pg = −1.2, clipped
    # token 2: ratio e^−0.5 = 0.6065307, A = −1: l1 = 0.6065, l2 = 0.8 → pg = 0.8, clipped
    # token 3: ratio e^−0.5, A = +1: l1 = −0.6065, l2 = −0.8 → pg = −0.6065, not clipped
    # token 4: ratio 1, A = 2: l1 = l2 = −2 → not clipped (equal is not greater)
    ppo_kl = t([-0.5, -0.5, 0.5, 0.5, 0.0])
    adv = t([-1.0, 1.0, -1.0, 1.0, 2.0])
    pg, clip = compute_policy_loss(ppo_kl, adv, eps_clip=0.2, eps_clip_high=0.2)
    e05, em05 = math.exp(0.5), math.exp(-0.5)
    assert pg.tolist() == pytest.approx([e05, -1.2, 0.8, -em05, -2.0], **F32)
    assert clip.tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]


def test_eps_clip_high_is_asymmetric():
    # A = +1. ratio e^0.2 = 1.2214028: clipped at 1 + 0.2, not at 1 + 0.28
    # ratio e^0.25 = 1.2840254: clipped at 1.28 under eps_clip_high = 0.28
    # ratio e^−0.3 = 0.7408182 with A = −1: the low side still uses eps_clip = 0.2 → 0.8, clipped
    ppo_kl = t([-0.2, -0.25, 0.3])
    adv = t([1.0, 1.0, -1.0])
    pg_sym, clip_sym = compute_policy_loss(ppo_kl, adv, eps_clip=0.2, eps_clip_high=0.2)
    pg_asym, clip_asym = compute_policy_loss(ppo_kl, adv, eps_clip=0.2, eps_clip_high=0.28)
    assert pg_sym.tolist() == pytest.approx([-1.2, -1.2, 0.8], **F32)
    assert clip_sym.tolist() == [1.0, 1.0, 1.0]
    assert pg_asym.tolist() == pytest.approx([-math.exp(0.2), -1.28, 0.8], **F32)
    assert clip_asym.tolist() == [0.0, 1.0, 1.0]


def test_sum_of_sample_mean_masks_and_guards_empty_samples():
    # sample 0: tokens [1, 2, 3] mask [1, 0, 1] → (1 + 3)/2 = 2; sample 1: empty → 0;
    # sample 2: [4, 5] fully masked → 0/max(0, 1) = 0; sample 3: [6] → 6
    values = t([1, 2, 3, 4, 5, 6])
    mask = t([1, 0, 1, 0, 0, 1])
    lengths = torch.tensor([3, 0, 2, 1])
    assert sum_of_sample_mean(values, mask, segment_ids(lengths), 4).item() == 8.0


PR65_LENGTHS = [3, 2, 4, 3]
PR65_ADV = [-1.0, 1.0, -1.0, 1.0]


def pr65_loss(log_prob: float, *, mask=None, entropy=None, entropy_coef=0.0, lengths=PR65_LENGTHS, adv=PR65_ADV):
    lengths_t = torch.tensor(lengths)
    total = sum(lengths)
    advantages = get_grpo_returns(t(adv), lengths_t)
    mask_t = t(mask) if mask is not None else torch.ones(total)
    out = policy_loss_fields(
        torch.full((total,), log_prob), torch.zeros(total), advantages, entropy, mask_t, lengths_t,
        eps_clip=0.2, eps_clip_high=0.2, entropy_coef=entropy_coef,
    )
    assert tuple(out) == LOSS_FIELDS
    return {k: v.item() for k, v in out.items()}


def test_pr65_loss_with_logp_half():
    # ppo_kl = −0.5 everywhere, ratio e^0.5. A = −1 samples: pg = e^0.5 (unclipped);
    # A = +1 samples: pg = −1.2 (clipped). pg_loss = 2(e^0.5 − 1.2) = 0.8974425414
    out = pr65_loss(0.5)
    assert 2 * (math.exp(0.5) - 1.2) == pytest.approx(0.8974425414, abs=1e-10)
    # float32 accumulation over 12 tokens lands a few ulps (ulp ≈ 6e-8 here) from the exact value
    assert out["pg_loss"] == pytest.approx(0.8974426, abs=5e-7)
    assert out["loss"] == out["pg_loss"]
    assert out["pg_clipfrac"] == 2.0  # two samples fully clipped, per-sample means summed
    assert out["ppo_kl"] == -2.0      # four samples × mean(−0.5)
    assert out["entropy_loss"] == 0.0  # no entropy payload


def test_pr65_loss_with_logp_zero():
    # ratio 1: l1 = l2 = −A → pg = −A, never clipped; Σ per-sample means = 1 − 1 + 1 − 1 = 0
    assert pr65_loss(0.0) == {"loss": 0.0, "pg_loss": 0.0, "entropy_loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0}


def test_pr65_loss_with_a_fully_masked_sample():
    # sample 1 (A = +1) masked out entirely: it contributes 0 to every field
    mask = [1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1]
    out = pr65_loss(0.5, mask=mask)
    assert out["pg_loss"] == pytest.approx(2 * math.exp(0.5) - 1.2, **F32)  # 2.0974425
    assert out["pg_clipfrac"] == 1.0
    assert out["ppo_kl"] == -1.5


def test_pr65_loss_with_a_zero_length_response():
    # sample 1 has no response tokens: 3 + 0 + 4 + 3 tokens; it adds 0 (denominator max(0, 1))
    out = pr65_loss(0.5, lengths=[3, 0, 4, 3])
    assert out["pg_loss"] == pytest.approx(2 * math.exp(0.5) - 1.2, **F32)
    assert out["pg_clipfrac"] == 1.0
    assert out["ppo_kl"] == -1.5


def test_entropy_coef_subtracts_the_masked_entropy_mean():
    # entropy = linspace(0.5, 1.5, 12) = 0.5 + k/11. Per-sample means: k ∈ {0,1,2} → 0.5 + 1/11,
    # {3,4} → 0.5 + 3.5/11, {5..8} → 0.5 + 6.5/11, {9,10,11} → 0.5 + 10/11; Σ = 2 + 21/11 = 3.9090909
    entropy = torch.linspace(0.5, 1.5, 12)
    out = pr65_loss(0.5, entropy=entropy, entropy_coef=0.01)
    pg = 2 * (math.exp(0.5) - 1.2)
    ent = 2 + 21 / 11
    assert out["entropy_loss"] == pytest.approx(ent, **F32)
    assert out["loss"] == pytest.approx(pg - 0.01 * ent, rel=1e-6)  # 0.8583516
    assert out["loss"] == pytest.approx(0.8583516, abs=5e-7)
    assert out["pg_loss"] == pytest.approx(pg, abs=5e-7)
    # with entropy_coef = 0 the entropy is reported but does not enter the loss
    out0 = pr65_loss(0.5, entropy=entropy, entropy_coef=0.0)
    assert out0["loss"] == out0["pg_loss"] and out0["entropy_loss"] == pytest.approx(ent, **F32)


# ------------------------------------------------------------------------------- element comparison


def _compare(expected, actual):
    """A per-token field of two samples judged with the fixed bound 1e-6 + 1e-5·|e|."""
    from replay_lib.judge.fields import PER_TOKEN, FieldResult, compare_field

    f = FieldResult(stage="advantage.kl", name="kl", per=PER_TOKEN, expected=expected, actual=actual,
                    tolerance=1e-6 + 1e-5 * expected.to(torch.float64).abs(), sample_ids=["s-0", "s-1"],
                    group_indices=[0, 0], offsets=torch.tensor([0, 2], dtype=torch.int64))
    return compare_field(f, 5)


def test_identical_finite_tensors_take_the_fast_path_with_the_full_passs_result():
    x = torch.tensor([0.25, -1.5, 3.0, 0.0], dtype=torch.float32)
    out = _compare(x, x.clone())
    assert (out.mismatches, out.bad_samples, out.max_abs_error, out.compared) == (0, 0, 0.0, 4)
    # one ulp apart: the full float64 pass runs and finds the difference, within tolerance
    y = x.clone()
    y[1] = torch.nextafter(y[1], torch.tensor(0.0))
    out = _compare(x, y)
    assert out.mismatches == 0 and out.max_abs_error == pytest.approx(1.1920929e-07, rel=1e-6)


def test_identical_tensors_with_inf_or_nan_still_diverge():
    x = torch.tensor([0.25, float("inf"), 3.0, float("nan")], dtype=torch.float32)
    out = _compare(x, x.clone())
    assert (out.mismatches, out.bad_samples, out.max_abs_error) == (2, 2, float("inf"))
    assert [(d.sample_id, d.token_offset) for d in out.divergences] == [("s-0", 1), ("s-1", 1)]


def test_report_numbers_are_the_shortest_float32_form_positional_when_exact():
    from replay_lib.judge.report import fmt_value

    cases = [(-5.5, "-5.5"), (1.0, "1.0"), (10.0, "10.0"), (100.0, "100.0"), (20000.0, "20000.0"),
             (0.8974426, "0.8974426"), (4.3928623e-05, "4.3928623e-05"), (0.0001, "0.0001"),
             (123456792.0, "1.2345679e+08"),  # positional would print 123456790.0: digits it does not have
             (1e15, "1e+15"), (3.4028234663852886e38, "3.4028235e+38"), (float("nan"), "nan"),
             (float("-inf"), "-inf"), (7, "7"), (None, "nan")]
    assert [fmt_value(x) for x, _ in cases] == [text for _, text in cases]
