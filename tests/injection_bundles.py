"""Bundles whose strings carry terminal escape sequences, for the CLI and TUI injection tests.

Each sequence below was seen to act on a real terminal when printed raw: OSC 52 writes the clipboard
(tmux pastes ``rm -rf ~``), ``ESC[2J`` clears the screen, OSC 8 opens a hyperlink, ``\\x9b`` is a C1 CSI on
its own and U+202E reverses the text after it. A bundle puts one of them into every string a view shows:
sample ids, bundle id, micro-batch ids, unknown config keys and fields, an unlisted payload file, weight
lineage, the producer's commit, and (in a capture directory) the bundle directory's own name."""

from __future__ import annotations

import json
from pathlib import Path

from replay_lib.demo import write_pr65
from replay_lib.safe_text import safe

SEQUENCES = {
    "osc52": "\x1b]52;c;cm0gLXJmIH4=\x07",
    "clear": "\x1b[2J",
    "osc8": "\x1b]8;;http://x\x1b\\",
    "c1csi": "\x9b2J",
    "rlo": "\u202e",
}
# What may never reach a terminal: ESC and BEL, any C1 control, the bidi override.
RAW = ("\x1b", "\x07", "\x9b", "\u202e")


def is_clean(text: str) -> bool:
    """No raw control character of the sequences, and no other C1 control either."""
    return not any(c in text for c in RAW) and not any(0x80 <= ord(c) <= 0x9f for c in text)


def in_name(seq: str) -> str:
    """``seq`` as it can appear in a file name (OSC 8's URL loses its slashes)."""
    return seq.replace("/", "")


def dump_json(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")


def write_hostile(path: Path, seq: str, reseal) -> Path:
    """A PR #65 bundle (reward.post_process diverges on every sample) whose strings all carry ``seq``.

    ``reseal``: the conftest's checksum re-sealer (the tampered JSON is sealed again, so the bundle is
    valid and every view gets to show the strings)."""
    bundle = write_pr65(path, buggy=True, bundle_id=f"b{seq}1")
    index = json.loads((bundle / "index.json").read_bytes())
    for i, s in enumerate(index["samples"]):
        s["sample_id"] = f"s{seq}{i}"
        s["micro_batch_id"] = f"mb{seq}{i // 2}"
    ident = index["identity"]
    ident["micro_batch_ids"] = [f"mb{seq}0", f"mb{seq}1"]
    ident["consumer_batch_ids"] = [f"cb{seq}0"]
    ident["weight_lineage"] = {"rollout_weight": f"w{seq}41", "actor_weight": f"w{seq}42"}
    index["config"][f"knob{seq}x"] = False  # an unknown knob with a neutral value: a warning, no refusal
    index[f"extra{seq}field"] = 1  # an unknown top-level field: a warning
    (bundle / "index.json").write_bytes(dump_json(index))
    manifest = json.loads((bundle / "manifest.json").read_bytes())
    manifest["producer"]["commit"] = f"c0ffee{seq}"
    manifest[f"note{seq}"] = "x"
    (bundle / "manifest.json").write_bytes(dump_json(manifest))
    (bundle / "payloads" / f"stray{in_name(seq)}.pt").write_bytes(b"not listed")
    reseal(bundle)
    return bundle


def shown(seq: str) -> str:
    """The escaped form a view must show in place of ``seq``."""
    return safe(seq)
