"""Stage ``logprob.support``: sample-support rescoring and the support-row invariants (SPEC §7).

Bundles are written by the real BundleWriter and replayed through ``replay_lib.run.runner.replay``; expected
log-probs are derived by hand from ``logp_S(y) = l_y − m − log Σ_{j∈S} exp(l_j − m)``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.cli import main
from replay_lib.demo import contracts, producer, support_parts, write_bundle, write_support_bundle
from replay_lib.errors import BundleError, UnsupportedError
from replay_lib.kernels import policy_loss_fields
from replay_lib.run.runner import replay
from replay_lib.bundle.schema import (
    FORMAT_VERSION,
    ActorStepId,
    BundleIndex,
    ComparisonPolicy,
    Identity,
    Manifest,
    RecomputeConfig,
    SampleRecord,
    StageCapability,
    StageContract,
    StageId,
)
from replay_lib.bundle.selection import Selection
from replay_lib.kernels.support import (
    check_routed_experts,
    check_support_rows,
    support_logprobs,
    unsupported_violations,
)
from replay_lib.run.validate import validate

SUPPORT = StageId.LOGPROB_SUPPORT
VOCAB = 8
# Token s-0@0: support ids [5, 2, 7] with logits [2, 1, 0], sampled id 2 (member 1), m = 2:
#   logp_S = 1 − 2 − ln(1 + e^−1 + e^−2) = −1 − ln(1 + 0.36787944117144233 + 0.1353352832366127)
#          = −1 − ln(1.5032147244080550) = −1 − 0.40760596444437967 = −1.40760596444437967
LOGP_S00 = -1.40760596444437967
# Token s-0@1: ids [3, 0, −1], logits [0.5, 0.5, 99 (padding, ignored)], sampled 3: −ln 2.
LOGP_S01 = -0.69314718055994531
# Token s-1@1: ids [1, 6, 4], logits [−1, 0, 1], sampled 4 (member 2), m = 1:
#   logp_S = 1 − 1 − ln(e^−2 + e^−1 + 1) = −0.40760596444437967
LOGP_S11 = -0.40760596444437967
# Token s-0@2: the appended EOS — no support row, takes its recorded full-vocabulary value.
EOS_FULL = -0.25

# Two trajectories: s-0 = 3 loss-bearing tokens (the last an appended EOS), s-1 = an observation token
# (loss mask 0, no support) and one sampled token.
LENGTHS = [3, 2]
MASKS = [[1, 1, 1], [0, 1]]
SUPPORT_IDS = [[5, 2, 7], [3, 0, -1], [-1, -1, -1], [-1, -1, -1], [1, 6, 4]]
SUPPORT_LOGITS = [[2.0, 1.0, 0.0], [0.5, 0.5, 99.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-1.0, 0.0, 1.0]]
SAMPLED = [2, 3, 7, 4, 4]
FULL = [-1.6, -0.9, EOS_FULL, -3.0, -0.6]
LOG_PROBS = [LOGP_S00, LOGP_S01, EOS_FULL, -3.0, LOGP_S11]


def hand_payloads() -> dict[str, torch.Tensor]:
    return {
        "support_ids": torch.tensor(SUPPORT_IDS, dtype=torch.int32),
        "support_logits": torch.tensor(SUPPORT_LOGITS, dtype=torch.float32),
        "sampled_token_ids": torch.tensor(SAMPLED, dtype=torch.int64),
        "full_log_probs": torch.tensor(FULL, dtype=torch.float32),
        "log_probs": torch.tensor(LOG_PROBS, dtype=torch.float32),
    }


def write_hand(path: Path, payloads=None, *, lengths=LENGTHS, masks=MASKS, groups=(0, 0), cp: int = 1,
               stages=(StageId.SAMPLE, SUPPORT), capability=StageCapability.RECOMPUTE, expected=None,
               **config) -> Path:
    """Samples s-0, s-1, … of one step, the given payloads, written by BundleWriter."""
    cfg = dict(n_samples_per_prompt=sum(1 for g in groups if g == groups[0]), vocab_size=VOCAB)
    cfg.update(config)
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=g, response_length=n, total_length=n + 4,
                            loss_mask=list(m), raw_reward=1.0, micro_batch_id="mb-0000")
               for i, (g, n, m) in enumerate(zip(groups, lengths, masks))]
    index = BundleIndex(bundle_id=path.name, identity=Identity(actor_step_id=ActorStepId(rollout_id=5, step_id=0),
                                                               rank={"cp": cp}),
                        samples=samples, config=RecomputeConfig(**cfg))
    stage_contracts = contracts(stages)
    stage_contracts[SUPPORT] = StageContract(stage=SUPPORT, version="v1", capability=capability)
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=path.name, producer=producer(),
                        stage_contracts=stage_contracts, payloads={}, comparison_policy=ComparisonPolicy(),
                        redaction={})
    writer = BundleWriter(path, manifest, index, expected or {})
    for name, tensor in (payloads if payloads is not None else hand_payloads()).items():
        writer.write_payload(name, tensor)
    return writer.finalize(ranks=[0])


def support_stage(report):
    stage = report.stage("logprob.support")
    assert stage is not None
    return stage


def only_divergence(report):
    stage = support_stage(report)
    assert stage.status == "fail" and stage.mismatches == 1 and len(stage.divergences) == 1, stage
    assert report.first_divergent_stage == "logprob.support"
    return stage.divergences[0]


# ------------------------------------------------------------------------------------------- kernels


def test_kernel_matches_the_hand_derived_formula():
    ids = torch.tensor(SUPPORT_IDS, dtype=torch.int32)
    out = support_logprobs(ids, torch.tensor(SUPPORT_LOGITS), torch.tensor(SAMPLED))
    assert out.dtype == torch.float32
    # float32 result within one float32 rounding of the exact value
    assert out[0].item() == pytest.approx(LOGP_S00, abs=2e-7)
    assert out[1].item() == pytest.approx(LOGP_S01, abs=1e-7)
    assert out[4].item() == pytest.approx(LOGP_S11, abs=1e-7)
    assert math.isnan(out[2].item()) and math.isnan(out[3].item())  # rows without support
    # the normalizer cancels: full-vocab log-probs of the members give the same value
    shifted = torch.tensor(SUPPORT_LOGITS) - 3.25
    assert support_logprobs(ids, shifted, torch.tensor(SAMPLED))[0].item() == pytest.approx(LOGP_S00, abs=2e-7)


def test_kernel_sampled_token_outside_its_row_is_nan():
    out = support_logprobs(torch.tensor([[1, 6, 4]], dtype=torch.int32), torch.tensor([[-1.0, 0.0, 1.0]]),
                           torch.tensor([5]))
    assert math.isnan(out[0].item())


def test_row_checks_flag_exact_rows():
    ids = torch.tensor([
        [5, 2, 7],     # 0 clean
        [3, 8, -1],    # 1 id 8 ≥ vocab
        [1, -1, 4],    # 2 padding before a member
        [5, 2, 5],     # 3 duplicate member 5
        [-1, -1, -1],  # 4 no support (padding repeated is not a duplicate)
        [-2, 1, 0],    # 5 id −2 < −1
        [6, 0, -1],    # 6 sampled 3 not a member
    ], dtype=torch.int32)
    sampled = torch.tensor([2, 3, 4, 2, 7, 1, 3])
    rows = check_support_rows(ids, sampled, VOCAB)
    assert torch.nonzero(rows.id_out_of_range).flatten().tolist() == [1, 5]
    assert torch.nonzero(rows.padding_not_trailing).flatten().tolist() == [2]
    assert torch.nonzero(rows.duplicate).flatten().tolist() == [3]
    assert torch.nonzero(~rows.has_support).flatten().tolist() == [4]
    assert torch.nonzero(~rows.sampled_in_row).flatten().tolist() == [4, 6]
    assert rows.sampled_slot.tolist()[:4] == [1, 0, 2, 1]


def test_unsupported_rule_counts_whole_trajectories():
    # trajectories of 2, 0 and 3 tokens; unsupported loss-bearing tokens at 1 (s-0 last), 2 and 4 (s-2 last)
    unsupported = torch.tensor([False, True, True, False, True])
    violating, counts = unsupported_violations(unsupported, torch.tensor([2, 0, 3]))
    assert counts.tolist() == [1, 0, 2]
    assert violating.tolist() == [False, False, True, False, False]


def test_routed_expert_checks_name_the_first_bad_layer():
    routes = torch.tensor([
        [[0, 1], [2, 3]],   # clean
        [[0, 1], [4, 3]],   # layer 1: expert 4 ≥ num_experts=4
        [[2, 2], [0, 1]],   # layer 0: expert 2 twice
    ], dtype=torch.int32)
    checked = check_routed_experts(routes, 4)
    assert checked.out_of_range_layer.tolist() == [-1, 1, -1]
    assert checked.duplicate_layer.tolist() == [-1, -1, 0]


# ------------------------------------------------------------------------------------ through replay


def test_clean_hand_bundle_replays_clean(tmp_path):
    report = replay(write_hand(tmp_path / "clean"))
    assert report.passed and report.first_divergent_stage is None
    stage = support_stage(report)
    assert stage.status == "pass" and stage.capability == "recompute"
    # loss-bearing: s-0@0, s-0@1, s-0@2 (EOS → full_log_probs), s-1@1; s-1@0 has loss mask 0
    assert stage.compared == 4
    assert stage.max_abs_error < 1e-6
    assert "1 unsupported last token(s) use full_log_probs" in stage.reason


def test_value_mismatch_reports_recorded_vs_rescored(tmp_path):
    payloads = hand_payloads()
    payloads["log_probs"][4] = -0.5
    d = only_divergence(replay(write_hand(tmp_path / "b", payloads)))
    assert (d.field, d.sample_id, d.token_offset) == ("support_logprob", "s-1", 1)
    assert d.expected == -0.5
    assert d.actual == pytest.approx(LOGP_S11, abs=1e-7)
    assert d.abs_error == pytest.approx(0.5 + LOGP_S11, abs=1e-7)


def test_eos_token_is_compared_with_its_full_vocab_value(tmp_path):
    payloads = hand_payloads()
    payloads["full_log_probs"][2] = -0.75  # the trainer consumed -0.25 for the EOS
    d = only_divergence(replay(write_hand(tmp_path / "b", payloads)))
    assert (d.field, d.sample_id, d.token_offset, d.expected, d.actual) == ("support_logprob", "s-0", 2, -0.25, -0.75)


def full_vocab_logits() -> torch.Tensor:
    """A full-vocabulary logit row per token whose top-3 ids are exactly the recorded support."""
    full = torch.full((5, VOCAB), -4.0)
    for t, (ids, logits) in enumerate(zip(SUPPORT_IDS, SUPPORT_LOGITS)):
        for i, lg in zip(ids, logits):
            if i >= 0:
                full[t, i] = lg
    return full


def test_full_vocab_scoring_by_mistake_fails_first_at_logprob_support(tmp_path):
    """The trainer took log_softmax over all logits instead of over the support; the loss it reports is
    consistent with those log-probs, so loss.policy passes and logprob.support is the first divergence."""
    full = full_vocab_logits()
    y = torch.tensor(SAMPLED)
    buggy = torch.log_softmax(full, dim=1).gather(1, y[:, None]).squeeze(1)
    buggy[2] = EOS_FULL  # the EOS row has no support either way
    payloads = hand_payloads()
    payloads["log_probs"] = buggy
    payloads["old_log_probs"] = buggy.clone()
    payloads["advantages"] = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0])
    mask = torch.tensor([m for row in MASKS for m in row], dtype=torch.float32)
    loss = policy_loss_fields(buggy, buggy, payloads["advantages"], None, mask, torch.tensor(LENGTHS),
                              eps_clip=0.2, eps_clip_high=0.2, entropy_coef=0.0)
    b = write_hand(tmp_path / "bug", payloads, stages=(StageId.SAMPLE, SUPPORT, StageId.LOSS_POLICY),
                   expected={"loss.policy": {k: float(v) for k, v in loss.items()}})
    report = replay(b)
    assert report.first_divergent_stage == "logprob.support"
    assert report.stage("sample").status == "pass" and report.stage("loss.policy").status == "pass"
    stage = support_stage(report)
    # s-0@0, s-0@1 and s-1@1, for both log_probs and old_log_probs
    assert stage.mismatches == 6
    d = report.first_divergence
    assert (d.field, d.sample_id, d.token_offset) == ("support_logprob", "s-0", 0)
    # e^2 + e + 1 + 5·e^−4: the five non-members at logit −4 take part of the mass
    assert d.expected == pytest.approx(1 - math.log(math.exp(2) + math.e + 1 + 5 * math.exp(-4)), abs=1e-6)
    assert d.actual == pytest.approx(LOGP_S00, abs=2e-7)
    fields = [x.field for x in stage.divergences]
    assert "support_old_logprob" in fields


def test_demo_bundle_clean_and_with_the_full_vocab_bug(tmp_path):
    clean = write_support_bundle(tmp_path / "clean", samples=8, tokens=12, k=5, vocab_size=64, vary_lengths=True,
                                 routed=(2, 2, 8))
    report = replay(clean)
    assert report.passed, report
    assert [s.stage for s in report.stages if s.status == "pass"] == [
        "sample", "reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate", "logprob.support",
        "loss.policy"]
    bug = replay(write_support_bundle(tmp_path / "bug", samples=8, tokens=12, k=5, vocab_size=64, full_vocab_bug=True))
    assert bug.first_divergent_stage == "logprob.support"
    assert bug.stage("loss.policy").status == "pass"
    assert bug.first_divergence.field == "support_logprob"
    assert (bug.first_divergence.sample_id, bug.first_divergence.token_offset) == ("s-0", 0)


# -------------------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("bad_id", [8, -2])
def test_support_id_outside_the_vocabulary(tmp_path, bad_id):
    payloads = hand_payloads()
    payloads["support_ids"][1] = torch.tensor([3, bad_id, -1], dtype=torch.int32)
    d = only_divergence(replay(write_hand(tmp_path / "b", payloads)))
    assert (d.field, d.sample_id, d.token_offset, d.actual) == ("support_id_range", "s-0", 1, float(bad_id))
    assert f"support id {bad_id} at slot 1 is outside [-1, vocab_size=8)" in d.message


def test_padding_before_a_member(tmp_path):
    payloads = hand_payloads()
    payloads["support_ids"][4] = torch.tensor([1, -1, 4], dtype=torch.int32)
    d = only_divergence(replay(write_hand(tmp_path / "b", payloads)))
    assert (d.field, d.sample_id, d.token_offset) == ("support_padding", "s-1", 1)
    assert "padding (-1) at slot 1 precedes id 4 at slot 2" in d.message


def test_duplicate_id_in_a_row(tmp_path):
    payloads = hand_payloads()
    payloads["support_ids"][0] = torch.tensor([5, 2, 5], dtype=torch.int32)
    d = only_divergence(replay(write_hand(tmp_path / "b", payloads)))
    assert (d.field, d.sample_id, d.token_offset, d.actual) == ("support_duplicate", "s-0", 0, 5.0)
    assert "member id 5 appears 2 times in the row [5, 2, 5]" in d.message


def test_one_row_per_response_token(tmp_path):
    payloads = hand_payloads()
    payloads["support_ids"] = payloads["support_ids"][:4].clone()
    report = replay(write_hand(tmp_path / "b", payloads))
    assert report.first_divergent_stage == "sample"  # sample checks every token payload's length first
    d = only_divergence_of(report)
    assert (d.field, d.sample_id, d.token_offset, d.expected, d.actual) == ("support_rows", "s-1", 1, 5.0, 4.0)
    assert "payload 'support_ids' has 4 row(s) for Σ response_length 5 (s-1@1 onward has no row)" in d.message


def only_divergence_of(report):
    stage = support_stage(report)
    assert stage.status == "fail" and stage.mismatches == 1, stage
    return stage.divergences[0]


def test_sampled_token_missing_from_its_row(tmp_path):
    """Seed review bug 2: a loss-bearing row with support that lacks the sampled token is caught."""
    payloads = hand_payloads()
    payloads["sampled_token_ids"][4] = 5
    d = only_divergence(replay(write_hand(tmp_path / "b", payloads)))
    assert (d.field, d.sample_id, d.token_offset, d.actual) == ("sampled_not_in_support", "s-1", 1, 5.0)
    assert "sampled token 5 is not in its support row [1, 6, 4]" in d.message


def test_sampled_id_outside_the_vocabulary(tmp_path):
    payloads = hand_payloads()
    payloads["sampled_token_ids"][3] = 9  # observation token (loss mask 0): still range-checked
    d = only_divergence(replay(write_hand(tmp_path / "b", payloads)))
    assert (d.field, d.sample_id, d.token_offset, d.actual) == ("sampled_id_range", "s-1", 0, 9.0)


def test_unsupported_token_that_is_not_the_last(tmp_path):
    payloads = hand_payloads()
    payloads["support_ids"][1] = -1
    d = only_divergence(replay(write_hand(tmp_path / "b", payloads)))
    assert (d.field, d.sample_id, d.token_offset, d.actual) == ("unsupported_token", "s-0", 1, 2.0)
    assert "2 loss-bearing token(s) of trajectory s-0 have no support row (offsets 1, 2)" in d.message


def test_unsupported_eos_without_full_log_probs(tmp_path):
    payloads = hand_payloads()
    del payloads["full_log_probs"]
    d = only_divergence(replay(write_hand(tmp_path / "b", payloads)))
    assert (d.field, d.sample_id, d.token_offset) == ("full_log_probs", "s-0", 2)
    assert "no full_log_probs payload" in d.message


def cp_fixture_payloads() -> tuple[dict[str, torch.Tensor], list[int]]:
    """One trajectory of 8 loss-bearing tokens under load-balanced CP=2: chunks of 2 tokens, CP rank 0 holds
    chunks 0 and 3 (offsets 0, 1, 6, 7), rank 1 holds chunks 1 and 2 (offsets 2–5). Offsets 5 and 7 have no
    support: each is the last token of its shard's local segment, so a per-shard count sees one each."""
    n = 8
    ids = torch.tensor([[(3 * t + j) % VOCAB for j in range(3)] for t in range(n)], dtype=torch.int32)
    ids[5] = -1
    ids[7] = -1
    logits = torch.tensor([[1.0, 0.0, -1.0]] * n)
    sampled = ids[:, 0].to(torch.int64).clone()
    sampled[5] = 7
    sampled[7] = 7
    logp = support_logprobs(ids, logits, sampled)
    full = torch.full((n,), -0.5)
    shards = [0, 0, 1, 1, 1, 1, 0, 0]
    return {
        "support_ids": ids, "support_logits": logits, "sampled_token_ids": sampled, "full_log_probs": full,
        "log_probs": torch.where(torch.isnan(logp), full, logp),
        "cp_shard": torch.tensor(shards, dtype=torch.int32),
    }, shards


def test_two_unsupported_tokens_split_across_cp_shards_are_caught(tmp_path):
    """Seed review bug 1: counting per CP shard misses two unsupported tokens of one trajectory."""
    payloads, shards = cp_fixture_payloads()
    unsupported = [t for t in range(8) if bool((payloads["support_ids"][t] < 0).all())]
    per_shard = {r: sum(1 for t in unsupported if shards[t] == r) for r in (0, 1)}
    assert unsupported == [5, 7] and per_shard == {0: 1, 1: 1}  # what a per-shard count would accept
    b = write_hand(tmp_path / "cp", payloads, lengths=[8], masks=[[1] * 8], groups=(0,), cp=2,
                   stages=(StageId.SAMPLE, SUPPORT))
    report = replay(b, stages=[SUPPORT])
    assert report.stage("sample").status == "pass"
    d = only_divergence(report)
    assert (d.field, d.sample_id, d.token_offset, d.actual) == ("unsupported_token", "s-0", 5, 2.0)
    assert ("2 loss-bearing token(s) of trajectory s-0 have no support row (offsets 5 [cp shard 1], "
            "7 [cp shard 0]); at most one is allowed, and only as the last token 7") in d.message


def test_cp_bundle_is_refused_for_the_grpo_stages_but_checkable_for_support(tmp_path, capsys):
    payloads, _ = cp_fixture_payloads()
    payloads["old_log_probs"] = payloads["log_probs"].clone()
    payloads["advantages"] = torch.zeros(8)
    b = write_hand(tmp_path / "cp", payloads, lengths=[8], masks=[[1] * 8], groups=(0,), cp=2,
                   stages=(StageId.SAMPLE, SUPPORT, StageId.LOSS_POLICY),
                   expected={"loss.policy": {"loss": 0.0}})
    with pytest.raises(UnsupportedError, match=r"\$\.identity\.rank\.cp=2: V1 recomputes context-parallel size 1"):
        replay(b)
    cli = [sys.executable, "-m", "replay_lib", "replay", str(b)]
    refused = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 4
    assert "context-parallel size 1 only" in refused.stderr and "logprob.support" in refused.stderr
    assert main(["replay", str(b), "--stage", "logprob.support", "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["first_divergent_stage"] == "logprob.support"
    first = doc["first_divergence"]
    assert (first["field"], first["sample_id"], first["token_offset"]) == ("unsupported_token", "s-0", 5)


def test_cp_shard_outside_the_cp_size(tmp_path):
    payloads, _ = cp_fixture_payloads()
    payloads["support_ids"][5] = torch.tensor([7, 0, 1], dtype=torch.int32)  # leave one EOS only
    logp = support_logprobs(payloads["support_ids"], payloads["support_logits"], payloads["sampled_token_ids"])
    payloads["log_probs"] = torch.where(torch.isnan(logp), payloads["full_log_probs"], logp)
    payloads["cp_shard"][3] = 2
    report = replay(write_hand(tmp_path / "cp", payloads, lengths=[8], masks=[[1] * 8], groups=(0,), cp=2),
                    stages=[SUPPORT])
    d = only_divergence(report)
    assert (d.field, d.sample_id, d.token_offset, d.actual) == ("cp_shard", "s-0", 3, 2.0)
    assert "cp_shard 2 is outside [0, identity.rank.cp=2)" in d.message


def hand_routes() -> torch.Tensor:
    # [5 tokens, 2 layers, top-2] over 4 experts
    return torch.tensor([[[0, 1], [2, 3]]] * 5, dtype=torch.int32)


def test_routed_expert_id_outside_num_experts(tmp_path):
    payloads = hand_payloads()
    payloads["routed_experts"] = hand_routes()
    payloads["routed_experts"][3, 1] = torch.tensor([3, 4], dtype=torch.int32)
    d = only_divergence(replay(write_hand(tmp_path / "b", payloads, num_experts=4)))
    assert (d.field, d.sample_id, d.token_offset, d.actual) == ("routed_experts", "s-1", 0, 4.0)
    assert "layer 1: expert id 4 is outside [0, num_experts=4) in [3, 4]" in d.message


def test_routed_expert_repeated_within_a_row(tmp_path):
    payloads = hand_payloads()
    payloads["routed_experts"] = hand_routes()
    payloads["routed_experts"][1, 0] = torch.tensor([2, 2], dtype=torch.int32)
    d = only_divergence(replay(write_hand(tmp_path / "b", payloads, num_experts=4)))
    assert (d.field, d.sample_id, d.token_offset, d.actual) == ("routed_experts", "s-0", 1, 2.0)
    assert "layer 0: expert 2 appears 2 times in [2, 2]" in d.message


def test_routed_experts_with_the_wrong_shape(tmp_path):
    # the reader refuses a payload of another rank than the stage reads (SPEC §11), before any stage
    payloads = hand_payloads()
    payloads["routed_experts"] = hand_routes().reshape(5, 4)
    b = write_hand(tmp_path / "b", payloads, num_experts=4)
    with pytest.raises(BundleError) as err:
        replay(b)
    assert str(err.value) == (f"{b / 'payloads' / 'routed_experts.safetensors'}: manifest $.payloads.routed_experts.shape: "
                              f"[5, 4], expected 3-D [Σ response_length, layers, topk]")


# ------------------------------------------------------------------------------ sources and config


def test_old_and_ref_log_probs_are_compared_when_recorded(tmp_path):
    payloads = hand_payloads()
    payloads["old_log_probs"] = payloads["log_probs"].clone()
    payloads["ref_log_probs"] = payloads["log_probs"].clone()
    payloads["ref_log_probs"][1] = -1.0
    d = only_divergence(replay(write_hand(tmp_path / "b", payloads)))
    assert (d.field, d.sample_id, d.token_offset, d.expected) == ("support_ref_logprob", "s-0", 1, -1.0)
    assert d.actual == pytest.approx(LOGP_S01, abs=1e-7)


def test_support_scored_limits_the_compared_sources(tmp_path):
    payloads = hand_payloads()
    payloads["ref_log_probs"] = torch.full((5,), -2.0)  # a reference model scored over the full vocabulary
    assert replay(write_hand(tmp_path / "b", payloads, support_scored=["log_probs"])).passed


def test_unknown_support_scored_name_is_refused(tmp_path):
    b = write_hand(tmp_path / "b", support_scored=["rollout_log_probs"])
    with pytest.raises(UnsupportedError, match=r"\$\.config\.support_scored=.*'rollout_log_probs' is not one of "
                                               r"log_probs, old_log_probs, ref_log_probs \(stage logprob\.support\)"):
        replay(b)


def test_missing_vocab_size(tmp_path):
    """validate and replay refuse it alike (exit 3: nothing is recomputed from an incomplete bundle)."""
    b = write_hand(tmp_path / "b", vocab_size=None)
    for check in (validate, replay):
        with pytest.raises(BundleError, match=r"dependency closure incomplete: logprob\.support needs index\.json "
                                              r"\$\.config\.vocab_size"):
            check(b)


def test_inspect_only_contract_is_skipped(tmp_path):
    payloads = hand_payloads()
    del payloads["support_logits"]
    report = replay(write_hand(tmp_path / "b", payloads, capability=StageCapability.INSPECT_ONLY))
    stage = support_stage(report)
    assert (stage.status, stage.reason, stage.capability) == ("skipped", "capability inspect-only", "inspect-only")
    assert report.passed


def test_partial_selection_reports_offsets_within_the_sample(tmp_path):
    payloads = hand_payloads()
    payloads["log_probs"][4] = -0.5
    b = write_hand(tmp_path / "b", payloads, groups=(0, 1), n_samples_per_prompt=1)
    report = replay(b, selection=Selection(samples=("s-1",)))
    assert report.selected_samples == ["s-1"]
    d = only_divergence(report)
    assert (d.field, d.sample_id, d.token_offset, d.expected) == ("support_logprob", "s-1", 1, -0.5)
    assert support_stage(report).compared == 1


def test_config_fields_round_trip_through_the_decoder(tmp_path):
    b = write_hand(tmp_path / "b", num_experts=4, support_scored=["log_probs"])
    raw = json.loads((b / "index.json").read_bytes())["config"]
    assert (raw["vocab_size"], raw["num_experts"], raw["support_scored"]) == (8, 4, ["log_probs"])
    index = msgspec.json.decode((b / "index.json").read_bytes(), type=BundleIndex)
    assert (index.config.vocab_size, index.config.num_experts, index.config.support_scored) == (8, 4, ["log_probs"])


def test_support_parts_are_consistent_at_scale(tmp_path):
    """A larger demo bundle (CP layout and routes) stays clean when only sample + logprob.support run."""
    parts = support_parts(samples=16, tokens=64, k=20, vocab_size=1024, vary_lengths=True, cp_size=2,
                          routed=(3, 4, 16), stages=(StageId.SAMPLE, SUPPORT))
    shards = parts[3]["cp_shard"]
    assert set(shards.tolist()) == {0, 1}
    report = replay(write_bundle(tmp_path / "big", *parts))
    assert report.passed, report
    assert support_stage(report).compared > 0


def test_row_checks_without_numpy_give_the_same_answers(monkeypatch):
    """numpy is optional (torch does not require it): the row checks fall back to torch and agree."""
    from replay_lib.kernels.support import check_support_rows

    ids = torch.tensor([[5, 3, -1], [2, 2, 7], [-1, 4, 1], [9, 8, 6]], dtype=torch.int32)
    sampled = torch.tensor([3, 7, 4, 0])
    with_numpy = check_support_rows(ids, sampled, vocab_size=10)

    def no_numpy(self, *args, **kwargs):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setitem(sys.modules, "numpy", None)  # `import numpy` raises ImportError
    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    without = check_support_rows(ids, sampled, vocab_size=10)
    for name in ("id_out_of_range", "padding_not_trailing", "duplicate", "has_support", "sampled_in_row",
                 "sampled_slot"):
        assert torch.equal(getattr(without, name), getattr(with_numpy, name)), name
    assert without.duplicate.tolist() == [False, True, False, False]
    assert without.padding_not_trailing.tolist() == [False, False, True, False]
    assert without.sampled_in_row.tolist() == [True, True, True, False]
    assert without.sampled_slot.tolist()[:3] == [1, 2, 1]
