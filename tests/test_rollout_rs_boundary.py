"""Rejection sampling (``rollout_rs``) decided within rounding of its threshold: a hazard, not a divergence — the
loss admits the token kept or dropped; a decision far from the threshold taken the other way still diverges."""

from __future__ import annotations

import math

import torch

from producers.inputs import Size
from producers.loss_knobs import LossConfig, produce_loss_bundle
from replay_lib.bundle import BundleReader
from replay_lib.bundle.rollout_rs import parse_rollout_rs
from replay_lib.kernels.mismatch import rejection_decisions

SIZE = Size(16, 64, 4)
CFG = LossConfig(is_level=None, kl_loss_type=None)


def _seg(lengths: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)


def test_rejection_decisions_hand_derived():
    """token_k1 with bounds [0.5, e^0.25]: k1 = rollout − old. A token at exactly log(upper) in float32 arithmetic is
    near; one 0.01 inside or outside is not; a sequence option's near decision is every loss token's of it."""
    old = torch.tensor([-1.0, -1.0, -1.0, -2.0, -2.0], dtype=torch.float32)
    up = math.exp(0.25)
    rollout = torch.tensor([-0.75, -0.74, -0.76, -2.0, -2.0], dtype=torch.float32)
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    seg = torch.tensor([0, 0, 0, 1, 1])
    keep, near = rejection_decisions(old.double() - rollout.double(), mask, seg, 2,
                                     parse_rollout_rs("token_k1", f"0.5_{up!r}"))
    assert keep.tolist()[1:] == [False, True, True, True]  # token 0: either way (near)
    assert near.tolist() == [True, False, False, False, False]
    # seq_mean_k1 of sample 0: (0.25 + 0.26 + 0.24) / 3 = 0.25 → near for its three tokens
    keep, near = rejection_decisions(old.double() - rollout.double(), mask, seg, 2,
                                     parse_rollout_rs("seq_mean_k1", f"0.5_{up!r}"))
    assert near.tolist() == [True, True, True, False, False]
    # a token rejected by another option far from its bound is not ambiguous
    keep, near = rejection_decisions(old.double() - rollout.double(), mask, seg, 2,
                                     parse_rollout_rs("token_k1,token_k2", f"0.5_{up!r},0.001"))
    assert keep.tolist() == [False, False, False, True, True] and not bool(near.any())


def _near_token(tmp_path):
    """A token whose k1 (rollout − old) becomes the upper bound: the threshold string is exp(k1) of it."""
    probe = produce_loss_bundle(tmp_path / "probe", 5, SIZE, CFG)
    r = BundleReader(probe)
    old, rollout = r.payload("old_log_probs"), r.payload("rollout_log_probs")
    mask = torch.tensor([m for i in range(len(r.index.samples)) for m in r.sample_mask(i)], dtype=torch.float32)
    k1 = (rollout.double() - old.double())
    i = int(torch.nonzero((mask > 0) & (k1 > 0.2) & (k1 < 0.4))[0])
    far = int(torch.nonzero((mask > 0) & (k1 > -0.3) & (k1 < 0.0))[0])  # kept, far from both bounds
    return i, far, f"0.5_{math.exp(float(k1[i]))!r}"


def _bundle(tmp_path, name, threshold, flip: int):
    """verl-like rejection in float64, with the decision of token ``flip`` (index on the token axis) the other way."""
    chain = parse_rollout_rs("token_k1", threshold)

    def reject(old, rollout, mask, lengths):
        keep, _ = rejection_decisions(old.double() - rollout.double(), torch.as_tensor(mask), _seg(lengths),
                                      len(lengths), chain)
        keep = keep.clone()
        keep[flip] = ~keep[flip]
        return torch.as_tensor(mask) * keep.to(torch.as_tensor(mask).dtype)

    return produce_loss_bundle(tmp_path / name, 5, SIZE, CFG, reject=reject,
                               config_extra=dict(rollout_rs="token_k1", rollout_rs_threshold=threshold))


def test_a_decision_at_the_threshold_is_a_hazard_not_a_divergence(cli, tmp_path):
    i, _, threshold = _near_token(tmp_path)
    path = _bundle(tmp_path, "near", threshold, flip=i)
    code, out, err = cli("replay", path, "--stage", "loss.policy", "--format", "json")
    assert (code, err) == (0, ""), out
    import json

    doc = json.loads(out)
    hazards = [h for h in doc["hazards"] if h["kind"] == "rs_boundary"]
    assert len(hazards) == 1 and hazards[0]["stage"] == "loss.policy"
    assert hazards[0]["message"].endswith(": 1 loss token(s) whose rejection-sampling decision (rollout_rs) lies "
                                          "within rounding of its threshold: a legitimate producer may keep or drop "
                                          "them (the loss admits either: the other decision fits the recorded "
                                          "loss)")


def test_a_decision_far_from_the_threshold_still_diverges(cli, tmp_path):
    """The near token is there (a hazard), but the producer took a far token's decision the other way."""
    _, far, threshold = _near_token(tmp_path)
    path = _bundle(tmp_path, "far", threshold, flip=far)
    code, out, err = cli("replay", path, "--stage", "loss.policy")
    assert code == 1 and "[   fail] loss.policy — loss field mismatch: loss, pg_loss" in out
    assert "rs_boundary" in out
