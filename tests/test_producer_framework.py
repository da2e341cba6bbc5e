"""The producer record's optional ``framework`` / ``framework_version`` (manifest.json): an old bundle without
them still reads and replays; a capture records them; ``inspect`` shows them, escaped."""

from __future__ import annotations

import json

import msgspec

from capture.producer import producer_info
from replay_lib.bundle import BundleReader
from replay_lib.bundle.schema import Manifest, ProducerInfo


def _producer_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("  producer"))


def test_an_old_bundle_without_the_fields_reads_validates_and_inspects(pr65_bundle, cli):
    doc = json.loads((pr65_bundle / "manifest.json").read_bytes())
    assert "framework" not in doc["producer"] and "framework_version" not in doc["producer"]
    producer = BundleReader(pr65_bundle).manifest.producer
    assert (producer.framework, producer.framework_version) == (msgspec.UNSET, msgspec.UNSET)
    # written again, the record stays as it was: no new key
    assert msgspec.json.decode(msgspec.json.encode(producer)) == doc["producer"]
    code, out, err = cli("validate", pr65_bundle)
    assert (code, err) == (0, "")
    code, out, err = cli("inspect", pr65_bundle)
    assert code == 0 and "framework" not in _producer_line(out)


def test_the_fields_round_trip_and_inspect_shows_them(pr65_bundle, cli, bundle_tools):
    bundle_tools.edit_json(pr65_bundle, "manifest.json", lambda doc: doc["producer"].update(
        framework="trl", framework_version="1.16.0"))
    producer = BundleReader(pr65_bundle).manifest.producer
    assert (producer.framework, producer.framework_version) == ("trl", "1.16.0")
    code, out, err = cli("inspect", pr65_bundle)
    assert code == 0 and _producer_line(out).endswith(" framework=trl 1.16.0"), out
    code, out, err = cli("inspect", pr65_bundle, "--format", "json")
    producer_json = json.loads(out)["bundles"][0]["producer"]
    assert (producer_json["framework"], producer_json["framework_version"]) == ("trl", "1.16.0")
    code, out, err = cli("validate", pr65_bundle)
    assert (code, err) == (0, "")


def test_a_hostile_version_is_escaped_in_inspect(pr65_bundle, cli, bundle_tools):
    bundle_tools.edit_json(pr65_bundle, "manifest.json", lambda doc: doc["producer"].update(
        framework="verl", framework_version="0.9.1\x1b]0;pwned\x07"))
    code, out, err = cli("inspect", pr65_bundle)
    assert code == 0 and "\x1b" not in out and "\x07" not in out
    assert _producer_line(out).endswith(" framework=verl 0.9.1\\x1b]0;pwned\\x07"), _producer_line(out)


def test_producer_info_records_the_framework_it_is_given(tmp_path):
    plain = producer_info(tmp_path)
    assert (plain.framework, plain.framework_version) == (msgspec.UNSET, msgspec.UNSET)
    assert "framework" not in msgspec.json.decode(msgspec.json.encode(plain))
    info = producer_info(tmp_path, ("trl", "1.16.0"))
    assert (info.framework, info.framework_version, info.torch_version) == ("trl", "1.16.0", plain.torch_version)
    encoded = msgspec.json.decode(msgspec.json.encode(info))
    assert (encoded["framework"], encoded["framework_version"]) == ("trl", "1.16.0")
    assert msgspec.json.decode(msgspec.json.encode(info), type=ProducerInfo) == info
    assert "producer" in Manifest.__struct_fields__
    # null is read as null (a writer that spells out "unknown")
    assert msgspec.json.decode(b'{"framework": null}', type=ProducerInfo).framework is None
