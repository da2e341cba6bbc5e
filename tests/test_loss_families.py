"""Policy-loss families (``RecomputeConfig.policy_loss``, ``kernels/families``) against an independent producer
(``producers.loss_families``, written from verl 0.9.1's and TRL 1.16's code): a legitimate float32 or bf16
producer of each family replays clean; each family's typical bug diverges at loss.policy; the kernels against
values derived by hand; an unknown family or parameter refused by name (exit 4)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from producers import Size
from producers.loss_families import CONFIGS, FAMILY_BUGS, produce_family_bundle

SIZE = Size(samples=16, tokens=256, group_size=4)


def _loss(report):
    return next(s for s in report["stages"] if s["stage"] == "loss.policy")


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_a_legitimate_producer_of_each_family_replays_clean(tmp_path, cli, precision, config):
    path = produce_family_bundle(tmp_path / "b", 0, SIZE, config, precision=precision)
    code, out, err = cli("replay", path, "--format", "json")
    report = json.loads(out)
    loss = _loss(report)
    assert (code, err, loss["status"]) == (0, "", "pass"), loss
    assert loss["max_noise_ratio"] < 1.0


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_each_family_bug_is_the_first_divergence(tmp_path, cli, config):
    bug = FAMILY_BUGS[config.loss]
    path = produce_family_bundle(tmp_path / "b", 3, SIZE, config, bug=bug)
    code, out, err = cli("replay", path, "--format", "json")
    report = json.loads(out)
    assert code == 1, _loss(report)
    assert report["first_divergent_stage"] == "loss.policy"
    assert report["first_divergence"]["field"] in {"pg_loss", "loss"}, report["first_divergence"]
    # explain/loss.py names the family's typical bug
    assert report["explanations"][0]["hypothesis"] == f"loss.{bug}", report["explanations"]
    assert report["explanations"][0]["matched"] == report["explanations"][0]["of"]


# ------------------------------------------------------------------------------------ the kernels by hand

def _terms(name, logp, old, adv, params=(), **knobs):
    from replay_lib.kernels.loss import LossKnobs, policy_token_terms, sample_log_terms

    k = LossKnobs(policy_loss=name, policy_loss_params=tuple(sorted(params)), **knobs)
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    logp, old, adv = t(logp), t(old), t(adv)
    lengths = torch.tensor([logp.numel()])
    st = sample_log_terms(logp, old, None, torch.ones_like(logp), lengths, k, torch.float64, advantages=adv)
    return policy_token_terms(logp, old, adv, k, seg=torch.zeros(logp.numel(), dtype=torch.long), sample_terms=st,
                              dtype=torch.float64)


LN = math.log


def test_cispo_by_hand_relative_and_absolute_caps():
    # r = 2, 0.5, 1.1 (ε_low 0.2, ε_high 0.28): clip(r) = 1.28, 0.8, 1.1; pg = −clip(r)·A·logp
    logp = [LN(0.2), LN(0.05), LN(0.11)]
    old = [LN(0.1), LN(0.1), LN(0.1)]
    t = _terms("cispo", logp, old, [1.0, -2.0, 0.5], eps_clip=0.2, eps_clip_high=0.28)
    assert t["pg"].tolist() == pytest.approx([-1.28 * LN(0.2), 0.8 * 2 * LN(0.05), -1.1 * 0.5 * LN(0.11)], rel=1e-12)
    assert t["clip"].tolist() == [1.0, 1.0, 0.0]
    # TRL's absolute cap ε_high = 1.5: min(r, 1.5) = 1.5, 0.5, 1.1; clipped only where r > 1.5 and A > 0
    t = _terms("cispo", logp, old, [1.0, -2.0, 0.5], params=[("cap", "absolute")], eps_clip=0.2, eps_clip_high=1.5)
    assert t["pg"].tolist() == pytest.approx([-1.5 * LN(0.2), 0.5 * 2 * LN(0.05), -1.1 * 0.5 * LN(0.11)], rel=1e-12)
    assert t["clip"].tolist() == [1.0, 0.0, 0.0]


def test_sapo_by_hand_tau_by_the_sign_of_a():
    # r = 2 with A = 1 (τ_pos = 1): σ(1)·4; r = 0.5 with A = −1 (τ_neg = 2): σ(2·(−0.5))·4/2 = σ(−1)·2
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    t = _terms("sapo", [LN(0.2), LN(0.05)], [LN(0.1), LN(0.1)], [1.0, -1.0], params=[("tau_pos", 1.0),
                                                                                       ("tau_neg", 2.0)])
    assert t["pg"].tolist() == pytest.approx([-sig(1.0) * 4, sig(-1.0) * 2], rel=1e-12)
    assert t["clip"].tolist() == [0.0, 0.0]


def test_gmpo_by_hand_geometric_mean_of_sign_clipped_ratios():
    # A = 1 on both tokens, Δ = ln 2 and ln 0.5 (ε 0.2/0.28): min(Δ, 0.28) = 0.28 and ln 0.5 (the low side unclipped
    # where A > 0); R = exp((0.28 + ln 0.5)/2); the sample's loss −1·R, spread over its 2 tokens
    t = _terms("geo_mean", [LN(0.2), LN(0.05)], [LN(0.1), LN(0.1)], [1.0, 1.0], eps_clip=0.2, eps_clip_high=0.28)
    r, a = math.exp((0.28 + LN(0.5)) / (2 + 1e-8)), 2 / (2 + 1e-8)  # verl's n + 1e-8 in both means
    assert t["pg"].tolist() == pytest.approx([-a * r / 2, -a * r / 2], rel=1e-12)
    assert t["clip"].tolist() == [1.0, 1.0] and t["clip_lower"].tolist() == [0.0, 0.0]
    # A = −1: max(Δ, −0.2) = ln 2 and −0.2
    t = _terms("geo_mean", [LN(0.2), LN(0.05)], [LN(0.1), LN(0.1)], [-1.0, -1.0], eps_clip=0.2, eps_clip_high=0.28)
    r = math.exp((LN(2.0) - 0.2) / (2 + 1e-8))
    assert t["pg"].tolist() == pytest.approx([a * r / 2, a * r / 2], rel=1e-12)
    assert t["clip_lower"].tolist() == [1.0, 1.0]


def test_dppo_tv_and_kl_by_hand_masks():
    # p − p_old = 0.1 and −0.04 (ε 0.05): A > 0 masks the first (0.1 > 0.05), A < 0 keeps the second (−0.04 ≥ −0.05)
    t = _terms("dppo_tv", [LN(0.2), LN(0.06)], [LN(0.1), LN(0.1)], [1.0, -1.0], params=[("trunc", 1.5)],
               eps_clip=0.05, eps_clip_high=0.05)
    assert t["clip"].tolist() == [1.0, 0.0]
    assert t["pg"].tolist() == pytest.approx([0.0, -(-1.0) * 0.6 * LN(0.06)], rel=1e-12)
    # binary KL of p = 0.2 against p_old = 0.1: 0.1·ln(0.5) + 0.9·ln((0.9 + 1e-8)/(0.8 + 1e-8)) ≈ 0.0367
    d = 0.1 * LN(0.5) + 0.9 * LN((0.9 + 1e-8) / (0.8 + 1e-8))
    for eps, kept in ((0.03, 0.0), (0.04, 1.0)):
        t = _terms("dppo_kl", [LN(0.2)], [LN(0.1)], [1.0], params=[("trunc", 1.5)], eps_clip=eps, eps_clip_high=eps)
        assert d == pytest.approx(0.03669, abs=1e-5) and t["clip"].tolist() == [1.0 - kept]
        assert t["pg"].tolist() == pytest.approx([-1.5 * LN(0.2) * kept], rel=1e-12)  # min(r = 2, c = 1.5)


def test_dro_and_gpg_by_hand():
    t = _terms("dro", [LN(0.2)], [LN(0.1)], [2.0], params=[("beta", 0.5)])
    assert t["pg"].tolist() == pytest.approx([-(LN(0.2) * 2.0 - 0.25 * LN(2.0) ** 2)], rel=1e-12)
    t = _terms("gpg", [LN(0.2)], [LN(0.1)], [2.0])
    assert t["pg"].tolist() == pytest.approx([-2.0 * LN(0.2)], rel=1e-12)


# ------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("policy_loss, params, message", [
    ("luspo_typo", {}, "index.json: $.config.policy_loss='luspo_typo': not a known policy-loss family (known: ppo, cispo, "
                      "clip_cov, cross_entropy, dppo_kl, dppo_mu, dppo_tv, dro, geo_mean, gpg, icepop, importance_sampling, ipo, kl_cov, "
                      "rollout_is, sapo, vespo)"),
    ("cispo", {"cap": "both"}, "$.config.policy_loss_params.cap='both': expected one of relative, absolute for "
                               "policy_loss 'cispo' (stage loss.policy)"),
    ("sapo", {"tau": 1.0}, "$.config.policy_loss_params.tau=1.0: not a parameter of policy_loss 'sapo' (its "
                           "parameters: tau_neg, tau_pos)"),
    ("dro", {}, "$.config.policy_loss_params.beta=None: policy_loss 'dro' needs it (a number > 0)"),
    ("dro", {"beta": -1.0}, "$.config.policy_loss_params.beta=-1.0: expected a finite number > 0 for policy_loss 'dro'"),
])
def test_an_unknown_family_or_parameter_is_refused_by_name(tmp_path, cli, policy_loss, params, message):
    from producers.loss_families import FamilyConfig

    path = produce_family_bundle(tmp_path / "b", 0, Size(samples=4, tokens=8, group_size=2),
                                 FamilyConfig("gpg", micro_batches=2), policy_loss=policy_loss, params=params)
    code, out, err = cli("replay", path)
    assert (code, out) == (4, ""), err
    assert message in err and err.count("\n") == 1, err


def test_a_dppo_mask_decided_within_rounding_of_its_edge_is_a_hazard_not_a_divergence(tmp_path, cli):
    """p − p_old of the first token lies within float32 rounding of ε_high = 0.05: a float32 producer keeps it
    (0.04999999), the float64 replay drops it (0.05000000). Its whole term is admitted in pg_loss and its decision
    in pg_clipfrac, with a hazard naming the sample."""
    from replay_lib.bundle import BundleWriter
    from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, ComparisonPolicy, Identity,
                                          Manifest, RecomputeConfig, SampleRecord, StageId, stage_contracts)
    from replay_lib.demo import producer

    logp = torch.tensor([math.log(0.15), math.log(0.3)], dtype=torch.float32)
    old = torch.tensor([math.log(0.1), math.log(0.3)], dtype=torch.float32)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float32)
    assert bool((logp.exp() - old.exp())[0] <= 0.05) and not bool((logp.double().exp() - old.double().exp())[0] <= 0.05)
    ratio = (logp - old).exp()
    pg = -adv * ratio.clamp(max=20.0) * logp  # both kept by the float32 producer
    policy = {"loss": float(pg.sum() / 2), "pg_loss": float(pg.sum() / 2), "pg_clipfrac": 0.0, "ppo_kl":
              float(-(logp - old).sum() / 2), "pg_clipfrac_lower": 0.0, "entropy_loss": 0.0}
    cfg = RecomputeConfig(eps_clip=0.05, eps_clip_high=0.05, loss_agg_mode="token_mean", loss_token_count=2,
                          policy_loss="dppo_tv", policy_loss_params={"trunc": 20.0}, log_ratio_clamp=20.0)
    index = BundleIndex(bundle_id="edge", identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0)),
                        samples=[SampleRecord(sample_id="s-0", group_index=0, response_length=2, total_length=6,
                                              loss_mask=[1, 1], raw_reward=0.0, reward=0.0)], config=cfg)
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id="edge", producer=producer(),
                        stage_contracts=stage_contracts([StageId.SAMPLE, StageId.LOSS_POLICY]), payloads={},
                        comparison_policy=ComparisonPolicy(), redaction={})
    writer = BundleWriter(tmp_path / "b", manifest, index, {"loss.policy": policy})
    for name, values in (("log_probs", logp), ("old_log_probs", old), ("advantages", adv)):
        writer.write_payload(name, values)
    path = writer.finalize(ranks=[0])
    code, out, err = cli("replay", path, "--format", "json")
    report = json.loads(out)
    loss = _loss(report)
    assert (code, err, loss["status"]) == (0, "", "pass"), loss
    kinds = sorted(h["kind"] for h in report["hazards"] if h["stage"] == "loss.policy")
    assert kinds == ["clip_boundary", "mask_boundary"], report["hazards"]


# ------------------------------------------------------------------------------------ the framework mappings


def test_verl_loss_modes_map_to_their_families():
    from replay_lib.frameworks import from_verl

    def cfg(actor):
        return from_verl({"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {
            "rollout": {"n": 4}, "actor": {"ppo_mini_batch_size": 2, **actor}}})

    c = cfg({"policy_loss": {"loss_mode": "cispo"}, "clip_ratio_high": 0.28})
    assert (c.policy_loss, c.policy_loss_params, c.eps_clip, c.eps_clip_high, c.eps_clip_c, c.log_ratio_clamp) == (
        "cispo", {}, 0.2, 0.28, None, 20.0)
    c = cfg({"policy_loss": {"loss_mode": "sapo"}, "tau_pos": 2.0})
    assert (c.policy_loss, c.policy_loss_params, c.loss_agg_mode, c.entropy_agg_mode, c.loss_seq_count) == (
        "sapo", {"tau_pos": 2.0, "tau_neg": 1.05}, "seq_mean_token_mean", "token_mean", 8)
    c = cfg({"policy_loss": {"loss_mode": "geo_mean"}, "ppo_micro_batch_size_per_gpu": 4})
    assert (c.policy_loss, c.loss_agg_mode, c.loss_seq_count, c.log_ratio_clamp) == (
        "geo_mean", "seq_mean_token_sum", 4, None)
    c = cfg({"policy_loss": {"loss_mode": "dppo_kl"}, "clip_ratio_c": 20.0})
    assert (c.policy_loss, c.policy_loss_params, c.eps_clip_c) == ("dppo_kl", {"trunc": 20.0}, None)
    c = cfg({"policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": 0.01}})
    assert (c.policy_loss, c.policy_loss_params, c.log_ratio_clamp) == (
        "kl_cov", {"kl_cov_ratio": 0.01, "ppo_kl_coef": 0.1}, None)
    c = cfg({"policy_loss": {"loss_mode": "dro", "dro_beta": 0.1}})
    assert (c.policy_loss, c.policy_loss_params, c.log_ratio_clamp) == ("dro", {"beta": 0.1}, None)
    assert cfg({"policy_loss": {"loss_mode": "gpg"}}).policy_loss == "gpg"
    assert cfg({}).policy_loss == "ppo" and cfg({}).policy_loss_params == {}


def test_trl_and_skyrl_cispo_differ_in_the_cap_and_their_defaults():
    from replay_lib.frameworks import from_skyrl, from_trl

    trl = from_trl({"loss_type": "cispo", "epsilon_high": 5.0, "num_generations": 4,
                    "per_device_train_batch_size": 4})
    assert (trl.policy_loss, trl.policy_loss_params, trl.eps_clip_high, trl.loss_agg_mode, trl.eps_clip_c) == (
        "cispo", {"cap": "absolute"}, 5.0, "token_mean", None)
    sapo = from_trl({"loss_type": "sapo", "num_generations": 4, "per_device_train_batch_size": 4})
    assert (sapo.policy_loss, sapo.policy_loss_params, sapo.loss_agg_mode) == (
        "sapo", {"tau_pos": 1.0, "tau_neg": 1.05}, "seq_mean_token_mean")
    sky = from_skyrl({"trainer": {"algorithm": {"policy_loss_type": "cispo"}}})
    assert (sky.policy_loss, sky.policy_loss_params, sky.eps_clip, sky.eps_clip_high) == (
        "cispo", {"anchor": "old"}, 1.0, 4.0)  # [0, 5]
    sky = from_skyrl({"trainer": {"algorithm": {"policy_loss_type": "cispo", "cispo": {"cispo_anchor": "rollout"}}}})
    assert sky.policy_loss_params == {"anchor": "rollout"}
    sky = from_skyrl({"trainer": {"algorithm": {"policy_loss_type": "sapo", "sapo": {"tau_neg": 2.0}}}})
    assert (sky.policy_loss, sky.policy_loss_params) == ("sapo", {"tau_pos": 1.0, "tau_neg": 2.0})


# ------------------------------------------------------------------------------------ the why strip


@pytest.mark.parametrize("loss, column", [("sapo", "gate f(r)"), ("cispo", "sg(clip(r))"), ("dppo_tv", "valid"),
                                          ("geo_mean", "sample loss −Ā·R")])
def test_the_why_strip_shows_the_family_formula_and_its_token_value(tmp_path, loss, column):
    from producers.loss_families import FamilyConfig, family_step  # noqa: F401
    from replay_lib.bundle import open_bundle
    from replay_lib.explain.inputs import element_inputs
    from replay_lib.kernels.families import family
    from replay_lib.kernels.loss import LossKnobs, policy_token_terms, sample_log_terms
    from replay_lib.judge.report import fmt_value
    from replay_lib.stages import StageContext

    config = next(c for c in CONFIGS if c.loss == loss)
    path = produce_family_bundle(tmp_path / "b", 0, Size(samples=4, tokens=8, group_size=2), replace(
        config, micro_batches=2))
    shard = open_bundle(path).shards[0]
    ctx = StageContext(reader=shard, indices=list(range(4)), partial=False)
    got = element_inputs(ctx, "pg_losses", 1, 2)
    # the token's pg from the family's kernel over its sample (offset 2 of sample 1)
    lo, n = int(ctx.offsets[1]), int(ctx.lengths[1])
    logp, old = shard.payload("log_probs")[lo:lo + n], shard.payload("old_log_probs")[lo:lo + n]
    adv = shard.payload("advantages")[lo:lo + n].double()
    knobs = LossKnobs.of(ctx.config, ctx.samples)
    mask = torch.tensor(shard.sample_mask(1))
    st = sample_log_terms(logp, old, None, mask, torch.tensor([n]), knobs, torch.float64, advantages=adv)
    pg = policy_token_terms(logp, old, adv, knobs, seg=torch.zeros(n, dtype=torch.long), sample_terms=st,
                            dtype=torch.float64)["pg"][2]
    assert got.formula == f"{family(loss).formula}; pg = {fmt_value(float(pg))}"
    assert column in dict(got.items) and dict(got.items)["A"] == fmt_value(float(adv[2]))
    assert got.note.startswith(f"policy_loss {loss}: adds pg·mask = ")


# ------------------------------------------------------------------------------------ the example trainer

# thresholds tight enough for the small policy drift of two steps on one rollout to reach them
TRAINER_FAMILIES = [("cispo", ["--loss-param", "cap=absolute", "--eps-clip-high", "0.9"], "cispo_cap"),
                    ("sapo", [], "sapo_tau"), ("geo_mean", [], "geo_mean"),
                    ("dppo_tv", ["--loss-param", "trunc=1.5", "--eps-clip", "0.0005", "--eps-clip-high", "0.0005"],
                     "dppo_mask"),
                    ("dppo_kl", ["--eps-clip", "1e-7", "--eps-clip-high", "1e-7"], "dppo_mask"),
                    ("dro", [], "dro_beta"), ("gpg", [], "gpg_old_logp")]


@pytest.mark.parametrize("loss, flags, bug", TRAINER_FAMILIES, ids=[f[0] for f in TRAINER_FAMILIES])
def test_the_example_trainer_with_each_family_replays_clean_and_its_bug_fails_loss_policy(tmp_path, loss, flags,
                                                                                        bug):
    from test_loss_trainer import STEPS, first_divergences, train

    base = ["--loss-agg", "token_mean", "--loss", loss, *flags]
    for run in ("clean", "bug"):
        (tmp_path / run).mkdir()
    clean = train(tmp_path / "clean", *base)
    assert first_divergences(clean) == dict.fromkeys(STEPS), loss
    bad = train(tmp_path / "bug", *base, f"--{bug.replace('_', '-')}-bug")
    got = first_divergences(bad)
    # the first step trains on-policy (ratio ≡ 1): a bug of the ratio's treatment shows from the second step on
    stages = {name: d[0] for name, d in got.items() if d is not None}
    assert set(stages.values()) == {"loss.policy"}, got


@pytest.mark.parametrize("command", ["validate", "replay"])
def test_a_parameter_that_is_no_scalar_is_a_schema_error_in_one_line(tmp_path, cli, bundle_tools, command):
    from producers.loss_families import FamilyConfig

    path = produce_family_bundle(tmp_path / "b", 0, Size(samples=4, tokens=8, group_size=2),
                                 FamilyConfig("dro", micro_batches=2, params={"beta": 0.5}))
    bundle_tools.edit_json(path, "index.json", lambda d: d["config"].update(policy_loss_params={"beta": [1, 2]}))
    code, out, err = cli(command, path)
    assert (code, out) == (3, ""), err
    assert err.endswith("index.json: $.config.policy_loss_params[...]: expected `bool | int | float | str | null`, "
                        "got `array`\n") and err.count("\n") == 1, err


def test_nemo_rl_use_cispo_is_the_relative_cap_on_its_clip_bounds():
    from replay_lib.errors import UnsupportedFrameworkConfig
    from replay_lib.frameworks import from_nemo_rl

    cfg = from_nemo_rl({"loss_fn": {"use_cispo": True, "ratio_clip_min": 0.2, "ratio_clip_max": 0.28}})
    assert (cfg.policy_loss, cfg.policy_loss_params, cfg.eps_clip, cfg.eps_clip_high, cfg.log_ratio_clamp) == (
        "cispo", {}, 0.2, 0.28, None)
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_nemo_rl({"loss_fn": {"use_cispo": True, "ratio_clip_c": 3.0}})
    assert str(err.value).endswith("loss_fn.ratio_clip_c=3.0: NeMo-RL rejects dual-clip with use_cispo")


def test_kl_cov_without_the_micro_batch_partition_names_what_to_record(tmp_path, cli, bundle_tools):
    from producers.loss_families import FamilyConfig

    path = produce_family_bundle(tmp_path / "b", 0, Size(samples=4, tokens=8, group_size=2),
                                 FamilyConfig("gpg", micro_batches=2), policy_loss="kl_cov", params={})
    bundle_tools.edit_json(path, "index.json", lambda d: [s.pop("micro_batch_id") for s in d["samples"]])
    code, out, err = cli("replay", path)
    assert code == 3, out + err
    assert "index.json $.samples[*].micro_batch_id (policy_loss='kl_cov' takes its top-k tokens within each of " \
           "the producer's micro-batches)" in out + err, out + err


def test_clip_cov_by_hand_the_recorded_draw_within_verls_rule():
    """Two samples in one micro-batch: Ā = 0, mean logp = ln(0.004)/4; cov = A·(logp − mean logp) = 0.687 (token
    0), token 1 PPO-clipped (r = 2, A > 0), 0.922, −0.464. Bounds (0.5, 5): tokens 0 and 2 may be drawn. The
    recorded draw [1, 1, 0, 1] zeroes token 0 only (token 1 is clipped, token 3 below the bound)."""
    from replay_lib.kernels.loss import LossKnobs, policy_token_terms, sample_log_terms

    logp = torch.tensor([LN(0.5), LN(0.2), LN(0.1), LN(0.4)], dtype=torch.float64)
    old = torch.tensor([LN(0.5), LN(0.1), LN(0.1), LN(0.4)], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(4, dtype=torch.float64)
    lengths = torch.tensor([2, 2])
    seg = torch.tensor([0, 0, 1, 1])
    k = LossKnobs(policy_loss="clip_cov", micro_batch=(0, 0),
                  policy_loss_params=(("clip_cov_lb", 0.5), ("clip_cov_ub", 5.0)))
    tokens = {"clip_cov_mask": torch.tensor([1, 1, 0, 1], dtype=torch.int8)}
    st = sample_log_terms(logp, old, None, mask, lengths, k, torch.float64, advantages=adv, family_tokens=tokens)
    mean_l = (LN(0.5) + LN(0.2) + LN(0.1) + LN(0.4)) / 4
    assert st["cov_mean_logp"].tolist() == pytest.approx([mean_l, mean_l], rel=1e-12)
    t = policy_token_terms(logp, old, adv, k, seg=seg, sample_terms=st, dtype=torch.float64, family_tokens=tokens)
    # pg = max(−A·r, −A·clamp(r, 0.8, 1.2))·(1 − selected): 0, −1.2, 1, 1
    assert t["pg"].tolist() == pytest.approx([0.0, -1.2, 1.0, 1.0], rel=1e-12)
    assert t["clip"].tolist() == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="payload 'clip_cov_mask' is required for policy_loss='clip_cov'"):
        policy_token_terms(logp, old, adv, k, seg=seg, sample_terms=st, dtype=torch.float64)


@pytest.mark.parametrize("partition", [(0, 0, 1, 1, 2), (1, 0, 2, 0, 1)], ids=["in-order", "interleaved"])
def test_cov_families_take_each_micro_batchs_own_tokens(partition):
    """KL-Cov's and Clip-Cov's per-micro-batch means and KL-Cov's top-k threshold, against each micro-batch's
    tokens picked by a boolean mask (micro-batches in sample order, or interleaved)."""
    from replay_lib.kernels.loss import LossKnobs, sample_log_terms

    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([3, 5, 2, 4, 6])
    total = int(lengths.sum())
    logp = -torch.rand(total, generator=g, dtype=torch.float64) * 2
    adv = torch.randn(5, generator=g, dtype=torch.float64).repeat_interleave(lengths)
    mask = (torch.rand(total, generator=g) > 0.2).to(torch.float64)
    seg = torch.repeat_interleave(torch.arange(5), lengths)
    mb = torch.tensor(partition)[seg]
    k = LossKnobs(policy_loss="kl_cov", micro_batch=partition, policy_loss_params=(("kl_cov_ratio", 0.3),))
    st = sample_log_terms(logp, logp, None, mask, lengths, k, torch.float64, advantages=adv)
    for i, b in enumerate(partition):
        at = (mb == b) & (mask > 0)
        a, lp = adv[at], logp[at]
        assert float(st["klcov_mean_adv"][i]) == pytest.approx(float(a.mean()), rel=1e-14)
        cov = torch.sort((a - a.mean()) * (lp - lp.mean()), descending=True).values
        top = max(1, int(len(cov) * 0.3))
        assert float(st["klcov_threshold"][i]) == pytest.approx(float((cov[top - 1] + cov[top]) / 2), rel=1e-12)
    k = LossKnobs(policy_loss="clip_cov", micro_batch=partition)
    st = sample_log_terms(logp, logp, None, mask, lengths, k, torch.float64, advantages=adv,
                          family_tokens={"clip_cov_mask": torch.zeros(total, dtype=torch.int8)})
    for i, b in enumerate(partition):
        at = (mb == b) & (mask > 0)
        assert float(st["cov_mean_logp"][i]) == pytest.approx(float(logp[at].mean()), rel=1e-14)
