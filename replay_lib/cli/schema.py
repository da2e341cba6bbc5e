"""``trajectory-replay schema report``: the JSON Schema (draft 2020-12) of ``replay --format json`` — the
report's document, which ``scan --format json`` also carries as each row's ``report`` — generated from the
report's own types (``judge.report``), so it cannot drift from what is written. Every property says whether it
is **stable** (``"x-stable": true``: part of the API, SPEC §10; removed or changed only with a major version)
or an addition that may still change (``false``). No torch is imported."""

from __future__ import annotations

import json
import sys

# The keys that are an API (the README's "Headless use" and SPEC §10): per type, the stable properties.
STABLE = {
    "ReplayReport": ("bundle_id", "passed", "first_divergent_stage", "first_divergence", "stages", "mode", "exact",
                     "tolerance_policy", "hazards", "explanations"),
    "Divergence": ("stage", "rank", "sample_id", "group_index", "field", "token_offset", "expected", "actual",
                   "abs_error", "tolerance", "noise_ratio"),
    "StageReport": ("stage", "status", "reason", "mismatches", "max_abs_error", "divergences", "max_noise_ratio"),
    "Hazard": ("stage", "kind", "sample_id", "group_index", "message", "rank"),
    "Explanation": ("stage", "hypothesis", "matched", "of", "detail", "unit", "rank"),
}
SCHEMAS = ("report",)


def report_schema() -> dict:
    """The report's JSON Schema, each property marked ``x-stable``."""
    import msgspec

    from ..judge.report import ReplayReport

    schema = msgspec.json.schema(ReplayReport)
    for name, definition in schema["$defs"].items():
        stable = set(STABLE.get(name, ()))
        for key, prop in definition.get("properties", {}).items():
            prop["x-stable"] = key in stable
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "trajectory-replay/report",
        "title": "trajectory-replay replay --format json",
        "description": ("One bundle's replay report (SPEC §10). Properties with x-stable: true are an API; the "
                        "others are additions that may change. The exit code says the verdict: 0 pass, 1 "
                        "divergence (an error writes no report: 2 usage, 3 invalid or unsafe input, 4 "
                        "unsupported, 5 internal error)."),
        **schema,
    }


def add_schema_arguments(p) -> None:
    p.add_argument("name", choices=SCHEMAS, help="which document: report (replay --format json; each scan row's "
                                                 "report)")


def run_schema_command(args) -> int:
    sys.stdout.write(json.dumps(report_schema(), indent=2, sort_keys=False) + "\n")
    return 0
