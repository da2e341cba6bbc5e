"""The off-policy correction's keep masks (``is_keep``, SPEC §4.4): hand-derived decisions and losses, the schema's
one-line errors, the edge hazard."""

from __future__ import annotations

import math

import pytest
import torch

from replay_lib.bundle.is_keep import parse_is_keep
from replay_lib.bundle.loss_knobs import LossKnobs
from replay_lib.kernels.is_keep import edge_samples, sample_keep, token_keep
from replay_lib.kernels.loss import policy_loss_fields

F64 = torch.float64
# two samples of 3 tokens; old − rollout per token: sample 0 [0.1, 0.5, −0.1], sample 1 [0.0, 0.02, 0.04]
OLD = torch.tensor([-1.0, -1.0, -1.0, -2.0, -2.0, -2.0], dtype=F64)
DELTA = torch.tensor([0.1, 0.5, -0.1, 0.0, 0.02, 0.04], dtype=F64)
ROLL = OLD - DELTA
LENGTHS = torch.tensor([3, 3])
MASK = torch.ones(6, dtype=F64)


def test_token_mask_keeps_low_le_ratio_le_high():
    # exp(0.5) = 1.65 > 1.5: the second token dropped; exp(±0.1) inside [0.5, 1.5]
    keep = token_keep(OLD, ROLL, parse_is_keep({"token": [0.5, 1.5]}), F64)
    assert keep.tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]


def test_sequence_masks_over_the_tokens_the_token_mask_kept():
    # geometric over the kept tokens: sample 0 (0.1 − 0.1)/2 = 0 → exp 1 (kept); sample 1 0.06/3 = 0.02 →
    # exp(0.02) = 1.0202 > 1.01 (dropped). Without the token mask sample 0's mean is 0.5/3 → 1.18 (dropped).
    spec = parse_is_keep({"token": [0.5, 1.5], "geometric": [0.99, 1.01]})
    got = sample_keep(OLD, ROLL, MASK, LENGTHS, spec, F64)
    assert got["is_keep_sample"].tolist() == [1.0, 0.0]
    assert got["is_keep_count"].tolist() == [2.0, 3.0]
    assert got["is_keep_stat"].tolist() == pytest.approx([0.0, 0.02], abs=1e-15)
    alone = sample_keep(OLD, ROLL, MASK, LENGTHS, parse_is_keep({"geometric": [0.99, 1.01]}), F64)
    assert alone["is_keep_sample"].tolist() == [0.0, 0.0]
    # product: Σ = 0.5 and 0.06 → exp 1.65 and 1.06, in [0.5, 2]
    product = sample_keep(OLD, ROLL, MASK, LENGTHS, parse_is_keep({"product": [0.5, 2.0]}), F64)
    assert product["is_keep_sample"].tolist() == [1.0, 1.0]


def test_outlier_drops_the_sample_with_any_token_out_of_bounds():
    got = sample_keep(OLD, ROLL, MASK, LENGTHS, parse_is_keep({"outlier": [None, 1.5]}), F64)
    assert got["is_keep_sample"].tolist() == [0.0, 1.0]
    # a masked token out of bounds does not count (opc.py:121)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0], dtype=F64)
    assert sample_keep(OLD, ROLL, mask, LENGTHS, parse_is_keep({"outlier": [None, 1.5]}), F64)[
        "is_keep_sample"].tolist() == [1.0, 1.0]


def test_the_loss_weighs_the_terms_but_keeps_the_normalizer_and_the_clip_metric():
    """token_mean over 6 tokens: ratio 1 (log_probs = old), A = 1 per token: pg = −1 per token; the token mask
    drops one term → pg_loss = −5/6 (not −5/5), pg_clipfrac 0 either way."""
    adv = torch.ones(6, dtype=F64)
    knobs = LossKnobs(loss_agg_mode="token_mean", metric_agg_mode="token_mean", loss_token_count=6,
                      is_keep=parse_is_keep({"token": [0.5, 1.5]}))
    out = policy_loss_fields(OLD, OLD, adv, None, MASK, LENGTHS, eps_clip=0.2, eps_clip_high=0.2, entropy_coef=0.0,
                             dtype=F64, knobs=knobs, rollout_log_probs=ROLL)
    assert float(out["pg_loss"]) == pytest.approx(-5.0 / 6.0, rel=1e-15)
    assert float(out["pg_clipfrac"]) == 0.0
    knobs = LossKnobs(loss_agg_mode="token_mean", loss_token_count=6,
                      is_keep=parse_is_keep({"outlier": [None, 1.5], "product": [0.5, 2.0]}))
    out = policy_loss_fields(OLD, OLD, adv, None, MASK, LENGTHS, eps_clip=0.2, eps_clip_high=0.2, entropy_coef=0.0,
                             dtype=F64, knobs=knobs, rollout_log_probs=ROLL)
    assert float(out["pg_loss"]) == pytest.approx(-3.0 / 6.0, rel=1e-15)


@pytest.mark.parametrize("value, message", [
    ({"harmonic": [0.5, 2.0]}, "is_keep: expected keys among outlier, token, binary_kl, tv, geometric, product; unknown key "
                               "'harmonic'"),
    ({"token": [0.5, None]}, "is_keep.token: expected positive finite bounds, got [0.5, None]"),
    ({"outlier": [None, None]}, "is_keep.outlier: expected at least one bound, got [None, None]"),
    ({"product": [3.0, 2.0]}, "is_keep.product: low 3.0 is above high 2.0"),
    ({"geometric": [0.9, 1.1], "product": [0.5, 2.0]}, "is_keep: expected one sequence mask (geometric or product), "
                                                       "got both"),
    ({"token": [0.5, math.inf]}, "is_keep.token: expected positive finite bounds, got [0.5, inf]"),
    ({"tv": [-0.1, 0.2]}, "is_keep.tv: expected finite bounds >= 0 (null for none), got [-0.1, 0.2]"),
    ({"binary_kl": [None, None]}, "is_keep.binary_kl: expected at least one bound, got [None, None]"),
])
def test_invalid_is_keep_is_one_line(value, message):
    with pytest.raises(ValueError) as err:
        parse_is_keep(value)
    assert str(err.value) == message


def test_a_config_with_invalid_is_keep_is_a_one_line_schema_error():
    import msgspec

    from replay_lib.bundle.schema import RecomputeConfig

    good = msgspec.json.decode(msgspec.json.encode({"is_keep": {"token": [0.5, 2]}}), type=RecomputeConfig)
    assert LossKnobs.of(good).is_keep == (("token", 0.5, 2.0),)
    with pytest.raises(msgspec.ValidationError) as err:
        msgspec.json.decode(b'{"is_keep": {"token": [2.0, 0.5]}}', type=RecomputeConfig)
    assert str(err.value) == "is_keep.token: low 2.0 is above high 0.5"


def test_a_decision_at_its_edge_is_a_hazard():
    # sample 1's geometric mean 0.02 against a high bound of exp(0.02): within rounding
    spec = parse_is_keep({"geometric": [0.5, math.exp(0.02)]})
    seg = torch.tensor([0, 0, 0, 1, 1, 1])
    assert edge_samples(OLD, ROLL, MASK, LENGTHS, spec, 2.0 ** -24, seg) == [(1, "its geometric sequence mask "
                                                                                  "decision")]
    spec = parse_is_keep({"token": [0.5, math.exp(0.5)]})
    assert edge_samples(OLD, ROLL, MASK, LENGTHS, spec, 2.0 ** -24, seg) == [(0, "a token's token mask decision")]
    assert edge_samples(OLD, ROLL, MASK, LENGTHS, parse_is_keep({"token": [0.5, 1.5]}), 2.0 ** -24, seg) == []


def test_validate_names_the_rollout_log_probs_is_keep_and_dppo_mu_need():
    import msgspec

    from replay_lib.bundle.schema import RecomputeConfig
    from replay_lib.stages.loss import knob_payloads

    keep = msgspec.json.decode(b'{"is_keep": {"geometric": [0.9, 1.1]}}', type=RecomputeConfig)
    assert knob_payloads(keep) == [("is_keep", "rollout_log_probs")]
    dppo = msgspec.json.decode(b'{"policy_loss": "dppo_mu"}', type=RecomputeConfig)
    assert knob_payloads(dppo) == [("policy_loss_params.anchor", "rollout_log_probs")]


def test_the_divergence_gates_keep_a_token_by_its_sampled_token_divergence():
    """binary_kl / tv (OpenRLHF loss.py:224-239): p = exp(rollout), q = exp(old), each clamped to [1e-6, 1 − 1e-6];
    a token is kept where low ≤ stat ≤ high. Two tokens by hand: p = 0.5, q = 0.25 (tv 0.25, binary KL
    0.5·ln 2 + 0.5·ln(2/3)) and p = q = 0.5 (both 0)."""
    import torch

    from replay_lib.kernels.is_keep import divergence, token_keep

    roll = torch.tensor([math.log(0.5), math.log(0.5)], dtype=F64)
    old = torch.tensor([math.log(0.25), math.log(0.5)], dtype=F64)
    assert divergence(old, roll, "tv", F64).tolist() == pytest.approx([0.25, 0.0], abs=1e-15)
    bkl = 0.5 * math.log(2.0) + 0.5 * math.log(0.5 / 0.75)
    assert divergence(old, roll, "binary_kl", F64).tolist() == pytest.approx([bkl, 0.0], abs=1e-15)
    assert token_keep(old, roll, parse_is_keep({"tv": [0.0, 0.2]}), F64).tolist() == [0.0, 1.0]
    assert token_keep(old, roll, parse_is_keep({"binary_kl": [0.0, 0.2]}), F64).tolist() == [1.0, 1.0]
    assert token_keep(old, roll, parse_is_keep({"binary_kl": [0.0, 0.05]}), F64).tolist() == [0.0, 1.0]
    # a probability rounded to 1 in bfloat16 (1 − 1e-6 is 1 there): the binary KL is NaN and the token dropped
    near_one = torch.tensor([-1e-4], dtype=F64)
    assert token_keep(near_one, near_one, parse_is_keep({"binary_kl": [0.0, 0.05]}), F64,
                      stat_dtype=torch.bfloat16).tolist() == [0.0]
    assert token_keep(near_one, near_one, parse_is_keep({"binary_kl": [0.0, 0.05]}), F64).tolist() == [1.0]
