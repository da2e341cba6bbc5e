"""``trajectory-replay import slime|nemo-rl …``: another framework's dump written as a verified bundle.

Text output: ``wrote BUNDLE (bundle ID: N sample(s) in G group(s), T token(s))``, one line per stage (``recompute``
or ``inspect-only — why``), then the notes (a value the importer chose). ``--format json``: the same as one
JSON document. Exit 0 when written; 3 for a malformed dump (one line naming the key); 4 for a setting of
``--config`` the mapping refuses.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import UsageError


def add_import_arguments(p: argparse.ArgumentParser, parser_class) -> None:
    sub = p.add_subparsers(dest="import_format", metavar="FORMAT", parser_class=parser_class)
    sub.required = True
    s = sub.add_parser("slime", help="slime's --save-debug-train-data dump (format_version 2)",
                       description="Import one rollout of slime's --save-debug-train-data dump (format_version 2); "
                                   "--rollout-dump (its --save-debug-rollout-data file) gives the group ids and raw "
                                   "rewards, joined by rollout_position.")
    s.add_argument("train_dump", type=Path, metavar="TRAIN_DUMP")
    s.add_argument("--rollout-dump", type=Path, default=None, metavar="ROLLOUT_DUMP",
                   help="the rollout dump of the same rollout (group ids, raw rewards)")
    s.add_argument("--reward-key", default=None, metavar="KEY",
                   help="slime's --reward-key, when the rollout dump's rewards are dicts")
    _common(s, "slime's arguments as JSON (dest or flag names, or an argv list) or YAML")
    n = sub.add_parser("nemo-rl", help="NeMo-RL's train_data_step<N>.jsonl",
                       description="Import one step of NeMo-RL's train_data_step<N>.jsonl; groups come from "
                                   "prompt-token equality.")
    n.add_argument("train_data", type=Path, metavar="JSONL")
    _common(n, "NeMo-RL's master config (grpo:, loss_fn:) as JSON or YAML")


def _common(p: argparse.ArgumentParser, config_help: str) -> None:
    p.add_argument("-o", "--output", type=Path, required=True, metavar="BUNDLE",
                   help="where to publish the bundle (must not exist; its name is the bundle id)")
    p.add_argument("--config", type=Path, default=None, metavar="FILE", help=config_help)
    p.add_argument("--n-samples-per-prompt", type=int, default=None, metavar="N",
                   help="the group size (default: --config's, else the most common group size in the dump)")
    p.add_argument("--format", choices=("text", "json"), default="text")


def run_import_command(args) -> int:
    from .config import load_config_file
    from ..safe_text import json_document
    from ..importers import import_nemo_rl, import_slime

    if args.n_samples_per_prompt is not None and args.n_samples_per_prompt < 1:
        raise UsageError("--n-samples-per-prompt must be at least 1")
    config = load_config_file(args.config) if args.config is not None else None
    where = str(args.config) if args.config is not None else None
    common = dict(config=config, config_where=where, n_samples_per_prompt=args.n_samples_per_prompt)
    try:
        if args.import_format == "slime":
            result = import_slime(args.train_dump, args.output, rollout_dump=args.rollout_dump,
                                  reward_key=args.reward_key, **common)
        else:
            result = import_nemo_rl(args.train_data, args.output, **common)
    except FileExistsError as exc:
        raise UsageError(str(exc)) from None
    if args.format == "json":
        sys.stdout.write(json_document({
            "path": str(result.path), "bundle_id": result.bundle_id, "samples": result.samples,
            "groups": result.groups, "tokens": result.tokens,
            "stages": {s: {"capability": c, "reason": result.reasons.get(s)} for s, c in result.stages.items()},
            "notes": result.notes}))
        return 0
    from .output import emit

    lines = [("header-pass", f"wrote {result.path} (bundle {result.bundle_id}: {result.samples} sample(s) in "
                             f"{result.groups} group(s), {result.tokens} token(s))")]
    for stage, cap in result.stages.items():
        why = result.reasons.get(stage)
        lines.append(("pass" if cap == "recompute" else "skipped",
                      f"  {stage:<20} {cap}" + (f" — {why}" if why else "")))
    lines += [("warning", f"note: {note}") for note in result.notes]
    emit(lines)
    return 0
