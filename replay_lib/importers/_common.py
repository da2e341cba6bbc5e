"""What the importers share: reading a dump safely, checking its fields with one-line errors that name the
key, and writing the ordinary verified bundle through the bundle writer (atomic publish, nothing partial).

A stage an importer cannot feed is declared ``inspect-only``; its contract's informational ``inputs`` list
says what the dump lacks (the engine never reads that list), and the importer prints the same reason.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
import re
import shutil
import warnings
import zipfile
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
    WRITE_FORMAT_VERSION,
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
# A torch.save archive's records inflate to at most this many times the archive's bytes in all (or
# INFLATE_FLOOR, for a small one), and a tensor's record to at most what its storage needs (SPEC §11).
# torch.save stores every record uncompressed; a compressed one is foreign, and checked before it is inflated.
INFLATE_RATIO = 4
INFLATE_FLOOR = 64 << 20
_INT64 = 1 << 63
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
    dump that needs arbitrary objects unpickled is refused with one line saying how to convert it. The zip
    archive's records are checked before anything is inflated (:func:`check_records`); torch's own warnings
    (a legacy or raw pickle) are not printed: the error, if any, is the one line."""
    require_safe_unpickler(path)
    data = read_dump(path, what)
    check_records(data, path, what)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
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


def check_records(data: bytes, path: Path, what: str) -> None:
    """Refuse (exit 3, naming the record) a ``torch.save`` zip archive whose records would inflate past
    ``max(INFLATE_FLOOR, INFLATE_RATIO × the archive's size)`` in all, or a tensor record (``data/<key>``)
    larger than its storage as the pickle declares it (``numel × element size``): read from the zip central
    directory and, when a record is compressed, from the pickle's opcodes (never executed), before any
    record is inflated. A file that is not a zip archive is left to ``torch.load``."""
    buffer = io.BytesIO(data)
    if not zipfile.is_zipfile(buffer):
        return
    try:
        with zipfile.ZipFile(buffer) as archive:
            infos = archive.infolist()
            bound = max(INFLATE_FLOOR, INFLATE_RATIO * len(data))
            total = 0
            for info in infos:
                total += info.file_size
                if total > bound:
                    raise FrameworkConfigError(
                        f"{path}: {what} record {info.filename} inflates to {info.file_size} bytes; the archive's "
                        f"records would reach {total}, over its bound of {bound} bytes (max({INFLATE_FLOOR}, "
                        f"{INFLATE_RATIO} × the file's {len(data)})); refused before inflating")
            if all(info.compress_type == zipfile.ZIP_STORED for info in infos):
                return  # each record is its bytes in the file: nothing inflates
            pickles = [i for i in infos if i.filename == "data.pkl" or i.filename.endswith("/data.pkl")]
            if len(pickles) != 1:
                return  # not torch's layout: torch.load says so
            prefix = pickles[0].filename[: -len("data.pkl")]
            declared = _declared_storages(archive.read(pickles[0]))
    except zipfile.BadZipFile:
        return  # torch.load names the damage
    for info in infos:
        if not info.filename.startswith(prefix + "data/"):
            continue
        key = info.filename[len(prefix) + len("data/"):]
        need = declared.get(key)
        if need is None:
            if info.compress_type != zipfile.ZIP_STORED:
                raise FrameworkConfigError(f"{path}: {what} record {info.filename} is compressed and no tensor "
                                           "storage of the pickle declares it; refused before inflating")
        elif info.file_size > need:
            raise FrameworkConfigError(f"{path}: {what} record {info.filename} inflates to {info.file_size} bytes, "
                                       f"more than its tensor storage needs ({need} bytes); refused before "
                                       "inflating")


_STORAGE_CLASS = re.compile(r"\Atorch ([A-Za-z0-9]*Storage)\Z")


def _declared_storages(pkl: bytes) -> dict[str, int]:
    """``{record key: bytes}`` of the tensor storages a ``torch.save`` pickle declares: its persistent ids
    ``("storage", torch.<X>Storage, key, location, numel)``, found by following the pickle's stack over its
    opcodes (nothing is unpickled). An unreadable pickle declares nothing (``torch.load`` then names it)."""
    opaque = object()
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[Any, Any] = {}
    out: dict[str, int] = {}
    literal = {"BINUNICODE", "SHORT_BINUNICODE", "UNICODE", "BINUNICODE8", "BININT", "BININT1", "BININT2",
               "LONG1", "LONG4", "INT", "LONG", "SHORT_BINSTRING", "BINSTRING", "STRING"}
    try:
        for op, arg, _ in pickletools.genops(pkl):
            name = op.name
            if name == "MARK":
                marks.append(len(stack))
            elif name in literal:
                stack.append(arg)
            elif name == "GLOBAL":
                stack.append(("global", arg))
            elif name == "STACK_GLOBAL":
                attr, module = stack.pop(), stack.pop()
                stack.append(("global", f"{module} {attr}"))
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                stack.append(memo.get(arg, opaque))
            elif name == "TUPLE":
                k = marks.pop()
                items = tuple(stack[k:])
                del stack[k:]
                stack.append(items)
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                items = tuple(stack[-n:])
                del stack[-n:]
                stack.append(items)
            elif name == "BINPERSID":
                _declare(stack.pop(), out)
                stack.append(opaque)
            else:  # any other opcode: its arity from pickletools, its results opaque
                before = op.stack_before
                if pickletools.markobject in before:
                    k = marks.pop()
                    del stack[k:]
                    n = before.index(pickletools.markobject)
                else:
                    n = len(before)
                if n:
                    del stack[-n:]
                stack.extend(opaque for _ in op.stack_after)
    except Exception:  # a malformed pickle: torch.load refuses it with its own words
        return out
    return out


def _declare(pid: Any, out: dict[str, int]) -> None:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        return
    _, cls, key, _, numel = pid
    found = _STORAGE_CLASS.match(cls[1]) if isinstance(cls, tuple) and len(cls) == 2 and isinstance(cls[1], str) \
        else None
    if found is None or not isinstance(key, str) or isinstance(numel, bool) or not isinstance(numel, int):
        return
    with warnings.catch_warnings():  # the typed storage classes are deprecated; their dtype is what is read
        warnings.simplefilter("ignore")
        storage = getattr(torch, found.group(1), None)
        dtype = getattr(storage, "dtype", torch.uint8) if storage is not None else torch.uint8
    try:
        size = torch.empty(0, dtype=dtype).element_size()
    except (TypeError, RuntimeError):
        size = 1
    out[key] = max(0, numel) * size


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
        if not -_INT64 <= value < _INT64:
            self.fail(key, "an integer outside int64")
        return value

    def number(self, value: Any, key: str, finite: bool = True) -> float:
        """A float from a number or a one-element tensor; like :meth:`vector`, a NaN or an infinity is refused
        unless ``finite`` is false (one rule for scalars and tensors)."""
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(key, f"expected a number, got {_kind(value)}")
        try:
            number = float(value)
        except OverflowError:
            self.fail(key, "an integer beyond the float range")
        if finite and not math.isfinite(number):
            self.fail(key, "is a NaN or an infinity")
        return number

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
    manifest = Manifest(format_version=WRITE_FORMAT_VERSION, bundle_id=bundle_id,
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

