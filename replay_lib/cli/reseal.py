"""``trajectory-replay reseal BUNDLE --i-edited-it``: recompute the checksums of a bundle edited by hand (an
experiment: a value changed in expected.json, a payload rewritten), so that it verifies again.

What it rewrites, in place, each file replaced atomically: in ``manifest.json`` each payload's ``bytes`` and
``sha256`` (from the file on disk; a safetensors payload's ``chunks`` checksums too, where it lists them) and the producer's ``commit``, marked ``+resealed`` (a resealed bundle never
passes for what a training job wrote); then the sha256 of the three JSON files in ``COMPLETE`` and in every
``COMPLETE.<rank>``, and the payload checksums there. Every other byte of the JSON documents is kept as edited. Then
the bundle is verified as ``validate`` does, and the verdict printed.

Refused: without ``--i-edited-it`` (exit 2: resealing makes any change verify, an accidental one too); a path that
is no single bundle directory of format 1.x (a cohort, a capture directory, format 2.0.0: exit 4); a manifest that
does not decode or names a payload that is missing or not a regular file (exit 3, nothing written). A bundle whose
edits break the format is resealed and then reported invalid by the verification (exit 3, its reason printed).
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path

import msgspec

from ..errors import BundleError, UnsupportedError, UsageError

RESEALED = "+resealed"


def add_reseal_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", type=Path, metavar="BUNDLE", help="a bundle directory (format 1.x) edited by hand")
    p.add_argument("--i-edited-it", action="store_true",
                   help="confirm the edits are yours: reseal makes any change to the bundle verify")
    p.add_argument("--format", choices=("text", "json"), default="text")


def _json(path: Path, root: Path) -> dict:
    from ..bundle.safe_open import UnsafeFile, read_json_file

    try:
        doc = msgspec.json.decode(read_json_file(path, root))
    except UnsafeFile as exc:
        raise BundleError(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise BundleError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise BundleError(f"{path}: $: expected a JSON object")
    return doc


def reseal(path: Path) -> dict:
    """Reseal the bundle at ``path``; ``{"path", "bundle_id", "payloads", "commit"}`` of what was written."""
    from ..bundle.files import _atomic_write, sha256_bytes, sha256_file
    from ..bundle.layout import METADATA_FILES, PAYLOAD_DIR, _RANK_DIR, _RANK_SENTINEL
    from ..bundle.packed import payload_file
    from ..bundle.schema import encode_json

    root = Path(path)
    if not root.is_dir() or root.is_symlink():
        raise BundleError(f"{root}: not a bundle directory")
    names = {p.name for p in root.iterdir()}
    if any(_RANK_DIR.match(n) for n in names) or "manifest.json" not in names:
        raise UnsupportedError(f"{root}: reseal takes a single bundle directory (manifest.json, COMPLETE), not a "
                               f"cohort or a capture directory: reseal each bundle")
    manifest = _json(root / "manifest.json", root)
    version = manifest.get("format_version")
    if not isinstance(version, str) or not version.startswith("1."):
        raise UnsupportedError(f"{root / 'manifest.json'}: $.format_version: reseal writes format 1.x, "
                               f"got {version!r} (convert it to 1.0.0 first)")
    payloads = manifest.get("payloads")
    if not isinstance(payloads, dict) or not all(isinstance(v, dict) for v in payloads.values()):
        raise BundleError(f"{root / 'manifest.json'}: $.payloads: expected an object of payload objects")
    producer = manifest.get("producer")
    if not isinstance(producer, dict):
        raise BundleError(f"{root / 'manifest.json'}: $.producer: expected an object")
    digests: dict[str, str] = {}
    for name, spec in payloads.items():
        file = payload_file(root / PAYLOAD_DIR, name, version)  # .safetensors from format 1.3, .pt before
        try:
            mode = os.lstat(file).st_mode
        except OSError:
            raise BundleError(f"{file}: $.payloads.{name}: the payload file is missing") from None
        if not stat.S_ISREG(mode) or ".." in name or "/" in name:
            raise BundleError(f"{file}: $.payloads.{name}: not a regular file inside the bundle")
        if isinstance(spec.get("chunks"), dict) and file.name.endswith(".safetensors"):
            # its chunk checksums too (bundle.chunks: a selected replay verifies those), in the same read
            from ..bundle.chunks import CHUNK_BYTES, hash_file

            digests[name], sums = hash_file(file, CHUNK_BYTES)
            spec["sha256"] = digests[name]
            spec["chunks"] = {"bytes": CHUNK_BYTES, "sha256": sums}
        else:
            digests[name] = spec["sha256"] = sha256_file(file)
        spec["bytes"] = os.lstat(file).st_size
    commit = producer.get("commit") if isinstance(producer.get("commit"), str) else ""
    if not commit.endswith(RESEALED):
        producer["commit"] = commit + RESEALED
    sentinels = {}
    for name in sorted(names):
        if name == "COMPLETE" or _RANK_SENTINEL.match(name):
            sentinels[name] = _json(root / name, root)
    if "COMPLETE" not in sentinels:
        raise BundleError(f"{root / 'COMPLETE'}: missing (an unpublished bundle is not resealed)")
    # everything decoded and checked: now written, each file replaced whole
    _atomic_write(root / "manifest.json", encode_json(manifest))
    metadata = {name: sha256_bytes((root / name).read_bytes()) for name in METADATA_FILES}
    for name, doc in sentinels.items():
        doc["metadata"] = dict(metadata)
        if name != "COMPLETE":
            doc["payloads"] = dict(sorted(digests.items()))
        _atomic_write(root / name, encode_json(doc))
    return {"path": str(root), "bundle_id": str(manifest.get("bundle_id", "")), "payloads": len(digests),
            "commit": producer["commit"]}


def run_reseal_command(args) -> int:
    from ..safe_text import json_document, safe
    from .output import emit

    if not args.i_edited_it:
        raise UsageError("reseal makes any change to the bundle verify (an accidental one too): "
                         "pass --i-edited-it to confirm the edits are yours")
    result = reseal(args.bundle)
    from ..bundle.resolution import open_bundle

    try:
        open_bundle(args.bundle, verify_chunks=True)  # as validate verifies it
        verified, reason = True, ""
    except BundleError as exc:
        verified, reason = False, str(exc)
    result.update(verified=verified, reason=reason)
    if args.format == "json":
        sys.stdout.write(json_document(result))
    else:
        line = (f"resealed {safe(result['path'])}: bundle {safe(result['bundle_id'])}, {result['payloads']} "
                f"payload(s), producer commit {safe(result['commit'])}")
        emit([("header-pass" if verified else "header-fail",
               line + ("; verified" if verified else f"; does not verify: {safe(reason)}"))])
    return 0 if verified else 3
