"""``trajectory-replay config FRAMEWORK FILE``: a framework's own configuration file mapped to the
``RecomputeConfig`` JSON the replay would use (the knobs and the defaults that framework encodes).

FILE is JSON (always) or YAML (``.yaml`` / ``.yml``, read with PyYAML when it is installed; this tool does not
depend on it). For slime, FILE may also be a JSON list of argv tokens (``["--eps-clip", "0.2", ...]``). Exit 3
for an unreadable or malformed file, 4 for a setting the mapping refuses (named).
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path
from typing import Any, Optional

from ..errors import FrameworkConfigError, UnsupportedError, UsageError
from ..bundle.safe_open import read_regular

MAX_CONFIG_BYTES = 64 << 20


def load_config_file(path: Path) -> Any:
    """The parsed content of a framework config file (JSON, or YAML through PyYAML when installed), within
    SPEC §11's limits for foreign input (nesting depth, integer digits, string length, at most
    :data:`~replay_lib.bundle.json_limits.MAX_CONFIG_NODES` keys and values, YAML aliases counted as what they
    expand to): a file over one is a one-line error naming where (exit 3). The keys and values of a JSON file are
    counted on its bytes, before it is decoded; a YAML file's while it is composed."""
    from ..bundle.json_limits import MAX_CONFIG_NODES, JSONLimitError, loads_limited

    path = Path(path)
    data = read_regular(path, path.parent if str(path.parent) else Path("."), "framework config", MAX_CONFIG_BYTES)
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            data.decode("utf-8")  # checked here for the message; PyYAML reads the bytes as a stream
        except UnicodeDecodeError as exc:
            raise FrameworkConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        try:
            import yaml  # optional: only to read YAML configs
        except ImportError:
            raise UnsupportedError(f"{path}: reading YAML needs PyYAML, which is not installed; give the config "
                                   "as JSON (or pip install pyyaml)") from None
        from ..frameworks._base import load_yaml

        try:
            return load_yaml(data)
        except JSONLimitError as exc:
            raise FrameworkConfigError(f"{path}: {exc}") from None
        except yaml.YAMLError as exc:
            raise FrameworkConfigError(f"{path}: not YAML: {' '.join(str(exc).split())[:200]}") from None
    try:
        return loads_limited(data, "a config", max_nodes=MAX_CONFIG_NODES)
    except UnicodeDecodeError as exc:
        raise FrameworkConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except JSONLimitError as exc:
        raise FrameworkConfigError(f"{path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise FrameworkConfigError(f"{path}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None


def map_config(framework: str, cfg: Any, where: Optional[str] = None):
    """``RecomputeConfig`` of ``cfg`` through the framework's ``from_*`` (``where`` names the file)."""
    from ..frameworks import FRAMEWORKS, mapping

    if framework not in FRAMEWORKS:
        raise UsageError(f"unknown framework {framework!r} (expected one of: {', '.join(FRAMEWORKS)})")
    try:
        fn = mapping(framework)
    except ImportError as exc:
        raise UnsupportedError(f"the {framework} mapping is not available: {exc}") from None
    if "where" in inspect.signature(fn).parameters:
        return fn(cfg, where=where)
    return fn(cfg)


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    from ..frameworks import FRAMEWORKS

    p.add_argument("framework", choices=tuple(FRAMEWORKS), metavar="FRAMEWORK",
                   help="one of: " + ", ".join(FRAMEWORKS))
    p.add_argument("file", type=Path, metavar="FILE", help="the framework's config: JSON, or YAML with PyYAML")


def run_config_command(args) -> int:
    """The mapped RecomputeConfig as JSON on stdout (what a bundle's ``config`` holds); on stderr, which keys of the
    file the mapping read and which it took at the framework's defaults, so a default is never mistaken for a
    setting of the run."""
    import sys

    from ..frameworks._base import recording
    from ..safe_text import json_document

    with recording() as readers:
        cfg = map_config(args.framework, load_config_file(args.file), where=str(args.file))
    sys.stdout.write(json_document(cfg))
    sys.stdout.flush()
    from .output import emit

    emit(source_lines(args.framework, str(args.file), readers), sys.stderr)
    return 0


def source_lines(framework: str, file: str, readers) -> list[tuple[str, str]]:
    """Where each key the mapping read came from: ``from the file`` (its value) or ``default`` (the value the
    mapping used for it, the framework's own default at the version it follows)."""
    reads: dict[str, tuple] = {}
    for reader in readers:
        for path, (value, from_file) in reader.reads.items():
            reads.setdefault(path, (value, from_file))
    from_file = [(k, v) for k, (v, f) in reads.items() if f]
    defaults = [(k, v) for k, (v, f) in reads.items() if not f]
    lines = [("title", f"{framework} keys read from {file}: {len(from_file)} set by the file, {len(defaults)} at "
                       f"{framework}'s defaults")]
    if not from_file:
        lines.append(("warning", f"none of the keys the {framework} mapping reads is in {file}: every knob above is "
                                 f"{framework}'s default (check the file's nesting, e.g. algorithm.adv_estimator)"))
    width = max((len(k) for k in reads), default=0)
    lines += [("", f"  file     {k:<{width}} = {v!r}") for k, v in from_file]
    lines += [("skipped", f"  default  {k:<{width}} = {v!r}") for k, v in defaults]
    lines += [("warning", note) for reader in readers for note in getattr(reader, "notes", ())]
    return lines
