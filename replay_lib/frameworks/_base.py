"""What every framework mapping shares: reading a framework's own config object, typed getters that name the
key they read, refusals by name, and the check that no unknown key could change the math.

A mapping reads each key it knows through :class:`ConfigReader` (which records it), declares the keys and
sections it knows to be neutral for the recomputed stages (paths, parallelism, optimizer, logging: things a
bundle records the *result* of), and then calls :meth:`ConfigReader.check_unknown`: every other key in the
math-bearing sections whose name looks like a knob of the reward → advantage → loss math (``kl``, ``clip``,
``adv``, ``reward``, ``loss``, ``entropy``, ``norm``, ``ratio``, ``coef`` …) and whose value is not off
(``None``, ``False``, ``0``, empty) is refused by name (exit 4) — never mapped to a silent default.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import functools
import itertools
import math
import re
from collections.abc import Mapping
from typing import Any, Iterable, Optional

import msgspec

from ..errors import FrameworkConfigError, UnsupportedFrameworkConfig
from ..bundle.json_limits import MAX_CONFIG_NODES, MAX_INT_DIGITS, MAX_JSON_DEPTH, JSONLimitError, check_limits
from ..bundle.schema import RecomputeConfig

_MISSING = object()

# The words of a key name that may change the recomputed math (matched as whole words of the key).
MATH_WORDS = (
    "kl", "clip", "adv", "advantage", "advantages", "reward", "rewards", "loss", "entropy", "tis", "is",
    "norm", "normalize", "normalization", "whiten", "gamma", "lam", "lambd", "eps", "epsilon", "baseline",
    "std", "ratio", "coef", "coeff", "estimator", "penalty", "agg", "reduction", "importance", "mis", "icepop",
    "value", "values", "critic", "opd", "beta", "scale", "scaling", "logprobs", "tau", "delta", "weight",
    "weights", "rs", "cispo", "gspo", "sapo", "dual",
)


def word_pattern(words: Iterable[str]) -> re.Pattern:
    """A pattern matching a key name that holds one of ``words`` as a whole ``_``- or ``-``-separated word."""
    return re.compile(r"(?:^|[_\-])(?:" + "|".join(words) + r")(?:$|[_\-])")


_MATH_KEY = word_pattern(MATH_WORDS)


def is_active(value: Any) -> bool:
    """Whether a value turns something on: not ``None``/``False``/``0``/empty/``"none"``/``"null"``."""
    if value is None or value is False:
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value != 0
    if isinstance(value, str):
        return value.strip().lower() not in ("", "none", "null", "false", "0")
    if isinstance(value, (list, tuple, dict)):
        return len(value) > 0
    return True


# What YAML aliases may add to a config: the nodes the anchored subtrees they name hold, summed over every
# alias (nested aliases counted expanded). A config shares a few small defaults blocks; a "billion laughs"
# document (ten aliases of ten aliases of …) is refused when its expansion passes this, long before it is built.
MAX_YAML_ALIAS_NODES = 100_000


def load_yaml(text: "str | bytes") -> Any:
    """A YAML document read with PyYAML's safe loader within SPEC §11's limits: nesting at most
    :data:`~replay_lib.bundle.json_limits.MAX_JSON_DEPTH` levels, at most :data:`MAX_YAML_ALIAS_NODES` nodes
    added by aliases, at most :data:`~replay_lib.bundle.json_limits.MAX_CONFIG_NODES` nodes in all (keys and
    values, aliases counted as what they name: refused while composing, so the node graph PyYAML builds stays
    within it), no alias inside the node it names (a recursive structure), integers and strings within
    :func:`~replay_lib.bundle.json_limits.check_limits`. A limit raises ``JSONLimitError`` naming the line;
    malformed YAML raises ``yaml.YAMLError``. Needs PyYAML (``ImportError`` otherwise).

    ``bytes`` (UTF-8) are read as a stream, 64 KiB at a time, so no copy of the whole text is made beside
    them; the positions of the nodes PyYAML composes are kept in small slotted marks (no source line)."""
    import io

    import yaml

    class SlimMark:  # yaml.Mark's interface, a third of its size: the node graph is ~10 objects a node
        __slots__ = ("name", "index", "line", "column", "buffer", "pointer")
        get_snippet = yaml.Mark.get_snippet
        __str__ = yaml.Mark.__str__

        def __init__(self, name: str, index: int, line: int, column: int, buffer: Any, pointer: Any):
            self.name, self.index, self.line, self.column, self.buffer, self.pointer = (
                name, index, line, column, buffer, pointer)

    class BoundedLoader(yaml.SafeLoader):
        def __init__(self, stream: str):
            super().__init__(stream)
            self._depth = 0
            self._expanded = 0  # nodes of the document so far, aliases counted as what they name
            self._from_aliases = 0
            self._sizes: dict[str, int] = {}  # anchor → the expanded size of its node
            self._open: set[str] = set()  # anchors whose node is being composed

        def get_mark(self) -> Any:
            mark = super().get_mark()
            return SlimMark(mark.name, mark.index, mark.line, mark.column, mark.buffer, mark.pointer)

        def _refuse(self, event: Any, message: str) -> None:
            raise JSONLimitError(f"line {event.start_mark.line + 1}: {message}")

        def _check_count(self, event: Any) -> None:
            if self._expanded > MAX_CONFIG_NODES:
                self._refuse(event, f"more than {MAX_CONFIG_NODES} keys and values (the limit for a config)")

        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent):
                if event.anchor in self._open:
                    self._refuse(event, f"alias *{event.anchor} inside the node it names (a recursive structure)")
                size = self._sizes.get(event.anchor, 0)
                self._expanded += size
                self._from_aliases += size
                if self._from_aliases > MAX_YAML_ALIAS_NODES:
                    self._refuse(event, f"aliases expand to more than {MAX_YAML_ALIAS_NODES} nodes")
                self._check_count(event)
                return super().compose_node(parent, index)
            if self._depth >= MAX_JSON_DEPTH:
                self._refuse(event, f"nested deeper than {MAX_JSON_DEPTH} levels (the limit for a config)")
            anchor = event.anchor
            before = self._expanded
            self._expanded += 1
            self._check_count(event)
            self._depth += 1
            if anchor is not None:
                self._open.add(anchor)
            try:
                node = super().compose_node(parent, index)
            finally:
                self._depth -= 1
                self._open.discard(anchor)
            if anchor is not None:
                self._sizes[anchor] = self._expanded - before
            return node

        def construct_yaml_int(self, node: Any) -> int:
            try:
                return super().construct_yaml_int(node)
            except ValueError:  # int() over Python's digit limit
                raise JSONLimitError(f"line {node.start_mark.line + 1}: an integer of more than 4300 digits, over "
                                     f"the {MAX_INT_DIGITS}-digit limit") from None

    BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)
    loader = BoundedLoader(io.BytesIO(text) if isinstance(text, bytes) else text)
    try:
        value = loader.get_single_data()
    finally:
        loader.dispose()
    check_limits(value)
    return value


def to_plain(cfg: Any, _depth: int = 0) -> Any:
    """A framework's config object as plain Python: mappings, OmegaConf (resolved), argparse namespaces,
    dataclasses, pydantic models and plain objects become dicts; lists stay lists. A plain list, and a dict
    whose keys are strings and whose values are already plain, are returned as they are (a config read
    from a file is not copied). Nesting deeper than :data:`MAX_JSON_DEPTH` (or a recursive structure) is a
    one-line error (exit 3)."""
    if _depth > MAX_JSON_DEPTH:
        raise FrameworkConfigError(f"config nested deeper than {MAX_JSON_DEPTH} levels (or a recursive structure)")
    d = _depth + 1
    module = type(cfg).__module__ or ""
    if module.startswith("omegaconf"):
        from omegaconf import OmegaConf  # only when an OmegaConf object was passed in

        return to_plain(OmegaConf.to_container(cfg, resolve=True), d)
    if type(cfg) is dict:
        out = None
        for k, v in cfg.items():
            p = to_plain(v, d)
            if out is None and (p is not v or type(k) is not str):
                out = {}  # a copy from the first item that changes
                for kk, vv in cfg.items():
                    if kk is k:
                        break
                    out[str(kk)] = vv
            if out is not None:
                out[str(k)] = p
        return cfg if out is None else out
    if isinstance(cfg, Mapping):
        return {str(k): to_plain(v, d) for k, v in cfg.items()}
    if isinstance(cfg, argparse.Namespace):
        return {k: to_plain(v, d) for k, v in vars(cfg).items()}
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_plain(getattr(cfg, f.name), d) for f in dataclasses.fields(cfg)}
    if callable(getattr(cfg, "model_dump", None)):  # pydantic
        return to_plain(cfg.model_dump(), d)
    if type(cfg) is list:
        out_list = None
        for i, v in enumerate(cfg):
            p = to_plain(v, d)
            if p is not v and out_list is None:
                out_list = list(cfg[:i])
            if out_list is not None:
                out_list.append(p)
        return cfg if out_list is None else out_list
    if isinstance(cfg, (list, tuple)):
        return [to_plain(v, d) for v in cfg]
    if isinstance(cfg, (str, int, float, bool)) or cfg is None:
        return cfg
    if hasattr(cfg, "__dict__"):
        return {k: to_plain(v, d) for k, v in vars(cfg).items() if not k.startswith("_")}
    return cfg


def nest_dotted(tree: Any) -> Any:
    """``{"a.b": 1}`` → ``{"a": {"b": 1}}`` at every level (argparse stores OpenRLHF's ``--algo.kl.init_coef``
    under a dotted name); a dotted key and a nested one for the same path are merged. A dict with no dotted key
    at any level is returned as it is (not copied); one that changes is new, and ``tree`` is never modified."""
    if not isinstance(tree, dict):
        return tree
    out: Optional[dict[str, Any]] = None
    made: set[int] = set()  # ids of the dicts made here (the others belong to ``tree``: copied before a change)

    def own(node: dict, key: str) -> dict:
        child = node[key]
        if id(child) not in made:
            child = node[key] = dict(child)
            made.add(id(child))
        return child

    for i, (key, value) in enumerate(tree.items()):
        nested = nest_dotted(value)
        if out is None:
            if nested is value and "." not in key:
                continue
            out = dict(itertools.islice(tree.items(), i))  # the keys before: plain, their values unchanged
        *parents, leaf = key.split(".") if key else [key]
        node = out
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
                made.add(id(node[part]))
            node = own(node, part)
        if isinstance(nested, dict) and isinstance(node.get(leaf), dict):
            own(node, leaf).update(nested)
        else:
            node[leaf] = nested
    return tree if out is None else out


_INTERPOLATION = re.compile(r"\A\$\{([^{}]+)\}\Z")


def resolve_interpolations(tree: dict) -> dict:
    """A YAML read without OmegaConf keeps its interpolations as strings: ``${a.b}`` (absolute), ``${.b}``
    (a sibling) and ``${oc.select:a.b,default}`` are resolved against the same tree, as OmegaConf would; any
    other resolver stays a string (a typed read then names it). Only the dicts on the way to a resolved value
    are new; ``tree`` is never modified."""

    def lookup(path: str, parent: list[str]) -> Any:
        if path.startswith("."):
            parts = parent + path.lstrip(".").split(".")
        else:
            parts = path.split(".")
        node: Any = tree
        for part in parts:
            if not isinstance(node, dict) or part not in node:
                return _MISSING
            node = node[part]
        return node

    def value_of(value: Any, parent: list[str], depth: int = 0) -> Any:
        match = _INTERPOLATION.match(value) if isinstance(value, str) else None
        if match is None or depth > 16:
            return value
        inner = match.group(1).strip()
        default: Any = _MISSING
        if inner.startswith("oc.select:"):
            inner, _, fallback = inner[len("oc.select:"):].partition(",")
            default = _literal(fallback.strip()) if fallback else None
        elif ":" in inner:
            return value  # another resolver (oc.env, …): not evaluated here
        found = lookup(inner.strip(), parent)
        if found is _MISSING:
            return value if default is _MISSING else default
        return value_of(found, parent, depth + 1)

    def walk(node: dict, parent: list[str]) -> dict:
        out = None  # a copy from the first value that changes: a dict without interpolations is kept as it is
        for i, (k, v) in enumerate(node.items()):
            new = walk(v, parent + [k]) if isinstance(v, dict) else value_of(v, parent)
            if new is not v and out is None:
                out = dict(itertools.islice(node.items(), i))
            if out is not None:
                out[k] = new
        return node if out is None else out

    return walk(tree, []) if isinstance(tree, dict) else tree


def _literal(text: str) -> Any:
    """An ``oc.select`` default as OmegaConf reads it: null, a bool, a number, else the string."""
    lowered = text.lower()
    if lowered in ("null", "none", "~"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": leaf}`` of a nested dict (lists are leaves)."""
    if not isinstance(tree, dict):
        return {prefix: tree} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and value:
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


# The readers made while a ``recording()`` is open (``trajectory-replay config`` says which keys came from the file).
_RECORDING: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("config_readers", default=None)


@contextlib.contextmanager
def recording():
    """``with recording() as readers:`` — every :class:`ConfigReader` made inside is appended to ``readers``, so a
    caller can list each key a mapping read, with its value and whether the file set it."""
    readers: list = []
    token = _RECORDING.set(readers)
    try:
        yield readers
    finally:
        _RECORDING.reset(token)


class ConfigReader:
    """Typed, recorded reads of one framework config. ``where`` (a file name) prefixes every message.
    ``reads``: every key read, in order, as ``(value used, whether the file set it)``."""

    def __init__(self, framework: str, cfg: Any, where: Optional[str] = None):
        self.framework = framework
        self.where = where
        self.reads: dict[str, tuple[Any, bool]] = {}
        readers = _RECORDING.get()
        if readers is not None:
            readers.append(self)
        tree = nest_dotted(to_plain(cfg))
        if not isinstance(tree, dict):
            raise FrameworkConfigError(f"{self._label()}: expected a mapping of settings, got {type(cfg).__name__}")
        self.tree = resolve_interpolations(tree)
        self.read: set[str] = set()
        self.neutral_prefixes: list[str] = []
        # what the config command says beside the keys: a value the bundle must hold for its own step
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        """A line the ``config`` command prints on stderr (a value the file cannot hold for every step)."""
        self.notes.append(text)

    @functools.cached_property
    def flat(self) -> dict[str, Any]:
        """``{"a.b": leaf}`` of the tree, made on first use (:meth:`check_unknown` walks the tree instead)."""
        return flatten(self.tree)

    def _label(self) -> str:
        return f"{self.where}: {self.framework} config" if self.where else f"{self.framework} config"

    # -------------------------------------------------------------------------------------- reads

    def has(self, path: str) -> bool:
        return self._lookup(path) is not _MISSING

    def _lookup(self, path: str) -> Any:
        node: Any = self.tree
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return _MISSING
            node = node[part]
        return node

    def raw(self, path: str, default: Any = None) -> Any:
        """The value at ``path`` (``default`` when absent); the key is then known (not an unknown knob)."""
        self.read.add(path)
        value = self._lookup(path)
        if isinstance(value, dict):  # a section read whole: every leaf under it is known
            self.neutral_prefixes.append(path)
        used = default if value is _MISSING else value
        if not isinstance(value, dict):
            self.reads.setdefault(path, (used, value is not _MISSING))
        return used

    def number(self, path: str, default: Any) -> Optional[float]:
        """A float (``None`` stays ``None``); a bool or a non-number names the key (exit 3)."""
        value = self.raw(path, default)
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                self.bad(path, value, "a number")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            self.bad(path, value, "a finite number")
        return float(value)

    def integer(self, path: str, default: Any) -> Optional[int]:
        value = self.raw(path, default)
        if value is None:
            return None
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            self.bad(path, value, "an integer")
        return value

    def flag(self, path: str, default: bool) -> bool:
        value = self.raw(path, default)
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
            return bool(value)
        if not isinstance(value, bool):
            self.bad(path, value, "true or false")
        return value

    def text(self, path: str, default: Optional[str]) -> Optional[str]:
        value = self.raw(path, default)
        if value is None:
            return None
        if not isinstance(value, str):
            self.bad(path, value, "a string")
        return value

    def bad(self, path: str, value: Any, expected: str) -> None:
        raise FrameworkConfigError(f"{self._label()}: {path}={value!r}: expected {expected}")

    # ----------------------------------------------------------------------------------- refusals

    def refuse(self, path: str, value: Any, why: str) -> None:
        raise UnsupportedFrameworkConfig(f"{self._label()}: {path}={value!r}: {why}")

    def neutral(self, *paths: str) -> None:
        """Keys or whole sections known not to change the recomputed math (the bundle records their result)."""
        for path in paths:
            self.read.add(path)
            self.neutral_prefixes.append(path)

    def _known(self, path: str) -> bool:
        if path in self.read:
            return True
        return any(path == p or path.startswith(p + ".") for p in self.neutral_prefixes)

    def check_unknown(self, sections: Optional[Iterable[str]] = None, pattern: Optional[re.Pattern] = None) -> None:
        """Refuse (exit 4) the first key under ``sections`` (every key when ``None``) that this mapping does
        not know, whose last name component matches ``pattern`` (default: :data:`MATH_WORDS`) and whose value
        is on."""
        pattern = pattern or _MATH_KEY
        candidates = dict(self._leaves(sections, pattern))  # only keys named like a knob: a few
        for path, value in sorted(candidates.items()):
            if self._known(path) or not is_active(value):
                continue
            self.refuse(path, value, f"a key the {self.framework} mapping does not know; it could change the "
                                     "math, so it is refused rather than guessed")

    def _leaves(self, sections: Optional[Iterable[str]], pattern: re.Pattern) -> Iterable[tuple[str, Any]]:
        """The leaves of :meth:`flat` under ``sections`` (all when ``None``) whose last name matches ``pattern``,
        walked in the tree: no path is made for another key."""

        def walk(node: dict, prefix: str) -> Iterable[tuple[str, Any]]:
            for key, value in node.items():
                if isinstance(value, dict) and value:
                    yield from walk(value, f"{prefix}.{key}" if prefix else key)
                elif pattern.search(key.lower()):
                    yield (f"{prefix}.{key}" if prefix else key), value

        scopes = None if sections is None else tuple(sections)
        for path, value in walk(self.tree, ""):
            if scopes is None or any(path == s or path.startswith(s + ".") for s in scopes):
                yield path, value

    # ------------------------------------------------------------------------------------- result

    def build(self, fields: dict[str, Any]) -> RecomputeConfig:
        """The ``RecomputeConfig`` of ``fields``; a value the schema rejects is a one-line error (exit 3)."""
        try:
            return msgspec.convert(fields, RecomputeConfig)
        except (msgspec.ValidationError, ValueError, TypeError) as exc:
            raise FrameworkConfigError(f"{self._label()}: maps to an invalid RecomputeConfig: {exc}") from None


def kl_clamps(kl_type: str, input_clamp: Optional[float], output_clamp: Optional[float]) -> dict[str, Any]:
    """The ``kl_loss_*_clamp`` fields of a KL-in-loss estimator that clamps (set only for k3, the one the
    frameworks clamp)."""
    if kl_type != "k3":
        return {"kl_loss_input_clamp": None, "kl_loss_output_clamp": None}
    return {"kl_loss_input_clamp": input_clamp, "kl_loss_output_clamp": output_clamp}


def framework_version(framework: str, version: Optional[str], known: Iterable[str],
                      where: Optional[str] = None) -> str:
    """``version`` (the bundle's ``producer.framework_version``; ``None``: the newest of ``known``) when a mapping
    knows its semantics, else a one-line refusal naming the versions it knows (exit 4)."""
    known = tuple(known)
    if version is None:
        return known[-1]
    if str(version) not in known:
        label = f"{where}: {framework} config" if where else f"{framework} config"
        raise UnsupportedFrameworkConfig(f"{label}: framework_version={str(version)!r}: not a version this mapping "
                                         f"knows (known: {', '.join(known)})")
    return str(version)
