"""Per-sample and per-token loss terms (SPEC §4): ``expected.json $.loss.policy.per_sample`` and the payload
``pg_losses`` — how the reader takes them (a malformed one is one line, exit 3) and how the replay compares
them (``replay_lib.stages.loss_terms``).

The step is the PR #65 loss fixture (``demo.write_step_loss``): lengths [3, 2, 4, 3], every token in the loss
mask, advantages −1, +1, −1, +1 broadcast, old = 0, logp = 0.5, eps_clip = eps_clip_high = 0.2. Per token:
ppo_kl = old − logp = −0.5, ratio = e^0.5 = 1.6487212 (float32); A = −1: l1 = 1.6487212 > l2 = 1.2, pg = ratio,
not clipped; A = +1: l1 = −1.6487212 < l2 = −1.2, pg = −1.2, clipped. So per sample:

    sample  n   pg_sum          clip_count  kl_sum  mask_count
    s-0     3   3·1.6487212     0           −1.5    3
    s-1     2   2·(−1.2)        2           −1.0    2
    s-2     4   4·1.6487212     0           −2.0    4
    s-3     3   3·(−1.2)        3           −1.5    3

and pg_clipfrac = 0/3 + 2/2 + 0/4 + 3/3 = 2, ppo_kl = 4·(−0.5) = −2 (SPEC §4's fixture numbers).
"""

from __future__ import annotations

import json

import pytest
import torch

from replay_lib.bundle import BundleReader
from replay_lib.demo import write_step_loss
from replay_lib.schema import PerSampleLossTerms

RATIO = float(torch.tensor(0.5).exp())  # e^0.5 in float32: 1.6487212181091309
CLIP = float(torch.tensor(1.2))  # 1 + eps_clip_high as the float32 clamp holds it
LENGTHS = [3, 2, 4, 3]
ENTROPY = torch.linspace(0.5, 1.5, 12, dtype=torch.float64).to(torch.float32).double()  # as write_step_loss


def _entropy_sums() -> list[float]:
    out, start = [], 0
    for n in LENGTHS:
        out.append(float(ENTROPY[start:start + n].sum()))
        start += n
    return out


def hand_terms() -> dict[str, list[float]]:
    """The table of the module docstring, in float64 (each float32 term exact, summed in float64)."""
    return {
        "pg_sum": [3 * RATIO, 2 * -CLIP, 4 * RATIO, 3 * -CLIP],
        "entropy_sum": _entropy_sums(),
        "kl_sum": [-1.5, -1.0, -2.0, -1.5],
        "clip_count": [0.0, 2.0, 0.0, 3.0],
        "mask_count": [3.0, 2.0, 4.0, 3.0],
    }


@pytest.fixture
def step_bundle(tmp_path, bundle_tools):
    """The PR #65 step bundle with the hand-derived per-sample terms recorded."""
    bundle = write_step_loss(tmp_path / "step")
    bundle_tools.edit_json(bundle, "expected.json", lambda doc: doc["loss.policy"].update(per_sample=hand_terms()))
    return bundle


# ------------------------------------------------------------------------------------------ reader


def test_recorded_per_sample_terms_are_read_and_the_bundle_validates(step_bundle, cli):
    reader = BundleReader(step_bundle)
    loss = reader.expected["loss.policy"]
    assert loss["per_sample"] == PerSampleLossTerms(**hand_terms())
    assert (loss["pg_clipfrac"], loss["ppo_kl"]) == (2.0, -2.0)  # the scalars beside them, as before
    code, out, err = cli("validate", step_bundle)
    assert code == 0 and err == "", out + err


def test_absent_null_and_unknown_terms(tmp_path, bundle_tools):
    """A term not recorded is absent or null; a term this reader does not know is ignored (a later minor
    version may add one); ``per_sample: null`` is no terms at all."""
    bundle = write_step_loss(tmp_path / "step")
    bundle_tools.edit_json(bundle, "expected.json", lambda doc: doc["loss.policy"].update(
        per_sample={"pg_sum": hand_terms()["pg_sum"], "entropy_sum": None, "kl_loss_sum": [0, 0, 0, 0]}))
    terms = BundleReader(bundle).expected["loss.policy"]["per_sample"]
    assert terms.recorded() == {"pg_sum": hand_terms()["pg_sum"]}
    bundle_tools.edit_json(bundle, "expected.json", lambda doc: doc["loss.policy"].update(per_sample=None))
    assert BundleReader(bundle).expected["loss.policy"]["per_sample"] is None


def test_a_nan_sum_is_read_and_written_back_as_null(tmp_path, bundle_tools):
    """msgspec writes a NaN as null: a sum that is null reads back (and diverges where it is compared)."""
    bundle = write_step_loss(tmp_path / "step")
    bundle_tools.edit_json(bundle, "expected.json", lambda doc: doc["loss.policy"].update(
        per_sample={"pg_sum": [1.0, None, 2.0, 3.0]}))
    assert BundleReader(bundle).expected["loss.policy"]["per_sample"].pg_sum == [1.0, None, 2.0, 3.0]


def _set(key, value):
    def edit(doc):
        terms = hand_terms()
        terms[key] = value
        doc["loss.policy"]["per_sample"] = terms
    return edit


@pytest.mark.parametrize("edit, where", [
    (_set("pg_sum", [1.0, 2.0, 3.0]),
     "$.loss.policy.per_sample.pg_sum: 3 value(s) for 4 sample(s) (expected one per sample of index.json $.samples)"),
    (_set("mask_count", [3, 2, 4, 3, 1]),
     "$.loss.policy.per_sample.mask_count: 5 value(s) for 4 sample(s) (expected one per sample of index.json "
     "$.samples)"),
    (_set("kl_sum", [-1.5, "-1.0", -2.0, -1.5]), "$.loss.policy.per_sample.kl_sum[1]: expected `float | null`, got "
                                                 "`str`"),
    (_set("entropy_sum", 1.0), "$.loss.policy.per_sample.entropy_sum: expected `array | null`, got `float`"),
    (_set("clip_count", [0, -2, 0, 3]), "$.loss.policy.per_sample.clip_count[1]: expected a whole number >= 0 (a "
                                        "token count), got -2.0"),
    (_set("clip_count", [0, 2, 0.5, 3]), "$.loss.policy.per_sample.clip_count[2]: expected a whole number >= 0 (a "
                                         "token count), got 0.5"),
    (_set("mask_count", [3, 2, 4, None]), "$.loss.policy.per_sample.mask_count[3]: expected `float`, got `null`"),
    (_set("mask_count", [3, 2, 4, True]), "$.loss.policy.per_sample.mask_count[3]: expected `float`, got `bool`"),
    (lambda doc: doc["loss.policy"].update(per_sample=[1.0, 2.0]),
     "$.loss.policy.per_sample: expected `object` (the per-sample loss terms), got `array`"),
    (lambda doc: doc["loss.policy"].update(per_sample=0.5),
     "$.loss.policy.per_sample: expected `object` (the per-sample loss terms), got `float`"),
    (lambda doc: doc["loss.policy"].update(pg_loss={"per_sample": 1.0}),
     "$.loss.policy.pg_loss: expected `float | array | null`, got `object`"),
])
@pytest.mark.parametrize("command", ["validate", "replay"])
def test_malformed_per_sample_terms_are_one_line_and_exit_3(tmp_path, bundle_tools, cli, edit, where, command):
    bundle = write_step_loss(tmp_path / "step")
    bundle_tools.edit_json(bundle, "expected.json", edit)
    code, out, err = cli(command, bundle)
    assert (code, out) == (3, "")
    assert err == f"trajectory-replay: error: {bundle / 'expected.json'}: {where}\n"


def test_the_same_terms_with_the_literal_nan_of_python_json_are_checked_too(tmp_path, bundle_tools, cli):
    """expected.json as Python's json writes it (a bare NaN elsewhere) takes the stdlib path: the per-sample
    terms are checked there as well."""
    bundle = write_step_loss(tmp_path / "step")
    path = bundle / "expected.json"
    doc = json.loads(path.read_bytes())
    doc["loss.policy"]["per_sample"] = {"clip_count": [0, 2, 0, 1.5]}
    doc["loss.policy"]["entropy_loss"] = float("nan")
    path.write_bytes((json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())
    assert b"NaN" in path.read_bytes()
    bundle_tools.reseal(bundle)
    code, out, err = cli("validate", bundle)
    assert (code, out) == (3, "")
    assert err == (f"trajectory-replay: error: {path}: $.loss.policy.per_sample.clip_count[3]: expected a whole "
                   "number >= 0 (a token count), got 1.5\n")
