"""Format 2.0.0, the original tool's second major (Relax ``relax/utils/replay/schema.py`` @ 78973a59), read and written
through the one 1.x model of :mod:`.schema`.

What 2.0 changed: the reward stages ``reward.raw`` and ``reward.post_process`` are gone (the DAG is sample →
advantage.kl → advantage.estimate → loss.policy, stage versions ``v2``); a sample's ``raw_reward`` is gone and its
``reward`` — the post-processed reward advantage estimation consumes, one per sample or ``response_length`` per-token
values — is required; the config's ``n_samples_per_prompt`` and ``grpo_std_normalization`` and the identity's
``normalization_cohort_ids`` are gone; expected.json has no reward keys. Manifest keys, payload specs, the sentinels
and the cohort layout are unchanged.

Reading: :func:`check_read` (the rules the reader adds for either major). Writing: :func:`wire_index`,
:func:`wire_manifest_2` and :func:`wire_expected` turn the model into the 2.0 documents, and :func:`lost_in_2` says
by name what a bundle loses on the way.
"""

from __future__ import annotations

import math
from typing import Optional

import msgspec

from .schema import (FORMAT_2_REMOVED_CONFIG, FORMAT_2_REMOVED_IDENTITY, FORMAT_2_REMOVED_SAMPLE,
                     FORMAT_2_REMOVED_STAGES, FORMAT_2_STAGE_IDS, BundleIndex, Expected, Manifest,
                     StageCapability, StageId)

# What ``trajectory-replay convert --to`` writes: the original's two majors and our current form (format 1.3.0,
# ``packed.PACKED_FORMAT_VERSION``), each from any of the others.
CONVERT_TARGETS = ("2.0.0", "1.0.0", "1.3.0")


def per_token_reward_error(index: BundleIndex) -> Optional[str]:
    """``$.samples[i].reward: …`` for the first per-token reward whose length is not its sample's
    ``response_length`` (either major), else ``None``."""
    for i, s in enumerate(index.samples):
        reward = s.reward
        if type(reward) is list and len(reward) != s.response_length:
            return (f"$.samples[{i}].reward: {len(reward)} per-token value(s) for response_length "
                    f"{s.response_length} (a per-token reward has one value per response token)")
    return None


def check_read(manifest: Manifest, index: BundleIndex, expected: Expected, major: int,
               raw_manifest: dict) -> tuple[Optional[tuple[str, str]], list[tuple[str, str]]]:
    """``(error, warnings)`` of a decoded bundle of format ``major``: the error as ``(file, message)`` (the reader
    raises it, exit 3), each warning as ``(file, message)``. A 2.0 bundle's expected reward keys (no 2.0 stage
    reads them) are removed from ``expected``."""
    bad = per_token_reward_error(index)
    if bad is not None:
        return ("index.json", bad), []
    if major != 2:
        return None, []
    for section in ("stage_contracts", "extension_stage_contracts"):
        contracts = raw_manifest.get(section)
        for stage in FORMAT_2_REMOVED_STAGES:
            if isinstance(contracts, dict) and stage in contracts:
                return ("manifest.json", f"$.{section}.{stage}: not a stage of format 2.0 (its reward stages "
                                         f"were removed: the recorded reward is advantage.estimate's input)"), []
    if _estimates(manifest):
        for i, s in enumerate(index.samples):
            if s.reward is None:
                return ("index.json", f"$.samples[{i}].reward: null, but advantage.estimate (declared recompute) "
                                      f"consumes it: format 2.0 records no other reward"), []
    warnings = []
    with_raw = [i for i, s in enumerate(index.samples) if s.raw_reward is not None]
    if with_raw:
        warnings.append(("index.json", f"$.samples[{with_raw[0]}].raw_reward: not a field of format 2.0 (ignored; "
                                       f"{len(with_raw)} sample(s) hold one)"))
        for i in with_raw:  # ignored for real: nothing downstream (an explanation) reads it
            index.samples[i] = msgspec.structs.replace(index.samples[i], raw_reward=None)
    for stage in FORMAT_2_REMOVED_STAGES:
        if stage in expected:
            del expected[stage]
            warnings.append(("expected.json", f"$.{stage}: not a stage of format 2.0 (ignored)"))
    return None, warnings


# -- writing ---------------------------------------------------------------------------------------------------


def lost_in_2(manifest: Manifest, index: BundleIndex, expected: Expected) -> list[str]:
    """What a bundle of ours holds that format 2.0 cannot, each named (empty: nothing is lost)."""
    lost = []
    for stage in FORMAT_2_REMOVED_STAGES:
        contract = manifest.stage_contracts.get(StageId(stage))
        if contract is not None:
            what = "recompute" if contract.capability == StageCapability.RECOMPUTE else contract.capability.value
            lost.append(f"stage {stage} ({what}): not in format 2.0, dropped")
    for stage in FORMAT_2_REMOVED_STAGES:
        for key in expected.get(stage, {}):
            lost.append(f"expected.json $.{stage}.{key}: not in format 2.0, dropped")
    raws = sum(s.raw_reward is not None for s in index.samples)
    if raws:
        lost.append(f"index.json $.samples[].raw_reward ({raws} sample(s)): not in format 2.0, dropped")
    config = msgspec.to_builtins(index.config)
    for knob in FORMAT_2_REMOVED_CONFIG:
        lost.append(f"index.json $.config.{knob}={config[knob]!r}: not in format 2.0, dropped")
    ids = index.identity.normalization_cohort_ids
    if ids:
        lost.append(f"index.json $.identity.normalization_cohort_ids ({len(ids)}): not in format 2.0, dropped")
    return lost


def wire_index(index: BundleIndex) -> dict:
    """index.json of format 2.0: the model without the fields 2.0 removed."""
    doc = msgspec.to_builtins(index)
    for sample in doc["samples"]:
        for key in FORMAT_2_REMOVED_SAMPLE:
            sample.pop(key, None)
    for key in FORMAT_2_REMOVED_CONFIG:
        doc["config"].pop(key, None)
    for key in FORMAT_2_REMOVED_IDENTITY:
        doc["identity"].pop(key, None)
    return doc


def wire_manifest_2(doc: dict) -> dict:
    """The written manifest (``writer.wire_manifest``'s dict) made 2.0: the reward stages' contracts removed, every
    2.0 stage's version ``v2``."""
    for section in ("stage_contracts", "extension_stage_contracts"):
        contracts = doc.get(section) or {}
        for stage in FORMAT_2_REMOVED_STAGES:
            contracts.pop(stage, None)
        for stage, contract in contracts.items():
            if stage in FORMAT_2_STAGE_IDS:
                contract["version"] = "v2"
    if not doc.get("extension_stage_contracts"):  # the original's 2.0 validate flags a top-level key it does not know
        doc.pop("extension_stage_contracts", None)
    return doc


def wire_expected(expected: Expected) -> Expected:
    """expected.json of format 2.0: no reward keys."""
    return {stage: values for stage, values in expected.items() if stage not in FORMAT_2_REMOVED_STAGES}


def _estimates(manifest: Manifest) -> bool:
    contract = manifest.stage_contracts.get(StageId.ADVANTAGE_ESTIMATE)
    return contract is not None and contract.capability == StageCapability.RECOMPUTE


def missing_reward(index: BundleIndex, manifest: Optional[Manifest] = None) -> Optional[str]:
    """``$.samples[i].reward: …`` for the first sample without the reward a 2.0 advantage.estimate consumes (its
    only reward), else ``None``; ``None`` too when ``manifest`` declares no advantage.estimate recompute."""
    if manifest is not None and not _estimates(manifest):
        return None
    for i, s in enumerate(index.samples):
        if s.reward is None:
            return (f"$.samples[{i}].reward: null, and format 2.0 requires each sample's post-processed reward "
                    f"(sample {s.sample_id!r})")
    return None


def refused_in_2(manifest: Manifest, index: BundleIndex, expected: Expected) -> list[str]:
    """What a caller asked :class:`~.writer.BundleWriter` to write as 2.0 that the format cannot hold (the config's
    two removed knobs excepted: every model has them, and they are left out), each named."""
    out = [item for item in lost_in_2(manifest, index, expected) if not item.startswith("index.json $.config.")]
    reward = missing_reward(index, manifest)
    return out + ([f"index.json {reward}"] if reward else [])


def has_per_token_reward(index: BundleIndex) -> bool:
    return any(type(s.reward) is list for s in index.samples)


def nonfinite_reward(sample) -> bool:
    """Whether a sample record's raw or post-processed reward holds a non-finite value."""
    for value in (sample.raw_reward, sample.reward):
        if type(value) is float:
            if not math.isfinite(value):
                return True
        elif type(value) is list and not all(math.isfinite(x) for x in value):
            return True
    return False

