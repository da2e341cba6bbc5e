"""Payloads as safetensors files (format 1.3 and later, SPEC §2.3): one tensor named ``data`` per file, its first
dimension the flat token axis (a sample's rows are at its offset, the cumulative ``response_length`` before it).

No unpickler is involved: a safetensors file is an 8-byte little-endian header length, a JSON header naming the
tensor's dtype, shape and byte range, and the raw bytes. The header is foreign input and is validated here
(SPEC §11) before any byte of the data is looked at: its size, its JSON, one tensor of a real floating point or
integer dtype, a shape whose byte count is exactly its ``data_offsets`` range, and that range covering the rest of
the file exactly (no gap, no overlap, nothing past the end). Each refusal is one line naming the file and the
header field (exit 3). A valid file is memory-mapped copy-on-write: only the pages a stage touches are read.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from pathlib import Path

import msgspec
import torch

from ..errors import BundleError

SUFFIX = ".safetensors"
TENSOR_KEY = "data"
# The header of a one-tensor file is a few hundred bytes; safetensors itself refuses headers over 100 MB. A header
# bigger than this is refused before it is read.
HEADER_MAX = 1 << 20

# safetensors dtype names → torch dtypes this reader takes (real floating point and integer ones; bool, complex and
# the unsigned types torch computes little with are refused by name).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

_HEADER_DECODER = msgspec.json.Decoder(dict)


def write(path: Path, tensor: torch.Tensor) -> None:
    """Write ``tensor`` (contiguous, CPU, a dtype of :data:`DTYPES`) as the file ``path`` with the safetensors
    library (which pads the header to a multiple of 8 bytes: the data starts aligned for every dtype)."""
    if tensor.dtype not in _NAMES:
        raise ValueError(f"{path.name}: dtype {tensor.dtype} cannot be stored as safetensors "
                         f"(expected one of {', '.join(str(d) for d in DTYPES.values())})")
    from safetensors.torch import save_file

    with open(path, "wb"):  # the mode any file written here gets (the umask's); the library creates its own 0600
        pass
    mode = os.stat(path).st_mode & 0o777
    save_file({TENSOR_KEY: tensor.contiguous()}, str(path))
    os.chmod(path, mode)


def _fail(path: Path, what: str) -> BundleError:
    return BundleError(f"{path}: safetensors header: {what}")


def parse_header(path: Path, fh, size: int) -> tuple[torch.dtype, list[int], int, int]:
    """``(dtype, shape, start, end)`` of the one tensor of the open file ``fh`` of ``size`` bytes, its byte range
    absolute in the file; a :class:`BundleError` naming what is wrong otherwise."""
    if size < 8:
        raise _fail(path, f"file is {size} bytes, shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", fh.read(8))
    if length > HEADER_MAX:
        raise _fail(path, f"length {length} bytes, more than the {HEADER_MAX} allowed")
    if 8 + length > size:
        raise _fail(path, f"length {length} bytes runs past the end of the {size}-byte file")
    blob = fh.read(length)
    try:
        header = _HEADER_DECODER.decode(blob)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if reason[:2].istitle():  # "Expected …" → "expected …"; "JSON …" stays
            reason = reason[:1].lower() + reason[1:]
        raise _fail(path, f"not a JSON object ({reason})") from None
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise _fail(path, "$.__metadata__: expected an object of strings")
    if list(header) != [TENSOR_KEY]:
        names = ", ".join(repr(k) for k in sorted(header)[:4]) or "none"
        raise _fail(path, f"expected exactly one tensor {TENSOR_KEY!r}, got {len(header)} ({names})")
    entry = header[TENSOR_KEY]
    where = f"$.{TENSOR_KEY}"
    if not isinstance(entry, dict):
        raise _fail(path, f"{where}: expected an object")
    unknown = sorted(set(entry) - {"dtype", "shape", "data_offsets"})
    if unknown:
        raise _fail(path, f"{where}.{unknown[0]}: unknown field")
    name = entry.get("dtype")
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise _fail(path, f"{where}.dtype: {name!r}, expected one of {', '.join(DTYPES)}")
    shape = entry.get("shape")
    if not (isinstance(shape, list) and len(shape) <= 8
            and all(type(d) is int and 0 <= d < (1 << 62) for d in shape)):
        raise _fail(path, f"{where}.shape: expected a list of at most 8 non-negative integers, got {shape!r}")
    offsets = entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        raise _fail(path, f"{where}.data_offsets: expected [begin, end], two non-negative integers, got {offsets!r}")
    begin, end = offsets
    data = size - 8 - length
    if begin != 0 or end != data:
        raise _fail(path, f"{where}.data_offsets: {offsets}, expected [0, {data}] (the data must fill the file "
                          f"after the header exactly: no gap, no overlap, nothing past its end)")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes != end - begin:
        raise _fail(path, f"{where}.shape: {shape} of {name} is {nbytes} bytes, data_offsets hold {end - begin}")
    return dtype, shape, 8 + length + begin, 8 + length + end


def load(path: Path, fd: int) -> torch.Tensor:
    """The tensor of the safetensors file open as ``fd`` (a regular file, checked by the caller), memory-mapped
    copy-on-write after :func:`parse_header` accepted it."""
    size = os.fstat(fd).st_size
    with open(fd, "rb", buffering=0, closefd=False) as fh:
        dtype, shape, start, end = parse_header(path, fh, size)
        if start == end:
            return torch.empty(shape, dtype=dtype)
        if start % dtype.itemsize:  # a header not padded as our writer pads it: a copy, aligned
            fh.seek(start)
            return torch.frombuffer(bytearray(fh.read(end - start)), dtype=dtype).reshape(shape)
    mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    tensor = torch.frombuffer(mapped, dtype=dtype, offset=start, count=(end - start) // dtype.itemsize).reshape(shape)
    rows = shape[0] if shape else 1
    setattr(tensor, _MAPPING, (mapped, start, (end - start) // rows if rows else 0, rows))
    return tensor


# The mapping behind a tensor load() returned (an attribute of that tensor object: it goes with it).
_MAPPING = "_replay_mapping"


def release(tensor: torch.Tensor, lo: int = 0, hi: "int | None" = None) -> None:
    """Let go of the resident pages of rows ``[lo, hi)`` (every row by default) of a tensor :func:`load` mapped: the
    whole pages those rows cover leave this process's memory (``MADV_DONTNEED``) and are read again, unchanged, from
    the file's page cache where a row is touched later. The mapping is only ever read (the stages never write a
    payload in place), so nothing is lost. Any other tensor (a copy, a ``.pt`` payload): nothing happens."""
    entry = getattr(tensor, _MAPPING, None)
    if entry is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    mapped, start, row_bytes, rows = entry
    hi = rows if hi is None else min(hi, rows)
    if hi <= lo:
        return
    page = mmap.PAGESIZE
    first = 0 if lo <= 0 else -(-(start + lo * row_bytes) // page) * page  # whole pages of these rows only
    stop = len(mapped) if hi >= rows else (start + hi * row_bytes) // page * page
    if stop > first:
        mapped.madvise(mmap.MADV_DONTNEED, first, stop - first)
