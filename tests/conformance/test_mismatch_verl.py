"""Stage ``logprob.mismatch`` against verl 0.9.1's own metric code: ``verl/utils/debug/metrics.py``
``calculate_debug_metrics`` (``training/rollout_probs_diff_{max,mean,std}``) and
``verl/trainer/ppo/rollout_corr_helper.py`` ``compute_offpolicy_metrics`` (``rollout_corr/*``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from replay_lib.bundle import BundleReader
from replay_lib.kernels.mismatch import VERL_DEBUG, VERL_ROLLOUT_CORR, mismatch_metrics

from .conftest import import_verl

import_verl()

from producers.mismatch import make_logprobs, produce_mismatch_bundle, verl_metrics  # noqa: E402

KINDS = ("exact", "fp8_lattice", "flat", "first_token", "bf16", "one_bad")


@pytest.mark.parametrize("kind", KINDS)
def test_float64_formulas_are_verls(kind):
    data = make_logprobs(11, 6, 48, kind)
    wide = {k: (v.astype(np.float64) if k in ("old", "rollout") else v) for k, v in data.items()}
    theirs = verl_metrics(wide)
    seg = torch.repeat_interleave(torch.arange(6), torch.from_numpy(data["lengths"]))
    ours = mismatch_metrics(torch.from_numpy(wide["rollout"]), torch.from_numpy(wide["old"]),
                            torch.from_numpy(data["mask"]), seg, 6)
    assert set(theirs) == set(VERL_DEBUG) | set(VERL_ROLLOUT_CORR)
    for k, v in theirs.items():
        assert ours[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k


@pytest.mark.parametrize("kind", KINDS)
def test_recorded_float32_metrics_pass(cli, tmp_path, kind):
    data = make_logprobs(12, 16, 256, kind)
    path = produce_mismatch_bundle(tmp_path / kind, data, expected=verl_metrics(data))
    code, out, err = cli("replay", path, "--format", "json")
    stage = next(s for s in json.loads(out)["stages"] if s["stage"] == "logprob.mismatch")
    assert (code, stage["status"]) == (0, "pass"), stage["reason"]
    assert stage["reason"].endswith(f"; {len(VERL_DEBUG) + len(VERL_ROLLOUT_CORR)} recorded metric(s) compared")


def test_metrics_of_another_batch_diverge(cli, tmp_path):
    data = make_logprobs(13, 16, 256, "fp8_lattice")
    other = dict(data, rollout=data["rollout"].copy())
    other["rollout"][data["offsets"][4] + 2] += np.float32(0.125)  # the engine's value of one token differs
    other["mask"] = data["mask"].copy()
    other["mask"][data["offsets"][4] + 2] = 1
    data["mask"] = other["mask"]
    path = produce_mismatch_bundle(tmp_path / "b", data, expected=verl_metrics(other))
    code, out, err = cli("replay", path, "--format", "json")
    stage = next(s for s in json.loads(out)["stages"] if s["stage"] == "logprob.mismatch")
    assert code == 1
    assert stage["reason"].startswith("mismatch metric(s) differ: ")
    assert "rollout_corr/kl," in stage["reason"]


# --- rejection sampling (verl rollout_rs): verl's compute_rollout_rejection_mask as the producer ----------------

RS_CHAINS = [
    ("token_k1", "0.8_1.25"), ("token_k2", 0.02), ("token_k3", "0.01"), ("seq_sum_k1", "0.05_20.0"),
    ("seq_sum_k3", 0.5), ("seq_mean_k1", "1.1"), ("seq_mean_k2", 0.005), ("seq_mean_k3", 0.004),
    ("seq_max_k2", 0.1), ("seq_max_k3", 0.08), ("token_k1,seq_mean_k3", "0.7_1.4,0.004"),
    ("seq_sum_k2,token_k3,seq_max_k3", "0.5"),
]


def _padded(data):
    lengths, offsets = data["lengths"], data["offsets"]
    width = int(lengths.max())
    pad = lambda x: torch.stack([torch.nn.functional.pad(torch.from_numpy(x[o:o + L]), (0, width - L))
                                 for o, L in zip(offsets, lengths)])
    return pad(data["old"]), pad(data["rollout"]), pad(data["mask"].astype(np.float32))


def _rs_data(seed):
    rng = np.random.Generator(np.random.PCG64(seed))
    data = make_logprobs(seed, 12, 64, "exact")
    # each sample its own offset and spread, so that sequence statistics differ between samples
    bias = np.repeat(rng.uniform(-0.2, 0.2, 12), data["lengths"])
    sigma = np.repeat(rng.uniform(0.02, 0.3, 12), data["lengths"])
    data["rollout"] = (data["old"] + bias + sigma * rng.normal(0, 1, data["old"].size)).astype(np.float32)
    data["mask"][data["offsets"][3]:data["offsets"][3] + data["lengths"][3]] = 0  # one fully masked sample
    return data


@pytest.mark.parametrize("rs, threshold", RS_CHAINS)
def test_rejection_mask_is_verls(rs, threshold):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    from replay_lib.bundle.rollout_rs import parse_rollout_rs
    from replay_lib.kernels.mismatch import rejection_keep

    data = _rs_data(21)
    old, rollout, mask = _padded(data)
    theirs, _ = compute_rollout_rejection_mask(old - rollout, mask, rollout_rs=rs, rollout_rs_threshold=threshold)
    lengths = torch.from_numpy(data["lengths"])
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    keep = rejection_keep(torch.from_numpy(data["old"]) - torch.from_numpy(data["rollout"]),
                          torch.from_numpy(data["mask"]), seg, len(lengths), parse_rollout_rs(rs, threshold))
    ours = torch.cat([(keep[o:o + L] & (torch.from_numpy(data["mask"][o:o + L]) > 0)).float()
                      for o, L in zip(data["offsets"], data["lengths"])])
    want = torch.cat([theirs[i, :L] for i, L in enumerate(data["lengths"])])
    assert 0 < int(want.sum()) < int(data["mask"].sum()), "the threshold rejects some tokens and keeps some"
    assert torch.equal(ours, want)


@pytest.mark.parametrize("rs, threshold", [("token_k1", "0.8_1.25"), ("token_k1,seq_mean_k3", "0.7_1.4,0.045")])
def test_loss_with_verls_rejection_replays_clean_and_without_it_diverges(cli, tmp_path, rs, threshold):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    from producers.inputs import Size
    from producers.loss_knobs import LossConfig, produce_loss_bundle

    def reject(old, rollout, mask, lengths):  # verl's own mask, on the padded batch, back to the token axis
        offsets = (torch.cumsum(lengths, 0) - lengths).tolist()
        data = dict(lengths=lengths.numpy(), offsets=np.array(offsets), old=old.numpy(), rollout=rollout.numpy(),
                    mask=mask.numpy())
        o, r, m = _padded(data)
        theirs, _ = compute_rollout_rejection_mask(o - r, m, rollout_rs=rs, rollout_rs_threshold=threshold)
        return torch.cat([theirs[i, :L] for i, L in enumerate(lengths.tolist())])

    cfg = LossConfig(is_level=None, kl_loss_type=None)
    extra = dict(rollout_rs=rs, rollout_rs_threshold=threshold)
    path = produce_loss_bundle(tmp_path / "rs", 5, Size(16, 64, 4), cfg, reject=reject, config_extra=extra)
    reader = BundleReader(path)
    kept = int(reader.index.config.loss_token_count)
    assert 0 < kept < sum(sum(reader.sample_mask(i)) for i in range(len(reader.index.samples)))  # some tokens rejected, some kept
    code, out, err = cli("replay", path, "--stage", "loss.policy")
    assert (code, err) == (0, ""), out
    # the same recorded loss read without the rejection: the mask differs, so does the loss
    unaware = produce_loss_bundle(tmp_path / "unaware", 5, Size(16, 64, 4), cfg, reject=reject)
    code, out, err = cli("replay", unaware, "--stage", "loss.policy")
    assert code == 1 and "[   fail] loss.policy" in out
