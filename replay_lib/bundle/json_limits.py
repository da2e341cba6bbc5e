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
from typing import Iterator, Optional

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


def _outside_strings(data: bytes, drop: bytes, table: Optional[bytes] = None) -> bytes:
    """The bytes of ``data`` outside its strings, less those in ``drop`` (which holds every byte but the
    quote and the marks kept), translated by ``table``. Exact for valid JSON."""
    s = _without_escapes(data).translate(table, drop)  # an escaped quote must not end or start a string
    if b'"' in s:
        # Strings without marks are now "" pairs: dropping adjacent pairs is a fast bytes replace. If no quote
        # is left, no mark was inside a string (a mark run inside one sits between an even- and an
        # odd-numbered quote, so the quote run before it has odd length and leaves a quote); else the regex.
        pairs_dropped = s.replace(b'""', b"")
        s = pairs_dropped if b'"' not in pairs_dropped else b"".join(_STRING.sub(b"", p) for p in _pieces(s))
    return s


def _without_escapes(data: bytes) -> bytes:
    """``data`` less its escaped backslashes and quotes: then every quote opens or closes a string."""
    if b"\\" not in data:
        return data
    return data.replace(b"\\\\", b"").replace(b'\\"', b"")


def _pieces(s: bytes, size: int = 1 << 18) -> Iterator[bytes]:
    """``s`` (without escapes) in pieces of about ``size`` bytes, each ending outside a string (after an even
    number of quotes), so that a regex finds whole strings in it and its list of fragments stays that of one
    piece (a regex over a whole 30 MB document of short strings holds ~100 bytes per string)."""
    start, n = 0, len(s)
    while start < n:
        end = min(start + size, n)
        if end < n and s.count(b'"', start, end) % 2:
            close = s.find(b'"', end)  # the string open at `end` closes there
            end = n if close < 0 else close + 1
        yield s[start:end]
        start = end


def _looks_deeper(data: bytes, limit: int) -> bool:
    """Whether the brackets outside strings nest deeper than ``limit``, from the bytes alone. Exact for valid
    JSON; malformed JSON may look deep, which :func:`_deep_path` then settles."""
    s = _outside_strings(data, _DROP, _FOLD)
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
# reached) and string length (:data:`MAX_STRING_CHARS`); a config also holds at most :data:`MAX_CONFIG_NODES`
# keys and values (``loads_limited(..., max_nodes=)``). YAML configs are held to the same limits by
# ``frameworks._base.load_yaml`` (plus a bound on what aliases expand to).

MAX_INT_DIGITS = 20  # 2**64 - 1 has 20 digits
# Keys and values a config may hold (each key, each value, each list item, each list or object, the document
# itself: YAML's nodes, aliases counted as what they name). A trainer config holds a few thousand; decoded,
# a key and its value cost Python ~150 bytes, so the bound caps what a config's structure can cost (~15 MB)
# whatever the size of the file.
MAX_CONFIG_NODES = 100_000
MAX_STRING_CHARS = 1 << 20  # 1 Mi characters: a chat template or a path is far shorter
_INT_BOUND = 10 ** MAX_INT_DIGITS


class JSONLimitError(ValueError):
    """A foreign document over one of the limits; ``str(err)`` is the part after the file name:
    ``"$.a.b: an integer of 5000 digits, over the 20-digit limit"``."""


_NODE_MARKS = b"[]{},:"
_NODE_QUOTE_DROP = bytes(c for c in range(256) if c not in _NODE_MARKS + b'"')
_WHITESPACE = b" \t\r\n"
_OTHER = bytes(c for c in range(256) if c not in _NODE_MARKS + _WHITESPACE)
_SCALAR = bytes.maketrans(_OTHER, b"0" * len(_OTHER))  # every byte of a scalar (a string's too) → "0"


def json_node_count(data: bytes) -> int:
    """The keys and values of the JSON document ``data`` (see :data:`MAX_CONFIG_NODES`), from the bytes alone,
    before any decoder builds them: its lists and objects, and its scalars (keys included) — the runs of bytes
    between the marks ``[]{},:``, whitespace left out. Exact for valid JSON (malformed JSON: its decoder says
    so). C-speed scans of 256 KiB at a time; a piece whose strings hold marks has its strings emptied first
    (a regex). Memory: one copy of the document at most (when it holds escapes), and one piece."""
    nodes, last = 0, b","  # a scalar at the very start opens a run like one after a comma
    for piece in _pieces_for_counting(_without_escapes(data)):
        t = piece.translate(_SCALAR, _WHITESPACE)
        if not t:
            continue
        nodes += t.count(b"[") + t.count(b"{")
        nodes += t.count(b"[0") + t.count(b"{0") + t.count(b",0") + t.count(b":0")
        nodes += last in b"[{,:" and t[0] == 0x30
        last = t[-1:]
    return nodes


def _pieces_for_counting(s: bytes) -> Iterator[bytes]:
    """``s`` (without escapes) in pieces where no string holds a mark: a piece whose marks outside its
    strings are fewer than all its marks has its strings emptied (``""``) by a regex."""
    for piece in _pieces(s):
        if b'"' in piece:
            marks = piece.translate(None, _NODE_QUOTE_DROP)
            if b'"' in marks.replace(b'""', b""):  # a quote run of odd length: a mark inside a string
                piece = _STRING.sub(b'""', piece)
        yield piece


def loads_limited(data: bytes, what: str = "foreign JSON", max_nodes: Optional[int] = None) -> object:
    """``data`` decoded within the limits above. ``json.JSONDecodeError`` (with the standard library's message,
    which callers quote) for malformed JSON; :class:`JSONLimitError` naming the path for a limit.

    msgspec decodes the bytes in place (no text copy); a document it refuses (``NaN``/``Infinity`` literals,
    which Python's json writes, or a malformed one) is decoded again by the json module for its values or
    its message. With ``max_nodes``, a document of more keys and values (:func:`json_node_count`) is refused
    before it is decoded."""
    import json

    deep = json_depth_error(data)
    if deep is not None:
        raise JSONLimitError(deep.replace("a bundle's JSON", what))
    if max_nodes is not None:
        nodes = json_node_count(data)
        if nodes > max_nodes:
            raise JSONLimitError(f"$: {nodes} keys and values, more than {max_nodes} (the limit for {what})")
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
