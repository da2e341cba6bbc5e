"""How deep a bundle's JSON may nest (SPEC §11), checked on the bytes before any decoder sees them.

A decoder recurses once per level: a 1,000-deep document (``[[[[…`` in an unknown field, or in ``COMPLETE``,
which no checksum covers) raises ``RecursionError`` inside msgspec or in the code that walks the result.
No file of the format nests deeper than five levels (``$.stage_contracts.<stage>.inputs[0]``), so
:data:`MAX_JSON_DEPTH` leaves room for any extension and refuses only what no producer writes.

The check is a scan of the bytes at C speed (a 23 MB ``index.json`` of loss masks: ~10 ms, a quarter of
its decode): escapes and string contents are dropped, the brackets left are measured. Only a document that
looks too deep is walked token by token, once, so that the error names where.
Torch-free: ``inspect`` reads the same files.
"""

from __future__ import annotations

import re
from typing import Optional

import msgspec

MAX_JSON_DEPTH = 64  # containers inside containers; the outermost object or array is level 1

_KEEP = b'"[]{}'
_DROP = bytes(c for c in range(256) if c not in _KEEP)
_FOLD = bytes.maketrans(b"{}", b"[]")  # only the nesting counts, not which kind of bracket
_STRING = re.compile(rb'"[^"]*"')
_RUNS = re.compile(rb"\[+|\]+")
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},]', re.S)  # a string (escapes and all) or a mark
_PATH_STEPS = 4  # the path in the message: enough to name the field, not the 64 levels below it


def json_depth_error(data: bytes, limit: int = MAX_JSON_DEPTH) -> Optional[str]:
    """``None`` if ``data`` nests at most ``limit`` levels deep (or is not JSON: its decoder says so), else
    the message after the file name: ``"$.zz[0][0][0]: nested deeper than 64 levels …"``."""
    if not _looks_deeper(data, limit):
        return None
    path = _deep_path(data, limit)
    if path is None:
        return None
    return f"{path}: nested deeper than {limit} levels (the limit for a bundle's JSON)"


def _looks_deeper(data: bytes, limit: int) -> bool:
    """Whether the brackets outside strings nest deeper than ``limit``, from the bytes alone. Exact for valid
    JSON; malformed JSON may look deep, which :func:`_deep_path` then settles."""
    s = data
    if b"\\" in s:  # an escaped backslash or quote must not end or start a string
        s = s.replace(b"\\\\", b"").replace(b'\\"', b"")
    s = s.translate(_FOLD, _DROP)
    if b'"' in s:
        # Strings without brackets are now "" pairs: dropping adjacent pairs is a fast bytes replace. If no quote
        # is left, no bracket was inside a string (a bracket run inside one sits between an even- and an
        # odd-numbered quote, so the quote run before it has odd length and leaves a quote); else the regex.
        pairs_dropped = s.replace(b'""', b"")
        s = pairs_dropped if b'"' not in pairs_dropped else _STRING.sub(b"", s)
    # Peel the innermost level while that shrinks the text a lot (a list of many small objects), then
    # follow the depth run by run (a deep chain is a few long runs).
    peeled = 0
    while len(s) > 2 * (limit - peeled):  # n brackets nest at most n/2 deep
        if peeled == limit:
            return True  # brackets left below `limit` peeled levels
        shorter = s.replace(b"[]", b"")
        if len(shorter) > 3 * len(s) // 4:
            break
        s, peeled = shorter, peeled + 1
    if len(s) <= 2 * (limit - peeled):
        return False
    depth = peeled
    for run in _RUNS.findall(s):
        if run[0] == 0x5B:  # "["
            depth += len(run)
            if depth > limit:
                return True
        else:
            depth -= len(run)
    return False


def _deep_path(data: bytes, limit: int) -> Optional[str]:
    """The msgspec-style path (its first few steps) to the first container nested deeper than ``limit``,
    from a walk over the tokens: only for a document that looks that deep, once, before it is refused.
    ``None`` when no container is (the document is malformed instead)."""
    stack: list[list] = []  # per open container: [is_object, index of the current member, its key]
    for m in _TOKEN.finditer(data):
        c = data[m.start()]
        if c == 0x22:  # a string: an object's key when it opens a member
            if stack and stack[-1][0] and stack[-1][2] is None:
                stack[-1][2] = m.group()
        elif c == 0x5B or c == 0x7B:  # [ {
            stack.append([c == 0x7B, 0, None])
            if len(stack) > limit:
                return "$" + "".join(_step(level) for level in stack[:-1][:_PATH_STEPS])
        elif c == 0x2C:  # ,
            if stack:
                stack[-1][1] += 1
                stack[-1][2] = None
        elif stack:  # ] }
            stack.pop()
    return None


def _step(level: list) -> str:
    is_object, index, key = level
    if not is_object:
        return f"[{index}]"
    try:
        name = msgspec.json.decode(key) if key is not None else "?"
    except msgspec.MsgspecError:
        name = key.decode("utf-8", "replace")
    return f".{name}"


# ---------------------------------------------------------------------------------------------------------------
# Foreign JSON outside a bundle (SPEC §11): framework configs (``config``, ``import --config``) and dump rows
# (NeMo-RL's jsonl). The same three limits for every reader: nesting depth (:data:`MAX_JSON_DEPTH`), integer
# size (:data:`MAX_INT_DIGITS` decimal digits: any int64 or uint64 fits, Python's own 4,300-digit limit is never
# reached) and string length (:data:`MAX_STRING_CHARS`). YAML configs are held to the same limits by
# ``frameworks._base.load_yaml`` (plus a bound on what aliases expand to).

MAX_INT_DIGITS = 20  # 2**64 - 1 has 20 digits
MAX_STRING_CHARS = 1 << 20  # 1 Mi characters: a chat template or a path is far shorter
_INT_BOUND = 10 ** MAX_INT_DIGITS


class JSONLimitError(ValueError):
    """A foreign document over one of the limits; ``str(err)`` is the part after the file name:
    ``"$.a.b: an integer of 5000 digits, over the 20-digit limit"``."""


def loads_limited(data: bytes, what: str = "foreign JSON") -> object:
    """``data`` decoded within the limits above. ``json.JSONDecodeError`` (with the standard library's message,
    which callers quote) for malformed JSON; :class:`JSONLimitError` naming the path for a limit.

    msgspec decodes the bytes in place (no text copy); a document it refuses (``NaN``/``Infinity`` literals,
    which Python's json writes, or a malformed one) is decoded again by the json module for its values or
    its message."""
    import json

    deep = json_depth_error(data)
    if deep is not None:
        raise JSONLimitError(deep.replace("a bundle's JSON", what))
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError:
        try:
            value = json.loads(data)
        except ValueError as exc:
            if isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError)):
                raise
            # int() over Python's digit limit (the json module's only other ValueError)
            raise JSONLimitError(f"$: an integer of more than 4300 digits, over the {MAX_INT_DIGITS}-digit "
                                 "limit") from None
    check_limits(value)
    return value


def check_limits(value: object, path: str = "$") -> None:
    """:class:`JSONLimitError` for the first integer over :data:`MAX_INT_DIGITS` digits or string over
    :data:`MAX_STRING_CHARS` characters in a decoded document (keys included). Recursive: callers bound the
    depth first (:func:`json_depth_error`, or the YAML composer's own bound)."""
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return
    if isinstance(value, int):
        if not -_INT_BOUND < value < _INT_BOUND:
            digits = _digits(value)
            raise JSONLimitError(f"{path}: an integer of {digits} digits, over the {MAX_INT_DIGITS}-digit limit")
    elif isinstance(value, str):
        if len(value) > MAX_STRING_CHARS:
            raise JSONLimitError(f"{path}: a string of {len(value)} characters, over the {MAX_STRING_CHARS}-"
                                 "character limit")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_limits(key, path)
            check_limits(item, f"{path}.{_short(key)}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_limits(item, f"{path}[{i}]")


def _digits(value: int) -> str:
    """The decimal digits of ``value`` as said in a message: ``"30"``, or ``"more than 4300"`` for one past
    Python's own limit on converting an int to text."""
    try:
        return str(len(str(abs(value))))
    except ValueError:
        return "more than 4300"


def _short(key: object) -> str:
    text = str(key)
    return text if len(text) <= 40 else text[:40] + "…"
