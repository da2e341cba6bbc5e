"""The refused fraction of the configs each installed framework registers (``scripts/config_coverage.py``): verl
0.9.1, OpenRLHF 0.11.2 and TRL 1.16 enumerated from their own code, each config mapped by ``replay_lib.frameworks``.

Issue 33's target is at most 5% refused per framework, the policy-loss families included. Each test asserts the
CURRENT count as a ceiling (a new refusal fails it) and the exact number of registered configs (an enumeration that
silently shrank would lower the fraction); ``test_the_five_percent_target`` holds the frameworks of ``AT_TARGET``
to it (all five now) and is a strict xfail for any other, which fails once that framework reaches 5%. Skipped,
with the reason, where a framework is not installed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "config_coverage.py"


def _load():
    spec = importlib.util.spec_from_file_location("config_coverage", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


cov = _load()

# framework → (configs enumerated, mapped, refused, loss families, rejected by the framework itself), measured
# (the policy-loss families are mapped or refused like any config: none is counted apart)
REGISTERED = {"verl": (66, 60, 2, 0, 4), "openrlhf": (43, 42, 1, 0, 0), "trl": (38, 38, 0, 0, 0),
              "skyrl": (42, 42, 0, 0, 0), "nemo-rl": (28, 26, 1, 0, 1)}


@pytest.fixture(scope="module")
def results():
    cache: dict = {}

    def get(framework: str):
        if framework not in cache:
            try:
                configs = cov.ENUMERATORS[framework]()
            except cov.Unavailable as exc:
                pytest.skip(str(exc))
            cache[framework] = cov.classify(framework, configs)
        return cache[framework]

    return get


@pytest.mark.parametrize("framework", list(REGISTERED))
def test_refused_fraction_within_its_ceiling(results, framework):
    got = results(framework)
    n = cov.counts(got)
    registered, mapped, refused, families, rejected = REGISTERED[framework]
    assert n["registered"] == registered, [r.label for r in got]
    assert n[cov.REFUSED] <= refused, [r.message for r in got if r.status == cov.REFUSED]
    assert (n[cov.MAPPED], n[cov.FAMILY], n[cov.FRAMEWORK_ERROR]) == (mapped + refused - n[cov.REFUSED], families,
                                                                      rejected)
    assert n["refused_fraction"] <= refused / (mapped + refused)


@pytest.mark.parametrize("framework", list(REGISTERED))
def test_every_refusal_is_one_line_naming_its_key(results, framework):
    for r in results(framework):
        if r.status == cov.REFUSED:
            label = {"trl": "TRL"}.get(framework, framework)
            assert r.message.startswith(f"{label} config: ") and "\n" not in r.message, r.message
            key = r.path_value.split("=")[0].removeprefix("trainer.algorithm.")  # SkyRL's labels drop it
            assert key in r.label, (key, r.label)


def test_registries_read_from_the_frameworks_code(results):
    """The axes come from the installed code: verl's 14 estimators and 12 policy losses, OpenRLHF's 7 estimators
    (its parser's choices), TRL's 8 loss types (the values its trainer compares loss_type with)."""
    # one key set (GDPO with the reward components verl asserts it names)
    verl = {r.label for r in results("verl") if "," not in r.label or "gdpo_reward_keys" in r.label}
    assert sum(label.startswith("algorithm.adv_estimator=") for label in verl) == 14
    assert sum(label.startswith("actor_rollout_ref.actor.policy_loss.loss_mode=") for label in verl) == 12
    assert "actor_rollout_ref.actor.loss_agg_mode=token-sum" in verl
    orl = {r.label for r in results("openrlhf") if "," not in r.label}
    assert sum(label.startswith("algo.advantage.estimator=") for label in orl) == 7
    trl = {r.label for r in results("trl") if "," not in r.label}
    assert sum(label.startswith("loss_type=") for label in trl) == 8


def test_markdown_lists_every_refusal(results):
    collected = {fw: results(fw) for fw in REGISTERED}
    table = cov.markdown(collected).splitlines()
    refused = [r for rs in collected.values() for r in rs if r.status == cov.REFUSED]
    assert table[:2] == ["| framework | key=value | reason | what a bundle would need |", "|---|---|---|---|"]
    assert len(table) == 2 + len(refused)
    assert any("| `algorithm.adv_estimator=optimal_token_baseline` | the optimal token baseline" in row
               and "sum_pi_squared per token |" in row for row in table)


# the frameworks at issue 33's target; the others a strict xfail, which fails once they reach it
AT_TARGET = ("verl", "trl", "skyrl", "openrlhf", "nemo-rl")


@pytest.mark.parametrize("framework", [
    pytest.param(fw, marks=() if fw in AT_TARGET else pytest.mark.xfail(
        strict=True, reason="issue 33's target (at most 5% refused per framework) is not met yet"))
    for fw in REGISTERED])
def test_the_five_percent_target(results, framework):
    assert cov.counts(results(framework))["refused_fraction"] <= 0.05
