"""NeMo-RL's ``train_data_step<N>.jsonl`` → a rollout-level bundle (SPEC §8).

Read from NVIDIA-NeMo/RL @ 7ea279abfbeb (2026-08-22): the GRPO loop writes one JSON object per sample with
``content``, ``rewards`` (the advantage input; ``filtered_rewards`` too under dynamic sampling, which is then the
input), ``input_lengths``, ``token_ids``, ``token_loss_mask``, ``sample_loss_mask``, ``advantages``,
``generation_logprobs``, ``prev_logprobs`` and optionally ``agent_ref`` (``nemo_rl/algorithms/grpo.py:3632-3653``),
each value a batch of one (``nemo_rl/utils/logger.py:1071-1096`` slices the batch by one and adds ``idx``).
Token arrays are padded rows over the whole sequence, prompt included.

Rebuilt here:

* groups from prompt-token equality, as NeMo-RL's baseline does (``nemo_rl/algorithms/utils.py:132-146``): a
  sample's prompt is its tokens before the first loss-bearing token, its response the rest up to
  ``input_lengths``;
* the normalized reward of a sample: its advantage at position 0 — GRPO broadcasts one value per sample over the
  whole row (``nemo_rl/algorithms/advantage_estimator.py:88-98``), and the assistant-span penalties never touch
  the prompt (``grpo.py:1994-2065``);
* ``loss_mask`` = ``token_loss_mask × sample_loss_mask`` over the response (the loss's mask,
  ``grpo.py:3289-3292``); payloads ``advantages``, ``old_log_probs`` (``prev_logprobs``) and
  ``rollout_log_probs`` (``generation_logprobs``) over the response tokens.

The dump has no reference log-probs and no loss: ``advantage.kl`` and ``loss.policy`` are inspect-only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from ..bundle.json_limits import JSONLimitError, loads_limited
from ..frameworks.nemo_rl import from_nemo_rl
from ..bundle.schema import Identity, SampleRecord, StageId
from ._common import DumpFields, ImportResult, read_dump, with_group_size, write_import

TOKEN_KEYS = ("token_ids", "token_loss_mask", "advantages", "generation_logprobs", "prev_logprobs")
SCALAR_KEYS = ("rewards", "input_lengths", "sample_loss_mask")
KL_REASON = ("not in NeMo-RL's train_data jsonl: no reference_policy_logprobs (nemo_rl/algorithms/grpo.py:"
             "3632-3653); its KL term is in the loss")
LOSS_REASON = ("not in NeMo-RL's train_data jsonl: no current-policy or reference log-probs, no "
               "global_valid_toks, no loss value")
VALUE_REASON = "not imported: a GRPO step has no value head"


def import_nemo_rl(jsonl: Path, out: Path, *, config: Any = None, config_where: Optional[str] = None,
                   n_samples_per_prompt: Optional[int] = None) -> ImportResult:
    """Write the bundle of one NeMo-RL GRPO step's training data at ``out``. ``config``: NeMo-RL's master config
    (see :func:`~replay_lib.frameworks.from_nemo_rl`), default NeMo-RL's defaults."""
    jsonl = Path(jsonl)
    dump = DumpFields(jsonl, "NeMo-RL train data")
    data = read_dump(jsonl, "NeMo-RL train data")
    try:
        data.decode("utf-8")  # checked whole first; the rows are then decoded one at a time from the bytes
    except UnicodeDecodeError as exc:
        dump.fail("", f"not UTF-8 text ({exc.reason} at byte {exc.start})")
    if not any(True for _ in _lines(data)):
        dump.fail("", "no records (expected one JSON object per line)")
    cfg = from_nemo_rl(config if config is not None else {}, where=config_where)
    rows = [_row(dump, line, i + 1) for i, line in enumerate(_lines(data))]
    del data
    seen: dict[int, int] = {}
    for lineno, r in enumerate(rows, 1):
        if r["idx"] in seen:
            dump.fail(f"line {lineno}.idx", f"{r['idx']} repeats line {seen[r['idx']]}'s")
        seen[r["idx"]] = lineno
    prompt_group: dict[tuple[int, ...], int] = {}
    groups = [prompt_group.setdefault(r["prompt"], len(prompt_group)) for r in rows]
    notes: list[str] = []
    cfg = with_group_size(cfg, n_samples_per_prompt, config is not None, groups, jsonl.name, notes)
    samples = [
        SampleRecord(sample_id=f"s-{r['idx']}", group_index=g, response_length=r["R"], total_length=r["T"],
                     loss_mask=r["mask"], raw_reward=r["raw"], reward=r["reward"])
        for r, g in zip(rows, groups)
    ]
    payloads = {name: torch.cat([r[name] for r in rows]) for name in ("advantages", "old_log_probs",
                                                                       "rollout_log_probs")}
    expected = {"reward.raw": {"raw_rewards": [r["raw"] for r in rows]},
                "reward.post_process": {"rewards": [r["reward"] for r in rows]}}
    reasons = {StageId.ADVANTAGE_KL: KL_REASON, StageId.LOSS_POLICY: LOSS_REASON, StageId.LOSS_VALUE: VALUE_REASON}
    identity = Identity(semantic_group_ids=sorted(set(groups)), rollout_id=_step_of(jsonl))
    return write_import(out, source="nemo-rl", identity=identity, samples=samples, config=cfg, expected=expected,
                        payloads=payloads, reasons=reasons, notes=notes)


def _step_of(path: Path) -> int:
    """The step number of ``train_data_step<N>.jsonl`` (the bundle's rollout anchor), else 0."""
    stem = path.name.split(".", 1)[0]
    digits = stem[len("train_data_step"):] if stem.startswith("train_data_step") else ""
    return int(digits) if digits.isdigit() else 0


def _one(dump: DumpFields, record: dict, key: str, where: str, per_token: bool) -> Any:
    """A value of a batch of one: ``[x]`` → ``x`` (a bare ``x`` is accepted too)."""
    value = dump.require(record, key, where)
    if isinstance(value, list) and len(value) == 1 and (not per_token or isinstance(value[0], list)):
        return value[0]
    if per_token and isinstance(value, list) and value and isinstance(value[0], list):
        dump.fail(f"{where}.{key}", f"a batch of {len(value)} rows, expected one")
    if not per_token and isinstance(value, list):
        dump.fail(f"{where}.{key}", f"a list of {len(value)} values, expected one")
    return value


def _lines(data: bytes) -> Iterator[bytes]:
    """The records of a jsonl file, one line's bytes at a time (blank lines skipped), never the whole text
    as one string or one list of lines."""
    start, end = 0, len(data)
    while start < end:
        stop = data.find(b"\n", start)
        stop = end if stop < 0 else stop
        line = data[start:stop]
        start = stop + 1
        if line.strip():
            yield line


def _row(dump: DumpFields, line: bytes, lineno: int) -> dict:
    where = f"line {lineno}"
    try:
        record = loads_limited(line, "a NeMo-RL row")
    except json.JSONDecodeError as exc:
        dump.fail(where, f"not JSON ({exc.msg} at column {exc.colno})")
    except JSONLimitError as exc:
        dump.fail(where, str(exc))
    if not isinstance(record, dict):
        dump.fail(where, f"expected a JSON object, got {type(record).__name__}")
    idx = dump.integer(record.get("idx", lineno - 1), f"{where}.idx")
    T = dump.integer(_one(dump, record, "input_lengths", where, False), f"{where}.input_lengths")
    if T < 1:
        dump.fail(f"{where}.input_lengths", f"{T}, expected at least 1")
    raw_key = "filtered_rewards" if "filtered_rewards" in record else "rewards"  # grpo.py:3095-3098,3637-3640
    raw = dump.number(_one(dump, record, raw_key, where, False), f"{where}.{raw_key}")
    sample_mask = dump.number(_one(dump, record, "sample_loss_mask", where, False), f"{where}.sample_loss_mask")
    dump.require(record, "rewards", where)
    arrays = {}
    for key in TOKEN_KEYS:
        value = _one(dump, record, key, where, True)
        # padding beyond input_lengths (and the prompt) may hold anything: finiteness is checked on the response
        t = dump.vector(value, f"{where}.{key}", None, torch.int64 if key in ("token_ids", "token_loss_mask")
                        else torch.float32, finite=False)
        if t.numel() < T:
            dump.fail(f"{where}.{key}", f"{t.numel()} value(s), shorter than input_lengths={T}")
        arrays[key] = t[:T] if key != "advantages" else t
    token_mask = arrays["token_loss_mask"]
    on = torch.nonzero(token_mask).reshape(-1)
    if on.numel() == 0:
        dump.fail(f"{where}.token_loss_mask", "no loss-bearing token: the prompt cannot be told from the "
                                              "response (groups come from prompt-token equality)")
    p = int(on[0])
    if arrays["advantages"].numel() == 0:
        dump.fail(f"{where}.advantages", "empty")
    for key in ("advantages", "prev_logprobs", "generation_logprobs"):
        dump.finite(arrays[key][p:T], f"{where}.{key}[{p}:{T}]")
    dump.finite(arrays["advantages"][:1], f"{where}.advantages[0]")
    mask = (token_mask[p:] * int(sample_mask != 0)).tolist()
    return {"idx": idx, "T": T, "R": T - p, "prompt": tuple(arrays["token_ids"][:p].tolist()), "raw": raw,
            "reward": float(arrays["advantages"][0]), "mask": mask,  # the response only (clones: no padding kept)
            "advantages": arrays["advantages"][p:T].clone(), "old_log_probs": arrays["prev_logprobs"][p:].clone(),
            "rollout_log_probs": arrays["generation_logprobs"][p:].clone()}
