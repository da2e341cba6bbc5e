"""What the importers share: reading a dump safely, checking its fields with one-line errors that name the
key, and writing the ordinary verified bundle through the bundle writer (atomic publish, nothing partial).

A stage an importer cannot feed is declared ``inspect-only``; its contract's informational ``inputs`` list
says what the dump lacks (the engine never reads that list), and the importer prints the same reason.
"""

from __future__ import annotations

import io
import pickle
import re
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import msgspec
import torch

from ..bundle.reader import require_safe_unpickler
from ..bundle.writer import BundleWriter
from ..errors import FrameworkConfigError
from ..bundle.safe_open import read_regular
from ..bundle.schema import (
    FORMAT_VERSION,
    BundleIndex,
    ComparisonPolicy,
    Identity,
    Manifest,
    ProducerInfo,
    RecomputeConfig,
    SampleRecord,
    StageCapability,
    StageContract,
    StageId,
)

# A dump is read whole into memory (torch.load does as much); the cap only stops a runaway file.
MAX_DUMP_BYTES = 64 << 30
STAGES = (StageId.SAMPLE, StageId.REWARD_RAW, StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_KL,
          StageId.ADVANTAGE_ESTIMATE, StageId.LOSS_POLICY, StageId.LOSS_VALUE)


@dataclass
class ImportResult:
    """What an import wrote: the bundle, its stages (``capability`` and, when not recomputed, the reason) and
    the notes the importer took (a value it had to choose, said out loud)."""

    path: Path
    bundle_id: str
    samples: int
    groups: int
    tokens: int
    stages: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def read_dump(path: Path, what: str) -> bytes:
    """The bytes of a dump: a regular file (a FIFO or a device never blocks the reader), at most
    :data:`MAX_DUMP_BYTES`; problems are one line naming the file (exit 3)."""
    path = Path(path)
    return read_regular(path, path.parent if str(path.parent) else Path("."), what, MAX_DUMP_BYTES)


def load_pt(path: Path, what: str) -> Any:
    """A ``torch.save`` dump loaded with ``weights_only=True`` (tensors, dicts, lists and plain values only); a
    dump that needs arbitrary objects unpickled is refused with one line saying how to convert it."""
    require_safe_unpickler(path)
    data = read_dump(path, what)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = _unpickler_detail(str(exc))
        found = re.search(r"GLOBAL (\S+)", detail)
        if found is None:  # not a pickle of objects at all: a damaged or foreign file
            raise FrameworkConfigError(f"{path}: {what} is not a readable torch.save file ({detail[:160]})") from None
        raise FrameworkConfigError(
            f"{path}: {what} holds objects that only a full unpickle can rebuild ({found.group(1)}); this tool "
            f"never unpickles. Convert it where you trust the file: d = torch.load(PATH, weights_only=False), "
            f"then torch.save of the same dict with its values as tensors, lists, numbers and strings") from None
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        raise FrameworkConfigError(f"{path}: {what} is not a readable torch.save file: "
                                   f"{' '.join(str(exc).split())[:200]}") from None


def _unpickler_detail(message: str) -> str:
    """The reason in torch's weights_only refusal (``WeightsUnpickler error: …``), on one line."""
    _, _, tail = message.partition("WeightsUnpickler error:")
    lines = [line.strip() for line in (tail or message).splitlines() if line.strip()]
    return lines[0].split(". ", 1)[0] if lines else "unreadable"


class DumpFields:
    """One-line errors (exit 3) that name the file and the key path of a malformed dump."""

    def __init__(self, path: Path, what: str):
        self.path = Path(path)
        self.what = what

    def fail(self, key: str, message: str) -> None:
        raise FrameworkConfigError(f"{self.path}: {self.what} {key}: {message}")

    def require(self, record: Any, key: str, where: str) -> Any:
        if not isinstance(record, dict):
            self.fail(where or "$", f"expected a mapping, got {type(record).__name__}")
        if key not in record:
            self.fail(f"{where}.{key}" if where else key, "missing")
        return record[key]

    def integer(self, value: Any, key: str) -> int:
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
            value = int(value.item())
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, f"expected an integer, got {_kind(value)}")
        return value

    def number(self, value: Any, key: str) -> float:
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(key, f"expected a number, got {_kind(value)}")
        return float(value)

    def vector(self, value: Any, key: str, length: Optional[int], dtype: torch.dtype = torch.float32,
               finite: bool = True) -> torch.Tensor:
        """A 1-D tensor (from a tensor or a list of numbers) of ``length`` elements (``None``: any). An integer
        ``dtype`` (token ids, masks) takes whole numbers only: a fraction is refused, never truncated."""
        integral = not dtype.is_floating_point
        allowed = (int,) if integral else (int, float)
        if isinstance(value, torch.Tensor):
            if value.dim() != 1:
                self.fail(key, f"expected a 1-D tensor, got shape {list(value.shape)}")
            if integral and (value.is_floating_point() or value.is_complex()):
                self.fail(key, f"expected integers, got a {value.dtype} tensor")
            t = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, allowed) and not isinstance(v, bool)
                                                      for v in value):
            try:
                t = torch.tensor(value, dtype=torch.int64 if integral else torch.float64)
            except (OverflowError, RuntimeError):
                self.fail(key, "holds an integer outside int64")
        else:
            what = "integers" if integral else "numbers"
            self.fail(key, f"expected a tensor or a list of {what}, got {_kind(value)}")
        if length is not None and t.numel() != length:
            self.fail(key, f"{t.numel()} value(s), expected {length}")
        if not integral:
            if not t.is_floating_point():
                t = t.to(torch.float64)
            if finite:
                self.finite(t, key)
        return t.to(dtype)

    def finite(self, t: torch.Tensor, key: str) -> None:
        if t.numel() and not bool(torch.isfinite(t).all()):
            self.fail(key, "holds a NaN or an infinity")


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return type(value).__name__


def with_group_size(cfg: RecomputeConfig, flag: Optional[int], config_given: bool, groups: Sequence[Optional[int]],
                    source: str, notes: list[str]) -> RecomputeConfig:
    """``cfg`` with its ``n_samples_per_prompt``: ``flag`` (``--n-samples-per-prompt``), else the framework
    config's when one was given, else the most common size among the dump's groups, said in a note (a group of
    another size then fails reward.post_process by name)."""
    n = cfg.n_samples_per_prompt if flag is None else flag
    known = [g for g in groups if g is not None]
    if flag is None and not config_given and known:
        sizes = Counter(Counter(known).values())
        n = max(sizes, key=lambda s: (sizes[s], s))
        notes.append(f"n_samples_per_prompt={n}: the most common group size in {source} "
                     f"(pass --n-samples-per-prompt or --config to set it)")
    return msgspec.structs.replace(cfg, n_samples_per_prompt=n)


def contracts(reasons: dict[StageId, str]) -> dict[StageId, StageContract]:
    """Every stage declared: ``recompute``, or ``inspect-only`` with what is missing in ``inputs``."""
    out = {}
    for stage in STAGES:
        if stage in reasons:
            out[stage] = StageContract(stage=stage, version="v1", capability=StageCapability.INSPECT_ONLY,
                                       implementation="reimplemented", inputs=[reasons[stage]])
        else:
            out[stage] = StageContract(stage=stage, version="v1", capability=StageCapability.RECOMPUTE,
                                       implementation="reimplemented")
    return out


def write_import(out: Path, *, source: str, identity: Identity, samples: list[SampleRecord], config: RecomputeConfig,
                 expected: dict, payloads: dict[str, torch.Tensor], reasons: dict[StageId, str],
                 notes: list[str]) -> ImportResult:
    """Publish the bundle at ``out`` (its directory name is the bundle id) through :class:`BundleWriter`: staged
    in a hidden sibling, verified sentinels, one atomic rename; on any error nothing is left behind."""
    out = Path(out)
    bundle_id = out.name
    index = BundleIndex(bundle_id=bundle_id, identity=identity, samples=samples, config=config)
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=bundle_id,
                        producer=ProducerInfo(commit=f"import:{source}", torch_version=torch.__version__),
                        stage_contracts=contracts(reasons), payloads={}, comparison_policy=ComparisonPolicy(),
                        redaction={})
    with BundleWriter(out, manifest, index, expected) as writer:
        for name, tensor in payloads.items():
            writer.write_payload(name, tensor)
        path = writer.finalize(ranks=[0])
    notes = list(notes) + _verify(path, source)
    groups = {s.group_index for s in samples if s.group_index is not None}
    return ImportResult(path=path, bundle_id=bundle_id, samples=len(samples), groups=len(groups),
                        tokens=sum(s.response_length for s in samples),
                        stages={s.value: ("inspect-only" if s in reasons else "recompute") for s in STAGES},
                        reasons={s.value: r for s, r in reasons.items()}, notes=notes)


def _verify(path: Path, source: str) -> list[str]:
    """Read the published bundle back as ``validate`` does (checksums, schema, tensors, dependency closure);
    a bundle that fails is removed, never left behind. Returns what a replay would refuse, as notes."""
    from ..errors import ReplayError
    from ..run.validate import validate

    try:
        result = validate(path)
    except ReplayError as exc:
        shutil.rmtree(path, ignore_errors=True)
        raise FrameworkConfigError(f"the bundle written from the {source} dump does not validate, so it was "
                                   f"removed: {exc}") from None
    return [f"replay would refuse (exit 4): {r}" for r in result.replay_refusals]

