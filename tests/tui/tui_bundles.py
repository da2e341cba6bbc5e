"""Bundles the TUI tests open: the demo set plus hand-made faults with known numbers.

Every synthetic one is written with ``settle=True`` (see replay_lib.demo): its bytes, and the digits the replay
shows for it, are the same on every host, so no snapshot depends on the CPU's floating point."""

from __future__ import annotations

from pathlib import Path

from replay_lib.demo import bundles as demo
# the screenshot demos live in the library (``replay-tui --demo kl-bug``); their numbers, for the tests
from replay_lib.demo import (KL_BUG_DELTA, KL_BUG_TOKENS, LOOSE_KL_ATOL, LOOSE_KL_DELTAS,  # noqa: F401
                             LOOSE_KL_TOKENS, LOSS_BUG_DELTA, write_hazard_clean, write_kl_bug, write_loose_kl,
                             write_loss_bug)
from replay_lib.bundle.schema import ProducerInfo

BRACKET_PREFIX = "[red]s-"


def fixed_producer() -> ProducerInfo:
    return ProducerInfo(commit="demo", dirty_patch_digest=None, torch_version="test")


def write_brackets(path: Path) -> Path:
    """Sample ids that look like markup (``[red]s-0``); the first sample's normalized reward is off by 1."""
    manifest, index, expected, payloads = demo.synthetic_parts(samples=4, tokens=4, seed=7, bundle_id="[b]brackets",
                                                               sample_prefix=BRACKET_PREFIX, settle=True)
    rewards = list(expected["reward.post_process"]["rewards"])
    rewards[0] += 1.0
    expected = dict(expected, **{"reward.post_process": {"rewards": rewards}})
    return demo.write_bundle(path, manifest, index, expected, payloads)


def write_refused(path: Path) -> Path:
    """A knob this engine cannot recompute (use_rollout_logprobs; use_tis, which this bundle once set, is
    recomputed since SPEC §4.2): replay refuses with exit 4."""
    import msgspec

    manifest, index, expected, payloads = demo.synthetic_parts(samples=4, tokens=4, bundle_id="refused",
                                                               settle=True)
    index = msgspec.structs.replace(index, config=msgspec.structs.replace(index.config, use_rollout_logprobs=True))
    return demo.write_bundle(path, manifest, index, expected, payloads)


# --------------------------------------------------------------------------------- sample support

SUPPORT_VOCAB = 8
# s-0: three loss-bearing tokens, the last an appended EOS without support (full_log_probs −0.25);
# s-1: an observation token (loss mask 0, no support), then one sampled token. Token s-0@0 has support
# ids [5, 2, 7] with logits [2, 1, 0] and samples id 2 (member 1).
SUPPORT_LENGTHS = [3, 2]
SUPPORT_MASKS = [[1, 1, 1], [0, 1]]
SUPPORT_IDS = [[5, 2, 7], [3, 0, -1], [-1, -1, -1], [-1, -1, -1], [1, 6, 4]]
SUPPORT_LOGITS = [[2.0, 1.0, 0.0], [0.5, 0.5, 99.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-1.0, 0.0, 1.0]]
SUPPORT_SAMPLED = [2, 3, 7, 4, 4]
SUPPORT_FULL = [-1.6, -0.9, -0.25, -3.0, -0.6]
# logp_S of s-0@0: 1 − 2 − ln(1 + e^−1 + e^−2); s-0@1: −ln 2; s-1@1: 1 − 1 − ln(e^−2 + e^−1 + 1)
LOGP_S00 = -1.40760596444437967
LOGP_S01 = -0.69314718055994531
LOGP_S11 = -0.40760596444437967
# The recorded log_probs: s-1@1 is off (−0.5 instead of logp_S); s-1@0 is not compared (loss mask 0).
SUPPORT_LOG_PROBS = [LOGP_S00, LOGP_S01, -0.25, -3.0, -0.5]
# support-invariants: token → the invariant it breaks (all loss-bearing)
INVARIANT_TOKENS = {("s-1", 3): "sampled_not_in_support", ("s-2", 5): "support_duplicate",
                    ("s-3", 2): "unsupported_token"}


def write_support_hand(path: Path) -> Path:
    """The hand-derived two-sample support bundle above (stages sample + logprob.support)."""
    import torch

    from replay_lib.bundle import BundleWriter
    from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, ComparisonPolicy, Identity, Manifest,
                                   RecomputeConfig, SampleRecord, StageId)

    samples = [SampleRecord(sample_id=f"s-{i}", group_index=0, response_length=n, total_length=n + 4,
                            loss_mask=m, raw_reward=1.0, micro_batch_id="mb-0000")
               for i, (n, m) in enumerate(zip(SUPPORT_LENGTHS, SUPPORT_MASKS))]
    index = BundleIndex(bundle_id="support-hand",
                        identity=Identity(actor_step_id=ActorStepId(rollout_id=5, step_id=0),
                                          rank={"dp": 1, "tp": 1, "pp": 1, "cp": 1}),
                        samples=samples, config=RecomputeConfig(n_samples_per_prompt=2, vocab_size=SUPPORT_VOCAB))
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id="support-hand", producer=fixed_producer(),
                        stage_contracts=demo.contracts((StageId.SAMPLE, StageId.LOGPROB_SUPPORT)), payloads={},
                        comparison_policy=ComparisonPolicy(), redaction={})
    writer = BundleWriter(path, manifest, index, {})
    writer.write_payload("support_ids", torch.tensor(SUPPORT_IDS, dtype=torch.int32))
    writer.write_payload("support_logits", torch.tensor(SUPPORT_LOGITS))
    writer.write_payload("sampled_token_ids", torch.tensor(SUPPORT_SAMPLED, dtype=torch.int64))
    writer.write_payload("full_log_probs", torch.tensor(SUPPORT_FULL))
    writer.write_payload("log_probs", torch.tensor(SUPPORT_LOG_PROBS))
    return writer.finalize(ranks=[0])


def write_support_invariants(path: Path) -> Path:
    """4 samples × 8 tokens, top-4 rows, every token loss-bearing, the values consistent; three rows break
    an invariant (INVARIANT_TOKENS): s-1@3 samples an id outside its row, s-2@5 repeats a member, s-3@2 has
    no support although it is not the trajectory's last token (whose appended EOS has none either)."""
    import msgspec

    from replay_lib.bundle.schema import StageId

    manifest, index, expected, payloads = demo.support_parts(
        samples=4, tokens=8, k=4, vocab_size=64, seed=9, bundle_id="support-invariants",
        stages=(StageId.SAMPLE, StageId.LOGPROB_SUPPORT), settle=True)
    records = [msgspec.structs.replace(r, loss_mask=[1] * r.response_length) for r in index.samples]
    index = msgspec.structs.replace(index, samples=records)
    ids = payloads["support_ids"].clone()
    sampled = payloads["sampled_token_ids"].clone()
    t = 1 * 8 + 3
    sampled[t] = next(x for x in range(64) if x not in ids[t].tolist())
    t = 2 * 8 + 5
    ids[t, 3] = ids[t, 0]
    ids[3 * 8 + 2] = -1
    payloads = dict(payloads, support_ids=ids, sampled_token_ids=sampled)
    return demo.write_bundle(path, manifest, index, {}, payloads)


def write_all(root: Path) -> Path:
    """Every bundle the TUI tests (and the screenshot script) open, under fixed names in ``root``."""
    saved = demo.producer
    demo.producer = fixed_producer  # no torch version on screen: snapshots are machine-independent
    try:
        demo.write_pr65(root / "pr65-buggy", buggy=True)
        demo.write_pr65(root / "pr65-fixed", buggy=False, bundle_id="b-00001-fixed")
        demo.write_step_loss(root / "step-loss")
        demo.write_cohort(root / "cohort-2rank", settle=True)
        write_kl_bug(root / "kl-bug")
        write_loss_bug(root / "loss-bug")
        write_loose_kl(root / "loose-kl")
        write_hazard_clean(root / "hazard-clean")
        write_brackets(root / "brackets")
        write_refused(root / "refused")
        demo.write_support_bundle(root / "support-fullvocab", **demo.SUPPORT_DEMO)
        write_support_hand(root / "support-hand")
        write_support_invariants(root / "support-invariants")
        broken = demo.write_pr65(root / "broken", buggy=True)
        (broken / "COMPLETE").unlink()
    finally:
        demo.producer = saved
    return root
