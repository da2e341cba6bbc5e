"""Hostile foreign input outside a bundle (SPEC §11): framework configs (``config``, ``import --config``) and
framework dumps (``import slime|nemo-rl``) are held to the same limits as a bundle's JSON — nesting depth,
integer digits, string length; YAML aliases bounded by what they expand to; compressed ``torch.save`` records
bounded before they are inflated. Each refusal is one stderr line naming the file and where, exit 3.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from replay_lib.bundle.json_limits import (MAX_CONFIG_NODES, MAX_STRING_CHARS, JSONLimitError, check_limits,
                                           json_node_count)
from replay_lib.cli import main
from replay_lib.frameworks._base import MAX_YAML_ALIAS_NODES, load_yaml, to_plain
from replay_lib.errors import FrameworkConfigError

REPO = Path(__file__).resolve().parents[1]


def billion_laughs() -> str:
    """782 bytes: ten keys of ten aliases of … eight levels deep (10**9 leaves when copied as a tree)."""
    lines = ["l0: &l0 {a: 1, b: 2, c: 3, d: 4, e: 5, f: 6, g: 7, h: 8, i: 9, j: 10}"]
    for k in range(1, 9):
        alias = f"*l{k - 1}"
        lines.append(f"l{k}: &l{k} {{" + ", ".join(f"{c}: {alias}" for c in "abcdefghij") + "}")
    return "\n".join(lines) + "\n"


def _config_error(capsys, tmp_path: Path, name: str, content: str, framework: str = "verl") -> tuple[int, str]:
    path = tmp_path / name
    path.write_text(content)
    code = main(["config", framework, str(path)])
    captured = capsys.readouterr()
    assert captured.out == ""
    return code, captured.err


CONFIG_CASES = [
    ("rec-map.yaml", "a: &a {b: *a}\n", "line 1: alias *a inside the node it names (a recursive structure)"),
    ("rec-list.yaml", "a: &a [*a]\n", "line 1: alias *a inside the node it names (a recursive structure)"),
    ("flow.yaml", "a: " + "[" * 20000 + "]" * 20000 + "\n",
     "line 1: nested deeper than 64 levels (the limit for a config)"),
    ("block.yaml", "".join("  " * i + f"k{i}:\n" for i in range(3000)) + "  " * 3000 + "v: 1\n",
     "line 64: nested deeper than 64 levels (the limit for a config)"),
    ("laughs.yaml", billion_laughs(), f"line 5: aliases expand to more than {MAX_YAML_ALIAS_NODES} nodes"),
    ("int.yaml", "a: " + "7" * 5000 + "\n", "line 1: an integer of more than 4300 digits, over the 20-digit limit"),
    ("int30.yaml", "a:\n  b: " + "7" * 30 + "\n", "$.a.b: an integer of 30 digits, over the 20-digit limit"),
    ("lists.json", "[" * 100_000 + "]" * 100_000, "$[0][0][0][0]: nested deeper than 64 levels (the limit for a config)"),
    ("objects.json", '{"a":' * 5000 + "1" + "}" * 5000,
     "$.a.a.a.a: nested deeper than 64 levels (the limit for a config)"),
    ("int.json", '{"a": ' + "7" * 5000 + "}", "$: an integer of more than 4300 digits, over the 20-digit limit"),
    ("int30.json", '{"a": {"b": [1, ' + "7" * 30 + "]}}", "$.a.b[1]: an integer of 30 digits, over the 20-digit limit"),
    ("string.json", '{"a": "' + "x" * (MAX_STRING_CHARS + 1) + '"}',
     f"$.a: a string of {MAX_STRING_CHARS + 1} characters, over the {MAX_STRING_CHARS}-character limit"),
]


@pytest.mark.parametrize("name, content, message", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_hostile_config_is_one_line_exit_3(tmp_path, capsys, name, content, message):
    code, err = _config_error(capsys, tmp_path, name, content)
    assert (code, err) == (3, f"trajectory-replay: error: {tmp_path / name}: {message}\n")


def test_hostile_config_of_import_is_refused_before_the_dump_is_read(tmp_path, capsys):
    """``import --config`` reads the config through the same loader: refused before the (absent) dump."""
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text("a: &a {b: *a}\n")
    code = main(["import", "nemo-rl", str(tmp_path / "absent.jsonl"), "--config", str(cfg), "-o", str(tmp_path / "o")])
    assert (code, capsys.readouterr().err) == (
        3, f"trajectory-replay: error: {cfg}: line 1: alias *a inside the node it names (a recursive structure)\n")


def test_billion_laughs_finishes_quickly_in_bounded_memory(tmp_path):
    """The 782-byte document, in a real process: refused (exit 3, one line) in well under its 10 s timeout, and
    the config command's own allocations stay small (tracemalloc's peak: ru_maxrss would also count the parent's
    pages at the fork, a pytest worker's hundreds of MB; the unbounded walk grew past gigabytes and never ended)."""
    path = tmp_path / "laughs.yaml"
    path.write_text(billion_laughs())
    assert path.stat().st_size == 782
    script = textwrap.dedent(f"""
        import sys, tracemalloc
        from replay_lib.cli import main
        tracemalloc.start()
        code = main(["config", "verl", {str(path)!r}])
        print(code, tracemalloc.get_traced_memory()[1] // 1024, file=sys.stderr)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=10, cwd=REPO)
    error, tail = proc.stderr.splitlines()
    code, peak_kib = map(int, tail.split())
    assert code == 3 and proc.stdout == ""
    assert error == f"trajectory-replay: error: {path}: line 5: aliases expand to more than 100000 nodes"
    assert peak_kib < 64 * 1024  # 100,000 counted nodes at most; 10**9 copied nodes: tens of GB


def test_aliases_within_the_bound_still_map(tmp_path, capsys):
    """Shared defaults and merge keys (a few aliases) read as before."""
    path = tmp_path / "verl.yaml"
    path.write_text("defaults: &d {clip_ratio_high: 0.28}\nactor_rollout_ref:\n  actor:\n    <<: *d\n"
                    "algorithm: {adv_estimator: grpo}\n")
    assert main(["config", "verl", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["eps_clip_high"] == 0.28


def test_alias_expansion_is_counted_as_the_expanded_tree():
    """A node counts once, keys included: l0 is 1 mapping + 10 keys + 10 values = 21 nodes, l1 = 11 + 10 × 21 =
    221, l2 = 2,221, l3 = 22,221, l4 = 222,221. The aliases of l1…l3 add 210 + 2,210 + 22,210 = 24,630 nodes;
    l4's (line 5) pass 100,000 at its fourth alias. Every node of the document counts too, aliases expanded
    (at most MAX_CONFIG_NODES): u is 1 + 9 + 9 = 19 nodes; the root, its two keys, u and the list v are 23; each
    alias of u adds 19 — 5,261 aliases and 18 scalars make exactly 100,000 nodes, which load; one more scalar is
    refused."""
    assert MAX_YAML_ALIAS_NODES == MAX_CONFIG_NODES == 100_000
    unit = "u: &u {" + ", ".join(f"k{i}: {i}" for i in range(9)) + "}\n"
    n = (MAX_CONFIG_NODES - 23) // 19
    pad = MAX_CONFIG_NODES - 23 - 19 * n
    assert (n, pad) == (5261, 18)
    loaded = load_yaml(unit + "v: [" + ", ".join(["*u"] * n + ["0"] * pad) + "]\n")
    assert len(loaded["v"]) == n + pad and loaded["v"][0] == {f"k{i}": i for i in range(9)}
    with pytest.raises(JSONLimitError) as err:
        load_yaml(unit + "v: [" + ", ".join(["*u"] * n + ["0"] * (pad + 1)) + "]\n")
    assert str(err.value) == f"line 2: more than {MAX_CONFIG_NODES} keys and values (the limit for a config)"


def _nodes(value) -> int:
    """Keys and values of a decoded document, counted as SPEC §11 counts them."""
    if isinstance(value, dict):
        return 1 + sum(1 + _nodes(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_nodes(v) for v in value)
    return 1


@pytest.mark.parametrize("text, count", [
    ("1", 1), (' "a" ', 1), ("[]", 1), ("{ }", 1), ("[1]", 2), ("[ 1 ]", 2), ('{"a": 1}', 3), ("[1, 2, 3]", 4),
    ('{"a": [], "b": {}}', 5), ('{"a,b": "c:[d]", "e": ["f\\"", "\\\\", ","]}', 8),
    ('[[], [[]], {"": {}}]', 7), ('{"k": [null, true, -1.5e-3, NaN]}', 7),
])
def test_json_node_count_is_exact(text, count):
    assert json_node_count(text.encode()) == count == (_nodes(json.loads(text)) if "NaN" not in text else count)


def test_json_node_count_across_pieces():
    """Strings that hold marks, escapes and whitespace, over many 256 KiB pieces, count as the decoded document."""
    doc = {f"k{i}, [x]": [f'v "{i}" : {{', i, [], {}, {"a b": None, "c\\": [1.5]}] for i in range(40_000)}
    data = json.dumps(doc, indent=1).encode()
    assert len(data) > 8 * (1 << 18)
    assert json_node_count(data) == _nodes(doc) == 1 + 40_000 * 12  # a key, its list of 5, 2 pairs, 1.5


def _keys_config(pairs: int, x: str) -> str:
    """A verl config: 15 keys and values of header and ``trainer.bulk``, ``pairs`` short keys under
    ``trainer.bulk`` (2 each), and ``trainer.x`` = ``x``."""
    bulk = ", ".join(f'"key_{i:08d}": "v{i % 1000}"' for i in range(pairs))
    return ('{"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"actor": {"clip_ratio_high": 0.28}}, '
            '"trainer": {"bulk": {' + bulk + '}, "x": ' + x + "}}")


def test_config_at_the_node_bound_maps_and_one_more_is_refused(tmp_path, capsys):
    """15 + 2 × 49,991 pairs + 3 (``"x": [1]``) = 100,000 keys and values: mapped. One list item more is refused
    before decoding, the count and the limit named, nothing on stdout."""
    pairs = 49_991
    at = tmp_path / "at.json"
    at.write_text(_keys_config(pairs, "[1]"))
    assert json_node_count(at.read_bytes()) == _nodes(json.loads(at.read_bytes())) == MAX_CONFIG_NODES
    assert main(["config", "verl", str(at)]) == 0
    assert json.loads(capsys.readouterr().out)["eps_clip_high"] == 0.28
    code, err = _config_error(capsys, tmp_path, "over.json", _keys_config(pairs, "[1, 2]"))
    assert (code, err) == (3, f"trajectory-replay: error: {tmp_path / 'over.json'}: $: 100001 keys and values, "
                              "more than 100000 (the limit for a config)\n")


def test_yaml_config_over_the_node_bound_is_refused(tmp_path, capsys):
    """A YAML config's nodes are counted while it is composed: the 100,001st is refused at its line."""
    bulk = "".join(f"    k{i}: {i}\n" for i in range(50_000))  # 9 + 100,000 nodes: the 100,001st is k49995's value
    content = "algorithm:\n  adv_estimator: grpo\ntrainer:\n  bulk:\n" + bulk
    code, err = _config_error(capsys, tmp_path, "big.yaml", content)
    assert (code, err) == (3, f"trajectory-replay: error: {tmp_path / 'big.yaml'}: line 50000: more than 100000 "
                              "keys and values (the limit for a config)\n")


def test_config_of_a_million_keys_is_refused_fast_in_bounded_memory(tmp_path):
    """17 MB of short keys (1.4 M keys and values): refused (exit 3, one line) from its bytes, in a real process,
    well within 3× the file above what the process held before (decoding it took ~15×: ~250 MB)."""
    path = tmp_path / "keys.json"
    path.write_text(_keys_config(700_000, "1"))
    size = path.stat().st_size
    assert size > 16_000_000
    script = textwrap.dedent(f"""
        import sys, time, tracemalloc
        from replay_lib.cli import main
        import replay_lib.frameworks.verl, replay_lib.bundle.json_limits, msgspec
        tracemalloc.start()  # the command's own allocations (ru_maxrss would count the forking parent's pages)
        t = time.monotonic()
        code = main(["config", "verl", {str(path)!r}])
        took = time.monotonic() - t
        print(code, 0, tracemalloc.get_traced_memory()[1], took, file=sys.stderr)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    error, tail = proc.stderr.splitlines()
    code, before, after, took = tail.split()
    assert int(code) == 3 and proc.stdout == ""
    assert error == (f"trajectory-replay: error: {path}: $: {15 + 2 * 700_000 + 2} keys and values, more than "
                     "100000 (the limit for a config)")
    assert int(after) - int(before) < 3 * size  # bytes at the peak, the file's own 17 MB included
    assert float(took) < 10  # ~0.5 s: byte scans, no decode


def test_to_plain_refuses_a_recursive_object_by_name():
    """A config passed in by a library caller may be recursive too: one line, exit 3, not a RecursionError."""
    cfg: dict = {"a": {}}
    cfg["a"]["b"] = cfg
    with pytest.raises(FrameworkConfigError) as err:
        to_plain(cfg)
    assert str(err.value) == "config nested deeper than 64 levels (or a recursive structure)"
    assert err.value.exit_code == 3
    plain = {"a": [1, 2], "b": {"c": "d"}}
    assert to_plain(plain) is plain and to_plain({1: (2,)}) == {"1": [2]}


def test_check_limits_names_keys_too():
    with pytest.raises(JSONLimitError, match=r"^\$: a string of 1048577 characters"):
        check_limits({"k" * (MAX_STRING_CHARS + 1): 1})


# ------------------------------------------------------------------------------------------------- dumps

import io  # noqa: E402
import zipfile  # noqa: E402
import zlib  # noqa: E402

import torch  # noqa: E402

from replay_lib.importers._common import INFLATE_FLOOR  # noqa: E402
from test_import_nemo_rl import PROMPT_OF, RESPONSES, REWARDS, write_jsonl  # noqa: E402
from test_import_slime import GROUPS_2230, RAW_2230, write_dumps  # noqa: E402


def _slime_error(capsys, *args) -> tuple[int, str]:
    code = main(["import", "slime", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.err


def _rezip(path: Path, record_suffix: str, inflated: int) -> tuple[str, int]:
    """Rewrite the torch.save archive at ``path`` with its first record ending in ``record_suffix`` replaced
    by ``inflated`` zero bytes, ZIP_DEFLATED (written in chunks: a few MB of memory whatever ``inflated``).
    Returns the record's name and its original (stored, uncompressed) size."""
    src = zipfile.ZipFile(io.BytesIO(path.read_bytes()))
    target = next(i for i in src.infolist() if i.filename.endswith(record_suffix))
    with zipfile.ZipFile(path, "w") as out:
        for info in src.infolist():
            if info.filename != target.filename:
                out.writestr(info, src.read(info))
                continue
            zinfo = zipfile.ZipInfo(target.filename)
            zinfo.compress_type = zipfile.ZIP_DEFLATED
            with out.open(zinfo, "w", force_zip64=True) as w:
                chunk = bytes(1 << 20)
                left = inflated
                while left:
                    w.write(chunk[: min(left, len(chunk))])
                    left -= min(left, len(chunk))
    return target.filename, target.file_size


def test_zip_bomb_record_is_refused_before_inflating(tmp_path, capsys):
    """A record deflated from 256 MiB of zeros (a few hundred KB on disk): over max(64 MiB, 4 × the file) in
    all, refused from the central directory, naming the record."""
    train, rollout = write_dumps(tmp_path, RAW_2230, GROUPS_2230)
    record, _ = _rezip(train, "/data/0", 256 << 20)
    size = train.stat().st_size
    assert size < 1 << 20
    infos = zipfile.ZipFile(train).infolist()
    upto = next(k for k, i in enumerate(infos) if i.filename == record)
    before = sum(i.file_size for i in infos[: upto + 1])  # the records up to data/0, in the directory's order
    code, err = _slime_error(capsys, train, "--rollout-dump", rollout, "-o", tmp_path / "out")
    assert (code, err) == (3, f"trajectory-replay: error: {train}: slime train dump record {record} inflates to "
                              f"{256 << 20} bytes; the archive's records would reach {before}, over its bound of "
                              f"{INFLATE_FLOOR} bytes (max({INFLATE_FLOOR}, 4 × the file's {size})); refused before "
                              "inflating\n")
    assert not (tmp_path / "out").exists()


def test_compressed_record_larger_than_its_storage_is_refused(tmp_path, capsys):
    """1 MiB of zeros is within the archive's bound but larger than the storage the pickle declares for the
    record (its original stored size: numel × element size)."""
    train, rollout = write_dumps(tmp_path, RAW_2230, GROUPS_2230)
    record, need = _rezip(train, "/data/0", 1 << 20)
    code, err = _slime_error(capsys, train, "--rollout-dump", rollout, "-o", tmp_path / "out")
    assert (code, err) == (3, f"trajectory-replay: error: {train}: slime train dump record {record} inflates to "
                              f"{1 << 20} bytes, more than its tensor storage needs ({need} bytes); refused before "
                              "inflating\n")
    assert 0 < need < 1 << 20


def test_compressed_records_within_their_storage_still_load(tmp_path, capsys):
    """An archive re-zipped with every record deflated (same bytes) imports as the stored one does."""
    train, rollout = write_dumps(tmp_path, RAW_2230, GROUPS_2230)
    src = zipfile.ZipFile(io.BytesIO(train.read_bytes()))
    with zipfile.ZipFile(train, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            out.writestr(info.filename, src.read(info))
    assert all(i.compress_type == zipfile.ZIP_DEFLATED for i in zipfile.ZipFile(train).infolist())
    assert main(["import", "slime", str(train), "--rollout-dump", str(rollout), "-o", str(tmp_path / "out")]) == 0


def _rewrite(path: Path, change) -> None:
    obj = torch.load(path, weights_only=True)
    change(obj)
    torch.save(obj, path)


def test_tensor_format_version_is_one_line_exit_3(tmp_path, capsys):
    """A 10**6-element tensor compared with 2 was an ambiguous tensor truth value (exit 5)."""
    train, rollout = write_dumps(tmp_path, RAW_2230, GROUPS_2230)
    _rewrite(train, lambda d: d.update(format_version=torch.zeros(10 ** 6)))
    code, err = _slime_error(capsys, train, "--rollout-dump", rollout, "-o", tmp_path / "out")
    assert (code, err) == (3, f"trajectory-replay: error: {train}: slime train dump format_version: got a tensor of "
                              "shape [1000000], expected 2 (--save-debug-train-data of slime/observability/"
                              "train_data_utils.py:181-188)\n")
    _rewrite(train, lambda d: d.update(format_version=torch.tensor(2)))  # a one-element integer tensor is its value
    assert main(["import", "slime", str(train), "--rollout-dump", str(rollout), "-o", str(tmp_path / "out")]) == 0


def test_a_20_mb_value_is_cut_in_the_error_line(tmp_path, capsys):
    """L2: the 20 MB format_version is quoted, cut to 1,024 characters with an ellipsis and the full length."""
    train, rollout = write_dumps(tmp_path, RAW_2230, GROUPS_2230)
    _rewrite(train, lambda d: d.update(format_version="v" * (20 << 20)))
    code, err = _slime_error(capsys, train, "--rollout-dump", rollout, "-o", tmp_path / "out")
    head = f"{train}: slime train dump format_version: '" + "v" * 1100
    full = len(f"{train}: slime train dump format_version: ") + (20 << 20) + 2 + len(
        ", expected 2 (--save-debug-train-data of slime/observability/train_data_utils.py:181-188)")
    assert (code, err) == (3, f"trajectory-replay: error: {head[:1024]}… ({full} characters)\n")


def test_one_line_cuts_escapes_and_collapses():
    from replay_lib.safe_text import one_line

    assert one_line("a \n b\x1b[2J") == "a \\n b\\x1b[2J"
    assert one_line("x" * 1024) == "x" * 1024
    assert one_line("x" * 1025) == "x" * 1024 + "… (1025 characters)"
    assert one_line("\x1b" * 300, limit=10) == "\\x1b\\x1b\\x"[:10] + "… (300 characters)"


def test_raw_pickle_is_one_line_without_torch_warnings(tmp_path):
    """L3: a plain pickle (not torch.save's zip) in a real process: the error line only, no UserWarning."""
    import pickle

    train = tmp_path / "train.pt"
    train.write_bytes(pickle.dumps({"format_version": 2, "rollout_id": 7}))
    proc = subprocess.run([sys.executable, "-m", "replay_lib", "import", "slime", str(train), "-o",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 3 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"trajectory-replay: error: {train}: slime train dump ")


@pytest.mark.parametrize("sample, key, message", [
    (0, "rewards", "is a NaN or an infinity"),
    (3, "local_raw_reward", "is a NaN or an infinity"),
])
def test_non_finite_scalar_is_refused_like_a_non_finite_tensor(tmp_path, capsys, sample, key, message):
    """L1: a NaN reward was written to the bundle as null with exit 0; one rule for numbers and vectors."""
    train, _ = write_dumps(tmp_path, RAW_2230, GROUPS_2230)
    _rewrite(train, lambda d: d["samples"][sample].update({key: float("nan")}))
    code, err = _slime_error(capsys, train, "-o", tmp_path / "out")
    assert (code, err) == (3, f"trajectory-replay: error: {train}: slime train dump samples[{sample}].{key}: "
                              f"{message}\n")
    assert not (tmp_path / "out").exists()


def _nemo_with_line(tmp_path: Path, line: str) -> Path:
    data = tmp_path / "train_data_step1.jsonl"
    write_jsonl(data, PROMPT_OF, REWARDS, RESPONSES)
    lines = data.read_text().splitlines()
    lines[1] = line
    data.write_text("\n".join(lines) + "\n")
    return data


@pytest.mark.parametrize("line, message", [
    ("[" * 100_000 + "]" * 100_000, "$[0][0][0][0]: nested deeper than 64 levels (the limit for a NeMo-RL row)"),
    ('{"a":' * 5000 + "1" + "}" * 5000, "$.a.a.a.a: nested deeper than 64 levels (the limit for a NeMo-RL row)"),
    ('{"idx": ' + "9" * 5000 + "}", "$: an integer of more than 4300 digits, over the 20-digit limit"),
    ('{"idx": 1, "content": [' + "9" * 30 + "]}", "$.content[0]: an integer of 30 digits, over the 20-digit limit"),
])
def test_hostile_nemo_row_is_one_line_exit_3(tmp_path, capsys, line, message):
    data = _nemo_with_line(tmp_path, line)
    assert main(["import", "nemo-rl", str(data), "-o", str(tmp_path / "out")]) == 3
    assert capsys.readouterr().err == f"trajectory-replay: error: {data}: NeMo-RL train data line 2: {message}\n"


def test_nan_reward_in_a_nemo_row_is_refused(tmp_path, capsys):
    """L1 for NeMo-RL: Python's json writes NaN; it was imported as a null raw reward with exit 0."""
    data = tmp_path / "train_data_step1.jsonl"
    write_jsonl(data, PROMPT_OF, [float("nan")] + REWARDS[1:], RESPONSES)
    assert main(["import", "nemo-rl", str(data), "-o", str(tmp_path / "out")]) == 3
    assert capsys.readouterr().err == (f"trajectory-replay: error: {data}: NeMo-RL train data line 1.rewards: is a "
                                       "NaN or an infinity\n")
