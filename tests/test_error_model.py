"""The error model (``replay_lib.judge.error_model``, SPEC §5.1): each rounding bound against hand-derived numbers, and
against a producer that reaches it; the flags that change how a replay judges (``--exact``,
``--tolerance-policy``, ``--verbose``), ``producer_precision`` and the hazards.

The producers here are written out in the test (a Python loop of float32 additions, bf16 arithmetic through
torch's bfloat16 dtype), never the replay's kernels."""

from __future__ import annotations

import json
import math
from array import array
from pathlib import Path

import msgspec
import pytest
import torch

from replay_lib.demo import ALL_STAGES, ROLLOUT_STAGES, STEP_STAGES, contracts, producer, write_bundle, write_pr65
from replay_lib.judge.error_model import (
    U32,
    GroupStats,
    Precision,
    Rules,
    bundle_tolerance,
    exact_multiples,
    group_stats,
    kl_bound,
    reward_bound,
    sequential_sum32,
    unit_roundoff,
)
from replay_lib.judge.report import fmt_value, report_to_text
from replay_lib.run.runner import replay
from replay_lib.bundle.schema import (
    FORMAT_VERSION,
    ActorStepId,
    BundleIndex,
    ComparisonPolicy,
    Identity,
    Manifest,
    RecomputeConfig,
    SampleRecord,
    Tolerance,
)

EPS = 1e-6


def bundle(path: Path, *, groups, lengths, raw, expected, payloads, stages=ALL_STAGES, masks=None,
           policy: ComparisonPolicy = ComparisonPolicy(), **config) -> Path:
    masks = masks if masks is not None else [[1] * n for n in lengths]
    cfg = dict(advantage_estimator="grpo", n_samples_per_prompt=groups.count(groups[0]),
               grpo_std_normalization=False, kl_loss_type="k1", kl_coef=0.0, eps_clip=0.2, eps_clip_high=0.2)
    cfg.update(config)
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=g, response_length=n, total_length=n + 4, loss_mask=m,
                            raw_reward=r, micro_batch_id="mb-0000")
               for i, (g, n, m, r) in enumerate(zip(groups, lengths, masks, raw))]
    index = BundleIndex(bundle_id=path.name, identity=Identity(actor_step_id=ActorStepId(rollout_id=3, step_id=1)),
                        samples=samples, config=RecomputeConfig(**cfg))
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=path.name, producer=producer(),
                        stage_contracts=contracts(stages), payloads={}, comparison_policy=policy, redaction={})
    tensors = {k: v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float32) for k, v in payloads.items()}
    return write_bundle(path, manifest, index, expected, tensors)


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def seq32_mean(values: list[float]) -> float:
    """A sequential float32 producer: ((v0 + v1) + v2) + … in float32, then divided in float32."""
    acc = array("f", [0.0])
    for v in values:
        acc[0] = acc[0] + v
    return f32(acc[0] / len(values))


# ------------------------------------------------------------------------------------------- unit roundoff


def test_unit_roundoffs_and_the_declared_precision():
    assert unit_roundoff("float32") == U32 == 2.0 ** -24
    assert (unit_roundoff("bfloat16"), unit_roundoff("float16"), unit_roundoff("float64")) == (2.0 ** -8, 2.0 ** -11,
                                                                                             2.0 ** -53)
    assert unit_roundoff(torch.bfloat16) == 2.0 ** -8
    policy = msgspec.convert({"producer_precision": {"compute": "bfloat16", "accumulate": "float64"}}, ComparisonPolicy)
    p = Precision.of(policy)
    assert (p.token, p.reduce, p.sequential) == (2.0 ** -8, 2.0 ** -53, False)
    assert Precision.of(ComparisonPolicy()) == Precision("float32", "float32")


# ------------------------------------------------------------------------------------------------ rewards


def test_reward_bound_hand_derived():
    # no std: 8u·(|r_i| + √n·max|r|); group [1, 3] (n = 2, max 3) and [10, 12]
    raw = torch.tensor([1.0, 3.0, 10.0, 12.0], dtype=torch.float64)
    stats = group_stats(raw, torch.tensor([0, 0, 1, 1]))
    truth = torch.tensor([-1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    got = reward_bound(raw, stats, truth, False, EPS).tolist()
    want = [8 * U32 * (r + math.sqrt(2) * m) for r, m in ((1, 3), (3, 3), (10, 12), (12, 12))]
    assert got == pytest.approx(want, rel=1e-12)
    # std: 8u·[(|r| + √n·max|r|)/(s + eps) + √n·|g|], s = √2 for [1, 3]
    s = math.sqrt(2.0)
    g = 1 / (s + EPS)
    got = reward_bound(raw[:2], group_stats(raw[:2], torch.tensor([0, 0])), torch.tensor([-g, g], dtype=torch.float64),
                       True, EPS).tolist()
    assert got == pytest.approx([8 * U32 * ((1 + s * 3) / (s + EPS) + s * g), 8 * U32 * ((3 + s * 3) / (s + EPS) + s * g)],
                                rel=1e-12)


def float32_group_normalize(raw: list[float], std: bool) -> list[float]:
    """A float32 producer (sequential sums, as a Python loop over float32 values)."""
    r = [f32(x) for x in raw]
    mean = seq32_mean(r)
    centered = [f32(x - mean) for x in r]
    if not std:
        return centered
    acc = array("f", [0.0])
    for c in centered:
        acc[0] = acc[0] + f32(c * c)
    sd = f32(math.sqrt(f32(acc[0] / (len(r) - 1))))
    return [f32(c / f32(sd + EPS)) for c in centered]


def test_equal_rewards_a_float32_producer_cannot_sum_exactly_are_admitted_and_reported(tmp_path):
    # eight rewards of 0.3: the exact answer is 0; the float32 producer's mean is an ulp off, its std is at the
    # rounding level, and what it writes is |g| = ulp / eps, far from 0 — and legitimate
    written = float32_group_normalize([0.3] * 8, std=True)
    assert 1e-3 < abs(written[0]) < 0.1 and len(set(written)) == 1
    raw = torch.tensor([0.3] * 8, dtype=torch.float64)
    stats = group_stats(raw, torch.zeros(8, dtype=torch.int64))
    bound = reward_bound(raw, stats, torch.zeros(8, dtype=torch.float64), True, EPS)
    assert float(bound[0]) == pytest.approx(8 * U32 * (0.3 + math.sqrt(8) * 0.3) / EPS)  # 0.55
    assert all(abs(w) <= float(b) for w, b in zip(written, bound))
    path = bundle(tmp_path / "b", groups=[0] * 8, lengths=[1] * 8, raw=[0.3] * 8, stages=ROLLOUT_STAGES,
                  grpo_std_normalization=True,
                  expected={"reward.raw": {"raw_rewards": [0.3] * 8}, "reward.post_process": {"rewards": written}},
                  payloads={"kl": [0.0] * 8, "advantages": written})
    report = replay(path)
    assert report.passed, report_to_text(report)
    assert [(h.stage, h.kind, h.group_index) for h in report.hazards] == [
        ("reward.post_process", "near_zero_std", 0), ("reward.post_process", "zero_advantage_group", 0)]
    text = report_to_text(report).splitlines()
    assert text[-2:] == [
        "hazard: reward.post_process near_zero_std g-0: group g-0: std 0 of its 8 rewards is at the rounding level "
        "of their mean (max |r| 0.3): a float32 producer's normalized values there are rounding noise, "
        "admitted up to ±0.548",
        "hazard: reward.post_process zero_advantage_group g-0: group g-0: every normalized reward is 0 (its 8 raw "
        "rewards are equal): the group adds no policy gradient"]


def test_equal_rewards_whose_sums_are_exact_must_normalize_to_exactly_zero(tmp_path):
    # binary rewards: every sum of 1.0s is exact in float32, so every producer writes 0 and the bound is 0
    assert exact_multiples(1.0, 8) and exact_multiples(0.0, 8) and exact_multiples(0.5, 1 << 20)
    assert not exact_multiples(0.3, 8) and not exact_multiples(f32(0.3), 8) and not exact_multiples(1.0, 1 << 24)
    assert float32_group_normalize([1.0] * 8, std=True) == [0.0] * 8
    raw = torch.ones(8, dtype=torch.float64)
    assert reward_bound(raw, group_stats(raw, torch.zeros(8, dtype=torch.int64)), torch.zeros(8, dtype=torch.float64),
                        True, EPS).tolist() == [0.0] * 8
    wrong = [0.0] * 7 + [1e-4]  # a bug that gives an all-correct group a signal
    path = bundle(tmp_path / "b", groups=[0] * 8, lengths=[1] * 8, raw=[1.0] * 8, stages=ROLLOUT_STAGES,
                  grpo_std_normalization=True, policy=ComparisonPolicy(tolerances={"reward.post_process":
                                                                                   Tolerance(atol=0.0, rtol=0.0)}),
                  expected={"reward.raw": {"raw_rewards": [1.0] * 8}, "reward.post_process": {"rewards": wrong}},
                  payloads={"kl": [0.0] * 8, "advantages": wrong})
    report = replay(path)
    assert report.first_divergent_stage == "reward.post_process"
    d = report.first_divergence
    assert (d.sample_id, d.tolerance, d.noise_ratio) == ("s-7", 0.0, math.inf)
    assert [h.kind for h in report.hazards] == ["zero_advantage_group"]


def test_raw_rewards_are_normalized_from_the_float64_json_not_rounded_to_float32(tmp_path):
    # reward-model scores ≈ 3 ± 1e-5: rounding them to float32 first moves the normalized values by ~1e-2;
    # a float64 producer (rounded once at the end) must pass, and the replay's actual is the float64 truth
    raw = [3.0 + 1e-5 * k for k in (-1.3, 0.4, 2.2, -1.1)]
    mean = sum(raw) / 4
    s = math.sqrt(sum((r - mean) ** 2 for r in raw) / 3)
    truth = [(r - mean) / (s + EPS) for r in raw]
    rounded = float32_group_normalize(raw, std=True)
    assert max(abs(a - b) for a, b in zip(rounded, truth)) > 1e-3  # what a float32 recompute would start from
    written = [f32(t) for t in truth]
    path = bundle(tmp_path / "b", groups=[0] * 4, lengths=[1] * 4, raw=raw, stages=ROLLOUT_STAGES,
                  grpo_std_normalization=True,
                  expected={"reward.raw": {"raw_rewards": raw}, "reward.post_process": {"rewards": written}},
                  payloads={"kl": [0.0] * 4, "advantages": written})
    report = replay(path, max_divergences=4)
    assert report.passed, report_to_text(report)
    assert report.stage("reward.post_process").max_abs_error < 1e-6


# ---------------------------------------------------------------------------------------------------- kl


def test_k3_bound_hand_derived_and_reached_by_bf16_arithmetic(tmp_path):
    r = torch.tensor([0.0, 0.5, -0.5, 2.0], dtype=torch.float64)
    truth = torch.exp(-r) - 1 + r
    got = kl_bound(r, truth, "k3", 2.0 ** -8, U32).tolist()
    want = [8 * 2.0 ** -8 * (math.exp(-x) + 1 + abs(x)) + U32 * abs(math.exp(-x) - 1 + x) for x in r.tolist()]
    assert got == pytest.approx(want, rel=1e-12)
    assert kl_bound(r, r, "k1", U32, U32).tolist() == pytest.approx([9 * U32 * abs(x) for x in r.tolist()])
    # a bf16 producer: log-probs, the log ratio and every op of k3 in bfloat16
    old = torch.tensor([-0.3, -1.2, -0.01, -2.5, -0.7, -0.05]).to(torch.bfloat16)
    ref = torch.tensor([-0.9, -0.4, -0.2, -0.1, -0.69, -3.0]).to(torch.bfloat16)
    neg = -(old - ref)
    kl = (neg.exp() - 1 - neg).float()
    policy = msgspec.convert({"producer_precision": {"compute": "bfloat16"}}, ComparisonPolicy)
    payloads = {"old_log_probs": old.float(), "ref_log_probs": ref.float(), "kl": kl, "advantages": [0.0] * 6}
    common = dict(groups=[0, 0], lengths=[3, 3], raw=[1.0, 1.0], stages=ROLLOUT_STAGES, kl_coef=0.1,
                  kl_loss_type="k3", expected={"reward.raw": {"raw_rewards": [1.0, 1.0]},
                                               "reward.post_process": {"rewards": [0.0, 0.0]}}, payloads=payloads)
    report = replay(bundle(tmp_path / "bf16", policy=policy, **common))
    assert report.passed, report_to_text(report)
    assert 0.01 < report.stage("advantage.kl").max_noise_ratio < 1  # the bound is reached, not vacuous
    # the same values declared float32 are far beyond a float32 producer's rounding
    report = replay(bundle(tmp_path / "f32", **common))
    assert report.first_divergent_stage == "advantage.kl" and report.first_divergence.noise_ratio > 100


# -------------------------------------------------------------------------------------------- loss scalars


EXACT_LOSS = ComparisonPolicy(tolerances={"loss.policy": Tolerance(atol=0.0, rtol=0.0)})  # the rounding bound alone


def loss_bundle(path: Path, n: int, pg_loss: float, policy: ComparisonPolicy = EXACT_LOSS, **kw) -> Path:
    # one sample of n tokens, ratio 1 (logp = old), advantage 0.1: every surrogate term is −0.1
    return bundle(path, groups=[0], lengths=[n], raw=[1.0], stages=STEP_STAGES, policy=policy,
                  expected={"loss.policy": {"pg_loss": pg_loss}},
                  payloads={"log_probs": [-0.5] * n, "old_log_probs": [-0.5] * n, "advantages": [0.1] * n}, **kw)


def test_a_sequential_float32_producer_reaches_beyond_a_condition_bound_and_passes(tmp_path):
    n = 4096
    term = f32(-0.1 * f32(1.0))
    produced = seq32_mean([term] * n)  # the sequential float32 producer on constant data
    truth = f32(0.1) * -1.0
    err = abs(produced - truth)
    plain = 2 * U32 * (abs(truth) + abs(truth)) + 2 * U32 * 3 * abs(truth)  # 2u·(K_sum + K_outer) + 2u·K_tok
    assert err > 30 * plain  # a √n or condition-number bound alone is not sound for this producer
    report = replay(loss_bundle(tmp_path / "seq", n, produced))
    assert report.passed, report_to_text(report)
    d_ratio = report.stage("loss.policy").max_noise_ratio
    assert 0.2 < d_ratio <= 1 / 3 + 1e-6  # err / (3·|seq32 − T| + …): the replay's seq32 is this very sum
    # an error a little beyond three such producers is a divergence
    report = replay(loss_bundle(tmp_path / "bug", n, truth + 3.3 * (produced - truth)))
    assert report.first_divergent_stage == "loss.policy"
    assert 1 < report.first_divergence.noise_ratio < 1.2


def test_sequential_sum32_is_float32_left_to_right():
    values = torch.tensor([1.0, 2.0 ** -24, 2.0 ** -24, -1.0], dtype=torch.float64)
    assert sequential_sum32(values) == 0.0  # (1 + u) rounds to 1 twice, then 1 − 1
    assert float(values.sum()) == 2.0 ** -23


def test_sequential_sum32_is_the_float32_loop_bit_for_bit():
    """The vectorized sum is the loop ``acc = float32(acc + v)`` from 0.0 on values of wide-ranging magnitude
    (where a pairwise or double-precision sum differs), on an empty and an all-negative-zero input."""
    gen = torch.Generator().manual_seed(3)
    for n in (1, 2, 7, 1000, 4096):
        values = (torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 8)).to(torch.float32)
        acc = array("f", [0.0])
        for v in values.tolist():
            acc[0] = acc[0] + v
        assert sequential_sum32(values) == acc[0]
    assert sequential_sum32(torch.zeros(0)) == 0.0
    assert math.copysign(1.0, sequential_sum32(torch.tensor([-0.0, -0.0]))) == 1.0


def test_accumulate_float64_drops_the_sequential_term(tmp_path):
    n = 4096
    produced = seq32_mean([f32(-0.1)] * n)
    policy = msgspec.convert({"producer_precision": {"accumulate": "float64"},
                              "tolerances": {"loss.policy": {"atol": 0.0, "rtol": 0.0}}}, ComparisonPolicy)
    report = replay(loss_bundle(tmp_path / "b", n, produced, policy=policy))
    assert report.first_divergent_stage == "loss.policy"  # a float64-accumulating producer is not that far off


# ----------------------------------------------------------------------------------------- flags and policy


def test_tolerance_policy_bundle_uses_a_loose_value_and_warns_default_caps_it(tmp_path, cli):
    loose = ComparisonPolicy(tolerances={"reward.post_process": Tolerance(atol=1e308, rtol=0.0)})
    wrong = [-5.0, 5.0]
    path = bundle(tmp_path / "b", groups=[0, 0], lengths=[1, 1], raw=[0.0, 2.0], stages=ROLLOUT_STAGES, policy=loose,
                  expected={"reward.raw": {"raw_rewards": [0.0, 2.0]}, "reward.post_process": {"rewards": wrong}},
                  payloads={"kl": [0.0, 0.0], "advantages": wrong})
    code, out, err = cli("replay", path)
    assert (code, err) == (0, "")
    where = f"{path / 'manifest.json'}: $.comparison_policy.tolerances.reward.post_process.atol=1e+308"
    # the warning under the header, before the stages
    assert out.splitlines()[1] == (f"warning: {where} is looser than the default 1e-06: used as declared "
                                   "(--tolerance-policy default caps it)")
    code, out, err = cli("replay", path, "--tolerance-policy", "default")
    assert (code, err) == (1, "")
    assert "          reward s-0: expected=-5.0 actual=-1.0 abs_err=4.0" in out.splitlines()
    assert out.splitlines()[1] == f"warning: {where} is looser than the default 1e-06: capped at 1e-06 (--tolerance-policy default)"
    assert bundle_tolerance(loose, "reward.post_process", "reward", "default") == (1e-6, 0.0)
    assert bundle_tolerance(loose, "reward.post_process", "reward", "bundle") == (1e308, 0.0)
    # validate names it too, as replay words it
    code, out, err = cli("validate", path)
    assert (code, err) == (0, "")
    assert out.splitlines()[-1] == (f"warning: {where} is looser than the default 1e-06: used as declared "
                                    "(--tolerance-policy default caps it)")


def test_exact_compares_bitwise_with_the_float32_kernels(tmp_path, cli):
    # a float64 producer's loss, rounded once: within the error model, not bit for bit the float32 kernels'
    n = 64
    path = loss_bundle(tmp_path / "b", n, -0.1)
    code, out, _ = cli("replay", path)
    assert code == 0
    code, out, _ = cli("replay", path, "--exact", "--format", "json")
    doc = json.loads(out)
    assert (code, doc["exact"], doc["first_divergent_stage"]) == (1, True, "loss.policy")
    d = doc["first_divergence"]
    assert (d["field"], d["tolerance"], d["expected"]) == ("pg_loss", 0.0, -0.1)
    # the demo bundles (written with the same float32 kernels) are bit for bit
    demo = write_pr65(tmp_path / "pr65", buggy=False)
    assert cli("replay", demo, "--exact")[0] == 0


def test_verbose_shows_tolerance_and_noise_and_the_default_text_does_not(tmp_path, cli):
    path = write_pr65(tmp_path / "b", buggy=True)
    code, out, _ = cli("replay", path, "--verbose")
    lines = out.splitlines()
    tol = 1e-6 + 1e-5 * 5.5 + 8 * U32 * (1 + math.sqrt(2) * 3)
    assert code == 1
    worst = max(4.5 / (1e-6 + 1e-5 * abs(e) + 8 * U32 * (abs(r) + math.sqrt(2) * m))
                for e, r, m in ((-5.5, 1, 3), (-3.5, 3, 3), (3.5, 10, 12), (5.5, 12, 12)))
    assert lines[3] == ("[   fail] reward.post_process — normalized reward mismatch in 4 sample(s) "
                        f"(max {worst:.1e}× noise)".replace("e+0", "e"))
    assert lines[4] == (f"          reward s-0: expected=-5.5 actual=-1.0 abs_err=4.5 tol={fmt_value(tol)} "
                        f"({4.5 / tol:.1e}× noise)".replace("e+0", "e"))
    assert lines[1].startswith("[   pass] sample — 4 sample(s), 12 token(s) consistent")
    plain = cli("replay", path)[1].splitlines()
    assert all("noise" not in line and "tol=" not in line for line in plain)


def test_json_carries_tolerance_noise_ratio_and_max_noise_ratio(tmp_path, cli):
    code, out, _ = cli("replay", write_pr65(tmp_path / "b", buggy=True), "--format", "json")
    doc = json.loads(out)
    first = doc["first_divergence"]
    assert first["tolerance"] == pytest.approx(1e-6 + 1e-5 * 5.5 + 8 * U32 * (1 + math.sqrt(2) * 3), rel=1e-12)
    assert first["noise_ratio"] == pytest.approx(4.5 / first["tolerance"], rel=1e-12)
    post = doc["stages"][2]
    assert post["max_noise_ratio"] == max(d["noise_ratio"] for d in post["divergences"])
    assert list(doc)[:5] == ["bundle_id", "passed", "first_divergent_stage", "first_divergence", "stages"]
    assert (doc["mode"], doc["exact"], doc["tolerance_policy"], doc["hazards"]) == ("per_stage", False, "bundle", [])


@pytest.mark.parametrize("policy,message", [
    ({"producer_precision": {"compute": "int8"}},
     "$.comparison_policy.producer_precision.compute: Invalid enum value 'int8'"),
    ({"producer_precision": {"accumulate": "bfloat16"}},
     "$.comparison_policy.producer_precision.accumulate: Invalid enum value 'bfloat16'"),
    ({"tolerances": {"loss.policy": {"atol": -1e-6, "rtol": 0.0}}},
     "$.comparison_policy.tolerances[...].atol: expected `float` >= 0.0"),
])
def test_nonsense_precision_or_tolerance_is_a_one_line_schema_error(tmp_path, cli, bundle_tools, policy, message):
    path = write_pr65(tmp_path / "b", buggy=False)
    bundle_tools.edit_json(path, "manifest.json", lambda doc: doc["comparison_policy"].update(policy))
    code, out, err = cli("replay", path)
    assert code == 3 and out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and "manifest.json" in err and message.lower() in err.lower()


def test_hazards_never_fail_a_stage_and_the_pr65_report_has_none(tmp_path):
    report = replay(write_pr65(tmp_path / "b", buggy=True))
    assert report.hazards == []
    path = bundle(tmp_path / "h", groups=[0, 0, 1], lengths=[2, 2, 2], raw=[1.0, 1.0, 4.0], stages=ROLLOUT_STAGES,
                  n_samples_per_prompt=1,
                  expected={"reward.raw": {"raw_rewards": [1.0, 1.0, 4.0]},
                            "reward.post_process": {"rewards": [0.0, 0.0, 0.0]}},
                  payloads={"kl": [0.0] * 6, "advantages": [0.0] * 6})
    report = replay(path)
    assert report.stage("reward.post_process").reason == "group g-0 has 2 sample(s), n_samples_per_prompt=1"
    kinds = [(h.kind, h.group_index) for h in report.hazards]
    assert kinds == [("zero_advantage_group", 0), ("singleton_group", 1)]


def test_bad_judging_flags_are_usage_errors(tmp_path, capsys):
    from replay_lib.cli import main

    path = write_pr65(tmp_path / "b", buggy=False)
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(path), "--tolerance-policy", "strict"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --tolerance-policy: invalid choice: 'strict'" in err


def test_replay_tui_check_takes_the_same_judging_flags(tmp_path, capsys):
    from replay_tui.__main__ import main

    path = write_pr65(tmp_path / "b", buggy=True)
    assert main([str(path), "--check", "--chain", "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["mode"] == "chained" and doc["stages"][4]["status"] == "fail"
    assert main([str(path), "--check", "--exact", "--verbose"]) == 1
    # bitwise: no tolerance, every difference infinitely beyond it
    assert capsys.readouterr().out.splitlines()[4] == \
        "          reward s-0: expected=-5.5 actual=-1.0 abs_err=4.5 tol=0.0 (inf× noise)"


def test_replay_help_documents_the_judging_flags_and_the_rule():
    import subprocess

    proc = subprocess.run(["trajectory-replay", "replay", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == ""
    text = " ".join(proc.stdout.split())
    for words in ("--chain", "--exact", "--tolerance-policy {bundle,default}", "--verbose",
                  "|actual - expected| > atol + rtol*|expected| + the producer's rounding bound",
                  "a bundle may only tighten them, a looser value is capped at the default",
                  "Hazards", "never fail one"):
        assert words in text, words


def test_a_float32_producer_on_close_rewards_comes_within_reach_of_the_reward_bound():
    # reward-model scores 3 ± 1e-4 (the ill-conditioned case): the float32 producer's error is a sizable
    # fraction of the bound, never beyond it
    import random

    worst = 0.0
    for seed in range(50):
        rng = random.Random(seed)
        raw = [3.0 + 1e-4 * rng.gauss(0, 1) for _ in range(8)]
        r = torch.tensor(raw, dtype=torch.float64)
        truth = (r - r.mean()) / (r.std() + EPS)
        bound = reward_bound(r, group_stats(r, torch.zeros(8, dtype=torch.int64)), truth, True, EPS)
        written = torch.tensor(float32_group_normalize(raw, std=True), dtype=torch.float64)
        worst = max(worst, float(((written - truth).abs() / bound).max()))
    assert 0.02 < worst <= 1.0


def test_advantage_bound_admits_the_payloads_rounding_of_the_recorded_reward(tmp_path):
    # rewards recorded in float64 (not float32 values), advantages as their float32 rounding: off by ≤ u·|A|,
    # within 2u·|A|; a bf16 payload of the same values is within its own 2·2⁻⁸·|A|
    rewards = [-1.2345678901234, 0.3333333333333, 0.9012345678901]
    lengths = [2, 1, 3]
    adv = [r for r, n in zip(rewards, lengths) for _ in range(n)]
    stages = [s for s in ROLLOUT_STAGES if s.value != "reward.post_process"]  # the recorded rewards as given
    exact_bundle_part = ComparisonPolicy(tolerances={"advantage.estimate": Tolerance(atol=0.0, rtol=0.0)})
    for dtype in (torch.float32, torch.bfloat16):
        path = bundle(tmp_path / str(dtype), groups=[0, 1, 2], lengths=lengths, raw=[0.0] * 3, stages=stages,
                      policy=exact_bundle_part,
                      expected={"reward.raw": {"raw_rewards": [0.0] * 3}, "reward.post_process": {"rewards": rewards}},
                      payloads={"kl": [0.0] * 6, "advantages": torch.tensor(adv, dtype=torch.float64).to(dtype)})
        report = replay(path)
        est = report.stage("advantage.estimate")
        assert est.status == "pass", report_to_text(report)
        assert 0.1 < est.max_noise_ratio <= 0.5  # one rounding of at most u·|A| against 2u·|A|
