"""The headless CLI: ``inspect`` on incomplete bundles, ``validate`` warnings for unknown fields, JSON output,
``demo write``, usage errors. In-process through ``replay_lib.cli.main`` (the same code the entry point runs)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from replay_lib.bundle import BundleReader
from replay_lib.cli import main
from replay_lib.demo import synthetic_parts, write_bundle, write_cohort, write_pr65


# --------------------------------------------------------------------------------------- inspect


def test_inspect_lists_what_an_incomplete_bundle_is_missing(pr65_bundle, cli, bundle_tools):
    (pr65_bundle / "COMPLETE").unlink()
    (pr65_bundle / "payloads" / "kl.safetensors").unlink()  # the default form: format 1.3.0
    before = bundle_tools.snapshot(pr65_bundle)
    rc, out, err = cli("inspect", pr65_bundle)
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"{pr65_bundle} — bundle, INCOMPLETE · 2 problems"
    assert "problem: missing payloads/kl.safetensors" in lines
    assert lines[-1] == ("inspect reads what is there without verifying it (payloads: sizes only); "
                         "validate checks checksums, schema and tensors")
    assert next(line for line in lines if line.split()[:1] == ["advantages"]).endswith("  size ok")
    assert "problem: missing COMPLETE (incomplete or still being written)" in lines
    kl_row = next(line for line in lines if line.split()[:1] == ["kl"])
    assert kl_row.split()[1:3] == ["torch.float32", "[12]"] and kl_row.endswith("MISSING")
    assert "  kind      rollout-level, rollout_id=120" in lines
    assert bundle_tools.snapshot(pr65_bundle) == before

    rc, out, err = cli("inspect", pr65_bundle, "--format", "json")
    assert (rc, err) == (0, "")
    doc = json.loads(out)
    assert (doc["layout"], doc["complete"]) == ("bundle", False)
    assert doc["problems"] == ["missing payloads/kl.safetensors",
                               "missing COMPLETE (incomplete or still being written)"]
    rows = {p["name"]: (p["present"], p["size_ok"]) for p in doc["bundles"][0]["payloads"]}
    assert rows == {"advantages": (True, True), "kl": (False, False), "old_log_probs": (True, True),
                    "ref_log_probs": (True, True), "loss_mask": (True, True)}
    assert (doc["bundles"][0]["samples"], doc["bundles"][0]["tokens"], doc["bundles"][0]["groups"]) == (4, 12, 2)


def test_inspect_a_cohort_missing_its_final_complete(tmp_path, cli):
    cohort = tmp_path / "cohort"
    write_bundle(cohort, *synthetic_parts(samples=4, tokens=3, bundle_id="c"), rank=0, ranks=[0, 1])
    rc, out, err = cli("inspect", cohort, "--format", "json")
    assert (rc, err) == (0, "")
    doc = json.loads(out)
    assert (doc["layout"], doc["complete"], doc["ranks_published"]) == ("cohort", False, [0])
    assert doc["problems"] == ["no cohort COMPLETE (ranks published: [0])"]
    assert [b["rank"] for b in doc["bundles"]] == [0]
    # validate refuses the same directory (exit 3), inspect only looked
    assert cli("validate", cohort)[0] == 3
    assert doc["bundles"][0]["complete"]  # rank 0 is published (COMPLETE.0), the cohort is not


def test_inspect_a_complete_cohort_missing_a_rank_says_so_in_its_header(tmp_path, cli):
    cohort = write_cohort(tmp_path / "cohort", samples=4, tokens=3)
    rc, out, _ = cli("inspect", cohort, "--format", "json")
    doc = json.loads(out)
    assert (rc, doc["complete"], [b["complete"] for b in doc["bundles"]]) == (0, True, [True, True])
    shutil.rmtree(cohort / "rank-1")
    rc, out, _ = cli("inspect", cohort)
    lines = out.splitlines()
    assert (rc, lines[0]) == (0, f"{cohort} — cohort, complete · 1 problem")
    assert "problem: missing rank shard rank-1" in lines


def test_inspect_names_a_broken_expected_json_but_does_not_hash(pr65_bundle, cli):
    (pr65_bundle / "expected.json").write_bytes(b"{not json")
    kl = pr65_bundle / "payloads" / "kl.safetensors"
    data = bytearray(kl.read_bytes())
    data[len(data) // 2] ^= 0x01
    kl.write_bytes(bytes(data))
    rc, out, _ = cli("inspect", pr65_bundle)
    assert rc == 0
    assert any(line.startswith("problem: expected.json: JSON is malformed") for line in out.splitlines()), out
    assert cli("validate", pr65_bundle)[0] == 3  # the flipped byte and the JSON are validate's to refuse


def test_inspect_a_directory_without_a_bundle_is_exit_3(tmp_path, cli):
    (tmp_path / "notes.txt").write_text("hello")
    rc, out, err = cli("inspect", tmp_path)
    assert (rc, out) == (3, "")
    assert err == (f"trajectory-replay: error: {tmp_path}: no bundle found (no manifest.json, no COMPLETE, "
                   "no bundle subdirectories)\n")


def test_inspect_a_missing_path_is_exit_3(tmp_path, cli):
    rc, out, err = cli("inspect", tmp_path / "nope")
    assert (rc, out) == (3, "")
    assert err == f"trajectory-replay: error: {tmp_path / 'nope'}: no such file or directory\n"


# -------------------------------------------------------------------------------------- validate


def test_validate_lists_unknown_fields_as_warnings(pr65_bundle, cli, bundle_tools):
    def manifest(doc):
        doc["format_version"] = "1.7.2"  # a newer minor of the same major
        doc["retention_days"] = 30
        doc["producer"]["hostname_digest"] = "ab12"

    def index(doc):
        doc["samples"][1]["judge_score"] = 0.5
        doc["identity"]["region"] = "eu"

    bundle_tools.edit_json(pr65_bundle, "manifest.json", manifest)
    bundle_tools.edit_json(pr65_bundle, "index.json", index)
    rc, out, err = cli("validate", pr65_bundle)
    assert (rc, err) == (0, "")
    assert out.splitlines()[0] == ("bundle b-00001 — valid (format 1.7.2, rollout-level, rollout_id=120, "
                                   "4 sample(s), 12 token(s))")
    warnings = sorted(line for line in out.splitlines() if line.startswith("warning: "))
    assert warnings == sorted([
        f"warning: {pr65_bundle / 'manifest.json'}: $.retention_days: unknown field (ignored)",
        f"warning: {pr65_bundle / 'manifest.json'}: $.producer.hostname_digest: unknown field (ignored)",
        f"warning: {pr65_bundle / 'index.json'}: $.samples[1].judge_score: unknown field (ignored)",
        f"warning: {pr65_bundle / 'index.json'}: $.identity.region: unknown field (ignored)",
    ])

    rc, out, err = cli("validate", pr65_bundle, "--format", "json")
    doc = json.loads(out)
    assert (rc, doc["valid"], doc["format_version"], len(doc["warnings"])) == (0, True, "1.7.2", 4)
    # and the bundle still replays to the same first divergence
    rc, out, err = cli("replay", pr65_bundle, "--format", "json")
    assert (rc, json.loads(out)["first_divergent_stage"]) == (1, "reward.post_process")


def test_validate_reports_an_unknown_active_knob_as_a_replay_refusal(pr65_bundle, cli, bundle_tools):
    bundle_tools.edit_json(pr65_bundle, "index.json", lambda doc: doc["config"].__setitem__("use_opd", True))
    rc, out, err = cli("validate", pr65_bundle, "--format", "json")
    doc = json.loads(out)
    assert (rc, err, doc["valid"]) == (0, "", True)
    assert doc["replay_refusals"] == [
        f"{pr65_bundle / 'index.json'}: $.config.use_opd=True: unknown config knob; refusing to guess what it changes"]
    assert doc["warnings"] == []  # refused, so never called "ignored" as well
    rc, out, err = cli("replay", pr65_bundle)
    assert (rc, out) == (4, "")
    assert "$.config.use_opd=True" in err and len(err.splitlines()) == 1


def test_an_unknown_knob_that_is_off_is_ignored_and_says_so(pr65_bundle, cli, bundle_tools):
    bundle_tools.edit_json(pr65_bundle, "index.json", lambda doc: doc["config"].__setitem__("use_opd", False))
    rc, out, err = cli("validate", pr65_bundle, "--format", "json")
    doc = json.loads(out)
    assert (rc, doc["replay_refusals"]) == (0, [])
    assert doc["warnings"] == [f"{pr65_bundle / 'index.json'}: $.config.use_opd: unknown field (ignored)"]
    rc, out, err = cli("replay", pr65_bundle, "--format", "json")
    assert (rc, json.loads(out)["first_divergent_stage"]) == (1, "reward.post_process")


def test_validate_never_recomputes_numbers(pr65_bundle, cli):
    """The PR #65 bundle diverges numerically, but it is well formed: validate says valid (exit 0)."""
    rc, out, err = cli("validate", pr65_bundle)
    assert (rc, err) == (0, "")
    assert out.splitlines()[1:] == [  # in pipeline order, as replay lists them
        "  sample               recompute", "  reward.raw           recompute", "  reward.post_process  recompute",
        "  advantage.kl         recompute", "  advantage.estimate   recompute", "  loss.value           unsupported"]


def test_validate_refuses_a_missing_expected_output(pr65_bundle, cli, bundle_tools):
    bundle_tools.edit_json(pr65_bundle, "expected.json", lambda doc: doc.pop("reward.post_process"))
    rc, out, err = cli("validate", pr65_bundle)
    assert (rc, out) == (3, "")
    assert err == (f"trajectory-replay: error: {pr65_bundle / 'manifest.json'}: dependency closure incomplete: "
                   f"reward.post_process needs expected.json $.reward.post_process.rewards\n")


# --------------------------------------------------------------------------------------- json out


def test_json_outputs_parse(pr65_bundle, tmp_path, cli):
    fixed = write_pr65(tmp_path / "fixed", buggy=False, bundle_id="b-00001-fixed")
    rc, out, _ = cli("replay", fixed, "--format", "json")
    doc = json.loads(out)
    assert (rc, doc["passed"], doc["first_divergent_stage"], doc["first_divergence"]) == (0, True, None, None)
    rc, out, _ = cli("replay", pr65_bundle, "--format", "json", "--max-divergences", "2")
    doc = json.loads(out)
    assert (rc, doc["passed"], doc["first_divergent_stage"]) == (1, False, "reward.post_process")
    first = doc["first_divergence"]
    assert {k: first[k] for k in ("stage", "rank", "sample_id", "group_index", "field", "token_offset", "expected",
                                  "actual", "abs_error")} == {
        "stage": "reward.post_process", "rank": None, "sample_id": "s-0", "group_index": 0, "field": "reward",
        "token_offset": None, "expected": -5.5, "actual": -1.0, "abs_error": 4.5}
    post = next(s for s in doc["stages"] if s["stage"] == "reward.post_process")
    assert (post["status"], post["mismatches"], post["max_abs_error"], len(post["divergences"])) == ("fail", 4, 4.5, 2)
    for argv in (("validate", pr65_bundle), ("inspect", pr65_bundle)):
        rc, out, err = cli(*argv, "--format", "json")
        assert (rc, err) == (0, "")
        assert json.loads(out)["path"] == str(pr65_bundle)


# ------------------------------------------------------------------------------------------- demo


def test_demo_write_small_synthetic_bundle(tmp_path, cli):
    target = tmp_path / "d"
    rc, out, err = cli("demo", "write", target, "--samples", "8", "--tokens", "4")
    assert (rc, out, err) == (0, f"wrote {target}\n", "")
    reader = BundleReader(target)
    assert reader.bundle_id == "d"
    assert [(s.sample_id, s.response_length, s.group_index) for s in reader.index.samples] == [
        (f"s-{i}", 4, i // 4) for i in range(8)]
    assert {n: list(reader.payload(n).shape) for n in reader.payload_names} == {
        n: [32] for n in ("advantages", "entropy", "kl", "log_probs", "old_log_probs", "ref_log_probs")}
    assert reader.payload("kl").dtype == torch.float32
    assert cli("validate", target)[0] == 0
    rc, out, _ = cli("replay", target)
    assert (rc, out.splitlines()[0]) == (0, "bundle d — no divergence (6 stage(s) compared)")
    # never overwrites: a second write into the same directory is refused (exit 2: the command's target), bundle unchanged
    before = (target / "COMPLETE").read_bytes()
    rc, out, err = cli("demo", "write", target, "--samples", "8", "--tokens", "4")
    assert (rc, out) == (2, "")
    assert "refusing to overwrite" in err and len(err.splitlines()) == 1
    assert (target / "COMPLETE").read_bytes() == before


def test_demo_write_all_writes_every_demo_the_debugger_offers(tmp_path, cli):
    from replay_lib.demo import DEMO_NAMES

    rc, out, err = cli("demo", "write-all", tmp_path / "demos")
    assert (rc, err) == (0, "")
    assert sorted(p.name for p in (tmp_path / "demos").iterdir()) == sorted(DEMO_NAMES)
    # the README's first example, as written there
    rc, out, _ = cli("replay", tmp_path / "demos" / "pr65-buggy")
    assert rc == 1 and out.splitlines()[0] == "bundle b-00001 — first divergent stage: reward.post_process"
    assert "reward s-0: expected=-5.5 actual=-1.0 abs_err=4.5" in out
    assert cli("replay", tmp_path / "demos" / "support-fullvocab")[0] == 1


def test_demo_write_rejects_bad_sizes(tmp_path, cli):
    rc, out, err = cli("demo", "write", tmp_path / "d", "--samples", "6", "--tokens", "4")
    assert (rc, out) == (2, "")
    assert err == ("trajectory-replay: error: --samples must be a positive multiple of --group-size; "
                   "--tokens must be >= 0\n")
    assert not (tmp_path / "d").exists()


def test_demo_write_where_it_cannot_is_a_command_line_error_not_a_bundle_or_internal_one(tmp_path, cli):
    # an existing target is the user's command's problem (exit 2), not an invalid bundle (3) or a bug (5)
    assert cli("demo", "write", tmp_path / "d", "--samples", "4", "--tokens", "3")[0] == 0
    before = sorted(p.name for p in (tmp_path / "d").rglob("*"))
    rc, out, err = cli("demo", "write", tmp_path / "d", "--samples", "4", "--tokens", "3")
    assert (rc, out) == (2, "")
    assert err == f"trajectory-replay: error: {tmp_path / 'd'}: bundle already exists; refusing to overwrite\n"
    assert sorted(p.name for p in (tmp_path / "d").rglob("*")) == before
    # a target under a regular file cannot be created: the OS's reason, one line, exit 2
    (tmp_path / "file").write_text("x")
    rc, out, err = cli("demo", "write-all", tmp_path / "file" / "demos")
    assert (rc, out) == (2, "")
    assert err.startswith(f"trajectory-replay: error: {tmp_path / 'file'}") and "Not a directory" in err
    assert err.count("\n") == 1 and "Traceback" not in err


# ------------------------------------------------------------------------------------- usage/help


def test_bad_command_line_is_exit_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["validate"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == "trajectory-replay validate: error: the following arguments are required: BUNDLE\n"


def test_help_documents_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for line in ("0  every compared stage passed", "1  a divergence was found", "2  bad command line",
                 "3  bundle invalid, incomplete, unsafe or ambiguous", "4  unsupported topology, stage or config knob"):
        assert line in out
    for command in ("inspect", "validate", "replay", "demo"):
        assert command in out


def test_inspect_never_reads_a_fifo_or_a_link_out_of_the_bundle(pr65_bundle, cli, tmp_path):
    import os

    (pr65_bundle / "index.json").unlink()
    os.mkfifo(pr65_bundle / "index.json")  # reading it would block forever
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    (pr65_bundle / "expected.json").unlink()
    (pr65_bundle / "expected.json").symlink_to(outside)
    rc, out, err = cli("inspect", pr65_bundle)
    assert (rc, err) == (0, "")
    assert "problem: index.json: not a regular file inside the bundle (not read)" in out.splitlines()
    assert "problem: expected.json: not a regular file inside the bundle (not read)" in out.splitlines()
    assert "  format    1.3.0" in out.splitlines()  # the readable manifest is still shown


def test_version_is_the_package_s(capsys):
    import tomllib
    from pathlib import Path

    version = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["version"]
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"trajectory-replay {version}\n"


def test_inspect_lists_what_is_left_of_a_bundle_or_cohort_instead_of_finding_nothing(tmp_path, cli, pr65_bundle):
    cohort = write_cohort(tmp_path / "cohort", samples=4, tokens=3)
    for rank_dir in cohort.glob("rank-*"):
        shutil.rmtree(rank_dir)
    rc, out, err = cli("inspect", cohort)
    assert (rc, err) == (0, "")
    assert out.splitlines()[:4] == [f"{cohort} — cohort, complete · 2 problems", "  ranks published: 0, 1",
                                    "problem: missing rank shard rank-0", "problem: missing rank shard rank-1"]
    (pr65_bundle / "manifest.json").unlink()
    (pr65_bundle / "index.json").unlink()
    rc, out, err = cli("inspect", pr65_bundle)
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"{pr65_bundle} — bundle, complete · 2 problems"
    assert "problem: missing manifest.json" in lines and "problem: missing index.json" in lines


def test_a_rank_shard_recorded_in_the_cohort_complete_is_published_as_the_reader_takes_it(tmp_path, cli):
    cohort = write_cohort(tmp_path / "cohort", samples=4, tokens=3)
    (cohort / "COMPLETE.1").unlink()  # the cohort COMPLETE carries rank 1's record: still a valid cohort
    assert cli("validate", cohort)[0] == 0
    rc, out, _ = cli("inspect", cohort, "--format", "json")
    doc = json.loads(out)
    assert (rc, doc["complete"], [(b["rank"], b["complete"]) for b in doc["bundles"]], doc["problems"]) == (
        0, True, [(0, True), (1, True)], [])


@pytest.mark.parametrize("name", ["manifest.json", "index.json", "expected.json", "COMPLETE"])
def test_inspect_lists_a_too_deep_json_file_as_a_problem_instead_of_crashing(tmp_path, cli, name):
    # 1,000 nested arrays would take a decoder out of its stack (RecursionError, exit 5): inspect lists the
    # file's problem with the path where it gets too deep, and exits 0 as for any other problem it lists
    b = write_pr65(tmp_path / "b", buggy=True)
    doc = (b / name).read_bytes().rstrip()
    (b / name).write_bytes(doc[:-1] + b', "zz": ' + b"[" * 1000 + b"]" * 1000 + b"}")
    code, out, err = cli("inspect", b)
    assert (code, err) == (0, "")
    if name == "COMPLETE":  # inspect reads it only for the early writer's case and leaves its problems to validate
        assert cli("validate", b)[0] == 3
        return
    assert f"problem: {name}: $.zz[0][0][0]: nested deeper than 64 levels (the limit for a bundle's JSON)" in \
        out.splitlines()
