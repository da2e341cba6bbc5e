"""Format 1.3 (SPEC §2.3): per-token masks packed into a payload, payloads stored as safetensors.

Format 1.0.0 and 1.1.0 write every sample's ``loss_mask`` as a JSON list in ``index.json`` and each payload as a
``torch.save`` archive (``.pt``); at 134M tokens that index is larger than any payload and decoding it dominates
``inspect`` and a one-sample replay. From 1.3.0 the writer stores the masks as the payload ``loss_mask`` — one byte
per token (``uint8``; ``int64`` if a producer records a value outside 0..255), on the flat token axis, a sample's
tokens at the offset its ``response_length`` values give — and ``index.json`` holds per-sample metadata only. The
reader reads both forms: a 1.3 bundle may also keep the masks in ``index.json`` (every sample, and then no
``loss_mask`` payload). Which form and which payload files a bundle has is chosen by its ``format_version``
(the writer's manifest picks): 1.0.0 and 1.1.0 bundles are written exactly as before.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Optional

import msgspec

if TYPE_CHECKING:  # torch is imported where a mask is packed or unpacked: ``inspect`` never loads it
    import torch

PACKED_FORMAT_VERSION = "1.3.0"
PACKED_MINOR = 3  # the first 1.x minor with packed masks and safetensors payloads
MASK_PAYLOAD = "loss_mask"


def format_minor(version) -> Optional[tuple[int, int]]:
    """``(major, minor)`` of a ``MAJOR.MINOR.PATCH`` string, ``None`` for anything else (its reader reports it)."""
    m = re.match(r"\A([0-9]{1,9})\.([0-9]{1,9})\.[0-9]{1,9}\Z", version) if isinstance(version, str) else None
    return (int(m.group(1)), int(m.group(2))) if m else None


def is_packed(version) -> bool:
    """Whether a bundle of ``format_version`` packs its masks and stores safetensors payloads (1.x, x ≥ 2)."""
    parsed = format_minor(version)
    return parsed is not None and parsed[0] == 1 and parsed[1] >= PACKED_MINOR


def payload_suffix(version) -> str:
    """The payload file suffix of a bundle of ``format_version``: ``.safetensors`` from 1.3, ``.pt`` before."""
    return ".safetensors" if is_packed(version) else ".pt"


SAFETENSORS_SUFFIX = ".safetensors"
SUFFIXES = (SAFETENSORS_SUFFIX, ".pt")


def payload_file(payload_dir, name: str, version):
    """The file of payload ``name``: ``<name>`` + the suffix of ``version`` (:func:`payload_suffix`) when that entry
    exists, else the other suffix's when that one does (a bundle relabelled to a minor of the other layout, a newer
    minor this reader does not know: each payload is read by what its file is, safetensors or a weights-only
    ``.pt``), else the version's (its absence is reported under that name)."""
    import os

    preferred = payload_dir / f"{name}{payload_suffix(version)}"
    if os.path.lexists(preferred):
        return preferred
    for suffix in SUFFIXES:
        other = payload_dir / f"{name}{suffix}"
        if other != preferred and os.path.lexists(other):
            return other
    return preferred


def payload_stem(filename: str):
    """The payload name of a file in ``payloads/`` (either suffix), ``None`` for any other file."""
    for suffix in SUFFIXES:
        if filename.endswith(suffix):
            return filename[: -len(suffix)]
    return None


def pack_masks(masks: list) -> "torch.Tensor":
    """The samples' ``loss_mask`` lists as one flat tensor: ``uint8`` when every value is in 0..255, else
    ``int64`` (a mask value is an int64, SPEC §11)."""
    import torch

    try:
        flat = bytearray().join(map(bytearray, masks))
    except (ValueError, TypeError):  # a value outside 0..255
        return torch.tensor([m for mask in masks for m in mask], dtype=torch.int64)
    if not flat:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(flat, dtype=torch.uint8).clone()


def unpack_masks(mask: "torch.Tensor", lengths: list[int]) -> list[list[int]]:
    """Each sample's mask as a list (the ``SampleRecord.loss_mask`` form), a sample ``lengths[i]`` tokens long;
    the caller has checked that ``mask`` holds ``sum(lengths)`` tokens."""
    out = []
    offset = 0
    for n in lengths:  # each sample's slice listed on its own: never a list of the whole mask beside them
        out.append(mask[offset:offset + n].tolist())
        offset += n
    return out


def _lean_index_decoder():
    """A strict decoder of index.json that checks every field as :class:`~.schema.BundleIndex` does but leaves each
    sample's ``loss_mask`` as its undecoded JSON text (``msgspec.Raw``: skipped, not parsed into ints)."""

    from .schema import BundleIndex, SampleRecord

    def spec(f, type_=None):
        kind = f.type if type_ is None else type_
        if f.default is not msgspec.NODEFAULT:
            return (f.name, kind, f.default)
        if f.default_factory is not msgspec.NODEFAULT:
            return (f.name, kind, msgspec.field(default_factory=f.default_factory))
        return (f.name, kind)

    sample = msgspec.defstruct(
        "LeanSampleRecord",
        [spec(f, msgspec.Raw | msgspec.UnsetType if f.name == "loss_mask" else None)
         for f in msgspec.structs.fields(SampleRecord)],
        kw_only=True, forbid_unknown_fields=True, frozen=True)
    index = msgspec.defstruct(
        "LeanBundleIndex",
        [spec(f, list[sample] if f.name == "samples" else None) for f in msgspec.structs.fields(BundleIndex)],
        kw_only=True, forbid_unknown_fields=True, frozen=True)
    return msgspec.json.Decoder(index)


_LEAN = []


def decode_index_lean(blob: bytes):
    """index.json for ``inspect``, whose summary needs no per-token data: the masks of a 1.0/1.1 index are skipped,
    not decoded. Raises for any document the strict decode would not take as it is (an unknown field, a wrong
    type): the caller then decodes it the usual way, which words the problem."""
    if not _LEAN:
        _LEAN.append(_lean_index_decoder())
    index = _LEAN[0].decode(blob)
    for sample in index.samples:  # a mask that is no array at all is worded by the usual decode; its items are not read
        mask = sample.loss_mask
        if type(mask) is msgspec.Raw and memoryview(mask)[:1] != b"[":
            raise ValueError("loss_mask: not an array")
    return index
