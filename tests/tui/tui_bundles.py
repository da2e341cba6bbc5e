"""Bundles the TUI tests open: the demo set plus hand-made faults with known numbers."""

from __future__ import annotations

from pathlib import Path

from replay_lib import demo
from replay_lib.schema import ProducerInfo

KL_BUG_TOKENS = {"s-5": (3, 7, 11), "s-6": (0,)}  # sample → token offsets whose expected kl is +0.25
KL_BUG_DELTA = 0.25
LOSS_BUG_DELTA = 0.5
BRACKET_PREFIX = "[red]s-"


def fixed_producer() -> ProducerInfo:
    return ProducerInfo(commit="demo", dirty_patch_digest=None, torch_version="test")


def write_kl_bug(path: Path) -> Path:
    """8 samples × 16 tokens, two groups; the recorded kl is off by +0.25 at s-5@3,7,11 and s-6@0."""
    manifest, index, expected, payloads = demo.synthetic_parts(samples=8, tokens=16, seed=3, bundle_id="kl-bug")
    kl = payloads["kl"].clone()
    for sid, offsets in KL_BUG_TOKENS.items():
        i = int(sid.split("-")[1])
        for off in offsets:
            kl[i * 16 + off] += KL_BUG_DELTA
    payloads["kl"] = kl
    return demo.write_bundle(path, manifest, index, expected, payloads)


def write_loss_bug(path: Path) -> Path:
    """Step-level bundle whose recorded pg_loss (and so loss) is off by +0.5."""
    manifest, index, expected, payloads = demo.synthetic_parts(samples=4, tokens=8, seed=5, bundle_id="loss-bug",
                                                               stages=demo.STEP_STAGES)
    loss = dict(expected["loss.policy"])
    loss["pg_loss"] += LOSS_BUG_DELTA
    loss["loss"] += LOSS_BUG_DELTA
    return demo.write_bundle(path, manifest, index, {"loss.policy": loss}, payloads)


def write_brackets(path: Path) -> Path:
    """Sample ids that look like markup (``[red]s-0``); the first sample's normalized reward is off by 1."""
    manifest, index, expected, payloads = demo.synthetic_parts(samples=4, tokens=4, seed=7, bundle_id="[b]brackets",
                                                               sample_prefix=BRACKET_PREFIX)
    rewards = list(expected["reward.post_process"]["rewards"])
    rewards[0] += 1.0
    expected = dict(expected, **{"reward.post_process": {"rewards": rewards}})
    return demo.write_bundle(path, manifest, index, expected, payloads)


def write_tis(path: Path) -> Path:
    """A knob V1 cannot recompute (use_tis): replay refuses with exit 4."""
    import msgspec

    manifest, index, expected, payloads = demo.synthetic_parts(samples=4, tokens=4, bundle_id="tis")
    index = msgspec.structs.replace(index, config=msgspec.structs.replace(index.config, use_tis=True))
    return demo.write_bundle(path, manifest, index, expected, payloads)


def write_all(root: Path) -> Path:
    """Every bundle the TUI tests (and the screenshot script) open, under fixed names in ``root``."""
    saved = demo.producer
    demo.producer = fixed_producer  # no torch version on screen: snapshots are machine-independent
    try:
        demo.write_pr65(root / "pr65-buggy", buggy=True)
        demo.write_pr65(root / "pr65-fixed", buggy=False, bundle_id="b-00001-fixed")
        demo.write_step_loss(root / "step-loss")
        demo.write_cohort(root / "cohort-2rank")
        write_kl_bug(root / "kl-bug")
        write_loss_bug(root / "loss-bug")
        write_brackets(root / "brackets")
        write_tis(root / "tis")
        broken = demo.write_pr65(root / "broken", buggy=True)
        (broken / "COMPLETE").unlink()
    finally:
        demo.producer = saved
    return root
