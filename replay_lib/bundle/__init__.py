"""The bundle format (SPEC §2–§3, §11): everything that defines, writes, reads and checks a bundle on disk.

* ``schema`` — the msgspec structs of ``index.json``, ``manifest.json``, ``expected.json`` and the sentinels;
  ``loss_knobs`` — the loss configuration's vocabulary (RecomputeConfig's knobs).
* ``layout`` — file and directory names; ``safe_open`` and ``json_limits`` — opening foreign files and decoding
  foreign JSON within SPEC §11's limits.
* ``writer`` — the atomic writer; ``reader`` — the verifying reader; ``resolution`` — a path to a bundle, a
  cohort or a capture directory; ``files`` — the checked reads they share.
* ``selection`` — which samples of a bundle a ``--sample/--group/--batch`` selection names; ``inspection`` —
  what ``inspect`` reads without verifying; ``gcpause`` — the collector paused around large decodes;
  ``dtypes`` — float8 payloads, upcast for the stages with the dtype they were stored in; ``packed`` — format 1.3's
  packed masks and which payload file a version uses; ``safetensors_io`` — safetensors payloads (headers validated).

The lowest room: it imports no other room of ``replay_lib`` (only the leaves ``errors`` and ``safe_text``).
The names below are loaded on first use, so ``bundle.schema`` can be imported without torch (``--help`` and
``inspect`` stay fast).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "HASH_CHUNK": "files", "check_payload_name": "files", "parse_format_version": "files",
    "sha256_bytes": "files", "sha256_file": "files",
    "BundleReader": "reader", "config_knob_active": "reader",
    "BundleSet": "resolution", "Resolved": "locate", "check_anchor": "resolution", "open_bundle": "resolution",
    "resolve_bundle": "locate", "resolve_capture": "locate",
    "BundleWriter": "writer", "try_finalize_cohort": "writer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
