"""``convert`` between any two forms of the format in one step (SPEC §2.2, §2.3): ``--to 1.0.0`` from 1.1/1.2/1.3/2.0
(``.pt`` payloads, masks in index.json, what 1.0.0 cannot hold named in a ``note:``), ``--to 1.3.0`` from 1.0/1.1/1.2/2.0
(packed masks, safetensors payloads; a payload safetensors cannot store refused, exit 4), the same version refused
(exit 2). The verdict survives every conversion, and 1.3.0 → 1.0.0 → 1.3.0 gives the source back byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from format2_original import BATCH_REWARDS, write_v2_bundle
from replay_lib.bundle import BundleReader, open_bundle
from replay_lib.demo import write_cohort, write_pr65
from test_float8_payloads import _bundle as write_float8_bundle
from test_wire_compat import FIXED_REWARDS, original_reads, original_reads_cohort, write_original_bundle

FROM_2_NOTES = [
    "note: stages reward.raw, reward.post_process: declared recorded-only (format 2.0 records no raw reward to "
    "recompute them from; each sample's reward stays advantage.estimate's input)",
    "note: index.json $.config.n_samples_per_prompt, $.config.grpo_std_normalization: not in format 2.0, written at "
    "their defaults (1, False; only reward.post_process reads them, and it is recorded-only)"]
PER_TOKEN_NOTE = ("note: index.json $.samples[].reward: per-token rewards, written as format 1.2.0 (the minor that "
                  "added them; a 1.0.0 reader takes a sample's reward as one number)")


def _report(cli, path: Path):
    rc, out, err = cli("replay", path, "--format", "json")
    assert err == ""
    return rc, json.loads(out)


def _verdict(cli, path: Path):
    """The exit code, the first divergence and every stage's status."""
    rc, doc = _report(cli, path)
    return rc, doc["first_divergent_stage"], doc["first_divergence"], [(s["stage"], s["status"])
                                                                      for s in doc["stages"]]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("rank-*")) or [path]


def test_every_demo_bundle_goes_to_1_0_0_and_back_to_1_3_0_with_its_verdict_and_its_bytes(tmp_path, cli):
    demos = tmp_path / "demos"
    assert cli("demo", "write-all", demos)[0] == 0
    names = sorted(p.name for p in demos.iterdir())
    assert len(names) == 11
    for name in names:
        src, v1, v13 = demos / name, tmp_path / f"{name}-1.0", tmp_path / f"{name}-1.3"
        rc, out, err = cli("convert", src, v1, "--to", "1.0.0")
        assert (rc, err) == (0, ""), name
        source = open_bundle(src)
        samples, bundle_id = sum(len(s.index.samples) for s in source.shards), source.bundle_id
        ranks = ", ranks 0, 1" if name == "cohort-2rank" else ""
        warning = ([f"note: validate: {v1 / 'manifest.json'}: $.comparison_policy.tolerances.advantage.kl.atol=0.1 "
                    f"is looser than the default 1e-06: used as declared (--tolerance-policy default caps it)"]
                   if name == "loose-kl" else [])
        assert out.splitlines() == [f"converted {src} (format 1.3.0) → {v1} (format 1.0.0): bundle {bundle_id}, "
                                    f"{samples} sample(s){ranks}; verified", *warning], name
        # the original's form: .pt payloads, the masks in index.json, a reader of its model takes every shard
        for shard in _shards(v1):
            assert sorted(p.suffix for p in (shard / "payloads").iterdir()) == [".pt"] * len(
                list((shard / "payloads").iterdir()))
            assert not (shard / "payloads" / "loss_mask.pt").exists()
            assert all("loss_mask" in s for s in json.loads((shard / "index.json").read_bytes())["samples"])
        (original_reads_cohort if name == "cohort-2rank" else original_reads)(v1)
        # the same report, word for word (a warning names the bundle's own path)
        rc_src, doc_src = _report(cli, src)
        rc_v1, doc_v1 = _report(cli, v1)
        assert (rc_v1, json.loads(json.dumps(doc_v1).replace(str(v1), str(src)))) == (rc_src, doc_src), name
        # and back: every file of the source, byte for byte (payload tensors, index records, sentinels)
        rc, out, err = cli("convert", v1, v13, "--to", "1.3.0")
        assert (rc, err) == (0, ""), name
        assert out.splitlines()[0] == (f"converted {v1} (format 1.0.0) → {v13} (format 1.3.0): bundle {bundle_id}, "
                                       f"{samples} sample(s){ranks}; verified")
        assert _files(v13) == _files(src), name
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_the_text_fields_are_carried_as_published_not_hashed_again(tmp_path, cli):
    src = write_pr65(tmp_path / "pr65")
    prompts = [s.prompt for s in BundleReader(src).index.samples]
    assert all(p is not None and len(p) == 64 for p in prompts)  # the sha256 the redaction policy wrote
    for to in ("2.0.0", "1.0.0"):
        assert cli("convert", src, tmp_path / to, "--to", to)[0] == 0
        assert [s.prompt for s in BundleReader(tmp_path / to).index.samples] == prompts, to


def test_the_original_s_2_0_bundle_converts_to_1_3_0_with_its_verdict(tmp_path, cli):
    src = write_v2_bundle(tmp_path / "v2", advantages_from=BATCH_REWARDS)
    rc, out, err = cli("convert", src, tmp_path / "v13", "--to", "1.3.0")
    assert (rc, err) == (0, "")
    assert out.splitlines() == [f"converted {src} (format 2.0.0) → {tmp_path / 'v13'} (format 1.3.0): bundle "
                                f"v2-rollout, 4 sample(s); verified", *FROM_2_NOTES]
    assert sorted(p.name for p in (tmp_path / "v13" / "payloads").iterdir()) == [
        "advantages.safetensors", "kl.safetensors", "loss_mask.safetensors", "old_log_probs.safetensors",
        "ref_log_probs.safetensors"]
    reader = BundleReader(tmp_path / "v13")
    assert {s.value: (c.version, c.capability.value) for s, c in reader.manifest.stage_contracts.items()} == {
        "advantage.kl": ("v1", "recompute"), "advantage.estimate": ("v1", "recompute"),
        "loss.value": ("v1", "unsupported"), "reward.raw": ("v1", "recorded-only"),
        "reward.post_process": ("v1", "recorded-only")}
    source = BundleReader(src)
    assert [reader.sample_mask(i) for i in range(4)] == [s.loss_mask for s in source.index.samples]
    assert [s.reward for s in reader.index.samples] == [s.reward for s in source.index.samples]
    # the reward stages are skipped either way (not in 2.0; recorded-only in 1.x): the same verdict
    rc_src, first_src, d_src, stages_src = _verdict(cli, src)
    assert (rc_src, first_src) == (1, "advantage.estimate")
    assert _verdict(cli, tmp_path / "v13") == (rc_src, first_src, d_src, stages_src)
    # and the same as the 1.0.0 the other path writes, but for the form
    assert cli("convert", src, tmp_path / "v1", "--to", "1.0.0")[0] == 0
    v1 = BundleReader(tmp_path / "v1")
    assert v1.index == reader.index_with_masks() and v1.expected == reader.expected
    for name in v1.payload_names:
        assert torch.equal(v1.payload(name), reader.payload(name)), name


def test_the_original_s_1_0_0_bundle_converts_to_1_3_0_and_back(tmp_path, cli):
    src = write_original_bundle(tmp_path / "v1", rewards=BATCH_REWARDS)
    rc, out, err = cli("convert", src, tmp_path / "v13", "--to", "1.3.0")
    assert (rc, out.splitlines()[1:], err) == (0, [], "")
    verdict = _verdict(cli, src)
    assert verdict[:2] == (1, "reward.post_process")
    assert _verdict(cli, tmp_path / "v13") == verdict
    assert cli("convert", tmp_path / "v13", tmp_path / "back", "--to", "1.0.0")[0] == 0
    a, b = BundleReader(src), BundleReader(tmp_path / "back")
    assert (b.manifest.format_version, b.index, b.expected) == ("1.0.0", a.index, a.expected)
    assert b.payload_names == a.payload_names
    for name in a.payload_names:
        x, y = a.payload(name), b.payload(name)
        assert (x.dtype, x.shape) == (y.dtype, y.shape) and x.numpy().tobytes() == y.numpy().tobytes(), name
    original_reads(tmp_path / "back")


def test_the_early_writer_s_bundle_converts_to_1_3_0_with_its_checksums_recorded(tmp_path, cli):
    src = write_original_bundle(tmp_path / "early", early=True)
    assert "COMPLETE: $.metadata: absent" in cli("validate", src)[1]
    rc, out, err = cli("convert", src, tmp_path / "v13", "--to", "1.3.0")
    assert (rc, out.splitlines()[1:], err) == (0, [], "")
    rc, out, err = cli("validate", tmp_path / "v13")
    assert (rc, err) == (0, "") and "warning" not in out
    assert json.loads((tmp_path / "v13" / "COMPLETE").read_bytes())["metadata"].keys() == {
        "manifest.json", "index.json", "expected.json"}


def test_per_token_rewards_go_to_1_3_0_and_stay_1_2_0_on_the_way_to_1_0_0(tmp_path, cli, bundle_tools):
    src = write_original_bundle(tmp_path / "pt")
    bundle_tools.edit_json(src, "index.json", lambda d: [s.__setitem__("reward", [r] * s["response_length"])
                                                          for s, r in zip(d["samples"], FIXED_REWARDS)])
    bundle_tools.edit_json(src, "manifest.json", lambda d: d.__setitem__("format_version", "1.2.0"))
    rc, out, err = cli("convert", src, tmp_path / "v13", "--to", "1.3.0")
    assert (rc, out.splitlines()[1:], err) == (0, [], "")
    assert BundleReader(tmp_path / "v13").manifest.format_version == "1.3.0"
    verdict = _verdict(cli, src)
    assert _verdict(cli, tmp_path / "v13") == verdict
    rc, out, err = cli("convert", tmp_path / "v13", tmp_path / "v1", "--to", "1.0.0")
    assert (rc, err) == (0, "")
    assert out.splitlines() == [f"converted {tmp_path / 'v13'} (format 1.3.0) → {tmp_path / 'v1'} (format 1.2.0): "
                                f"bundle orig-rollout, 4 sample(s); verified", PER_TOKEN_NOTE]
    back = BundleReader(tmp_path / "v1")
    assert back.index == BundleReader(src).index
    assert _verdict(cli, tmp_path / "v1") == verdict


def test_a_cohort_converts_shard_by_shard_both_ways(tmp_path, cli):
    src = write_cohort(tmp_path / "co", format_version="1.1.0")
    rc, out, err = cli("convert", src, tmp_path / "co13", "--to", "1.3.0", "--format", "json")
    assert (rc, err) == (0, "")
    result = json.loads(out)
    assert (result["source_version"], result["format_version"], result["ranks"], result["samples"],
            result["notes"]) == ("1.1.0", "1.3.0", [0, 1], 16, [])
    assert sorted(p.name for p in (tmp_path / "co13").iterdir()) == ["COMPLETE", "COMPLETE.0", "COMPLETE.1",
                                                                      "rank-0", "rank-1"]
    for r in (0, 1):
        assert (tmp_path / "co13" / f"rank-{r}" / "payloads" / "loss_mask.safetensors").is_file()
    assert [s.manifest.format_version for s in open_bundle(tmp_path / "co13").shards] == ["1.3.0", "1.3.0"]
    assert _verdict(cli, tmp_path / "co13") == _verdict(cli, src)
    rc, out, err = cli("convert", tmp_path / "co13", tmp_path / "co10", "--to", "1.0.0")
    assert (rc, err) == (0, "")
    original_reads_cohort(tmp_path / "co10")
    for a, b in zip(open_bundle(src).shards, open_bundle(tmp_path / "co10").shards):
        assert (b.manifest.format_version, b.index) == ("1.0.0", a.index)
        for name in a.payload_names:
            assert torch.equal(a.payload(name), b.payload(name)), name


def test_the_same_version_is_refused_and_nothing_is_written(tmp_path, cli):
    for path, to, version in ((write_pr65(tmp_path / "pr65"), "1.3.0", "1.3.0"),
                              (write_original_bundle(tmp_path / "orig"), "1.0.0", "1.0.0"),
                              (write_cohort(tmp_path / "co"), "1.3.0", "1.3.0")):
        rc, out, err = cli("convert", path, tmp_path / "dst", "--to", to)
        assert (rc, out, err) == (2, "", f"trajectory-replay: error: {path}: already format {version}; nothing to "
                                         f"convert\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["co", "orig", "pr65"]


def test_a_payload_safetensors_cannot_store_is_refused_before_anything_is_written(tmp_path, cli):
    src = write_float8_bundle(tmp_path / "fnuz", dtype=torch.float8_e4m3fnuz, logp=[-1.0, -2.0], ppo_kl=0.0,
                              format_version="1.1.0")
    rc, out, err = cli("convert", src, tmp_path / "v13", "--to", "1.3.0")
    assert (rc, out) == (4, "")
    assert err == (f"trajectory-replay: error: {src / 'manifest.json'}: $.payloads.log_probs.dtype: "
                   f"torch.float8_e4m3fnuz, which format 1.3.0 cannot hold (a payload there is a safetensors file of "
                   f"torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, "
                   f"torch.float8_e5m2, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fnuz"]
    # the original's form stores it (a .pt), in its own dtype
    assert cli("convert", src, tmp_path / "v1", "--to", "1.0.0")[0] == 0
    assert BundleReader(tmp_path / "v1").manifest.payloads["log_probs"].dtype == "torch.float8_e4m3fnuz"
    # a float8 dtype safetensors has goes to 1.3.0 as stored
    fn = write_float8_bundle(tmp_path / "fn", dtype=torch.float8_e4m3fn, logp=[-1.0, -2.0], ppo_kl=0.0,
                             format_version="1.1.0")
    assert cli("convert", fn, tmp_path / "fn13", "--to", "1.3.0")[0] == 0
    assert (tmp_path / "fn13" / "payloads" / "log_probs.safetensors").is_file()
    assert BundleReader(tmp_path / "fn13").manifest.payloads["log_probs"].dtype == "torch.float8_e4m3fn"
    assert _verdict(cli, tmp_path / "fn13") == _verdict(cli, fn)


def test_a_payload_of_its_own_named_loss_mask_cannot_go_to_1_3_0(tmp_path, cli, bundle_tools):
    src = write_original_bundle(tmp_path / "v1")
    torch.save(torch.ones(sum(len(s.loss_mask) for s in BundleReader(src).index.samples)),
               src / "payloads" / "loss_mask.pt")

    def add(manifest):
        spec = dict(manifest["payloads"]["kl"], name="loss_mask")
        manifest["payloads"]["loss_mask"] = spec

    bundle_tools.edit_json(src, "manifest.json", add)
    bundle_tools.reseal(src)
    assert cli("validate", src)[0] == 0
    rc, out, err = cli("convert", src, tmp_path / "v13", "--to", "1.3.0")
    assert (rc, out) == (4, "")
    assert err == (f"trajectory-replay: error: {src / 'manifest.json'}: $.payloads.loss_mask: format 1.3.0 keeps "
                   f"the samples' loss masks under this name, so a payload of its own cannot be carried\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]


def test_help_names_every_target(capsys):
    import pytest

    from replay_lib.cli.entry import main

    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert ("--to VERSION the format to write: 2.0.0 or 1.0.0 (the original's: .pt payloads, masks in index.json) or "
            "1.3.0 (ours: packed masks, safetensors payloads); what the target cannot hold is named in a note: line, "
            "or refused (exit 4)") in out


def test_a_source_validate_refuses_is_refused_with_its_line_not_as_an_internal_error(tmp_path, cli, bundle_tools):
    src = write_original_bundle(tmp_path / "v1")  # replay runs it (sample diverges); validate refuses it
    bundle_tools.edit_json(src, "index.json", lambda d: d["samples"][1]["loss_mask"].append(1))
    line = (f"trajectory-replay: error: {src / 'index.json'}: $.samples[1].loss_mask: 3 value(s), "
            f"$.samples[1].response_length is 2 (sample 's-1')\n")
    assert cli("validate", src) == (3, "", line)
    for to in ("2.0.0", "1.3.0"):
        assert cli("convert", src, tmp_path / to, "--to", to) == (3, "", line), to
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]
