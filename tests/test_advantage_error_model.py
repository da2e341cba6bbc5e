"""The error model's bounds for the advantage-side formulas (SPEC §5.1, §4.2), at sizes where float32 rounding
matters: an independent float32 producer (``tests/producers/advantage.py``: NumPy, per-token backward loops,
pairwise sums) replays clean on long responses with per-token KL rewards, GAE and whitening, while a bug whose
signal is a small fraction of the values still fails; ``--exact`` compares the kernels' float32 bitwise and
``--chain`` consumes the recomputed rewards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from producers import advantage as producer
from replay_lib.judge.error_model import Rules, recursion_bound, whiten_bound, U32
from replay_lib.kernels import (discounted_returns, group_normalize, token_rewards,
                                whiten)
from replay_lib.judge.report import report_to_text
from replay_lib.run.runner import replay

F64 = torch.float64


def long_inputs(samples=16, length=2048, seed=1):
    gen = np.random.default_rng(seed)
    lengths = [length - int(gen.integers(0, 64)) for _ in range(samples)]
    total = sum(lengths)
    raw = gen.integers(0, 5, size=samples) / 4
    groups = [i // 4 for i in range(samples)]
    masks = [[1] * n for n in lengths]
    old = (-gen.random(total) * 2).astype(np.float32)
    # a nearly constant KL: the long sums where a sequential float32 evaluation drifts like L·u
    ref = (old - 0.01 - gen.normal(0, 1e-4, total)).astype(np.float32)
    kl = (old - ref).astype(np.float32)
    values = gen.normal(0.5, 0.1, total).astype(np.float32)
    return dict(raw=raw, groups=groups, lengths=lengths, masks=masks, old=old, ref=ref, kl=kl, values=values)


def write(tmp_path, name, inp, rewards, adv, returns=None, **config):
    return producer.write(tmp_path / name, raw=inp["raw"], groups=inp["groups"], lengths=inp["lengths"],
                          masks=inp["masks"], rewards=rewards, advantages=adv, returns_=returns, kl=inp["kl"],
                          values=inp["values"] if returns is not None else None, old_log_probs=inp["old"],
                          ref_log_probs=inp["ref"], grpo_std_normalization=True, n_samples_per_prompt=4, **config)


def test_long_kl_returns_from_a_float32_producer_pass_and_a_one_percent_kl_coef_bug_fails(tmp_path):
    inp = long_inputs()
    rewards = producer.group_post_process(inp["raw"], inp["groups"], std=True)
    config = dict(kl_in_reward="token_returns", kl_coef=0.05, gamma=1.0)
    adv = producer.returns(producer.per_token_rewards(rewards, inp["masks"], inp["lengths"], inp["kl"], 0.05), 1.0)
    clean = replay(write(tmp_path, "clean", inp, rewards, adv, **config))
    assert clean.passed, report_to_text(clean)
    # the float32 producer's own drift is real (a sequential sum of ~2,000 KL terms), and inside the bound
    truth = discounted_returns(token_rewards(torch.tensor(rewards, dtype=F64), torch.ones(adv.size),
                                             torch.tensor(inp["lengths"]), torch.tensor(inp["kl"], dtype=F64), 0.05,
                                             dtype=F64), torch.tensor(inp["lengths"]), 1.0, dtype=F64)
    assert float((torch.tensor(adv, dtype=F64) - truth).abs().max()) > 1e-7
    bad_adv = producer.returns(producer.per_token_rewards(rewards, inp["masks"], inp["lengths"], inp["kl"], 0.0505),
                               1.0)
    bad = replay(write(tmp_path, "bad", inp, rewards, bad_adv, **config))
    assert bad.first_divergent_stage == "advantage.estimate", report_to_text(bad)


def test_long_whitened_gae_from_a_float32_producer_passes_and_a_lambda_bug_fails(tmp_path):
    inp = long_inputs(samples=8, length=1024)
    rewards = np.asarray(inp["raw"], dtype=np.float32)
    rows = producer.per_token_rewards(rewards, inp["masks"], inp["lengths"], inp["kl"], 0.02)
    config = dict(advantage_estimator="gae", gamma=0.999, lam=0.95, kl_in_reward="token_returns", kl_coef=0.02,
                  normalize_advantages=True)
    adv, returns = producer.gae(rows, inp["values"], inp["masks"], inp["lengths"], 0.999, 0.95)
    white, _, _ = producer.whiten(adv, inp["masks"])
    clean = replay(write(tmp_path, "clean", inp, rewards, white, returns, **config))
    assert clean.passed, report_to_text(clean)
    adv_bug, ret_bug = producer.gae(rows, inp["values"], inp["masks"], inp["lengths"], 0.999, 0.96)
    white_bug, _, _ = producer.whiten(adv_bug, inp["masks"])
    bad = replay(write(tmp_path, "bad", inp, rewards, white_bug, ret_bug, **config))
    assert bad.first_divergent_stage == "advantage.estimate", report_to_text(bad)
    fields = {d.field for d in bad.stage("advantage.estimate").divergences}
    assert fields == {"advantage"} or fields == {"advantage", "returns"}


def test_recursion_bound_hand_derived():
    # T = [1.0, 2.0], T32 off by 1e-7 at the first token, cond = [3, 2]: 8·2⁻²⁴·cond + 3·|T32 − T|
    got = recursion_bound(torch.tensor([1.0, 2.0], dtype=F64), torch.tensor([1.0 + 1e-7, 2.0], dtype=F64),
                          torch.tensor([3.0, 2.0], dtype=F64), U32)
    assert got.tolist() == pytest.approx([8 * U32 * 3 + 3e-7, 8 * U32 * 2], rel=1e-9)


def test_whiten_bound_hand_derived():
    # A = [1, 3] (N = 2 loss tokens), ρ = [0, 0], μ = 2, σ = √2, A' = [−1/√2, 1/√2]:
    # Δμ = 2·u·√2·(1 + 3)/2 = 4√2·u; Δσ/σ = u·√2; bound = Δμ/σ + |A'|·(√2·u + 2u) = 4u + (1/√2)(√2 + 2)u
    a = torch.tensor([1.0, 3.0], dtype=F64)
    w = (a - 2) / 2 ** 0.5
    got = whiten_bound(a, torch.zeros(2, dtype=F64), torch.ones(2), w, 2.0, 2 ** 0.5, recorded=False)
    want = 4 * U32 + (1 / 2 ** 0.5) * (2 ** 0.5 + 2) * U32
    assert got.tolist() == pytest.approx([want, want], rel=1e-12)
    # recorded statistics: only the advantages' own bound and the final roundings remain
    got = whiten_bound(a, torch.tensor([1e-6, 0.0], dtype=F64), torch.ones(2), w, 2.0, 2 ** 0.5, recorded=True)
    assert got.tolist() == pytest.approx([1e-6 / 2 ** 0.5 + 2 * U32 / 2 ** 0.5, 2 * U32 / 2 ** 0.5], rel=1e-12)


def kernel_bundle(tmp_path, name, inp, **config):
    """A bundle whose expected values are the kernels' own float32 (what --exact reproduces bit for bit)."""
    lengths = torch.tensor(inp["lengths"])
    mask = torch.ones(int(lengths.sum()))
    rewards = group_normalize(torch.tensor(inp["raw"]), torch.tensor(inp["groups"]), True)
    per_token = token_rewards(rewards, mask, lengths, torch.tensor(inp["kl"]), config["kl_coef"])
    adv = whiten(discounted_returns(per_token, lengths, config["gamma"]), mask)
    return write(tmp_path, name, inp, rewards.numpy(), adv.numpy(), **config)


def test_exact_mode_recomputes_the_kernels_float32_bitwise(tmp_path):
    inp = long_inputs(samples=8, length=64)
    config = dict(normalize_advantages=True, gamma=0.9, kl_in_reward="token_returns", kl_coef=0.05)
    path = kernel_bundle(tmp_path, "b", inp, **config)
    assert replay(path, rules=Rules(exact=True)).passed
    assert replay(path).passed  # and within the float64 replay's bound
    # one ulp off at one token: a divergence under --exact, noise for the error model
    from replay_lib.bundle import BundleReader
    adv = BundleReader(path).payload("advantages").clone()
    adv[5] = torch.nextafter(adv[5], torch.tensor(float("inf")))
    nudged = write(tmp_path, "nudged", inp, group_normalize(torch.tensor(inp["raw"]), torch.tensor(inp["groups"]),
                                                            True).numpy(), adv.numpy(), **config)
    exact = replay(nudged, rules=Rules(exact=True))
    assert exact.first_divergent_stage == "advantage.estimate" and exact.stage("advantage.estimate").mismatches == 1
    assert replay(nudged).passed


def test_chain_consumes_the_recomputed_rewards_with_their_bound(tmp_path):
    inp = long_inputs(samples=8, length=64)
    rewards = producer.group_post_process(inp["raw"], inp["groups"], std=True)
    adv = producer.returns(producer.per_token_rewards(rewards, inp["masks"], inp["lengths"], inp["kl"], 0.05), 0.95)
    white, _, _ = producer.whiten(adv, inp["masks"])
    path = write(tmp_path, "b", inp, rewards, white, normalize_advantages=True, gamma=0.95,
                 kl_in_reward="token_returns", kl_coef=0.05)
    report = replay(path, rules=Rules(chain=True))
    assert report.passed and report.mode == "chained", report_to_text(report)


def test_low_var_kl_clamp_hazard_is_found_beside_a_nan_log_ratio(tmp_path):
    # the hazard pass skips a chunk whose smallest and largest r are inside the candidate window; a NaN makes both
    # NaN, and the chunk is then tested token by token: the k3 beyond the clamp at r = 11.5 (sample 2) is found
    # beside the NaN r of sample 0, and a chunk of ordinary r (the second bundle) has no hazard
    lengths = [3, 2, 4]
    r = np.array([0.1, np.nan, -0.2, 0.3, 0.0, 1.0, 11.5, -1.0, 0.5], dtype=np.float32)
    ref = np.full(9, -1.0, dtype=np.float32)
    for name, values, want in (("nan", r, {"s-2"}), ("inside", np.where(np.isnan(r) | (r > 11), 0.25, r), set())):
        values = values.astype(np.float32)
        old = (ref + values).astype(np.float32)
        exact = old.astype(np.float64) - ref.astype(np.float64)
        kl = np.clip(np.exp(-exact) - 1 + exact, -10, 10).astype(np.float32)
        path = producer.write(tmp_path / name, raw=np.zeros(3), groups=[0, 1, 2], lengths=lengths, rewards=np.zeros(3),
                              advantages=np.zeros(9), kl=kl, old_log_probs=old, ref_log_probs=ref, kl_coef=0.05,
                              kl_loss_type="low_var_kl")
        report = replay(path)
        assert {h.sample_id for h in report.hazards if h.kind == "kl_clamp"} == want, report_to_text(report)


@pytest.mark.parametrize("samples", [6, 40000], ids=["one-pass", "chunked"])
def test_low_var_kl_clamp_hazards_match_a_float64_reference_on_every_token(tmp_path, samples):
    # advantage.kl's hazard: tokens whose k3 = exp(−r) − 1 + r (r = old − ref) lies beyond low_var_kl's ±10
    # clamp. k3 = 10 at r = −2.61087 and r = 10.99998: log-ratios a hair inside and outside both roots, far out,
    # and ordinary ones, on short samples; the hazard's counts per sample against NumPy float64 on every token.
    # 40,000 samples take the chunked pass (more tokens than KEEP_COLUMNS).
    gen = np.random.default_rng(7)
    edges = np.array([-2.6110, -2.6108, -2.6105, 10.9999, 11.0001, 11.5, -30.0, 40.0, -2.5, 10.8], dtype=np.float32)
    lengths = [int(gen.integers(1, 12)) for _ in range(samples)]
    total = sum(lengths)
    r = (gen.normal(0, 1.5, total)).astype(np.float32)
    where = gen.choice(total, size=min(total, 400), replace=False)
    r[where] = edges[np.arange(where.size) % edges.size]
    ref = (-gen.random(total) * 2).astype(np.float32)
    old = (ref + r).astype(np.float32)
    exact = old.astype(np.float64) - ref.astype(np.float64)
    k3 = np.exp(-exact) - 1 + exact
    kl = np.clip(k3, -10, 10).astype(np.float32)
    seg = np.repeat(np.arange(samples), lengths)
    want = np.bincount(seg[np.abs(k3) > 10], minlength=samples)
    assert 0 < want.sum() < total  # hits and misses (the edge values sit on both sides of both roots)
    path = producer.write(tmp_path / "kl", raw=np.zeros(samples), groups=list(range(samples)), lengths=lengths,
                          rewards=np.zeros(samples), advantages=np.zeros(total), kl=kl, old_log_probs=old,
                          ref_log_probs=ref, kl_coef=0.05, kl_loss_type="low_var_kl")
    report = replay(path, max_divergences=10**6)
    found = {h.sample_id: int(h.message.split(": ", 1)[1].split(" ", 1)[0])
             for h in report.hazards if h.kind == "kl_clamp"}
    assert found == {f"s-{i}": int(n) for i, n in enumerate(want) if n}
    assert report.stage("advantage.kl").status == "pass", report_to_text(report)
