"""A GAE bundle in the debugger: advantage.estimate compares the recorded returns too, and the model offers them
as a field of their own (f cycles to it), with the mismatch located to the token."""

from __future__ import annotations

from safetensors.torch import save_file

from replay_lib.bundle import BundleReader, open_bundle
from replay_lib.run.runner import replay_run
from replay_tui.model import build_model

from test_advantage_estimate import CASES, case_bundle


def test_the_returns_of_a_gae_bundle_are_a_field_of_the_debugger(tmp_path, bundle_tools):
    path = case_bundle(tmp_path, "gae", CASES["gae"])
    bundles = open_bundle(path)
    report, contexts = replay_run(bundles)
    model = build_model(bundles, report, contexts=contexts)
    assert report.passed and {"advantage", "returns"} <= set(model.fields)
    # one recorded return off by 0.5 at token 3 of the first sample: only the returns field diverges, there
    reader = BundleReader(path)
    returns = reader.payload("returns").clone()
    returns[3] += 0.5
    save_file({"data": returns}, str(path / "payloads" / "returns.safetensors"))  # the default form's file
    bundle_tools.reseal(path)
    bundles = open_bundle(path)
    report, contexts = replay_run(bundles)
    [d] = [d for d in report.stage("advantage.estimate").divergences]
    assert (d.field, d.sample_id, d.token_offset) == ("returns", reader.index.samples[0].sample_id, 3)
