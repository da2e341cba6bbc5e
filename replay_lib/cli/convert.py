"""``trajectory-replay convert SRC DST --to 2.0.0|1.0.0|1.3.0``: a bundle or cohort rewritten in another form of the
format in one step — the original tool's 2.0.0 or 1.0.0, or our current 1.3.0 — verified before it is published
(``replay_lib.run.convert``).

Text output: ``converted SRC (format A) → DST (format B): bundle ID, N sample(s)[, ranks …]; verified``, then one
``note:`` line for each thing the target format cannot hold. ``--format json``: the same as one document. Exit 0
when written; 2 for a bad target, an existing DST or a SRC already of the target's version; 3 for an invalid SRC; 4
when the target cannot hold SRC.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_convert_arguments(p: argparse.ArgumentParser) -> None:
    from ..bundle.format2 import CONVERT_TARGETS as TARGETS

    p.add_argument("source", type=Path, metavar="SRC", help="a bundle or a cohort")
    p.add_argument("target", type=Path, metavar="DST", help="where to publish the converted copy (must not exist)")
    p.add_argument("--to", required=True, choices=TARGETS, metavar="VERSION",
                   help="the format to write: 2.0.0 or 1.0.0 (the original's: .pt payloads, masks in index.json) or "
                        "1.3.0 (ours: packed masks, safetensors payloads); what the target cannot hold is named in a "
                        "note: line, or refused (exit 4)")
    p.add_argument("--format", choices=("text", "json"), default="text")


def run_convert_command(args) -> int:
    from ..run.convert import convert
    from ..safe_text import json_document, safe
    from .output import emit

    result = convert(args.source, args.target, args.to)
    if args.format == "json":
        sys.stdout.write(json_document({
            "source": result.source, "path": result.path, "source_version": result.source_version,
            "format_version": result.format_version, "bundle_id": result.bundle_id, "ranks": result.ranks,
            "samples": result.samples, "notes": result.notes}))
        return 0
    ranks = f", ranks {', '.join(map(str, result.ranks))}" if result.ranks else ""
    lines = [("header-pass", f"converted {safe(result.source)} (format {safe(result.source_version)}) → "
                             f"{safe(result.path)} (format {result.format_version}): bundle {safe(result.bundle_id)}, "
                             f"{result.samples} sample(s){ranks}; verified")]
    lines += [("warning", f"note: {safe(note)}") for note in result.notes]
    emit(lines)
    return 0
