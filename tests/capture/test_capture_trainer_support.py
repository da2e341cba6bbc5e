"""The example trainer with sample-support scoring: its bundles replay ``logprob.support`` clean, and the
full-vocabulary scoring bug is pinned to that stage at the first loss-bearing token."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from capture_helpers import TINY, bundle_dirs, capture_env
from replay_lib import cli
from replay_lib.bundle import BundleReader
from replay_lib.run.runner import replay
from replay_lib.bundle.schema import StageCapability
from replay_lib.kernels.support import support_logprobs

pytestmark = pytest.mark.slow

ALL_BUNDLES = ["rollout-0", "rollout-1", "step-0-0", "step-0-1", "step-1-0", "step-1-1"]
SUPPORT = ["--sample-support", "--append-eos"]


# ------------------------------------------------------------------------------- the scoring function


def test_support_log_probs_match_the_replay_kernel_and_differentiate_over_the_support(trainer):
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 10, generator=gen) * 3).requires_grad_(True)
    ids = torch.tensor([[3, 7, 1], [0, 9, -1], [-1, -1, -1], [4, 2, 8], [5, -1, -1], [-1, -1, -1]], dtype=torch.int32)
    targets = torch.tensor([7, 9, 2, 4, 5, 0])
    full = F.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
    logp, members = trainer.support_log_probs(logits, ids, targets, full)
    # the replay's kernel on the recorded member logits gives the same float32 numbers
    has = (ids >= 0).any(1)
    replayed = support_logprobs(ids, members, targets)
    assert torch.equal(torch.where(has, replayed, full.detach()), logp.detach())
    assert members[1].tolist()[2] == 0.0 and members[2].tolist() == [0.0, 0.0, 0.0]  # padding slots written as 0
    assert logp[4].item() == 0.0  # a single member holds all the support's mass
    # hand-derived: row 0 renormalizes over {3, 7, 1}; rows without support take the full log-softmax
    row = logits[0].detach()
    lse = math.log(sum(math.exp(row[j].item()) for j in (3, 7, 1)))
    assert logp[0].item() == pytest.approx(row[7].item() - lse, abs=1e-5)
    assert logp[2].item() == full[2].item() and logp[5].item() == full[5].item()
    logp.sum().backward()
    grad = logits.grad
    assert bool(torch.isfinite(grad).all())
    # d logp_S(y) / d l_j = [j = y] − softmax_S(l)_j on the members, 0 elsewhere
    soft = torch.softmax(row[[3, 7, 1]], dim=0)
    expected0 = torch.zeros(10)
    expected0[[3, 7, 1]] = -soft
    expected0[7] += 1.0
    assert torch.allclose(grad[0], expected0, atol=1e-6)
    expected2 = -torch.softmax(logits[2].detach(), dim=0)
    expected2[2] += 1.0
    assert torch.allclose(grad[2], expected2, atol=1e-6)  # the full-vocabulary fallback row


# ------------------------------------------------------------------------------- clean runs, on vs off


@pytest.fixture(scope="module")
def support_runs(trainer, tmp_path_factory):
    directory = tmp_path_factory.mktemp("support") / "bundles"
    off = trainer.run([*TINY, *SUPPORT], env={})
    on = trainer.run([*TINY, *SUPPORT], env=capture_env(directory))
    plain = trainer.run(TINY, env={})
    return directory, off, on, plain


def _params(result) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in result.model.named_parameters()}


def test_capture_on_and_off_stay_bitwise_identical_with_sample_support(support_runs):
    _, off, on, plain = support_runs
    assert (on.capture_stats.written, on.capture_stats.errors, off.capture_stats.written) == (6, 0, 0)
    p_off, p_on, p_plain = _params(off), _params(on), _params(plain)
    assert len(p_off) == 11
    for name in p_off:
        assert torch.equal(p_off[name], p_on[name]), name
    assert on.mean_rewards == off.mean_rewards
    # the flag does change training: support scoring differs from full-vocabulary scoring
    assert any(not torch.equal(p_off[name], p_plain[name]) for name in p_off)


def test_sample_support_bundles_replay_clean_with_logprob_support_passing(support_runs, capsys):
    directory = support_runs[0]
    assert bundle_dirs(directory) == ALL_BUNDLES
    appended = 0
    for name in ALL_BUNDLES:
        reader = BundleReader(directory / name)
        assert reader.manifest.stage_contracts["logprob.support"].capability == StageCapability.RECOMPUTE
        scored = "old_log_probs" if name.startswith("rollout") else "log_probs"
        assert reader.index.config.support_scored == [scored]
        ids = reader.payload("support_ids")
        total = sum(s.response_length for s in reader.index.samples)
        assert ids.dtype == torch.int32 and list(ids.shape) == [total, 8]
        has = (ids >= 0).any(1)
        ends = torch.cumsum(torch.tensor([s.response_length for s in reader.index.samples]), 0) - 1
        no_support = torch.nonzero(~has).reshape(-1)
        assert set(no_support.tolist()) <= set(ends.tolist())  # only appended EOS lack support: the last token
        assert bool((reader.payload("sampled_token_ids")[no_support] == 12).all())  # <eos>
        appended += int(no_support.numel())
        recorded = reader.payload(scored)
        # top-8 of 14 tokens: renormalizing over the support raises every supported token's log-prob
        assert bool((recorded[has] > reader.payload("full_log_probs")[has]).all())
        assert torch.equal(recorded[~has], reader.payload("full_log_probs")[~has])
        report = replay(directory / name)
        assert report.exit_code == 0, (name, report.first_divergence)
        support = next(s for s in report.stages if s.stage == "logprob.support")
        assert support.status == "pass" and support.max_abs_error <= 1e-6
        n = int(no_support.numel())
        assert support.reason == (f"{int(has.sum())} loss-bearing token(s) rescored over the support against {scored}"
                                  + (f"; {n} unsupported last token(s) use full_log_probs" if n else ""))
    assert appended > 0, "the fixture must exercise the appended EOS"
    code = cli.main(["replay", "--format", "json", str(directory / "step-1-1")])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["passed"] is True
    assert [(s["stage"], s["status"]) for s in doc["stages"] if s["status"] != "skipped"] == [
        ("sample", "pass"), ("logprob.support", "pass"), ("logprob.mismatch", "pass"), ("loss.policy", "pass")]


def test_without_the_flag_no_bundle_declares_logprob_support(trainer, tmp_path):
    trainer.run([*TINY, "--rollouts", "1", "--steps-per-rollout", "1"], env=capture_env(tmp_path))
    for name in ("rollout-0", "step-0-0"):
        reader = BundleReader(tmp_path / name)
        assert "logprob.support" not in reader.manifest.stage_contracts
        assert reader.index.config.support_scored is None
    assert BundleReader(tmp_path / "rollout-0").has_payload("support_ids")  # still recorded for inspection


# ------------------------------------------------------------------------------- the full-vocabulary bug


def _hand_logp_s(reader: BundleReader, token: int) -> float:
    ids = reader.payload("support_ids")[token].tolist()
    logits = reader.payload("support_logits")[token].tolist()
    y = int(reader.payload("sampled_token_ids")[token])
    members = [(i, l) for i, l in zip(ids, logits) if i >= 0]
    top = max(l for _, l in members)
    return dict(members)[y] - top - math.log(sum(math.exp(l - top) for _, l in members))


def test_full_vocabulary_scoring_is_pinned_to_logprob_support_at_the_first_loss_bearing_token(
        trainer, tmp_path, capsys):
    directory = tmp_path / "bundles"
    result = trainer.run([*TINY, "--support-full-vocab-bug", "--append-eos", "--mask-truncated"],
                         env=capture_env(directory))
    assert (result.capture_stats.written, result.capture_stats.errors) == (6, 0)
    failing = 0
    for name in ALL_BUNDLES:
        reader = BundleReader(directory / name)
        scored = "old_log_probs" if name.startswith("rollout") else "log_probs"
        field = "support_old_logprob" if name.startswith("rollout") else "support_logprob"
        has = (reader.payload("support_ids") >= 0).any(1)
        mask = reader.packed_mask.to(torch.bool)  # format 1.3.0: every sample's mask, flat
        # what the bug recorded: the full-vocabulary log-probs, on every token
        assert torch.equal(reader.payload(scored), reader.payload("full_log_probs"))
        report = replay(directory / name, max_divergences=1000)
        support = next(s for s in report.stages if s.stage == "logprob.support")
        # the other stages consumed exactly what the trainer computed, so they all pass
        assert all(s.status in ("pass", "skipped") for s in report.stages if s.stage != "logprob.support"), name
        candidates = torch.nonzero(mask & has).reshape(-1)
        if candidates.numel() == 0:  # every sample of this step was truncated and masked out
            assert support.status == "pass", name
            continue
        failing += 1
        assert report.exit_code == 1 and report.first_divergent_stage == "logprob.support", name
        assert support.mismatches == int(candidates.numel())  # every loss-bearing supported token, nothing else
        first = int(candidates[0])
        starts = torch.cumsum(torch.tensor([0] + [s.response_length for s in reader.index.samples]), 0)
        sample = int(torch.searchsorted(starts, first, right=True)) - 1
        div = report.first_divergence
        assert (div.sample_id, div.token_offset, div.field) == (
            reader.index.samples[sample].sample_id, first - int(starts[sample]), field), name
        assert div.group_index == reader.index.samples[sample].group_index
        assert div.expected == reader.payload(scored)[first].item()
        assert div.actual == pytest.approx(_hand_logp_s(reader, first), abs=1e-5)
        assert div.abs_error > 0.05  # −log(the support's share of the softmax mass)
    assert failing >= 4
    code = cli.main(["replay", str(directory / "step-0-0")])
    out = capsys.readouterr().out
    assert code == 1
    assert out.startswith("bundle step-0-0 — first divergent stage: logprob.support")
    assert "[   fail] logprob.support — support log-prob mismatch in log_probs" in out
    assert "[   pass] loss.policy" in out
