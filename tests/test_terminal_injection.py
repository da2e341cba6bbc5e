"""No bundle string reaches the terminal unescaped from the CLI (SPEC §5.2): text report, validate,
inspect, stderr error lines, and JSON (valid, the same values, hidden characters as ``\\u`` escapes).

Each bundle carries one escape sequence (OSC 52, ``ESC[2J``, OSC 8, a C1 CSI, U+202E; see
``injection_bundles``) in every string a view shows; the tests run the real entry point (in-process and
as a process) and assert that no raw control character is printed and that the escaped form is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from replay_lib.judge.report import report_to_json, report_to_text
from replay_lib.run.runner import replay
from replay_lib.safe_text import safe, safe_json

from injection_bundles import RAW, SEQUENCES, in_name, is_clean, shown, write_hostile

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=list(SEQUENCES), ids=list(SEQUENCES))
def seq(request) -> str:
    return SEQUENCES[request.param]


@pytest.fixture
def hostile(tmp_path, seq, bundle_tools) -> Path:
    """The hostile bundle, in a capture directory, under a directory name that carries ``seq`` too."""
    return write_hostile(tmp_path / "capture" / f"bundle{in_name(seq)}", seq, bundle_tools.reseal)


def run(cli, *args):
    code, out, err = cli(*args)
    assert is_clean(out), [line for line in out.splitlines() if not is_clean(line)]
    assert is_clean(err), err
    assert "Traceback" not in err
    return code, out, err


def warnings_of(bundle: Path, esc: str, name_esc: str) -> list[str]:
    where = safe(str(bundle))
    return [
        f"warning: {where}/manifest.json: $.note{esc}: unknown field (ignored)",
        f"warning: {where}/index.json: $.config.knob{esc}x: unknown field (ignored)",
        f"warning: {where}/index.json: $.extra{esc}field: unknown field (ignored)",
        f"warning: {where}/payloads/stray{name_esc}.pt: file not listed in manifest.json (ignored)",
    ]


# ------------------------------------------------------------------------------------ the function


def test_safe_escapes_every_sequence_visibly():
    assert safe(SEQUENCES["osc52"]) == "\\x1b]52;c;cm0gLXJmIH4=\\x07"
    assert safe(SEQUENCES["clear"]) == "\\x1b[2J"
    assert safe(SEQUENCES["osc8"]) == "\\x1b]8;;http://x\\x1b\\"
    assert safe(SEQUENCES["c1csi"]) == "\\x9b2J"
    assert safe(SEQUENCES["rlo"]) == "\\u202e"
    assert safe("a\nb\tc\rd\x7f\x00") == "a\\nb\\tc\\rd\\x7f\\x00"
    assert safe("\u2028\u2029\u200e\u200f\u061c\u2066\u2069\u202a\ufeff") == \
        "\\u2028\\u2029\\u200e\\u200f\\u061c\\u2066\\u2069\\u202a\\ufeff"
    assert safe("\U000e0041") == "\\U000e0041"  # a tag character (Cf, outside the BMP)
    assert safe("\udcff") == "\\udcff"  # a lone surrogate: a file name that is not UTF-8


def test_safe_leaves_printable_text_alone():
    for text in ("s-0", "mb-0007", "é — ✓ 日本 [red]x[/red]", "C:\\path\\x1b", ""):
        assert safe(text) is text  # the fast path: the string itself
    assert safe("a\xa0b\u3000c") == "a\xa0b\u3000c"  # spaces (Zs) are not hidden
    assert safe(41) == "41" and safe(None) == "None"


def test_safe_is_idempotent():
    for seq in SEQUENCES.values():
        assert safe(safe(seq)) == safe(seq)
        assert is_clean(safe(seq))


def test_safe_json_is_valid_json_of_the_same_values():
    doc = json.dumps({f"k{s}": [s, "é", "\U000e0041"] for s in SEQUENCES.values()}, ensure_ascii=False, indent=2)
    out = safe_json(doc)
    assert json.loads(out) == json.loads(doc)
    assert is_clean(out) and "\u202e" not in out
    assert "\\u009b2J" in out and "\\udb40\\udc41" in out and "é" in out
    assert safe_json('{"a": 1}\n') == '{"a": 1}\n'


# ------------------------------------------------------------------------------------ text views


def test_replay_text_report(hostile, seq, cli):
    esc = shown(seq)
    code, out, err = run(cli, "replay", hostile)
    assert code == 1 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"bundle b{esc}1 — first divergent stage: reward.post_process"
    assert f"          reward s{esc}0: expected=-5.5 actual=-1.0 abs_err=4.5" in lines
    # a per-token line too: under --chain the advantages broadcast the recomputed rewards
    chained = run(cli, "replay", hostile, "--chain")[1].splitlines()
    assert f"          advantage s{esc}0@0: expected=-5.5 actual=-1.0 abs_err=4.5" in chained
    for w in warnings_of(hostile, esc, shown(in_name(seq))):
        assert w in lines
    assert f"warning: index.json $.config.knob{esc}x=False: unknown knob with a neutral value (ignored)" in lines


def test_the_library_text_report_is_escaped_too(hostile, seq):
    text = report_to_text(replay(hostile))
    assert is_clean(text)
    assert f"reward s{shown(seq)}0: expected=-5.5" in text


def test_validate_text(hostile, seq, cli):
    esc = shown(seq)
    code, out, err = run(cli, "validate", hostile)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"bundle b{esc}1 — valid (format ")
    for w in warnings_of(hostile, esc, shown(in_name(seq))):
        assert w in lines


@pytest.mark.parametrize("where", ["bundle", "capture"])
def test_inspect_text(hostile, seq, cli, where):
    esc = shown(seq)
    target = hostile if where == "bundle" else hostile.parent
    code, out, err = run(cli, "inspect", target)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert f"bundle b{esc}1" in lines
    assert f"  path      {safe(str(hostile))}" in lines
    assert f"  weights   rollout=w{esc}41 actor=w{esc}42" in lines
    assert f"  micro_batch_ids           mb{esc}0, mb{esc}1" in lines
    assert f"  consumer_batch_ids        cb{esc}0" in lines
    assert any(line.startswith(f"  producer  commit=c0ffee{esc} torch=") for line in lines)


def test_inspect_lists_a_broken_entry_of_a_capture_directory_escaped(tmp_path, seq, cli):
    capture = tmp_path / "capture"
    broken = capture / f"run{in_name(seq)}"
    broken.mkdir(parents=True)
    (broken / "manifest.json").write_text("{not json")
    code, out, err = run(cli, "inspect", capture)
    assert code == 0 and err == ""
    assert f"  path      {safe(str(broken))}" in out.splitlines()
    assert f"problem: run{shown(in_name(seq))}: missing index.json" in out.splitlines()


# ------------------------------------------------------------------------------------ stderr


def test_a_selection_error_names_the_id_escaped(hostile, seq, cli):
    code, out, err = run(cli, "replay", "--sample", f"nope{seq}", hostile)
    assert (code, out) == (3, "")
    assert err == (f"trajectory-replay: error: {safe(str(hostile))}: --sample nope{shown(seq)}: "
                   "no such sample in the bundle\n")


def test_an_ambiguous_capture_directory_lists_its_entries_escaped(hostile, seq, cli, bundle_tools):
    capture = hostile.parent
    write_hostile(capture / f"other{in_name(seq)}", seq, bundle_tools.reseal)
    code, out, err = run(cli, "replay", capture)
    assert (code, out) == (3, "")
    name = shown(in_name(seq))
    assert err.startswith(f"trajectory-replay: error: {capture}: ambiguous capture directory with 2 bundles")
    assert err.endswith(f"candidates: bundle{name} (rollout 120); other{name} (rollout 120)\n")


def test_a_path_error_is_escaped(tmp_path, seq, cli):
    missing = tmp_path / f"gone{in_name(seq)}"
    code, _, err = run(cli, "validate", missing)
    assert code == 3
    assert err == f"trajectory-replay: error: {tmp_path}/gone{shown(in_name(seq))}: no such file or directory\n"


def test_a_schema_error_quoting_a_key_is_one_escaped_line(tmp_path, seq, cli, bundle_tools):
    bundle = write_hostile(tmp_path / "b", seq, bundle_tools.reseal)
    bundle_tools.edit_json(bundle, "index.json", lambda doc: doc["identity"]["rank"].__setitem__(f"dp{seq}", "x"))
    code, out, err = run(cli, "replay", bundle)
    assert (code, out) == (3, "")
    assert err == f"trajectory-replay: error: {bundle}/index.json: $.identity.rank[...]: expected `int`, got `str`\n"


def test_a_usage_error_quoting_an_argument_is_escaped(tmp_path, seq, capsys):
    from replay_lib.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["replay", str(tmp_path), f"extra{seq}"])
    out, err = capsys.readouterr()
    assert (exit_.value.code, out) == (2, "")
    assert err == f"trajectory-replay: error: unrecognized arguments: extra{shown(seq)}\n"


def test_a_newline_in_an_error_message_stays_on_one_line(tmp_path, cli):
    missing = tmp_path / "two\nlines"
    code, _, err = run(cli, "validate", missing)
    assert code == 3
    assert err == f"trajectory-replay: error: {tmp_path}/two\\nlines: no such file or directory\n"


# ------------------------------------------------------------------------------------ JSON


def strings(doc):
    if isinstance(doc, str):
        yield doc
    elif isinstance(doc, dict):
        for k, v in doc.items():
            yield k
            yield from strings(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from strings(v)


@pytest.mark.parametrize("command", ["replay", "validate", "inspect"])
def test_json_is_exact_and_terminal_safe(hostile, seq, cli, command):
    code, out, err = run(cli, command, "--format", "json", hostile)
    assert code == (1 if command == "replay" else 0) and err == ""
    assert not any(c in out for c in RAW)
    doc = json.loads(out)
    values = set(strings(doc))
    assert f"s{seq}0" in values or command != "replay"  # the raw id, exactly, once decoded
    assert any(f"b{seq}1" == v for v in values)
    if command == "replay":
        assert doc["first_divergence"]["sample_id"] == f"s{seq}0"
        assert out == report_to_json(replay(hostile))


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file names are bytes")
def test_a_file_name_that_is_not_utf8_is_escaped_in_text_and_exact_in_json(tmp_path, cli):
    from replay_lib.demo import write_pr65

    run_dir = os.fsdecode(os.fsencode(str(tmp_path)) + b"/run\xff")  # os.listdir's surrogate escape
    os.mkdir(run_dir)
    write_pr65(Path(run_dir) / "b")
    code, out, err = run(cli, "inspect", tmp_path)
    assert code == 0 and err == ""
    assert f"  path      {tmp_path}/run\\udcff/b" in out.splitlines()
    code, out, err = run(cli, "inspect", "--format", "json", tmp_path)
    assert code == 0 and err == "" and out.isascii()
    assert '"path": "' + str(tmp_path) + '/run\\udcff/b"' in out
    assert os.fsencode(json.loads(out)["bundles"][0]["path"]) == os.fsencode(str(tmp_path)) + b"/run\xff/b"


# ------------------------------------------------------------------------------------ a real process


def test_a_real_process_writes_no_raw_control_byte(tmp_path, bundle_tools):
    seq = "".join(SEQUENCES.values())
    bundle = write_hostile(tmp_path / f"all{in_name(seq)}", seq, bundle_tools.reseal)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for args in (["replay", bundle], ["validate", bundle], ["inspect", bundle], ["replay", "--format", "json", bundle],
                 ["replay", "--sample", f"x{seq}", bundle]):
        proc = subprocess.run([sys.executable, "-m", "replay_lib", *map(str, args)], capture_output=True, env=env,
                              timeout=120, cwd=REPO)
        assert proc.returncode in (0, 1, 3), proc.stderr
        for stream in (proc.stdout, proc.stderr):
            assert b"\x1b" not in stream and b"\x07" not in stream
            assert b"\xc2\x9b" not in stream and b"\xe2\x80\xae" not in stream  # C1 CSI, U+202E in UTF-8
        assert b"Traceback" not in proc.stderr
        assert safe(seq).encode() in proc.stdout + proc.stderr or args[1] == "--format"
