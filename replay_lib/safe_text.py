"""Bundle strings made safe to show on a terminal (SPEC §5.2).

A bundle is someone else's data: a sample id, a key, a file name or a commit string may hold an escape
sequence (OSC 52 writes the clipboard, ``ESC[2J`` clears the screen, OSC 8 forges a link), a C1 control
(``\\x9b`` is CSI on its own) or a bidi override (U+202E reverses what follows). Every view — the text
report, stderr lines, ``inspect``, the TUI — passes what it shows through :func:`safe`, which turns each
such character into a visible escape (``\\x1b``, ``\\u202e``) and leaves every other string untouched.

Hidden characters are the Unicode categories Cc (C0, DEL, C1), Cf (bidi and other format controls,
zero-width characters), Zl/Zp (line and paragraph separators) and Cs (lone surrogates: a file name that
is not UTF-8, which a terminal stream cannot even encode). ``\\n``, ``\\t`` and ``\\r`` are escaped too: a
field shown on one line stays on one line. A backslash is left as it is (paths stay readable).
"""

from __future__ import annotations

import math
import re
import unicodedata

import msgspec

HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
# Characters that may be hidden: everything outside printable ASCII (the category decides, per match).
_CANDIDATE = re.compile(r"[^\x20-\x7e]")
_JSON_CANDIDATE = re.compile(r"[^\x20-\x7e\n]")  # a JSON document's own newlines are layout


def hidden(char: str) -> bool:
    """Whether ``char`` would act on a terminal (or vanish) instead of showing."""
    return unicodedata.category(char) in HIDDEN_CATEGORIES


def escape_char(char: str) -> str:
    """The visible form of one hidden character, as Python writes it: ``\\x1b``, ``\\u202e``, ``\\U000e0001``."""
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def _visible(match: re.Match) -> str:
    char = match.group()
    return escape_char(char) if hidden(char) else char


def safe(text: object) -> str:
    """``text`` with every hidden character escaped; a string without one is returned as it is.

    Fast for the common case (the report and the TUI show thousands of ids): a printable string costs
    one ``str.isprintable`` call. The result is printable, so ``safe(safe(s)) == safe(s)``."""
    if not isinstance(text, str):
        text = str(text)
    if text.isprintable():
        return text
    return _CANDIDATE.sub(_visible, text)


MAX_LINE_CHARS = 1024  # an error line's message; our longest (a directory's elided listing of 5 entries) is ≈ 650


def one_line(text: object, limit: int = MAX_LINE_CHARS) -> str:
    """``text`` as one line of an error: escaped (:func:`safe`), runs of whitespace collapsed, and cut to
    ``limit`` characters with an ellipsis and the full length (``… (20000047 characters)``) when longer, so that
    a value quoted from foreign input (a 20 MB field) never floods the terminal. Only the head of a long text
    is escaped and split."""
    if not isinstance(text, str):
        text = str(text)
    head = text[: 4 * limit] if len(text) > 4 * limit else text
    line = " ".join(safe(head).split())
    if len(line) <= limit and head is text:
        return line
    return f"{line[:limit]}… ({len(text)} characters)"


def _json_escape(match: re.Match) -> str:
    char = match.group()
    if not hidden(char):
        return char
    code = ord(char)
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000  # a UTF-16 surrogate pair, as JSON spells a character outside the BMP
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def elided_listing(values, limit: int = 4, fmt=str) -> str:
    """``a, b, c, d … (+60)``: the first ``limit`` of ``values``, then how many more ("—" when empty); ``fmt``
    writes each one shown (only those: a step's thousands of groups are counted, not formatted)."""
    values = list(values)
    if not values:
        return "—"
    shown = ", ".join(fmt(v) for v in values[:limit])
    return shown + (f" … (+{len(values) - limit})" if len(values) > limit else "")


def safe_json(document: str) -> str:
    """A JSON document with the hidden characters inside its strings written as ``\\uXXXX`` escapes.

    The document decodes to exactly the same values (JSON may escape any character) and stays valid;
    only its bytes change, so a ``--format json`` report on a terminal cannot carry a raw C1 control or
    a bidi override either (msgspec already escapes C0 controls)."""
    if document.isascii() and "\x7f" not in document:
        return document
    return _JSON_CANDIDATE.sub(_json_escape, document)


def json_document(obj, encode=msgspec.json.encode) -> str:
    """``obj`` as an indented JSON document (one trailing newline), terminal-safe (:func:`safe_json`).

    A file name that is not UTF-8 reaches a result as lone surrogates (``os.listdir``'s escapes), which
    msgspec refuses to encode; such a document is written by the json module instead, the surrogate as its
    ``\\udcXX`` escape (Python's ``json.loads`` and ``os.fsencode`` give the original bytes back)."""
    try:
        text = msgspec.json.format(encode(obj), indent=2).decode()
    except UnicodeEncodeError:
        import json

        text = json.dumps(_finite(msgspec.to_builtins(obj)), indent=2, ensure_ascii=False)
    return safe_json(text) + "\n"


def _finite(value):
    """NaN and ±Inf as ``null``, as msgspec writes them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
