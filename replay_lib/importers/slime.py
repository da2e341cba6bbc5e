"""slime's ``--save-debug-train-data`` dump (format_version 2) [+ ``--save-debug-rollout-data``] → a rollout-level
bundle (SPEC §8).

Read from THUDM/slime @ 624b824a898a (2026-08-21):

* the train dump is ``torch.save`` of ``{"format_version": 2, "rollout_id", "rank", "samples", "dp_shards",
  "raw_reward"}`` (``slime/observability/train_data_utils.py:181-188``). Each sample holds the per-sample
  columns of the rank's rollout data plus ``data_parallel_rank``, ``sample_index`` and ``rollout_position`` (its
  index in the rollout dump, ``train_data_utils.py:131,154-162``), sorted by ``rollout_position``
  (``:165-174``): ``tokens``, ``response_lengths``, ``rewards`` (normalized), ``truncated``, ``rollout_ids``,
  ``loss_masks``, ``rollout_mask_sums`` (``slime/ray/rollout.py:657-700``), ``total_lengths`` and
  ``local_raw_reward`` (``slime/utils/data.py:318,326-327``), per-token ``rollout_log_probs`` (``rollout.py:715-716``),
  ``log_probs`` (old, recomputed or captured from the training forward, ``slime/backends/megatron_utils/actor.py:
  481-487,517-541``), ``ref_log_probs``, ``kl``, ``advantages``, ``returns``
  (``slime/backends/megatron_utils/loss.py:743-881``). ``dp_shards[r]`` keeps ``partition`` (the rank's rollout
  positions) and ``micro_batch_indices`` (per micro-batch, indices into ``partition``;
  ``slime/utils/dp_schedule.py:200-207``). The whole-batch ``raw_reward`` is in rollout order
  (``rollout.py:808-812``).
* the rollout dump is ``torch.save({"rollout_id", "samples": [Sample.to_dict()]})``
  (``slime/observability/rollout_data_utils.py:140-153``): ``group_index`` and the raw ``reward`` (a number, or a
  dict read with ``--reward-key``; ``slime/utils/types.py:246-247``).

Stages: ``sample``, ``reward.raw``, ``advantage.kl``, ``advantage.estimate`` recompute; ``reward.post_process``
too when the rollout dump gives the group ids (without it: inspect-only, never a group guessed from positions);
``loss.policy`` / ``loss.value`` are inspect-only (the dump has no loss scalar, no training-forward entropy and no
current-policy log-probs after the first optimizer step). slime normalizes by reshaping the batch by n
(``rollout.py:618-623``), the replay by ``group_index``: a run hit by slime#2230 diverges at reward.post_process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from ..frameworks.slime import from_slime
from ..bundle.schema import Identity, SampleRecord, StageId
from ._common import DumpFields, ImportResult, _kind, load_pt, with_group_size, write_import

FORMAT_VERSION = 2
SAMPLE_KEYS = ("rollout_position", "tokens", "response_lengths", "total_lengths", "rewards", "loss_masks",
               "log_probs", "kl", "advantages")
LOSS_REASON = ("not in slime's train dump: no loss scalar, no entropy or current-policy log-probs of the "
               "training forward (slime/observability/train_data_utils.py:112-188)")
VALUE_REASON = "not imported: the value loss's old values and clip are not in slime's train dump"


def import_slime(train_dump: Path, out: Path, *, rollout_dump: Optional[Path] = None, config: Any = None,
                 config_where: Optional[str] = None, n_samples_per_prompt: Optional[int] = None,
                 reward_key: Optional[str] = None) -> ImportResult:
    """Write the bundle of one slime rollout at ``out``. ``config``: slime's arguments (see
    :func:`~replay_lib.frameworks.from_slime`), default slime's defaults."""
    train_dump = Path(train_dump)
    dump = DumpFields(train_dump, "slime train dump")
    obj = load_pt(train_dump, "slime train dump")
    version = dump.require(obj, "format_version", "")
    if isinstance(version, torch.Tensor) and version.numel() == 1 and not version.is_floating_point():
        version = int(version.item())
    if type(version) is not int or version != FORMAT_VERSION:
        small = isinstance(version, (float, str)) or (isinstance(version, int) and abs(version) < 1 << 63)
        shown = repr(version) if small else f"got {_kind(version)}"  # a tensor's values are never printed
        dump.fail("format_version", f"{shown}, expected {FORMAT_VERSION} (--save-debug-train-data of "
                                    "slime/observability/train_data_utils.py:181-188)")
    rollout_id = dump.integer(dump.require(obj, "rollout_id", ""), "rollout_id")
    raw_samples = dump.require(obj, "samples", "")
    if not isinstance(raw_samples, list) or not raw_samples:
        dump.fail("samples", "expected a non-empty list of sample dicts")
    notes: list[str] = []
    cfg = from_slime(config if config is not None else {}, where=config_where)
    rows = [_sample(dump, s, f"samples[{i}]") for i, s in enumerate(raw_samples)]
    positions = [r["pos"] for r in rows]
    if len(set(positions)) != len(positions):
        dup = next(p for p in positions if positions.count(p) > 1)
        dump.fail("samples[].rollout_position", f"{dup} appears twice")
    order = sorted(range(len(rows)), key=lambda i: positions[i])
    rows = [rows[i] for i in order]
    mb_of, dp_size = _micro_batches(dump, obj.get("dp_shards"), set(positions))

    reasons: dict[StageId, str] = {StageId.LOSS_POLICY: LOSS_REASON, StageId.LOSS_VALUE: VALUE_REASON}
    if rollout_dump is not None:
        groups, raw = _join_rollout(Path(rollout_dump), rollout_id, rows, reward_key)
    else:
        groups = [None] * len(rows)
        raw = _train_raw_rewards(dump, obj, rows)
        reasons[StageId.REWARD_POST_PROCESS] = ("no group ids: slime's train dump has none; pass --rollout-dump "
                                                "(groups are never inferred from positions)")
    if raw is None:
        reasons[StageId.REWARD_RAW] = "no raw rewards in the train dump (raw_reward) and no rollout dump"
        reasons.setdefault(StageId.REWARD_POST_PROCESS, "no raw rewards to normalize")
    source = Path(rollout_dump).name if rollout_dump is not None else train_dump.name
    cfg = with_group_size(cfg, n_samples_per_prompt, config is not None, groups, source, notes)

    old_key = "rollout_log_probs" if cfg.use_rollout_logprobs else "log_probs"  # loss.py:730-731
    payloads = {"old_log_probs": _cat(dump, rows, old_key), "kl": _cat(dump, rows, "kl"),
                "advantages": _cat(dump, rows, "advantages")}
    for key in ("ref_log_probs", "rollout_log_probs", "values", "returns"):  # values: the critic's (ppo)
        if all(key in r["tensors"] for r in rows):
            payloads[key] = _cat(dump, rows, key)
    if cfg.advantage_estimator == "gae" and "values" not in payloads:
        reasons[StageId.ADVANTAGE_ESTIMATE] = "GAE (--advantage-estimator ppo) needs the critic's values; the train " \
                                              "dump has none"
    if cfg.kl_coef != 0 and "ref_log_probs" not in payloads:
        reasons[StageId.ADVANTAGE_KL] = "kl_coef != 0 but the train dump has no ref_log_probs"
    samples = [
        SampleRecord(sample_id=f"s-{r['pos']}", group_index=g, response_length=r["R"], total_length=r["T"],
                     loss_mask=r["mask"], raw_reward=None if raw is None else raw[k], reward=r["reward"],
                     micro_batch_id=mb_of.get(r["pos"]))
        for k, (r, g) in enumerate(zip(rows, groups))
    ]
    expected: dict = {"reward.post_process": {"rewards": [r["reward"] for r in rows]}}
    if raw is not None:
        expected["reward.raw"] = {"raw_rewards": list(raw)}
    identity = Identity(rollout_id=rollout_id, micro_batch_ids=sorted(set(mb_of.values())),
                        semantic_group_ids=sorted({g for g in groups if g is not None}), rank={"dp": dp_size})
    return write_import(out, source="slime", identity=identity, samples=samples, config=cfg, expected=expected,
                        payloads=payloads, reasons=reasons, notes=notes)


def _sample(dump: DumpFields, s: Any, where: str) -> dict:
    for key in SAMPLE_KEYS:
        dump.require(s, key, where)
    pos = dump.integer(s["rollout_position"], f"{where}.rollout_position")
    R = dump.integer(s["response_lengths"], f"{where}.response_lengths")
    T = dump.integer(s["total_lengths"], f"{where}.total_lengths")
    if pos < 0:
        dump.fail(f"{where}.rollout_position", f"{pos} is negative")
    if not 0 <= R <= T:
        dump.fail(f"{where}.response_lengths", f"{R} is not within [0, total_lengths={T}]")
    dump.vector(s["tokens"], f"{where}.tokens", T, torch.int64)
    mask = dump.vector(s["loss_masks"], f"{where}.loss_masks", R, torch.int64).tolist()
    tensors = {key: dump.vector(s[key], f"{where}.{key}", R)
               for key in ("log_probs", "kl", "advantages", "ref_log_probs", "rollout_log_probs", "values", "returns")
               if key in s}
    reward = dump.number(s["rewards"], f"{where}.rewards")
    local_raw = dump.number(s["local_raw_reward"], f"{where}.local_raw_reward") if "local_raw_reward" in s else None
    return {"pos": pos, "R": R, "T": T, "mask": mask, "tensors": tensors, "reward": reward, "local_raw": local_raw,
            "where": where}


def _cat(dump: DumpFields, rows: list[dict], key: str) -> torch.Tensor:
    for r in rows:
        if key not in r["tensors"]:
            dump.fail(f"{r['where']}.{key}", "missing")
    return torch.cat([r["tensors"][key] for r in rows]) if rows else torch.zeros(0)


def _micro_batches(dump: DumpFields, shards: Any, positions: set[int]) -> tuple[dict[int, str], int]:
    """``{rollout_position: micro-batch id}`` from ``dp_shards`` (``mb-0000`` per rank's data-iterator index,
    ``dp<r>-mb-0000`` when there are several ranks) and the DP size; absent shards: no ids."""
    if shards is None:
        return {}, 1
    if not isinstance(shards, list) or not shards:
        dump.fail("dp_shards", "expected a non-empty list of shard layouts")
    out: dict[int, str] = {}
    for r, shard in enumerate(shards):
        where = f"dp_shards[{r}]"
        part = dump.require(shard, "partition", where)
        mbs = dump.require(shard, "micro_batch_indices", where)
        if not isinstance(part, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in part):
            dump.fail(f"{where}.partition", "expected a list of rollout positions")
        if not isinstance(mbs, list):
            dump.fail(f"{where}.micro_batch_indices", "expected a list of index lists")
        dp = shard.get("data_parallel_rank", r)
        prefix = f"dp{dp}-" if len(shards) > 1 else ""
        for k, local in enumerate(mbs):
            if not isinstance(local, list):
                dump.fail(f"{where}.micro_batch_indices[{k}]", "expected a list of indices")
            for j in local:
                if not isinstance(j, int) or not 0 <= j < len(part):
                    dump.fail(f"{where}.micro_batch_indices[{k}]", f"index {j!r} outside partition "
                                                                   f"(length {len(part)})")
                if part[j] not in positions:
                    dump.fail(f"{where}.partition[{j}]", f"rollout position {part[j]} has no sample")
                out[part[j]] = f"{prefix}mb-{k:04d}"
    return out, len(shards)


def _train_raw_rewards(dump: DumpFields, obj: dict, rows: list[dict]) -> Optional[list[float]]:
    """The raw rewards the train dump logged: the whole-batch ``raw_reward`` at each rollout position, else each
    sample's ``local_raw_reward``."""
    whole = obj.get("raw_reward")
    if isinstance(whole, list):
        out = []
        for r in rows:
            if not r["pos"] < len(whole):
                dump.fail("raw_reward", f"{len(whole)} value(s); rollout_position {r['pos']} is beyond them")
            out.append(dump.number(whole[r["pos"]], f"raw_reward[{r['pos']}]"))
        return out
    if all(r["local_raw"] is not None for r in rows):
        return [r["local_raw"] for r in rows]
    return None


def _join_rollout(path: Path, rollout_id: int, rows: list[dict],
                  reward_key: Optional[str]) -> tuple[list[int], list[float]]:
    """Group ids and raw rewards of the train samples, from the rollout dump's samples at their positions."""
    dump = DumpFields(path, "slime rollout dump")
    obj = load_pt(path, "slime rollout dump")
    rid = dump.integer(dump.require(obj, "rollout_id", ""), "rollout_id")
    if rid != rollout_id:
        dump.fail("rollout_id", f"{rid}, but the train dump is of rollout {rollout_id}")
    samples = dump.require(obj, "samples", "")
    if not isinstance(samples, list):
        dump.fail("samples", "expected a list of sample dicts")
    groups, raw = [], []
    for r in rows:
        where = f"samples[{r['pos']}]"
        if r["pos"] >= len(samples):
            dump.fail("samples", f"{len(samples)} sample(s); the train dump's rollout_position {r['pos']} is "
                                 "beyond them")
        s = samples[r["pos"]]
        group = dump.require(s, "group_index", where)
        if group is None:
            dump.fail(f"{where}.group_index", "None: the sample's semantic group is unknown")
        groups.append(dump.integer(group, f"{where}.group_index"))
        length = dump.integer(dump.require(s, "response_length", where), f"{where}.response_length")
        if length != r["R"]:
            dump.fail(f"{where}.response_length", f"{length}, but the train dump's sample at this position has "
                                                  f"response_lengths={r['R']}")
        reward = dump.require(s, "reward", where)
        if isinstance(reward, dict):  # slime/utils/types.py:246-247: reward[args.reward_key]
            if reward_key is None:
                dump.fail(f"{where}.reward", f"a dict of {sorted(map(str, reward))}; pass --reward-key")
            if reward_key not in reward:
                dump.fail(f"{where}.reward.{reward_key}", "missing")
            reward = reward[reward_key]
        raw.append(dump.number(reward, f"{where}.reward"))
    return groups, raw
