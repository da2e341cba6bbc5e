"""Hostile bundles that pass their checksums (SPEC §11): JSON nested too deep or holding integers outside
int64, rank lists out of bounds, cohort shard keys that are no rank numbers, payload tensors of the wrong
kind or rank, compressed archives, names with a trailing newline, warnings on stderr, and the counts
``validate`` checks without arithmetic.

Every hostile bundle is re-sealed after tampering (``COMPLETE`` is not checksummed and is written as is),
so the check under test is the one that fires. ``validate`` and ``replay`` both refuse it: exit 3, one line
on stderr naming the file and the field, no traceback. A handful run as real subprocesses.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from replay_lib.bundle.schema import FORMAT_VERSION, UNPACKED_FORMAT_VERSION
from safetensors.torch import load_file, save_file
from replay_lib.demo import support_parts, write_bundle, write_cohort, write_pr65, write_step_loss
from replay_lib.bundle.json_limits import MAX_JSON_DEPTH

REPO = Path(__file__).resolve().parents[1]
# The cases tamper with the older form's files (torch.save payloads, masks in index.json): written as 1.1.0.
OLD = UNPACKED_FORMAT_VERSION
INT64_MAX = (1 << 63) - 1
TOO_BIG = f"expected `int` <= {INT64_MAX}"


def _pr65(tmp: Path, buggy: bool = True, version: str = OLD) -> Path:
    return write_pr65(tmp / "bundle", buggy=buggy, format_version=version)


def _payload(bundle: Path, name: str) -> Path:
    safetensors = bundle / "payloads" / f"{name}.safetensors"  # the default form's (format 1.3.0)
    return safetensors if safetensors.exists() else bundle / "payloads" / f"{name}.pt"


def _load(bundle: Path, name: str) -> torch.Tensor:
    if _payload(bundle, name).suffix == ".safetensors":
        return load_file(str(_payload(bundle, name)))["data"]
    return torch.load(_payload(bundle, name), weights_only=True)


def _nested(depth: int) -> str:
    """A JSON array ``depth`` levels deep."""
    return "[" * depth + "]" * depth


def _with_member(blob: bytes, member: str) -> bytes:
    """``blob`` (a JSON object) with ``member`` (``"key": value``) added as its last member."""
    text = blob.decode("utf-8").rstrip()
    assert text.endswith("}")
    return (text[:-1].rstrip() + f', {member}}}\n').encode("utf-8")


def _set(doc, path: str, value) -> None:
    """``doc`` with the member at ``path`` (``samples.0.group_index``) set to ``value``."""
    *parents, last = path.split(".")
    for step in parents:
        doc = doc[int(step)] if isinstance(doc, list) else doc[step]
    if isinstance(doc, list):
        doc[int(last)] = value
    else:
        doc[last] = value


def _replace_payload(bundle: Path, name: str, tensor, tools, **spec) -> None:
    """Save ``tensor`` as payload ``name``; ``spec`` (dtype, shape) goes into the manifest; re-seal."""
    if _payload(bundle, name).suffix == ".safetensors":
        save_file({"data": tensor}, str(_payload(bundle, name)))
    else:
        torch.save(tensor, _payload(bundle, name))
    if spec:
        tools.edit_json(bundle, "manifest.json", lambda doc: doc["payloads"][name].update(spec))
    else:
        tools.reseal(bundle)


def _deflate(path: Path) -> None:
    """Rewrite a torch archive with every record DEFLATE-compressed (what ``zipfile`` writes by default
    when asked to compress): a valid file ``torch.load`` reads, which a memory map would misread."""
    with zipfile.ZipFile(path) as src:
        records = [(info.filename, src.read(info.filename)) for info in src.infolist()]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for name, data in records:
            dst.writestr(name, data)


def _check_refusal(rc: int, out: str, err: str, keywords: list[str]) -> None:
    assert rc == 3, (rc, out, err)
    assert out == ""
    assert err.endswith("\n") and len(err.splitlines()) == 1, err
    assert "Traceback" not in err and "Warning" not in err
    assert err.startswith("trajectory-replay: error: ")
    for word in keywords:
        assert word in err, (word, err)


def _subprocess(*args) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "replay_lib", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


# Each case builds a hostile bundle under ``tmp`` and returns (path to open, words the one stderr line
# must contain: the file first, then the field and what was expected).

# -------------------------------------------------------------------------------- 1. JSON depth

def _reseal_metadata(bundle: Path) -> None:
    """Record the JSON files' checksums in the sentinels (``reseal`` would parse a manifest that nests
    deeper than Python's own json reads)."""
    digests = {name: hashlib.sha256((bundle / name).read_bytes()).hexdigest()
               for name in ("manifest.json", "index.json", "expected.json")}
    for sentinel in ("COMPLETE", "COMPLETE.0"):
        doc = json.loads((bundle / sentinel).read_bytes())
        doc["metadata"] = digests
        (bundle / sentinel).write_text(json.dumps(doc))


def _deep_member(tmp, name: str, member: str, where: str):
    b = _pr65(tmp)
    path = b / name
    path.write_bytes(_with_member(path.read_bytes(), member))
    if name.endswith(".json"):
        _reseal_metadata(b)  # no checksum covers COMPLETE or COMPLETE.0 themselves
    return b, [f"{path}: {where}: nested deeper than {MAX_JSON_DEPTH} levels (the limit for a bundle's JSON)"]


def case_deep_index(tmp, tools):
    return _deep_member(tmp, "index.json", f'"zz": {_nested(1000)}', "$.zz[0][0][0]")


def case_deep_manifest(tmp, tools):
    return _deep_member(tmp, "manifest.json", f'"zz": {_nested(1000)}', "$.zz[0][0][0]")


def case_deep_expected(tmp, tools):
    return _deep_member(tmp, "expected.json", f'"zz": {_nested(1000)}', "$.zz[0][0][0]")


def case_deep_complete(tmp, tools):
    return _deep_member(tmp, "COMPLETE", f'"zz": {_nested(1000)}', "$.zz[0][0][0]")


def case_deep_rank_complete(tmp, tools):
    return _deep_member(tmp, "COMPLETE.0", f'"zz": {_nested(1000)}', "$.zz[0][0][0]")


def case_deep_inside_a_sample(tmp, tools):
    b = _pr65(tmp)
    tools.edit_json(b, "index.json", lambda doc: doc["samples"][2].__setitem__("zz", json.loads(_nested(200))))
    return b, [f"{b / 'index.json'}: $.samples[2].zz[0]: nested deeper than {MAX_JSON_DEPTH} levels"]


def case_deep_objects(tmp, tools):
    return _deep_member(tmp, "index.json", '"zz": ' + '{"a": ' * 1000 + "1" + "}" * 1000, "$.zz.a.a.a")


def case_deep_cohort_complete(tmp, tools):
    c = write_cohort(tmp / "cohort", samples=4, tokens=3)
    final = c / "COMPLETE"
    final.write_bytes(_with_member(final.read_bytes(), f'"zz": {_nested(1000)}'))
    return c, [f"{final}: $.zz[0][0][0]: nested deeper than {MAX_JSON_DEPTH} levels"]


# ---------------------------------------------------------------------------- 1. integer ranges

# (file, path in it, value, the path msgspec names — a dict's member is `[...]` — and what it says)
INT_FIELDS = {
    "group_index": ("index.json", "samples.0.group_index", 1 << 63, "$.samples[0].group_index", TOO_BIG),
    "response_length": ("index.json", "samples.1.response_length", 1 << 63, "$.samples[1].response_length", TOO_BIG),
    "total_length": ("index.json", "samples.2.total_length", 1 << 64, "$.samples[2].total_length", TOO_BIG),
    "loss_mask_value": ("index.json", "samples.3.loss_mask.1", 1 << 63, "$.samples[3].loss_mask[1]", TOO_BIG),
    "negative_group_index": ("index.json", "samples.0.group_index", -(1 << 63) - 1, "$.samples[0].group_index",
                             f"expected `int` >= {-(1 << 63)}"),
    "rollout_id": ("index.json", "identity.rollout_id", 1 << 63, "$.identity.rollout_id", TOO_BIG),
    "semantic_group_id": ("index.json", "identity.semantic_group_ids.0", 1 << 63,
                          "$.identity.semantic_group_ids[0]", TOO_BIG),
    "rank_size": ("index.json", "identity.rank.dp", 1 << 63, "$.identity.rank[...]", TOO_BIG),
    "rank_size_zero": ("index.json", "identity.rank.tp", 0, "$.identity.rank[...]", "expected `int` >= 1"),
    "n_samples_per_prompt": ("index.json", "config.n_samples_per_prompt", 1 << 63, "$.config.n_samples_per_prompt",
                             TOO_BIG),
    "vocab_size": ("index.json", "config.vocab_size", 1 << 63, "$.config.vocab_size", TOO_BIG),
    "num_experts": ("index.json", "config.num_experts", 1 << 63, "$.config.num_experts", TOO_BIG),
    "payload_dimension": ("manifest.json", "payloads.kl.shape.0", 1 << 63, "$.payloads[...].shape[0]", TOO_BIG),
    "payload_dimension_negative": ("manifest.json", "payloads.kl.shape.0", -1, "$.payloads[...].shape[0]",
                                   "expected `int` >= 0"),
    "complete_rank": ("COMPLETE", "ranks.0", 1 << 63, "$.ranks[0]", TOO_BIG),
    "rank_complete_rollout_id": ("COMPLETE.0", "rollout_id", 1 << 63, "$.rollout_id", TOO_BIG),
}


def _int_case(field: str):
    name, path, value, shown, expected = INT_FIELDS[field]

    def case(tmp, tools):
        b = _pr65(tmp)
        if name.startswith("COMPLETE"):  # no checksum covers a sentinel: written as is
            doc = json.loads((b / name).read_bytes())
            _set(doc, path, value)
            (b / name).write_text(json.dumps(doc))
        else:
            tools.edit_json(b, name, lambda doc: _set(doc, path, value))
        return b, [f"{b / name}: {shown}: {expected}"]

    return case


def case_int_with_5000_digits(tmp, tools):
    # beyond what Python's int() parses from text by default (4300 digits): msgspec refuses it itself
    b = _pr65(tmp)
    path = b / "index.json"
    text = path.read_text()
    assert '"group_index": 0,' in text
    path.write_text(text.replace('"group_index": 0,', '"group_index": ' + "9" * 5000 + ",", 1))
    tools.reseal(b)
    return b, [f"{path}: $.samples[0].group_index: integer value out of range"]


def case_step_id(tmp, tools):
    b = write_step_loss(tmp / "step", format_version=OLD)
    tools.edit_json(b, "index.json", lambda doc: _set(doc, "identity.actor_step_id.step_id", 1 << 63))
    return b, [f"{b / 'index.json'}: $.identity.actor_step_id.step_id: {TOO_BIG}"]


# ------------------------------------------------------------------------------ 1. shard keys

def _cohort_with_shard_key(tmp, key: str):
    c = write_cohort(tmp / "cohort", samples=4, tokens=3)
    final = c / "COMPLETE"
    doc = json.loads(final.read_bytes())
    doc["shards"][key] = doc["shards"].pop("1")
    final.write_text(json.dumps(doc))
    return c, [f"{final}: $.shards: shard keys must be rank numbers, got {key!r}"]


def case_shard_key_word(tmp, tools):
    return _cohort_with_shard_key(tmp, "x")


def case_shard_key_space(tmp, tools):
    return _cohort_with_shard_key(tmp, " 1")


def case_shard_key_space_rank_path(tmp, tools):
    c, words = _cohort_with_shard_key(tmp, " 1")
    return c / "rank-0", words  # a rank shard opened directly reads the cohort COMPLETE too


# --------------------------------------------------------------------------------- 2, 5. tensors

def case_meta_tensor(tmp, tools):
    b = _pr65(tmp)
    _replace_payload(b, "kl", torch.empty(12, device="meta"), tools)
    return b, [f"{_payload(b, 'kl')}: payload must be a CPU tensor, got device 'meta'"]


def case_quantized_tensor(tmp, tools):
    b = _pr65(tmp)
    with warnings.catch_warnings():  # torch deprecates creating quantized tensors
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(_load(b, "kl"), 0.1, 0, torch.qint8)
    _replace_payload(b, "kl", q, tools, dtype="torch.qint8")
    return b, [f"{_payload(b, 'kl')}: payload must hold real numbers, got the quantized dtype torch.qint8"]


def case_sparse_tensor(tmp, tools):
    b = _pr65(tmp)
    _replace_payload(b, "kl", _load(b, "kl").to_sparse(), tools)
    return b, [f"{_payload(b, 'kl')}: payload must be a dense (strided) tensor, got layout torch.sparse_coo"]


def case_complex_tensor(tmp, tools):
    b = _pr65(tmp)
    _replace_payload(b, "old_log_probs", _load(b, "old_log_probs") + 5j, tools, dtype="torch.complex64")
    return b, [f"{_payload(b, 'old_log_probs')}: payload must hold real numbers, got the complex dtype torch.complex64"]


def case_bool_tensor(tmp, tools):
    b = _pr65(tmp)
    _replace_payload(b, "kl", _load(b, "kl") > 0, tools, dtype="torch.bool")
    return b, [f"{_payload(b, 'kl')}: payload must have a floating point or integer dtype, got torch.bool"]


def case_integer_log_probs(tmp, tools):
    b = _pr65(tmp)
    _replace_payload(b, "old_log_probs", _load(b, "old_log_probs").to(torch.int64), tools, dtype="torch.int64")
    return b, [f"{_payload(b, 'old_log_probs')}: manifest $.payloads.old_log_probs.dtype: torch.int64, "
               f"expected a floating point dtype"]


def case_column_log_probs(tmp, tools):
    # [Σ, 1] would broadcast against the [Σ] old log-probs into a [Σ, Σ] product in the loss
    b = write_step_loss(tmp / "step", format_version=OLD)
    column = _load(b, "log_probs").reshape(-1, 1).clone()
    _replace_payload(b, "log_probs", column, tools, shape=list(column.shape))
    return b, [f"{_payload(b, 'log_probs')}: manifest $.payloads.log_probs.shape: [12, 1], "
               f"expected 1-D [Σ response_length]"]


def case_flat_support_ids(tmp, tools):
    b = write_bundle(tmp / "support", *support_parts(samples=4, tokens=6, k=4, vocab_size=64, seed=3, format_version=OLD))
    flat = _load(b, "support_ids").reshape(-1).clone()
    _replace_payload(b, "support_ids", flat, tools, shape=list(flat.shape))
    return b, [f"{_payload(b, 'support_ids')}: manifest $.payloads.support_ids.shape: [{flat.numel()}], "
               f"expected 2-D [Σ response_length, K]"]


def case_float_support_ids(tmp, tools):
    b = write_bundle(tmp / "support", *support_parts(samples=4, tokens=6, k=4, vocab_size=64, seed=3, format_version=OLD))
    ids = _load(b, "support_ids").to(torch.float32)
    _replace_payload(b, "support_ids", ids, tools, dtype="torch.float32")
    return b, [f"{_payload(b, 'support_ids')}: manifest $.payloads.support_ids.dtype: torch.float32, "
               f"expected an integer dtype"]


# ------------------------------------------------------------------------------ 3. rank lists

def _complete_ranks(tmp, ranks):
    b = _pr65(tmp)
    doc = json.loads((b / "COMPLETE").read_bytes())
    doc["ranks"] = ranks
    (b / "COMPLETE").write_text(json.dumps(doc))  # a 6 MB file for a million ranks
    return b


def case_million_repeated_ranks(tmp, tools):
    b = _complete_ranks(tmp, [0] * 10 ** 6)
    return b, [f"{b / 'COMPLETE'}: $.ranks[1]: duplicate rank 0 (first at $.ranks[0])"]


def case_more_ranks_than_the_world(tmp, tools):
    b = _complete_ranks(tmp, list(range(10 ** 6)))
    return b, [f"{b / 'COMPLETE'}: $.ranks: 1000000 ranks, more than the 1 producer(s) that index.json "
               f"$.identity.rank allows (dp·tp·pp·cp = 1·1·1·1)"]


# ------------------------------------------------------------------------------- 4. compression

def case_compression_bomb(tmp, tools):
    # a 12-element view of a 2M-element storage: torch.save keeps the whole storage, DEFLATE shrinks it
    b = _pr65(tmp)
    big = torch.zeros(2_000_000)
    big[:12] = _load(b, "kl")
    torch.save(big[:12], _payload(b, "kl"))
    _deflate(_payload(b, "kl"))
    tools.reseal(b)
    return b, [f"{_payload(b, 'kl')}: compressed records inflate to", "more than the 1048624 that manifest "
               "$.payloads.kl.shape and .dtype allow"]


# ------------------------------------------------------------------------------ 6. whole names

def case_payload_name_with_newline(tmp, tools):
    b = _pr65(tmp)
    torch.save(torch.zeros(12), b / "payloads" / "evil\n.pt")
    spec = {"name": "evil\n", "dtype": "torch.float32", "shape": [12], "bytes": 0, "sha256": ""}
    tools.edit_json(b, "manifest.json", lambda doc: doc["payloads"].__setitem__("evil\n", spec))
    return b, [f"{b / 'COMPLETE.0'}: $.payloads: unsafe payload name 'evil\\n'"]


def case_format_version_with_newline(tmp, tools):
    b = _pr65(tmp)
    tools.edit_json(b, "manifest.json", lambda doc: doc.__setitem__("format_version", "1.1.0\n"))
    return b, [f"{b / 'manifest.json'}: $.format_version: expected 'MAJOR.MINOR.PATCH', got '1.1.0\\n'"]


def case_format_version_other_digits(tmp, tools):
    b = _pr65(tmp)
    tools.edit_json(b, "manifest.json", lambda doc: doc.__setitem__("format_version", "\u0661.1.0"))
    return b, [f"{b / 'manifest.json'}: $.format_version: expected 'MAJOR.MINOR.PATCH'"]


def case_format_version_endless_digits(tmp, tools):
    b = _pr65(tmp)
    tools.edit_json(b, "manifest.json", lambda doc: doc.__setitem__("format_version", "1." + "9" * 5000 + ".0"))
    return b, [f"{b / 'manifest.json'}: $.format_version: expected 'MAJOR.MINOR.PATCH'"]


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
CASES.update({f"int_{field}": _int_case(field) for field in INT_FIELDS})
SUBPROCESS_CASES = ["deep_complete", "deep_index", "int_response_length", "int_vocab_size", "column_log_probs",
                    "quantized_tensor", "complex_tensor", "million_repeated_ranks", "shard_key_word",
                    "compression_bomb"]


@pytest.mark.parametrize("kind", sorted(CASES))
def test_validate_and_replay_refuse(kind, tmp_path, cli, bundle_tools):
    target, keywords = CASES[kind](tmp_path, bundle_tools)
    for command in ("validate", "replay"):
        _check_refusal(*cli(command, target), keywords)


@pytest.mark.parametrize("kind", SUBPROCESS_CASES)
def test_validate_and_replay_refuse_in_subprocess(kind, tmp_path, bundle_tools):
    target, keywords = CASES[kind](tmp_path, bundle_tools)
    for command in ("validate", "replay"):
        _check_refusal(*_subprocess(command, target), keywords)


# ------------------------------------------------------------------------- what is still accepted

def test_json_at_the_depth_limit_is_read(tmp_path, cli, bundle_tools):
    """The limit counts the outermost object as level 1: an unknown member nesting 63 more still reads."""
    b = _pr65(tmp_path)
    path = b / "index.json"
    path.write_bytes(_with_member(path.read_bytes(), f'"zz": {_nested(MAX_JSON_DEPTH - 1)}'))
    bundle_tools.reseal(b)
    rc, out, err = cli("validate", b)
    assert (rc, err) == (0, "")
    assert f"warning: {path}: $.zz: unknown field (ignored)" in out.splitlines()
    path.write_bytes(_with_member(path.read_bytes(), f'"zy": {_nested(MAX_JSON_DEPTH)}'))
    bundle_tools.reseal(b)
    _check_refusal(*cli("validate", b), [f"{path}: $.zy[0][0][0]: nested deeper than {MAX_JSON_DEPTH} levels"])


def test_json_strings_do_not_count_as_nesting(tmp_path, cli, bundle_tools):
    """Brackets, quotes and backslashes inside strings are text (an escaped quote does not end one)."""
    b = _pr65(tmp_path)
    text = '\\"' + "[" * 500 + '\\\\' + "{" * 500
    bundle_tools.edit_json(b, "index.json", lambda doc: doc["samples"][0].__setitem__("label_hash", text))
    rc, out, err = cli("validate", b)
    assert (rc, err) == (0, "")


def test_int64_bounds_are_inclusive(tmp_path, cli, bundle_tools):
    """The largest int64 is a valid group index: validate passes and the replay reports the group, whose
    size no longer matches, as reward.post_process's divergence (exit 1) — no OverflowError."""
    b = _pr65(tmp_path)
    bundle_tools.edit_json(b, "index.json", lambda doc: _set(doc, "samples.0.group_index", INT64_MAX))
    rc, out, err = cli("validate", b)
    assert (rc, err) == (0, "")
    rc, out, err = cli("replay", b, "--format", "json")
    assert (rc, err) == (1, "")
    report = json.loads(out)
    assert report["first_divergent_stage"] == "reward.post_process"
    assert report["first_divergence"]["group_index"] == INT64_MAX


def test_ranks_within_the_world_are_read(tmp_path, cli):
    """A bundle whose COMPLETE lists as many ranks as its world holds (dp=2) opens as before."""
    from replay_lib.demo import synthetic_parts

    b = write_bundle(tmp_path / "b", *synthetic_parts(samples=4, tokens=3, rank_sizes={"dp": 2}), ranks=[0, 1])
    assert json.loads((b / "COMPLETE").read_bytes())["ranks"] == [0, 1]
    rc, out, err = cli("validate", b)
    assert (rc, err) == (0, "")


def test_compressed_payload_is_read_as_torch_load_reads_it(tmp_path, cli, bundle_tools):
    """A DEFLATE-compressed .pt is a valid archive: its values are what ``torch.load`` returns (a memory map
    would take the compressed bytes for floats and report a false divergence in advantage.kl)."""
    plain = write_pr65(tmp_path / "plain", buggy=True, format_version=OLD)
    packed = write_pr65(tmp_path / "packed", buggy=True, format_version=OLD)
    for name in ("kl", "old_log_probs", "ref_log_probs", "advantages"):
        _deflate(_payload(packed, name))
        with zipfile.ZipFile(_payload(packed, name)) as archive:
            assert {info.compress_type for info in archive.infolist()} == {zipfile.ZIP_DEFLATED}
    bundle_tools.reseal(packed)
    rc, out, err = cli("validate", packed)
    assert (rc, err) == (0, "")
    reports = []
    for b in (plain, packed):
        rc, out, err = cli("replay", b, "--format", "json")
        assert (rc, err) == (1, "")  # the PR #65 bug, and nothing else
        reports.append(json.loads(out))
    assert reports[0]["first_divergent_stage"] == reports[1]["first_divergent_stage"] == "reward.post_process"
    assert reports[1]["stages"] == reports[0]["stages"]
    assert [s["status"] for s in reports[1]["stages"] if s["stage"] == "advantage.kl"] == ["pass"]


# ------------------------------------------------------------------------ 7. nothing on stderr

def test_requires_grad_payload_is_read_without_a_warning(tmp_path, bundle_tools):
    """A payload saved from a tensor that required grad holds the recorded values: accepted, and neither
    validate nor replay prints a warning (real processes: Python's warnings go to their stderr)."""
    b = _pr65(tmp_path, buggy=False)
    _replace_payload(b, "kl", _load(b, "kl").requires_grad_(True), bundle_tools)
    assert torch.load(_payload(b, "kl"), weights_only=True).requires_grad
    rc, out, err = _subprocess("validate", b)
    assert (rc, err) == (0, "")
    assert "— valid" in out
    rc, out, err = _subprocess("replay", b)
    assert (rc, err) == (0, "")
    assert "no divergence" in out


def test_unlisted_payload_files_are_named_in_a_warning(tmp_path, cli):
    b = _pr65(tmp_path, buggy=False)
    torch.save(torch.zeros(3), b / "payloads" / "stray.pt")
    (b / "payloads" / "notes.txt").write_text("not a payload")
    rc, out, err = cli("validate", b)
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert f"warning: {b / 'payloads' / 'notes.txt'}: file not listed in manifest.json (ignored)" in lines
    assert f"warning: {b / 'payloads' / 'stray.pt'}: file not listed in manifest.json (ignored)" in lines


# ------------------------------------------------------------- 8. counts validate checks itself

def test_loss_mask_longer_than_response_length(tmp_path, cli, bundle_tools):
    """validate refuses it naming the sample (exit 3); replay reports it as the sample stage's divergence."""
    b = _pr65(tmp_path)
    bundle_tools.edit_json(b, "index.json", lambda doc: doc["samples"][3]["loss_mask"].append(1))
    _check_refusal(*cli("validate", b), [
        f"{b / 'index.json'}: $.samples[3].loss_mask: 4 value(s), $.samples[3].response_length is 3 (sample 's-3')"])
    rc, out, err = cli("replay", b, "--format", "json")
    assert (rc, err) == (1, "")
    d = json.loads(out)["first_divergence"]
    assert (d["stage"], d["sample_id"], d["field"]) == ("sample", "s-3", "loss_mask_length")


def test_response_length_beyond_the_payload_rows(tmp_path, cli, bundle_tools):
    """The '1000000000198 token(s)' bundle: validate no longer calls it valid; replay fails its sample stage."""
    b = _pr65(tmp_path)
    bundle_tools.edit_json(b, "index.json", lambda doc: _set(doc, "samples.0.response_length", 10 ** 12))
    words = [f"{b / 'index.json'}: $.samples[0].loss_mask: 3 value(s), $.samples[0].response_length is "
             f"1000000000000 (sample 's-0')"]
    _check_refusal(*cli("validate", b), words)
    _check_refusal(*_subprocess("validate", b), words)
    rc, out, err = cli("replay", b, "--format", "json")
    assert (rc, err) == (1, "")
    report = json.loads(out)
    assert report["first_divergent_stage"] == "sample"
    assert report["first_divergence"]["sample_id"] == "s-0"


@pytest.mark.parametrize("version", [OLD, FORMAT_VERSION])
def test_payload_with_fewer_rows_than_tokens(tmp_path, cli, bundle_tools, version):
    b = _pr65(tmp_path, version=version)
    assert _payload(b, "kl").suffix == (".pt" if version == OLD else ".safetensors")
    short = _load(b, "kl")[:11].clone()
    _replace_payload(b, "kl", short, bundle_tools, shape=[11])
    _check_refusal(*cli("validate", b), [
        f"{_payload(b, 'kl')}: 11 row(s), index.json Σ $.samples[*].response_length is 12 "
        f"(sample 's-3' ($.samples[3]) has none from its token 2 on)"])
    rc, out, err = cli("replay", b, "--format", "json")
    assert (rc, err) == (1, "")
    report = json.loads(out)
    assert report["first_divergent_stage"] == "sample"
    assert report["first_divergence"]["message"] == "payload 'kl' has 11 row(s), Σ response_length is 12"


@pytest.mark.parametrize("version", [OLD, FORMAT_VERSION])
def test_payload_with_more_rows_than_tokens(tmp_path, cli, bundle_tools, version):
    b = _pr65(tmp_path, version=version)
    assert _payload(b, "advantages").suffix == (".pt" if version == OLD else ".safetensors")
    long = torch.cat([_load(b, "advantages"), torch.zeros(2)])
    _replace_payload(b, "advantages", long, bundle_tools, shape=[14])
    _check_refusal(*cli("validate", b), [
        f"{_payload(b, 'advantages')}: 14 row(s), index.json Σ $.samples[*].response_length is 12 "
        f"(2 row(s) after the last sample's tokens)"])
    rc, out, err = cli("replay", b)
    assert (rc, err) == (1, "")
    assert "payload 'advantages' has 14 row(s), Σ response_length is 12" in out
