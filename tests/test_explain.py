"""Explanations (SPEC §10, ``replay_lib.explain``): one bundle per hypothesis with exactly that bug, and no
explanation for a clean bundle or an unrelated bug.

Every bundle comes from the independent producers of ``tests/producers`` (the ``float64`` family: float64
arithmetic, each output rounded once to float32), written with the real :class:`BundleWriter` and replayed
through the runner. A producer bug of ``producers.bugs`` is used where there is one; the other bugs are applied
here, with the formulas written out in NumPy below (never ``replay_lib.kernels``): the recorded value of the
buggy stage is replaced, and the bundle declares the stages up to that one, so that exactly one stage is wrong.

Expected counts, by hand: ``SIZE`` is 16 samples in groups of 4 with responses of 48–64 tokens; seed 1 draws
901 response tokens in all (``TOKENS``, read off the producer's inputs), so a per-sample stage is judged on 16
samples, a per-token one on 901 tokens, and the loss scalars are the 5 reported fields.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

import msgspec
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from producers import Config, Size, bug_config, produce_parts, write_parts  # noqa: E402
from replay_lib.explain.reward import consumer_batches  # noqa: E402
from replay_lib.judge.report import explanation_line  # noqa: E402
from replay_lib.run.runner import replay  # noqa: E402
from replay_lib.bundle.schema import StageId, stage_contracts  # noqa: E402
from replay_lib.bundle.selection import Selection  # noqa: E402
from replay_lib.stages import StageContext  # noqa: E402
from replay_lib.bundle import open_bundle  # noqa: E402

SIZE = Size(16, 64, 4)
SEED = 1
FAMILY = "float64"
ROLLOUT = (StageId.SAMPLE, StageId.REWARD_RAW, StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_KL,
           StageId.ADVANTAGE_ESTIMATE)
STEP = ROLLOUT + (StageId.LOSS_POLICY,)


def _parts(config: Config = Config(), bug: Optional[str] = None, per_sample: bool = False, name: str = "b"):
    return produce_parts(FAMILY, SEED, SIZE, config, bug=bug, per_sample=per_sample, bundle_id=name)


TOKENS = int(_parts().inputs.lengths.sum())


def test_the_step_has_901_tokens():
    assert TOKENS == 901


# ------------------------------------------------------------------------------ NumPy references


def normalize(raw: np.ndarray, labels: np.ndarray, std: bool, eps: float = 1e-6, ddof: int = 1) -> np.ndarray:
    """GRPO normalization over the sets ``labels``: r − mean, / (std + eps) with std of ``ddof``."""
    out = np.empty_like(raw)
    for k in np.unique(labels):
        at = labels == k
        r = raw[at]
        g = r - r.mean()
        out[at] = g / (r.std(ddof=ddof) + eps) if std else g
    return out


def approx_kl(a: np.ndarray, b: np.ndarray, kl_type: str) -> np.ndarray:
    r = a.astype(np.float64) - b.astype(np.float64)
    if kl_type == "k1":
        return r
    if kl_type == "k2":
        return r * r / 2
    k3 = np.exp(-r) - 1 + r
    return np.clip(k3, -10, 10) if kl_type == "low_var_kl" else k3


def loss_fields(inputs, adv: np.ndarray, *, eps_clip: float = 0.2, eps_clip_high: float = 0.28,
                dual_c: Optional[float] = None, mask: Optional[np.ndarray] = None, stale: bool = False,
                agg: str = "sum_of_sample_means", entropy_coef: float = 0.0) -> dict[str, float]:
    """SPEC §4 loss.policy fields in float64: the clipped surrogate (dual-clip: min with −c·A where A < 0),
    per-sample masked sums, aggregated with ``agg``'s weights (SPEC §4.2)."""
    old = inputs.old_log_probs.astype(np.float64)
    logp = old if stale else inputs.log_probs.astype(np.float64)
    m = (inputs.mask if mask is None else mask).astype(np.float64)
    a = adv.astype(np.float64)
    ppo_kl = old - logp
    ratio = np.exp(-ppo_kl)
    l1, l2 = -ratio * a, -np.clip(ratio, 1 - eps_clip, 1 + eps_clip_high) * a
    pg = np.maximum(l1, l2)
    if dual_c is not None:
        pg = np.where(a < 0, np.minimum(pg, -dual_c * a), pg)
    clip = (l2 > l1).astype(np.float64)
    seg = np.repeat(np.arange(inputs.lengths.size), inputs.lengths)
    sums = {k: np.bincount(seg, v * m, minlength=inputs.lengths.size)
            for k, v in (("pg", pg), ("clip", clip), ("kl", ppo_kl), ("ent", inputs.entropy.astype(np.float64)))}
    n = np.bincount(seg, m, minlength=inputs.lengths.size)
    w = {"sum_of_sample_means": 1 / np.maximum(n, 1), "token_mean": np.full(n.size, 1 / n.sum()),
         "seq_mean_token_mean": 1 / (n.size * np.maximum(n, 1)), "seq_mean_token_sum": np.full(n.size, 1 / n.size),
         "seq_mean_token_sum_norm": np.full(n.size, 1 / (n.size * inputs.lengths.max()))}[agg]
    out = {k: float((w * sums[s]).sum()) for k, s in (("pg_loss", "pg"), ("entropy_loss", "ent"),
                                                     ("pg_clipfrac", "clip"), ("ppo_kl", "kl"))}
    out["loss"] = out["pg_loss"] - entropy_coef * out["entropy_loss"]
    return out


def f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float64)


# ------------------------------------------------------------------------------ bundles


def write(tmp_path: Path, parts, stages=STEP, *, rewards: Optional[np.ndarray] = None,
          kl: Optional[np.ndarray] = None, advantages: Optional[np.ndarray] = None,
          loss: Optional[dict] = None, consumer_batch_ids: Optional[list[str]] = None) -> Path:
    """``parts`` with the recorded values of one stage replaced, declaring ``stages``."""
    lengths = parts.inputs.lengths
    if rewards is not None:  # recorded in float32, as a float32 producer writes them; advantages follow them
        rec = f32(rewards)
        parts.expected["reward.post_process"] = {"rewards": rec.tolist()}
        samples = [msgspec.structs.replace(s, reward=float(r)) for s, r in zip(parts.index.samples, rec)]
        parts.index = msgspec.structs.replace(parts.index, samples=samples)
        parts.payloads["advantages"] = torch.from_numpy(np.repeat(rec, lengths).astype(np.float32))
    if kl is not None:
        parts.payloads["kl"] = torch.from_numpy(kl.astype(np.float32))
    if advantages is not None:
        parts.payloads["advantages"] = torch.from_numpy(advantages.astype(np.float32))
    if loss is not None:
        parts.expected["loss.policy"] = loss
    if consumer_batch_ids is not None:
        identity = msgspec.structs.replace(parts.index.identity, consumer_batch_ids=consumer_batch_ids)
        parts.index = msgspec.structs.replace(parts.index, identity=identity)
    if StageId.LOSS_POLICY not in stages:
        parts.expected.pop("loss.policy", None)
    parts.manifest = msgspec.structs.replace(parts.manifest, stage_contracts=stage_contracts(stages))
    return write_parts(parts, tmp_path / parts.index.bundle_id)


def explained(path: Path, **kw) -> list[tuple]:
    report = replay(path, **kw)
    return [(e.stage, e.hypothesis, e.matched, e.of, e.unit) for e in report.explanations]


def first_stage(path: Path) -> Optional[str]:
    return replay(path).first_divergent_stage


# ------------------------------------------------------------------------------ reward.post_process

RAW = _parts().inputs.raw_rewards  # binary rewards, groups of 4 (Config's default: std normalization on)
GROUPS = np.arange(16) // 4


def test_consumer_batches(tmp_path):
    """Three consumer batches for 16 samples: ⌈16/3⌉ = 6 each, the last 4 — (0–5, 6–11, 12–15), normalized
    with std as declared. (The same sets as chunks of 6, which are then not listed again.)"""
    rewards = normalize(RAW, np.arange(16) // 6, std=True)
    path = write(tmp_path, _parts(), ROLLOUT, rewards=rewards, consumer_batch_ids=["cb-0", "cb-1", "cb-2"])
    report = replay(path)
    assert report.first_divergent_stage == "reward.post_process"
    assert [(e.stage, e.hypothesis, e.matched, e.of, e.unit) for e in report.explanations] == [
        ("reward.post_process", "reward.consumer_batches", 16, 16, "samples")]
    assert report.explanations[0].detail == ("the recorded rewards equal group normalization over consumer batches "
                                             "cb-0, cb-1, cb-2 (not semantic groups)")


def test_consumer_batches_of_a_size_that_does_not_divide_the_samples(tmp_path):
    """Three consumer batches for 16 samples of 7 each, the last 2 (0–6, 7–13, 14–15): the even split (6, 6, 4) is
    not the only placement of three batches, and a trainer's --consumer-batch rarely divides its rollout. (7 is
    no chunk size tried otherwise: a group is 4.)"""
    rewards = normalize(RAW, np.arange(16) // 7, std=True)
    path = write(tmp_path, _parts(), ROLLOUT, rewards=rewards, consumer_batch_ids=["cb-0", "cb-1", "cb-2"])
    report = replay(path)
    assert [(e.hypothesis, e.matched, e.of) for e in report.explanations] == [
        ("reward.consumer_batches_of_7", 16, 16)]
    assert report.explanations[0].detail == ("the recorded rewards equal group normalization over consumer batches "
                                             "cb-0, cb-1, cb-2 of 7 samples (the last of 2) (not semantic groups)")


def test_micro_batches(tmp_path):
    """The family's micro-batches hold 8 samples each (mb-0000: 0–7, mb-0001: 8–15): two groups each."""
    path = write(tmp_path, _parts(), ROLLOUT, rewards=normalize(RAW, np.arange(16) // 8, std=True))
    assert explained(path) == [("reward.post_process", "reward.micro_batches", 16, 16, "samples")]


def test_whole_batch(tmp_path):
    """slime#2230: one mean (and std) over all 16 samples."""
    path = write(tmp_path, _parts(), ROLLOUT, rewards=normalize(RAW, np.zeros(16), std=True))
    assert explained(path) == [("reward.post_process", "reward.whole_batch", 16, 16, "samples")]


def test_whole_batch_under_a_selection(tmp_path):
    """--sample s-5 expands to its group g-1 (s-4 … s-7); the hypothesis is still the whole batch's statistics
    (all 16 samples), read at the 4 selected."""
    path = write(tmp_path, _parts(), ROLLOUT, rewards=normalize(RAW, np.zeros(16), std=True))
    assert explained(path, selection=Selection(samples=("s-5",))) == [
        ("reward.post_process", "reward.whole_batch", 4, 4, "samples")]


def test_pr65_chunks_of_one_and_a_half_groups(tmp_path):
    """producers.bugs "pr65": consecutive physical batches of 4 + 4 // 2 = 6 samples (one consumer batch id
    in the identity, so it is the chunk hypothesis that names them)."""
    parts = _parts(bug="pr65")
    path = write(tmp_path, parts, STEP)
    assert explained(path) == [("reward.post_process", "reward.chunks_of_6", 16, 16, "samples")]


def test_biased_std(tmp_path):
    path = write(tmp_path, _parts(bug_config("biased_std", Config()), bug="biased_std"), STEP)
    assert explained(path) == [("reward.post_process", "reward.biased_std", 16, 16, "samples")]


def test_std_switched_off_and_on(tmp_path):
    """Declared std on, recorded without it; and declared off, recorded with it."""
    off = write(tmp_path, _parts(name="off"), ROLLOUT, rewards=normalize(RAW, GROUPS, std=False))
    assert explained(off) == [("reward.post_process", "reward.std_off", 16, 16, "samples")]
    on = write(tmp_path, _parts(Config(std_normalization=False), name="on"), ROLLOUT,
               rewards=normalize(RAW, GROUPS, std=True))
    assert explained(on) == [("reward.post_process", "reward.std_on", 16, 16, "samples")]


def test_other_eps(tmp_path):
    """Rewards of a std ≈ 1e-4 make the eps visible: a group of [0, 0, 0, 2e-4] has std 1e-4; its normalized
    rewards with eps 1e-4 are half those with 1e-6 (1e-4 / (1e-4 + 1e-4) vs 1e-4 / (1e-4 + 1e-6))."""
    raw = RAW.copy()
    raw[0:4] = [0.0, 0.0, 0.0, 2e-4]
    parts = _parts(name="eps")
    parts.inputs.raw_rewards[:] = raw
    parts.expected["reward.raw"] = {"raw_rewards": raw.tolist()}
    parts.index = msgspec.structs.replace(parts.index, samples=[
        msgspec.structs.replace(s, raw_reward=float(r)) for s, r in zip(parts.index.samples, raw)])
    path = write(tmp_path, parts, ROLLOUT, rewards=normalize(raw, GROUPS, std=True, eps=1e-4))
    # only g-0 differs (its 4 samples); the binary groups have std ≥ 0.5, where eps 1e-4 moves a value by
    # ≤ 2e-4 relative — beyond the float32 bound, so they diverge too and the hypothesis matches all 16
    assert explained(path)[0] == ("reward.post_process", "reward.eps_0.0001", 16, 16, "samples")


def test_unnormalized_rewards(tmp_path):
    path = write(tmp_path, _parts(), ROLLOUT, rewards=RAW)
    assert explained(path) == [("reward.post_process", "reward.unnormalized", 16, 16, "samples")]


def leave_one_out(raw: np.ndarray, labels: np.ndarray, skip_zero: bool = True) -> np.ndarray:
    """NeMo-RL's rule (std on): b_i the mean of the group's other rewards, divided by the unbiased std of those
    others (fewer than two others: std 0) + 1e-6; ``skip_zero`` (NeMo-RL's) keeps the centred value where that
    std is 0."""
    out = np.empty_like(raw)
    for i in range(raw.size):
        others = raw[(labels == labels[i]) & (np.arange(raw.size) != i)]
        g = raw[i] - others.mean()
        std = others.std(ddof=1) if others.size >= 2 else 0.0
        out[i] = g if skip_zero and std == 0 else g / (std + 1e-6)
    return out


def _loo_config(parts):
    cfg = msgspec.structs.replace(parts.index.config, group_baseline="leave_one_out", std_zero="skip")
    parts.index = msgspec.structs.replace(parts.index, config=cfg)
    return parts


def test_the_leave_one_out_reference_is_what_the_stage_recomputes(tmp_path):
    path = write(tmp_path, _loo_config(_parts(name="loo")), ROLLOUT, rewards=leave_one_out(RAW, GROUPS))
    report = replay(path)
    assert report.passed and report.explanations == []


def test_the_mean_baseline_where_leave_one_out_is_declared(tmp_path):
    path = write(tmp_path, _loo_config(_parts(name="mean")), ROLLOUT, rewards=normalize(RAW, GROUPS, std=True))
    report = replay(path)
    assert [(e.hypothesis, e.matched, e.of) for e in report.explanations] == [("reward.baseline_mean", 16, 16)]
    assert report.explanations[0].detail == ("the recorded rewards equal group normalization around the group mean "
                                             "(config: leave_one_out baseline)")


def test_the_mean_baseline_in_one_group_only(tmp_path):
    """nemo-loo's case: g-1 normalized with GRPO's group mean and std, the other groups as declared: no
    whole-batch hypothesis fits (12 of 16 samples break it), the one of the divergent group does."""
    rewards = np.where(GROUPS == 1, normalize(RAW, GROUPS, std=True), leave_one_out(RAW, GROUPS))
    assert not np.allclose(rewards[GROUPS == 1], leave_one_out(RAW, GROUPS)[GROUPS == 1])
    path = write(tmp_path, _loo_config(_parts(name="one")), ROLLOUT, rewards=rewards)
    report = replay(path)
    assert [(e.hypothesis, e.matched, e.of) for e in report.explanations] == [
        ("reward.baseline_mean_in_groups", 16, 16)]
    assert report.explanations[0].detail == (
        "the recorded rewards of g-1 equal group normalization around the group mean (config: leave_one_out "
        "baseline; the other groups as declared)")


def test_leave_one_out_where_the_mean_is_declared(tmp_path):
    """The rest of the declared rule kept: a zero std of the others is divided by as eps says (the config's
    std_zero), ±1e6 where a sample's three others are equal."""
    rewards = leave_one_out(RAW, GROUPS, skip_zero=False)
    assert np.abs(rewards).max() > 1e5
    path = write(tmp_path, _parts(name="lo"), ROLLOUT, rewards=rewards)
    assert explained(path) == [("reward.post_process", "reward.baseline_leave_one_out", 16, 16, "samples")]


def test_a_scaled_group_under_leave_one_out_gets_no_baseline_explanation(tmp_path):
    rewards = np.where(GROUPS == 1, 1.5 * leave_one_out(RAW, GROUPS), leave_one_out(RAW, GROUPS))
    report = replay(write(tmp_path, _loo_config(_parts(name="scaled")), ROLLOUT, rewards=rewards))
    assert not report.passed and report.explanations == []


def test_the_nemo_loo_demo_is_explained(tmp_path):
    from replay_lib.demo import write_demo

    report = replay(write_demo("nemo-loo", tmp_path / "nemo"))
    assert [(e.hypothesis, e.matched, e.of) for e in report.explanations] == [
        ("reward.baseline_mean_in_groups", 12, 12)]
    assert report.explanations[0].detail.startswith("the recorded rewards of g-2 equal group normalization around")


# ------------------------------------------------------------------------------ advantage.kl

INPUTS = _parts().inputs


def test_kl_type_swapped(tmp_path):
    """producers.bugs "k1_for_k3": the payload is k1 where the config declares k3."""
    path = write(tmp_path, _parts(bug_config("k1_for_k3", Config()), bug="k1_for_k3"), STEP)
    assert explained(path) == [("advantage.kl", "kl.type_k1", TOKENS, TOKENS, "tokens")]


def test_kl_type_swapped_in_bf16_copies_of_float32_values(tmp_path):
    """The same bug from ``producers.stored_bf16`` (float32 arithmetic, bf16 payloads): the hypothesis's bound
    carries the inputs' storage rounding as the stage's does, so k1 still explains every token."""
    parts = produce_parts("stored_bf16", SEED, SIZE, bug_config("k1_for_k3", Config()), bug="k1_for_k3",
                          bundle_id="stored")
    assert parts.payloads["old_log_probs"].dtype == torch.bfloat16
    path = write(tmp_path, parts, STEP)
    assert explained(path) == [("advantage.kl", "kl.type_k1", TOKENS, TOKENS, "tokens")]


def test_kl_arguments_swapped(tmp_path):
    path = write(tmp_path, _parts(), STEP, kl=approx_kl(INPUTS.ref_log_probs, INPUTS.old_log_probs, "k3"))
    assert first_stage(path) == "advantage.kl"
    assert explained(path) == [("advantage.kl", "kl.arguments_swapped", TOKENS, TOKENS, "tokens")]


def test_kl_of_another_estimator_and_scaled_by_the_coefficient(tmp_path):
    k2 = write(tmp_path, _parts(name="k2"), STEP, kl=approx_kl(INPUTS.old_log_probs, INPUTS.ref_log_probs, "k2"))
    assert explained(k2) == [("advantage.kl", "kl.type_k2", TOKENS, TOKENS, "tokens")]
    # Config's kl_coef is 0.05: the k3 values times 0.05
    scaled = write(tmp_path, _parts(name="scaled"), STEP,
                   kl=0.05 * approx_kl(INPUTS.old_log_probs, INPUTS.ref_log_probs, "k3"))
    assert explained(scaled) == [("advantage.kl", "kl.scaled_by_coef", TOKENS, TOKENS, "tokens")]


def test_kl_of_the_current_log_probs(tmp_path):
    path = write(tmp_path, _parts(), STEP, kl=approx_kl(INPUTS.log_probs, INPUTS.ref_log_probs, "k3"))
    assert explained(path) == [("advantage.kl", "kl.current_log_probs", TOKENS, TOKENS, "tokens")]


# ------------------------------------------------------------------------------ advantage.estimate

RECORDED = f32(_parts().rewards)  # the normalized rewards the producer recorded


def test_sign_flipped_advantages(tmp_path):
    path = write(tmp_path, _parts(bug="sign_flip"), STEP)
    assert explained(path) == [("advantage.estimate", "advantage.sign_flipped", TOKENS, TOKENS, "tokens")]


def test_unnormalized_advantages(tmp_path):
    path = write(tmp_path, _parts(), ROLLOUT, advantages=np.repeat(RAW, INPUTS.lengths))
    assert explained(path) == [("advantage.estimate", "advantage.unnormalized", TOKENS, TOKENS, "tokens")]


def test_advantages_shifted_one_token(tmp_path):
    """A[t − 1] along the packed tokens, 0 at the first: only each sample's first token changes (where the
    previous sample's reward differs), and the hypothesis reproduces every token."""
    adv = np.repeat(RECORDED, INPUTS.lengths)
    shifted = np.r_[0.0, adv[:-1]]
    path = write(tmp_path, _parts(), ROLLOUT, advantages=shifted)
    assert explained(path) == [("advantage.estimate", "advantage.shifted_later", TOKENS, TOKENS, "tokens")]


def test_advantages_shifted_one_token_earlier(tmp_path):
    """A[t + 1], 0 at the last token: each sample's last token holds the next sample's reward."""
    adv = np.repeat(RECORDED, INPUTS.lengths)
    path = write(tmp_path, _parts(), ROLLOUT, advantages=np.r_[adv[1:], 0.0])
    assert explained(path) == [("advantage.estimate", "advantage.shifted_earlier", TOKENS, TOKENS, "tokens")]


def test_advantages_shifted_inside_each_sample(tmp_path):
    adv = np.repeat(RECORDED, INPUTS.lengths)
    starts = np.cumsum(INPUTS.lengths) - INPUTS.lengths
    shifted = np.r_[0.0, adv[:-1]]
    shifted[starts] = 0.0
    path = write(tmp_path, _parts(), ROLLOUT, advantages=shifted)
    assert explained(path) == [("advantage.estimate", "advantage.shifted_later_in_sample", TOKENS, TOKENS,
                                "tokens")]


def test_advantages_permuted_between_samples(tmp_path):
    """s-0 and s-5 swap their rewards (s-0 is in g-0, s-5 in g-1: different values)."""
    assert RECORDED[0] != RECORDED[5]
    perm = np.arange(16)
    perm[[0, 5]] = [5, 0]
    path = write(tmp_path, _parts(), ROLLOUT, advantages=np.repeat(RECORDED[perm], INPUTS.lengths))
    report = replay(path)
    assert [(e.hypothesis, e.matched, e.of) for e in report.explanations] == [("advantage.permuted", TOKENS, TOKENS)]
    assert report.explanations[0].detail == ("the recorded advantages are the normalized rewards permuted between "
                                             "samples (s-0 has s-5's, s-5 has s-0's)")


# ------------------------------------------------------------------------------ loss.policy


def _loss(**kw) -> dict:
    return loss_fields(INPUTS, np.repeat(RECORDED, INPUTS.lengths).astype(np.float32), **kw)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                 "seq_mean_token_sum_norm"])
def test_other_aggregation(tmp_path, agg):
    path = write(tmp_path, _parts(name=agg), STEP, loss=_loss(agg=agg))
    assert explained(path) == [("loss.policy", f"loss.agg_{agg}", 5, 5, "loss fields")]


def test_token_mean_with_per_sample_terms(tmp_path):
    """producers.bugs "token_mean" with the per-sample terms recorded: 16 samples × 5 terms are right, the 5
    scalars are not, and the recorded scalars against the recorded terms' aggregation fail too (when the
    stage has that check): every value matches the token mean."""
    path = write(tmp_path, _parts(bug="token_mean", per_sample=True), STEP)
    [(stage, hypothesis, matched, of, unit)] = explained(path)
    assert (stage, hypothesis, unit) == ("loss.policy", "loss.agg_token_mean", "values")
    assert matched == of and of in (16 * 5 + 5, 16 * 5 + 5 + 5)


def test_clip_bounds(tmp_path):
    """0.2/0.3 where the config declares 0.2/0.28. The inputs' log-ratios stay within ±0.3, so ratios lie in
    [e^−0.3, e^0.3] = [0.741, 1.350]: the upper bounds 1.28 and 1.3 differ on the ratios in (1.28, 1.35], and
    only the lower bound 0.8 binds (0.72 and 0.7 lie below every ratio), so no other pair of {0.2, 0.28, 0.3}
    gives these values."""
    path = write(tmp_path, _parts(name="clip"), STEP, loss=_loss(eps_clip=0.2, eps_clip_high=0.3))
    assert explained(path) == [("loss.policy", "loss.clip_0.2_0.3", 5, 5, "loss fields")]


def test_clip_high_for_both_bounds(tmp_path):
    """producers.bugs "clip_high_both": 0.28 for both bounds. A lower bound of 0.72 or of 0.7 clips no ratio
    ≥ 0.741 (see test_clip_bounds), so 0.28/0.28 and 0.3/0.28 give the same values: both are listed, the
    closer fit first."""
    path = write(tmp_path, _parts(bug="clip_high_both"), STEP)
    assert explained(path) == [("loss.policy", "loss.clip_0.28_0.28", 5, 5, "loss fields"),
                               ("loss.policy", "loss.clip_0.3_0.28", 5, 5, "loss fields")]


def test_dual_clip(tmp_path):
    """Dual-clip c = 3 binds where A < 0 and the surrogate ratio·|A| exceeds 3·|A|: ratio > 3, which never
    happens here (≤ 1.35); so s-2 (A = −1.5) gets logp − old = ln 4 on its tokens (ratio 4, loss capped at 3·|A|)."""
    inputs = _parts().inputs
    adv = np.repeat(RECORDED, inputs.lengths)
    assert RECORDED[2] < 0
    start = int(inputs.lengths[:2].sum())
    logp = inputs.log_probs.copy()
    logp[start:start + inputs.lengths[2]] = inputs.old_log_probs[start:start + inputs.lengths[2]] + np.log(4.0)
    parts = _parts(name="dual")
    parts.payloads["log_probs"] = torch.from_numpy(logp.astype(np.float32))
    inputs.log_probs = logp.astype(np.float32)
    path = write(tmp_path, parts, STEP, loss=loss_fields(inputs, adv.astype(np.float32), dual_c=3.0))
    assert explained(path) == [("loss.policy", "loss.dual_clip_on", 5, 5, "loss fields")]


def test_mask_shifted(tmp_path):
    path = write(tmp_path, _parts(bug="mask_shift"), STEP)
    assert explained(path) == [("loss.policy", "loss.mask_shifted_later", 5, 5, "loss fields")]


def test_mask_shifted_earlier(tmp_path):
    """m'[t] = m[t + 1] inside each sample, 0 at its last token."""
    m = INPUTS.mask
    ends = np.cumsum(INPUTS.lengths)
    shifted = np.r_[m[1:], 0].astype(np.uint8)
    shifted[ends - 1] = 0
    path = write(tmp_path, _parts(name="earlier"), STEP, loss=_loss(mask=shifted))
    assert explained(path) == [("loss.policy", "loss.mask_shifted_earlier", 5, 5, "loss fields")]


def test_response_length_denominator(tmp_path):
    """Σ_i (Σ_t x·mask) / len_i: each per-sample mean taken over the whole response (its masked tokens counted
    in the denominator), the declared clip bounds 0.2/0.28."""
    seg = np.repeat(np.arange(16), INPUTS.lengths)
    old, logp = INPUTS.old_log_probs.astype(np.float64), INPUTS.log_probs.astype(np.float64)
    a = np.repeat(RECORDED, INPUTS.lengths)
    ratio = np.exp(logp - old)
    l1, l2 = -ratio * a, -np.clip(ratio, 0.8, 1.28) * a
    m = INPUTS.mask.astype(np.float64)
    w = 1 / INPUTS.lengths
    loss = {name: float((w * np.bincount(seg, x * m, minlength=16)).sum()) for name, x in (
        ("pg_loss", np.maximum(l1, l2)), ("entropy_loss", INPUTS.entropy.astype(np.float64)),
        ("pg_clipfrac", (l2 > l1).astype(np.float64)), ("ppo_kl", old - logp))}
    loss["loss"] = loss["pg_loss"]  # entropy_coef 0
    path = write(tmp_path, _parts(name="len"), STEP, loss=loss)
    assert explained(path) == [("loss.policy", "loss.agg_response_length", 5, 5, "loss fields")]


def test_negated_advantages_inside_the_loss(tmp_path):
    path = write(tmp_path, _parts(name="neg"), STEP,
                 loss=loss_fields(INPUTS, -np.repeat(RECORDED, INPUTS.lengths).astype(np.float32)))
    assert explained(path) == [("loss.policy", "loss.advantages_negated", 5, 5, "loss fields")]


def test_stale_old_log_probs(tmp_path):
    path = write(tmp_path, _parts(name="stale"), STEP, loss=_loss(stale=True))
    assert explained(path) == [("loss.policy", "loss.stale_old_log_probs", 5, 5, "loss fields")]


def _token_mean_config(parts, tokens: int):
    """``parts`` declaring verl's token mean (loss and metrics) over the recorded ``loss_token_count``."""
    cfg = msgspec.structs.replace(parts.index.config, loss_agg_mode="token_mean", metric_agg_mode="token_mean",
                                  loss_token_count=tokens)
    parts.index = msgspec.structs.replace(parts.index, config=cfg)
    return parts


def micro_batch_token_mean(inputs, adv: np.ndarray, micro: np.ndarray, averaged: bool,
                           with_metrics: bool = False) -> dict[str, float]:
    """The token-mean loss fields of a trainer whose token mean divided each micro-batch's Σ x·mask by that
    micro-batch's own loss tokens, then summed (or averaged) the micro-batches' means — for each loss term it
    aggregates (pg_loss, entropy_loss); its metrics over all the tokens, or (``with_metrics``) per micro-batch
    the same way."""
    out = loss_fields(inputs, adv, agg="token_mean")
    seg = np.repeat(np.arange(inputs.lengths.size), inputs.lengths)
    old, logp = inputs.old_log_probs.astype(np.float64), inputs.log_probs.astype(np.float64)
    a, m = adv.astype(np.float64), inputs.mask.astype(np.float64)
    ratio = np.exp(logp - old)
    n = np.bincount(seg, m, minlength=16)
    l1, l2 = -ratio * a, -np.clip(ratio, 0.8, 1.28) * a
    metrics = (("pg_clipfrac", (l2 > l1).astype(np.float64)), ("ppo_kl", old - logp)) if with_metrics else ()
    for name, x in (("pg_loss", np.maximum(l1, l2)),
                    ("entropy_loss", inputs.entropy.astype(np.float64)), *metrics):
        per_sample = np.bincount(seg, x * m, minlength=16)
        means = [per_sample[micro == k].sum() / n[micro == k].sum() for k in np.unique(micro)]
        out[name] = float(np.mean(means) if averaged else np.sum(means))
    out["loss"] = out["pg_loss"]  # entropy_coef 0
    return out


@pytest.mark.parametrize("averaged", [False, True])
def test_token_mean_per_micro_batch(tmp_path, averaged):
    """The family's micro-batches are samples 0–7 and 8–15; the config declares the token mean over all 901
    tokens' loss tokens. Summed, the two micro-batch means are about twice the step's; averaged, they differ
    from it by how unequal the two micro-batches' token counts are. With the per-sample terms recorded
    (averaged), the 16 × 5 terms are right and only the scalars (5) and their check against the terms (5) fail:
    every value matches."""
    micro = np.arange(16) // 8
    tokens = int(INPUTS.mask.sum())
    parts = _token_mean_config(_parts(name=f"mb-{averaged}", per_sample=averaged), tokens)
    adv = np.repeat(RECORDED, INPUTS.lengths).astype(np.float32)
    loss = {**parts.expected["loss.policy"], **micro_batch_token_mean(INPUTS, adv, micro, averaged)}
    assert ("per_sample" in loss) == averaged
    path = write(tmp_path, parts, STEP, loss=loss)
    report = replay(path)
    assert report.first_divergent_stage == "loss.policy"
    hid = "loss.micro_batch_token_mean" + ("_averaged" if averaged else "")
    expected = (16 * 5 + 5 + 5, "values") if averaged else (5, "loss fields")
    assert [(e.stage, e.hypothesis, e.matched, e.of, e.unit) for e in report.explanations] == [
        ("loss.policy", hid, expected[0], expected[0], expected[1])]
    how = "averaged over the 2 micro-batches" if averaged else "summed over the micro-batches"
    assert report.explanations[0].detail == (
        f"the recorded loss equals a token mean per micro-batch (mb-0000, mb-0001): each one's Σ x·mask over its own "
        f"loss tokens, {how}, instead of over loss_token_count={tokens}")


@pytest.mark.parametrize("averaged", [False, True])
def test_token_mean_per_micro_batch_with_the_loss_weights_recorded(tmp_path, averaged):
    """A producer that records each sample's loss weight (the example trainer's ``loss_weight``, verl's
    1/loss_token_count): under the per-micro-batch bug it is 1/(its micro-batch's loss tokens), halved when the two
    means are averaged, and 16 weights diverge beside the scalars. The hypothesis predicts the weights too: all
    16 × 6 terms, 5 scalars and 5 checks match (it was "no known cause matches" once a producer recorded them)."""
    micro = np.arange(16) // 8
    tokens = int(INPUTS.mask.sum())
    parts = _token_mean_config(_parts(name=f"mbw-{averaged}", per_sample=True), tokens)
    adv = np.repeat(RECORDED, INPUTS.lengths).astype(np.float32)
    loss = {**parts.expected["loss.policy"], **micro_batch_token_mean(INPUTS, adv, micro, averaged)}
    seg = np.repeat(np.arange(16), INPUTS.lengths)
    n = np.bincount(seg, INPUTS.mask.astype(np.float64), minlength=16)
    per_micro = np.array([n[micro == k].sum() for k in range(2)])
    weights = 1.0 / (per_micro[micro] * (2 if averaged else 1))
    loss["per_sample"] = {**loss["per_sample"], "loss_weight": [float(w) for w in weights]}
    report = replay(write(tmp_path, parts, STEP, loss=loss))
    weight = report.stage("loss.policy")
    assert any(d.field == "loss_weight" for d in weight.divergences), weight.divergences
    hid = "loss.micro_batch_token_mean" + ("_averaged" if averaged else "")
    assert [(e.hypothesis, e.matched, e.of) for e in report.explanations] == [(hid, 16 * 6 + 5 + 5, 16 * 6 + 5 + 5)]


def test_another_aggregation_with_the_loss_weights_recorded(tmp_path):
    """The config says sum_of_sample_means, the producer aggregated (and weighted each sample) with the token mean:
    its recorded weights are all 1/Σmask, not 1/n_i, and the token-mean hypothesis predicts them."""
    parts = _parts(name="aggw", per_sample=True)
    adv = np.repeat(RECORDED, INPUTS.lengths).astype(np.float32)
    loss = {**parts.expected["loss.policy"], **loss_fields(INPUTS, adv, agg="token_mean")}
    loss["per_sample"] = {**loss["per_sample"], "loss_weight": [1.0 / float(INPUTS.mask.sum())] * 16}
    report = replay(write(tmp_path, parts, STEP, loss=loss))
    assert report.first_divergent_stage == "loss.policy"
    [e] = report.explanations
    assert (e.hypothesis, e.matched) == ("loss.agg_token_mean", e.of) and e.of >= 16 * 6 + 5


def test_token_mean_per_micro_batch_for_the_metrics_too(tmp_path):
    """The producer's one aggregation took each micro-batch's own count for the metrics as well (verl's agg_loss
    with the micro-batch's denominator): pg_clipfrac and ppo_kl diverge too, and the hypothesis that extends the
    loss-only one to them explains every value; the loss-only one is not reported beside it."""
    micro = np.arange(16) // 8
    tokens = int(INPUTS.mask.sum())
    parts = _token_mean_config(_parts(name="mbm"), tokens)
    adv = np.repeat(RECORDED, INPUTS.lengths).astype(np.float32)
    loss = {**parts.expected["loss.policy"], **micro_batch_token_mean(INPUTS, adv, micro, False, with_metrics=True)}
    report = replay(write(tmp_path, parts, STEP, loss=loss))
    failing = {d.field for d in report.stage("loss.policy").divergences}
    assert report.first_divergent_stage == "loss.policy" and failing, failing
    assert [(e.hypothesis, e.matched, e.of) for e in report.explanations] == [
        ("loss.micro_batch_token_mean_with_metrics", 5, 5)]
    assert report.explanations[0].detail.endswith("(the metrics pg_clipfrac, ppo_kl too)")


@pytest.mark.parametrize("per_sample", [False, True])
def test_another_aggregation_under_a_knob_the_surrogate_variants_do_not_model(tmp_path, per_sample):
    """A log-ratio clamp (20: it never binds on these ratios, so NumPy's plain formula is the producer's) makes
    the configuration one the surrogate variants do not model; the producer aggregated with the token mean where
    the config declares sum_of_sample_means. The re-aggregation of the stage's own sums still names it (it was
    "no known cause matches" under any such knob: a KL term in the loss, TIS, GSPO)."""
    parts = _parts(name=f"agg-clamp-{per_sample}", per_sample=per_sample)
    cfg = msgspec.structs.replace(parts.index.config, log_ratio_clamp=20.0)
    parts.index = msgspec.structs.replace(parts.index, config=cfg)
    adv = np.repeat(RECORDED, INPUTS.lengths).astype(np.float32)
    loss = {**parts.expected["loss.policy"], **loss_fields(INPUTS, adv, agg="token_mean")}
    report = replay(write(tmp_path, parts, STEP, loss=loss))
    assert report.first_divergent_stage == "loss.policy"
    [e] = report.explanations
    assert (e.hypothesis, e.matched) == ("loss.agg_token_mean", e.of)
    assert e.of == (16 * 5 + 5 + 5 if per_sample else 5)
    assert e.detail == "the recorded loss fields equal a token_mean aggregation (config: sum_of_sample_means)"


def test_the_verl_dapo_demo_is_explained(tmp_path):
    """Its trainer took the token mean per micro-batch (× dp) under dual-clip and a log-ratio clamp, knobs the
    surrogate variants do not model: the re-aggregation still applies. 16 samples × 4 recorded terms, 4 checks
    of the scalars against the terms and 6 scalars: 74 values."""
    from replay_lib.demo import write_demo

    report = replay(write_demo("verl-dapo", tmp_path / "dapo"))
    assert [(e.hypothesis, e.matched, e.of) for e in report.explanations] == [
        ("loss.micro_batch_token_mean", 74, 74)]


# ------------------------------------------------------------------------------ no false explanation


@pytest.mark.parametrize("config", [Config(), Config(std_normalization=False, kl_type="k1", entropy_coef=0.01)])
def test_clean_bundles_have_none(tmp_path, config):
    report = replay(write(tmp_path, _parts(config, per_sample=True), STEP))
    assert report.passed and report.explanations == []


def test_unrelated_bugs_get_none(tmp_path):
    """Rewards scaled by 1.5, a KL 0.01 too high everywhere, advantages 0.25 too high, pg_loss 0.5 too high:
    each stage fails and no known cause matches."""
    cases = {
        "scaled": dict(stages=ROLLOUT, rewards=1.5 * RECORDED),
        "kl": dict(stages=STEP, kl=approx_kl(INPUTS.old_log_probs, INPUTS.ref_log_probs, "k3") + 0.01),
        "adv": dict(stages=ROLLOUT, advantages=np.repeat(RECORDED, INPUTS.lengths) + 0.25),
        "loss": dict(stages=STEP, loss={**_loss(), "pg_loss": _loss()["pg_loss"] + 0.5}),
    }
    # and under a token mean (the micro-batch hypotheses apply): pg_loss 0.5 too high
    tokens = int(INPUTS.mask.sum())
    adv = np.repeat(RECORDED, INPUTS.lengths).astype(np.float32)
    token_mean = loss_fields(INPUTS, adv, agg="token_mean")
    report = replay(write(tmp_path, _token_mean_config(_parts(name="tm"), tokens), STEP,
                          loss={**token_mean, "pg_loss": token_mean["pg_loss"] + 0.5}))
    assert not report.passed and report.explanations == []
    report = replay(write(tmp_path, _token_mean_config(_parts(name="tm-clean"), tokens), STEP, loss=token_mean))
    assert report.passed and report.explanations == []
    for name, kw in cases.items():
        stages = kw.pop("stages")
        report = replay(write(tmp_path, _parts(name=name), stages, **kw))
        assert not report.passed, name
        assert report.explanations == [], (name, report.explanations)


def test_a_cohort_names_the_rank_whose_shard_has_the_bug(tmp_path):
    """A 2-rank cohort (``demo.synthetic_parts`` shards of 8 samples in groups of 4, std on): rank 1 recorded
    rewards normalized over its whole shard; rank 0 is right. Each shard's 8 samples are one micro-batch
    (mb-0001 on rank 1), so the whole shard is that micro-batch, listed first. Judged on the rank where the
    stage fails: 8/8 samples, named on rank 1 (on rank 0 the hypothesis would break 8 right values)."""
    from replay_lib.demo import synthetic_parts, write_bundle

    path = tmp_path / "cohort"
    for r in range(2):
        manifest, index, expected, payloads = synthetic_parts(
            bundle_id="cohort", seed=100 + r, sample_prefix=f"r{r}-s-", batch_offset=r,
            rank_sizes={"dp": 2, "tp": 1, "pp": 1, "cp": 1}, stages=ROLLOUT)
        if r == 1:
            raw = np.array([smp.raw_reward for smp in index.samples])
            rec = f32(normalize(raw, np.zeros(8), std=True))
            expected["reward.post_process"] = {"rewards": rec.tolist()}
            index = msgspec.structs.replace(index, samples=[
                msgspec.structs.replace(smp, reward=float(v)) for smp, v in zip(index.samples, rec)])
            lengths = np.array([smp.response_length for smp in index.samples])
            payloads["advantages"] = torch.from_numpy(np.repeat(rec, lengths).astype(np.float32))
        write_bundle(path, manifest, index, expected, payloads, rank=r, ranks=range(2))
    report = replay(path)
    assert report.first_divergent_stage == "reward.post_process"
    assert [(e.hypothesis, e.matched, e.of, e.rank) for e in report.explanations] == [
        ("reward.micro_batches", 8, 8, 1)]
    assert explanation_line(report.explanations[0]) == (
        "likely cause [rank 1]: the recorded rewards equal group normalization over micro-batches mb-0001 (not "
        "semantic groups) — 8/8 samples")


# ------------------------------------------------------------------------------ the consumer-batch layout


@pytest.mark.parametrize("n,ids,expected", [
    (16, 3, [0] * 6 + [1] * 6 + [2] * 4),  # ⌈16/3⌉ = 6: 6, 6, 4
    (10, 4, [0] * 3 + [1] * 3 + [2] * 3 + [3]),  # ⌈10/4⌉ = 3 and ⌈10/3⌉ = 4 batches: 3, 3, 3, 1
    (5, 4, None),  # ⌈5/4⌉ = 2 makes only ⌈5/2⌉ = 3 batches: no layout of 4 ids
    (16, 1, None),  # a single batch is the whole batch, not a consumer-batch hypothesis
])
def test_consumer_batch_layout(tmp_path, n, ids, expected):
    parts = produce_parts(FAMILY, SEED, Size(n, 8, 1), Config(kl_coef=0.0, std_normalization=False),
                          bundle_id=f"l{n}-{ids}")
    path = write(tmp_path, parts, ROLLOUT, consumer_batch_ids=[f"cb-{k}" for k in range(ids)])
    reader = open_bundle(path).shards[0]
    ctx = StageContext(reader=reader, indices=list(range(n)), partial=False)
    found = consumer_batches(ctx)
    assert (found[1].tolist() if found else None) == expected


# ------------------------------------------------------------------------------ the views


def test_text_and_json_in_a_real_process(tmp_path):
    """The CLI prints ``likely cause: …`` under the failing stage and ``--format json`` carries the same."""
    rewards = normalize(RAW, np.arange(16) // 6, std=True)
    path = write(tmp_path, _parts(), ROLLOUT, rewards=rewards, consumer_batch_ids=["cb-0", "cb-1", "cb-2"])
    text = subprocess.run(["trajectory-replay", "replay", str(path)], capture_output=True, text=True, timeout=120)
    assert text.returncode == 1, text.stderr
    lines = text.stdout.splitlines()
    # cb-2 (samples 12–15) is the group g-3, normalized right: 12 samples diverge, all 16 match the hypothesis
    at = lines.index("[   fail] reward.post_process — normalized reward mismatch in 12 sample(s)")
    assert lines[at + 6] == "          ... 7 more; max abs_err=0.85450105"
    assert lines[at + 7] == ("          likely cause: the recorded rewards equal group normalization over consumer "
                             "batches cb-0, cb-1, cb-2 (not semantic groups) — 16/16 samples")
    js = subprocess.run(["trajectory-replay", "replay", str(path), "--format", "json"], capture_output=True,
                        text=True, timeout=120)
    assert json.loads(js.stdout)["explanations"] == [{
        "stage": "reward.post_process", "hypothesis": "reward.consumer_batches", "matched": 16, "of": 16,
        "detail": "the recorded rewards equal group normalization over consumer batches cb-0, cb-1, cb-2 (not "
                  "semantic groups)", "unit": "samples", "rank": None}]


def test_verbose_says_when_no_known_cause_matches(tmp_path):
    path = write(tmp_path, _parts(), ROLLOUT, rewards=1.5 * RECORDED)
    out = subprocess.run(["trajectory-replay", "replay", str(path), "--verbose"], capture_output=True, text=True,
                         timeout=120).stdout.splitlines()
    assert "          likely cause: no known cause matches" in out
    quiet = subprocess.run(["trajectory-replay", "replay", str(path)], capture_output=True, text=True,
                           timeout=120).stdout
    assert "likely cause" not in quiet


def test_configurations_outside_the_varied_formulas_get_no_hypotheses():
    """A hypothesis family varies one declared formula; a configuration it does not model (a leave-one-out
    baseline, KL in the reward, importance weights, a log-ratio clamp, sequence-level ratios) gets none, never
    one built on the wrong formula."""
    from replay_lib.explain import loss, reward
    from replay_lib.bundle.schema import RecomputeConfig

    assert reward.modelled(RecomputeConfig()) and loss.modelled(RecomputeConfig())
    for knob in (dict(group_baseline="leave_one_out"), dict(kl_in_reward="sequence"), dict(std_zero="skip"),
                 dict(singleton_group="zero"), dict(advantage_estimator="rloo")):
        assert not reward.modelled(RecomputeConfig(**knob)), knob
    for knob in (dict(use_tis=True), dict(is_level="token"), dict(log_ratio_clamp=20.0),
                 dict(importance_level="sequence"), dict(use_kl_loss=True, kl_loss_coef=0.1)):
        assert not loss.modelled(RecomputeConfig(**knob)), knob
    assert loss.modelled(RecomputeConfig(use_kl_loss=True, kl_loss_coef=0.0))  # effective values: no KL term


def test_causes_that_fit_equally_well_are_said_to_be_a_tie(pr65_bundle):
    """Two exclusive causes that both reproduce every value (a bf16 bundle's loss mask shifted one token
    earlier or later, both 40/40 within the storage allowance) are a tie: the text report and the TUI's
    verdict line say so instead of ranking one first."""
    from replay_lib.judge.report import Explanation, render_text
    from replay_tui.model import explanation_text

    report = replay(pr65_bundle)
    stage = report.first_divergent_stage
    earlier = Explanation(stage=stage, hypothesis="a", matched=40, of=40, detail="shifted one token earlier")
    later = Explanation(stage=stage, hypothesis="b", matched=40, of=40, detail="shifted one token later")
    partial = Explanation(stage=stage, hypothesis="c", matched=30, of=40, detail="something else")
    tied = msgspec.structs.replace(report, explanations=[earlier, later, partial])
    lines = [line.strip() for _, line in render_text(tied)]
    at = lines.index("likely cause: shifted one token earlier — 40/40 values")
    assert lines[at:at + 4] == [
        "likely cause: shifted one token earlier — 40/40 values", "likely cause: shifted one token later — 40/40 values",
        "likely cause: something else — 30/40 values",
        "(2 causes fit these values equally well: the recorded values cannot tell them apart)"]
    assert explanation_text(tied) == "likely cause: shifted one token earlier — 40/40 values (or 1 more that fits as well)"
    single = msgspec.structs.replace(report, explanations=[earlier, partial])
    assert not any("equally well" in line for _, line in render_text(single))
    assert explanation_text(single) == "likely cause: shifted one token earlier — 40/40 values"


# ------------------------------------------------------------------------------ the partitions' cost (H1)


def _whole_batch_bundle(tmp_path: Path, n: int, consumer_batch_ids: Optional[list[str]] = None,
                        own_batches: Optional[list[str]] = None) -> Path:
    """``n`` samples in groups of 4 whose recorded rewards are normalized over the whole batch; ``own_batches``:
    each sample's recorded ``consumer_batch_id`` (and the rewards normalized over those batches instead)."""
    parts = produce_parts(FAMILY, SEED, Size(n, 4, 4), Config(kl_coef=0.0), bundle_id=f"w{n}")
    labels = np.zeros(n)
    if own_batches is not None:
        samples = [msgspec.structs.replace(s, consumer_batch_id=b) for s, b in zip(parts.index.samples, own_batches)]
        parts.index = msgspec.structs.replace(parts.index, samples=samples)
        labels = np.array([int(b.removeprefix("cb-")) for b in own_batches])
    rewards = normalize(parts.inputs.raw_rewards, labels, std=True)
    return write(tmp_path, parts, ROLLOUT, rewards=rewards, consumer_batch_ids=consumer_batch_ids)


def _reward_work(path: Path, monkeypatch) -> tuple[list[str], int]:
    """The ids of the partitions tried and the number of ``torch.unique`` calls (a sort each) that
    ``explain.reward.hypotheses`` makes on a bundle whose reward.post_process failed."""
    from replay_lib.explain import reward
    from replay_lib.run.runner import replay_run

    report, contexts = replay_run(open_bundle(path), explain=False)
    assert report.first_divergent_stage == "reward.post_process"
    ctx = contexts[0]
    fields = ctx.fields["reward.post_process"]
    calls = []
    real = torch.unique

    def counted(*args, **kw):
        calls.append(args[0].numel())
        return real(*args, **kw)

    monkeypatch.setattr(torch, "unique", counted)
    hyps = reward.hypotheses(ctx, fields)
    monkeypatch.setattr(torch, "unique", real)
    tried = [h.id for h in hyps if h.id.startswith(("reward.consumer", "reward.micro", "reward.whole", "reward.chunks"))]
    return tried, sum(1 for n in calls if n == len(ctx.reader.index.samples))


def test_the_partitions_take_no_sort_each(tmp_path, monkeypatch):
    """The reward explanations of a 4,096-sample bundle try 16 partitions (the micro-batches of 8, the whole
    batch, chunks of 2, 6, 12 … 32 and the powers of two up to 2,048; chunks of 4 and 8 are the groups and the
    micro-batches), those of a 64-sample one 10, and both sort the samples twice (the semantic groups' numbering
    and statistics), whatever the number of partitions: each partition is made in its canonical numbering, told
    apart from the others and normalized by linear passes. (Before: every pair of partitions was compared by
    sorting both — 156 sorts of the samples for 64 samples, 328 for 4,096, 628 for 160,000.)"""
    small, small_sorts = _reward_work(_whole_batch_bundle(tmp_path / "s", 64), monkeypatch)
    big, big_sorts = _reward_work(_whole_batch_bundle(tmp_path / "b", 4096), monkeypatch)
    chunks = [f"reward.chunks_of_{c}" for c in (2, 6, 12, 16, 20, 24, 28, 32)]
    assert small == ["reward.micro_batches", "reward.whole_batch"] + chunks
    assert big == small + [f"reward.chunks_of_{1 << p}" for p in range(6, 12)]
    assert (small_sorts, big_sorts) == (2, 2)


def _fake_ctx(n: int, consumer_batch_ids=(), own=None, group_size: int = 4):
    from types import SimpleNamespace

    samples = [SimpleNamespace(micro_batch_id=None, consumer_batch_id=own[i] if own is not None else None)
               for i in range(n)]
    index = SimpleNamespace(samples=samples, identity=SimpleNamespace(consumer_batch_ids=list(consumer_batch_ids)))
    return SimpleNamespace(reader=SimpleNamespace(index=index),
                           config=SimpleNamespace(n_samples_per_prompt=group_size))


def test_the_partitions_tried_are_bounded():
    """Two consumer batch ids over 1,000 samples fit 499 batch sizes (500 … 998): the first 16 are tried; groups
    of 60 different sizes add 60 chunk sizes: 48 partitions are tried in all, in the order listed."""
    from replay_lib.explain import reward

    layouts = reward.consumer_batch_layouts(_fake_ctx(1000, ["cb-0", "cb-1"]))
    assert [size for _, _, size in layouts] == list(range(500, 516))
    assert reward.MAX_LAYOUTS == 16 and reward.MAX_PARTITIONS == 48
    sizes = range(1, 61)  # 1,830 samples
    groups = torch.repeat_interleave(torch.arange(60), torch.tensor(sizes))
    tried = [pid for pid, _, _ in reward.partitions(_fake_ctx(int(groups.numel()), ["cb-0", "cb-1"]), groups)]
    assert len(tried) == 48
    assert tried[:18] == (["reward.consumer_batches"] + [f"reward.consumer_batches_of_{c}" for c in range(916, 931)]
                          + ["reward.whole_batch", "reward.chunks_of_2"])


class _CountedId(str):
    """A batch id that counts how often it is compared."""

    compared = 0

    def __eq__(self, other):
        _CountedId.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_per_sample_consumer_batches_are_placed_in_linear_work():
    """5,000 samples, each its own recorded consumer batch: each id is compared a bounded number of times
    (a hash look-up), not with every id before it (``list.index``: 12.5 million comparisons)."""
    from replay_lib.explain import reward

    n = 5000
    own = [_CountedId(f"cb-{i}") for i in range(n)]
    _CountedId.compared = 0
    [(ids, labels, size)] = reward.consumer_batch_layouts(_fake_ctx(n, own=own))
    assert _CountedId.compared <= n
    assert ids == [f"cb-{i}" for i in range(n)] and labels.tolist() == list(range(n)) and size is None


def test_recorded_consumer_batches_of_each_sample(tmp_path):
    """SPEC §3: a sample's own ``consumer_batch_id`` is part of the schema (no "unknown field" warning), the
    explanation names those batches in order of first appearance, and the views' column shows them as recorded
    (no ``~``: not a layout guessed from the identity)."""
    from replay_lib.explain.inputs import consumer_batch_labels
    from replay_lib.run.runner import replay_run

    own = [f"cb-{2 - (i // 4) % 3}" for i in range(48)]  # whole groups; cb-2 first, then cb-1, cb-0
    path = _whole_batch_bundle(tmp_path, 48, own_batches=own)
    assert json.loads((path / "index.json").read_bytes())["samples"][5]["consumer_batch_id"] == "cb-1"
    bundles = open_bundle(path)
    assert bundles.warnings == []
    report, contexts = replay_run(bundles)
    assert [(e.hypothesis, e.matched, e.of) for e in report.explanations] == [("reward.consumer_batches", 48, 48)]
    assert report.explanations[0].detail == ("the recorded rewards equal group normalization over consumer batches "
                                             "cb-2, cb-1, cb-0 (not semantic groups)")
    labels = consumer_batch_labels(contexts[0])
    assert (labels.names, labels[0:13]) == (["cb-2", "cb-1", "cb-0"], ["cb-2"] * 4 + ["cb-1"] * 4 + ["cb-0"] * 4
                                            + ["cb-2"])


def test_a_bundle_without_them_is_written_as_before(tmp_path):
    """A record that does not carry ``consumer_batch_id`` is written without the key (not ``null``): bundles
    written before the field existed and after are the same bytes."""
    path = _whole_batch_bundle(tmp_path, 8)
    assert all("consumer_batch_id" not in s for s in json.loads((path / "index.json").read_bytes())["samples"])


def test_a_160k_shaped_bundle_replays_in_a_real_process(tmp_path, bundle_tools):
    """The shape of the 160,000-sample report at 4,000 samples: one token each, each sample its own consumer
    batch (recorded per sample and in the identity), one normalized reward off by 1. The replay completes, names
    the divergence, and warns of nothing (the per-sample ids are no unknown field)."""
    path = tmp_path / "b4k"
    subprocess.run(["trajectory-replay", "demo", "write", "--samples", "4000", "--tokens", "1", str(path)],
                   check=True, capture_output=True, timeout=120)
    index = json.loads((path / "index.json").read_bytes())
    index["identity"]["consumer_batch_ids"] = [f"cb-{i}" for i in range(4000)]
    for i, s in enumerate(index["samples"]):
        s["consumer_batch_id"] = f"cb-{i}"
    (path / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    expected = json.loads((path / "expected.json").read_bytes())
    expected["reward.post_process"]["rewards"][0] += 1.0
    (path / "expected.json").write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
    bundle_tools.reseal(path)
    out = subprocess.run(["trajectory-replay", "replay", str(path)], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stderr) == (1, "")
    lines = out.stdout.splitlines()
    assert lines[0] == "bundle b4k — first divergent stage: reward.post_process"
    assert lines[3] == "[   fail] reward.post_process — normalized reward mismatch in 1 sample(s)"
    assert [line for line in lines if line.startswith("warning")] == []
