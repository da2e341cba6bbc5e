"""Policy-loss families and loss-side masks of issue 34 (part 2): VESPO, OPSM, TRL's entropy mask, on-policy
distillation's loss term; the family mechanism's refusals. Hand-derived values, TRL 1.16's own functions as the
producer where they run on CPU (``get_gamma_weights``, ``get_off_policy_mask``, ``get_high_entropy_mask``), a
reference of slime's ``compute_opsm_mask`` (``slime/utils/ppo_utils.py:54-92`` @ 624b824a898a), and replays of
real bundles (writer, reader, runner, CLI)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types

import pytest

import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, ComparisonPolicy, Identity, Manifest,
                                      RecomputeConfig, SampleRecord, StageId, stage_contracts)
from replay_lib.demo import producer
from replay_lib.kernels.loss import (LossKnobs, opd_advantages, opd_estimate, policy_fields_for, policy_loss_fields,
                                     policy_token_terms,
                                     sample_log_terms)

LENGTHS = [2, 3]
LOGP = [-0.1, 0.0, -0.5, -0.2, -1.0]
OLD = [0.0, 0.0, -0.4, -0.3, -1.5]
ROLLOUT = [0.05, 0.0, -0.45, -0.3, -1.2]
ADV = [1.0, 1.0, -0.5, -0.5, -0.5]
ENT = [0.3, 1.2, 0.7, 2.0, 0.1]
TEACHER = [-0.3, -0.2, -0.1, -0.9, -0.6]


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _fields(cfg: RecomputeConfig, dtype=torch.float64, micro_batch=None, **payloads) -> dict[str, float]:
    knobs = LossKnobs.of(cfg)
    if micro_batch is not None:
        knobs = dataclasses.replace(knobs, micro_batch=micro_batch)
    out = policy_loss_fields(_t(LOGP).to(dtype), _t(OLD).to(dtype), _t(ADV).to(dtype), payloads.pop("entropy", None),
                             torch.ones(5), torch.tensor(LENGTHS), eps_clip=cfg.eps_clip,
                             eps_clip_high=cfg.eps_clip_high, entropy_coef=0.0, dtype=dtype, knobs=knobs, **payloads)
    return {k: float(v) for k, v in out.items()}


# ------------------------------------------------------------------------------------------------ VESPO


def _phi(log_w: float, adv: float, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0) -> float:
    k, lam = (k_pos, lam_pos) if adv >= 0 else (k_neg, lam_neg)
    return math.exp(lam + k * log_w - lam * math.exp(log_w))


def test_vespo_by_hand():
    # sample 0: log w = −0.1 + 0 = −0.1, A = 1 → (k, λ) = (2, 3): log φ = 3 − 0.2 − 3·e^−0.1
    # sample 1: log w = −0.1 + 0.1 + 0.5 = 0.5, A = −0.5 → (3, 2): log φ = 2 + 1.5 − 2·e^0.5
    phi0, phi1 = math.exp(3 - 0.2 - 3 * math.exp(-0.1)), math.exp(2 + 1.5 - 2 * math.exp(0.5))
    assert phi0 == pytest.approx(1.0892482, rel=1e-6) and phi1 == pytest.approx(1.2245304, rel=1e-6)
    # pg = −φ·A·logp per token; the sum of per-sample means (V1's aggregation)
    pg0 = (-phi0 * 1.0 * -0.1 + 0.0) / 2
    pg1 = -phi1 * -0.5 * (-0.5 - 0.2 - 1.0) / 3
    out = _fields(RecomputeConfig(policy_loss="vespo"))
    assert out["pg_loss"] == pytest.approx(pg0 + pg1, rel=1e-12)
    assert out["pg_clipfrac"] == 0.0
    # the parameters are read from the bundle: k_neg = 1 changes only sample 1
    phi1b = math.exp(2 + 0.5 - 2 * math.exp(0.5))
    out = _fields(RecomputeConfig(policy_loss="vespo", policy_loss_params={"k_neg": 1}))
    assert out["pg_loss"] == pytest.approx(pg0 - phi1b * -0.5 * -1.7 / 3, rel=1e-12)


def _trl():
    # a conformance test's stubs of the heavy modules not installed (tests/conformance/conftest.py) read as installed
    # packages (version 'N/A') to transformers' availability checks, cached when verl imported transformers: the
    # stubs out of the way, and transformers imported afresh, before TRL is imported in the same process
    stubs = [f for f in sys.meta_path if type(f).__name__ == "_StubFinder"]
    if stubs and "trl.trainer.grpo_trainer" not in sys.modules:
        roots = set().union(*(f.roots for f in stubs)) | {"transformers", "trl"}
        for finder in stubs:
            sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] in roots]:
            del sys.modules[name]
    return pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL 1.16 (the conformance producer) is not "
                                                                   "installed").GRPOTrainer


def _padded(values, lengths, pad=0.0):
    width = max(lengths)
    out, k = torch.full((len(lengths), width), pad, dtype=torch.float64), 0
    for i, n in enumerate(lengths):
        out[i, :n] = torch.tensor(values[k:k + n], dtype=torch.float64)
        k += n
    return out


def _random_step(seed: int, lengths):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    logp = -torch.rand(total, generator=g, dtype=torch.float64) * 2
    old = logp + (torch.rand(total, generator=g, dtype=torch.float64) - 0.5) * 0.2
    rollout = old + (torch.rand(total, generator=g, dtype=torch.float64) - 0.5) * 0.2
    adv_s = torch.randn(len(lengths), generator=g, dtype=torch.float64)
    adv = torch.repeat_interleave(adv_s, torch.tensor(lengths))
    ent = torch.rand(total, generator=g, dtype=torch.float64) * 3
    return logp, old, rollout, adv, adv_s, ent


def _mask(lengths):
    return _padded([1.0] * sum(lengths), lengths)


def _seg(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def test_vespo_per_token_loss_matches_trl_get_gamma_weights():
    """TRL's producer: ``phi = get_gamma_weights(A, logp − old, mask, None, k/λ)`` and ``per_token_loss =
    −phi·A·logp`` (grpo_trainer.py:3125-3136), against our per-token ``pg``."""
    trainer = _trl()
    lengths = [3, 7, 1, 5]
    logp, old, _, adv, adv_s, _ = _random_step(1, lengths)
    mask = _mask(lengths)
    params = dict(k_pos=2.5, lambda_pos=3.0, k_neg=3.0, lambda_neg=1.5)
    phi = trainer.get_gamma_weights(adv_s.unsqueeze(1), _padded(logp.tolist(), lengths) - _padded(old.tolist(),
                                    lengths), mask, None, **params)
    expected = (-phi * adv_s.unsqueeze(1) * _padded(logp.tolist(), lengths))[mask.bool()]
    knobs = LossKnobs.of(RecomputeConfig(policy_loss="vespo", policy_loss_params=params))
    terms = sample_log_terms(logp, old, None, torch.ones(len(logp)), torch.tensor(lengths), knobs, torch.float64)
    t = policy_token_terms(logp, old, adv, knobs, seg=_seg(lengths), sample_terms=terms, dtype=torch.float64)
    assert torch.allclose(t["pg"], expected, rtol=1e-12, atol=0)
    assert torch.allclose(t["phi"], phi.squeeze(1)[_seg(lengths)], rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------------------------ OPSM


def test_opsm_by_hand_anchor_old_and_rollout():
    # old − logp: sample 0 mean (0.1 + 0)/2 = 0.05; sample 1 (0.1 − 0.1 − 0.5)/3 = −1/6
    # rollout − logp: sample 0 (0.15 + 0)/2 = 0.075; sample 1 (0.05 − 0.1 − 0.2)/3 = −1/12
    # δ = 0.06: sample 0 has A > 0 (kept whatever its KL); sample 1 has A < 0 and KL ≤ δ: kept either way
    knobs = LossKnobs.of(RecomputeConfig(opsm_delta=0.06))
    terms = sample_log_terms(_t(LOGP), _t(OLD), _t(ROLLOUT), torch.ones(5), torch.tensor(LENGTHS), knobs,
                             torch.float64)
    assert terms["opsm_kl"].tolist() == pytest.approx([0.05, -1 / 6], rel=1e-12)
    knobs = LossKnobs.of(RecomputeConfig(opsm_delta=0.06, opsm_anchor="rollout"))
    terms = sample_log_terms(_t(LOGP), _t(OLD), _t(ROLLOUT), torch.ones(5), torch.tensor(LENGTHS), knobs,
                             torch.float64)
    assert terms["opsm_kl"].tolist() == pytest.approx([0.075, -1 / 12], rel=1e-12)
    # δ = −0.2 drops sample 1 (A < 0, KL −1/6 > −0.2): its pg is 0; sample 0 (A ≥ 0) is kept
    base = _fields(RecomputeConfig())
    masked = _fields(RecomputeConfig(opsm_delta=-0.2))
    ratio0 = [math.exp(-0.1), 1.0]
    pg0 = sum(-min(r, 1.2) * 1.0 for r in ratio0) / 2
    assert masked["pg_loss"] == pytest.approx(pg0, rel=1e-12) and base["pg_loss"] != pytest.approx(pg0, rel=1e-3)


def _slime_opsm(logp, old, adv, lengths, delta):
    """slime ``compute_opsm_mask`` (utils/ppo_utils.py:79-89): per sample ``seq_kl = Σ (old − logp)·m /
    clamp_min(Σ m, 1)``; ``mask = (advantage < 0) & (seq_kl > δ)`` per token; the kept tokens are ``1 − mask``."""
    keep, k = [], 0
    for n in lengths:
        seq_kl = float((old[k:k + n] - logp[k:k + n]).sum()) / max(n, 1)
        keep += [0.0 if (float(a) < 0 and seq_kl > delta) else 1.0 for a in adv[k:k + n]]
        k += n
    return torch.tensor(keep, dtype=torch.float64)


def _opsm_keep(knobs, logp, old, rollout, adv, lengths):
    terms = sample_log_terms(logp, old, rollout, torch.ones(len(logp)), torch.tensor(lengths), knobs, torch.float64)
    return policy_token_terms(logp, old, adv, knobs, seg=_seg(lengths), sample_terms=terms, dtype=torch.float64,
                              rollout_log_probs=rollout)["opsm_keep"]


def test_opsm_matches_trl_get_off_policy_mask_and_slime_reference():
    trainer = _trl()
    lengths = [4, 2, 6, 3, 5, 1]
    logp, old, rollout, adv, adv_s, _ = _random_step(7, lengths)
    mask = _mask(lengths)
    for delta in (-0.02, 0.0, 0.01, 0.05):
        trl_keep = trainer.get_off_policy_mask(adv_s.unsqueeze(1), _padded(logp.tolist(), lengths),
                                               _padded(rollout.tolist(), lengths), mask, delta)
        ours = _opsm_keep(LossKnobs.of(RecomputeConfig(opsm_delta=delta, opsm_anchor="rollout")), logp, old, rollout,
                          adv, lengths)
        assert ours.tolist() == trl_keep.squeeze(1)[_seg(lengths)].tolist(), delta
        slime = _opsm_keep(LossKnobs.of(RecomputeConfig(opsm_delta=delta)), logp, old, rollout, adv, lengths)
        assert slime.tolist() == _slime_opsm(logp, old, adv, lengths, delta).tolist(), delta
    # the two anchors decide differently on this step (TRL sampling vs slime old): the anchor is a real knob
    assert _opsm_keep(LossKnobs.of(RecomputeConfig(opsm_delta=0.0, opsm_anchor="rollout")), logp, old, rollout, adv,
                      lengths).tolist() != _slime_opsm(logp, old, adv, lengths, 0.0).tolist()


# ------------------------------------------------------------------------------------------ entropy mask


def test_entropy_mask_by_hand():
    # q = 0.4 keeps the top 40%: the threshold is the 0.6 quantile of [0.3, 1.2, 0.7, 2.0, 0.1]: sorted
    # [0.1, 0.3, 0.7, 1.2, 2.0], position 0.6·4 = 2.4 → 0.7 + 0.4·(1.2 − 0.7) = 0.9; kept: 1.2 and 2.0
    knobs = LossKnobs.of(RecomputeConfig(top_entropy_quantile=0.4))
    terms = sample_log_terms(_t(LOGP), _t(OLD), None, torch.ones(5), torch.tensor(LENGTHS), knobs, torch.float64,
                             entropy=_t(ENT))
    assert terms["entropy_threshold"].tolist() == pytest.approx([0.9, 0.9], rel=1e-12)
    t = policy_token_terms(_t(LOGP), _t(OLD), _t(ADV), knobs, seg=_seg(LENGTHS), sample_terms=terms,
                           dtype=torch.float64, entropy=_t(ENT))
    assert t["entropy_keep"].tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]
    # per micro-batch (its scope is the local batch): sample 0 alone → 0.6 quantile of [0.3, 1.2] = 0.84; sample 1
    # alone: [0.1, 0.7, 2.0] at position 1.2 → 0.7 + 0.2·1.3 = 0.96
    knobs = dataclasses.replace(knobs, micro_batch=(0, 1))
    terms = sample_log_terms(_t(LOGP), _t(OLD), None, torch.ones(5), torch.tensor(LENGTHS), knobs, torch.float64,
                             entropy=_t(ENT))
    assert terms["entropy_threshold"].tolist() == pytest.approx([0.84, 0.7 + 0.2 * 1.3], rel=1e-12)


def test_entropy_mask_matches_trl_get_high_entropy_mask():
    trainer = _trl()
    lengths = [4, 2, 6, 3, 5, 1]
    logp, old, _, adv, _, ent = _random_step(3, lengths)
    accelerator = types.SimpleNamespace(pad_across_processes=lambda x, dim, pad_index: x, gather=lambda x: x)
    stub = types.SimpleNamespace(accelerator=accelerator)
    for q in (0.2, 0.5, 0.8):
        trl = trainer.get_high_entropy_mask(stub, _padded(ent.tolist(), lengths).float(), _mask(lengths), 1 - q)
        knobs = LossKnobs.of(RecomputeConfig(top_entropy_quantile=q))
        terms = sample_log_terms(logp, old, None, torch.ones(len(logp)), torch.tensor(lengths), knobs,
                                 torch.float64, entropy=ent.float())
        t = policy_token_terms(logp, old, adv, knobs, seg=_seg(lengths), sample_terms=terms, dtype=torch.float64,
                               entropy=ent.float())
        assert t["entropy_keep"].bool().tolist() == trl[_mask(lengths).bool()].tolist(), q


# ---------------------------------------------------------------------------------- on-policy distillation


def test_opd_estimators_and_clamp_by_hand():
    s, te = _t([-0.1, -2.0]), _t([-0.3, -0.2])  # r = student − teacher = [0.2, −1.8]
    for kind, want in (("k1", [0.2, -1.8]), ("abs", [0.2, 1.8]), ("k2", [0.02, 1.62]),
                       ("k3", [math.exp(-0.2) - 1 + 0.2, math.exp(1.8) - 1 - 1.8])):
        knobs = LossKnobs.of(RecomputeConfig(opd_placement="loss", opd_kl_type=kind))
        assert opd_estimate(s, te, knobs, torch.float64).tolist() == pytest.approx(want, rel=1e-12), kind
    knobs = LossKnobs.of(RecomputeConfig(opd_placement="loss", opd_kl_type="k3", opd_clamp=1.0))
    assert opd_estimate(s, te, knobs, torch.float64).tolist() == pytest.approx([math.exp(-0.2) - 0.8, 1.0],
                                                                                  rel=1e-12)
    # the advantage placement (slime): A − coef·(old − teacher)
    knobs = LossKnobs.of(RecomputeConfig(opd_placement="advantage", opd_coef=0.5))
    assert opd_advantages(_t([1.0, 1.0]), s, te, knobs, torch.float64).tolist() == pytest.approx([0.9, 1.9])


def test_opd_loss_term_by_hand():
    # k1 per token r = logp − teacher = [0.2, 0.2, −0.4, 0.7, −0.4]; per-sample means [0.2, −0.1/3]
    cfg = RecomputeConfig(opd_placement="loss", opd_kl_type="k1", opd_coef=0.5)
    out = _fields(cfg, teacher_log_probs=_t(TEACHER))
    assert out["opd_loss"] == pytest.approx(0.2 - 0.1 / 3, rel=1e-12)
    assert out["loss"] == pytest.approx(out["pg_loss"] + 0.5 * out["opd_loss"], rel=1e-12)


# ------------------------------------------------------------------------------- bundles, refusals, bugs


def write_step(path, *, config: dict, policy: dict, payloads: dict | None = None):
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=i, response_length=n, total_length=n + 4,
                            loss_mask=[1] * n, raw_reward=0.0, reward=0.0) for i, n in enumerate(LENGTHS)]
    cfg = RecomputeConfig(**config)
    index = BundleIndex(bundle_id="fam", identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0)),
                        samples=samples, config=cfg)
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id="fam", producer=producer(),
                        stage_contracts=stage_contracts([StageId.SAMPLE, StageId.LOSS_POLICY]), payloads={},
                        comparison_policy=ComparisonPolicy(), redaction={})
    writer = BundleWriter(path, manifest, index, {"loss.policy": policy})
    base = {"log_probs": LOGP, "old_log_probs": OLD, "advantages": ADV, "rollout_log_probs": ROLLOUT,
            "entropy": ENT, "teacher_log_probs": TEACHER}
    for name, values in {**base, **(payloads or {})}.items():
        writer.write_payload(name, torch.tensor(values, dtype=torch.float32))
    return writer.finalize(ranks=[0])


def _produced(config: dict, **kw) -> dict[str, float]:
    """The fields a float32 producer reports (our float32 kernel on the float32 payloads)."""
    cfg = RecomputeConfig(**config)
    f32 = {k: torch.tensor(v, dtype=torch.float32) for k, v in
           (("rollout_log_probs", ROLLOUT), ("teacher_log_probs", TEACHER))}
    out = policy_loss_fields(torch.tensor(LOGP), torch.tensor(OLD), torch.tensor(ADV), torch.tensor(ENT),
                             torch.ones(5), torch.tensor(LENGTHS), eps_clip=0.2, eps_clip_high=0.2, entropy_coef=0.0,
                             dtype=torch.float32, knobs=LossKnobs.of(cfg), **f32, **kw)
    reported = policy_fields_for(LossKnobs.of(cfg))  # a family records only the metrics its framework reports
    return {k: float(v) for k, v in out.items() if k in reported}


CASES = {
    "vespo": dict(policy_loss="vespo"),
    "opsm": dict(opsm_delta=-0.2),
    "opsm_rollout": dict(opsm_delta=-0.12, opsm_anchor="rollout"),
    "entropy_mask": dict(top_entropy_quantile=0.4),
    "opd_loss": dict(opd_placement="loss", opd_kl_type="k3", opd_coef=0.25, opd_clamp=5.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_float32_producer_replays_clean(tmp_path, cli, case):
    policy = _produced(CASES[case])
    code, out, err = cli("replay", write_step(tmp_path / case, config=CASES[case], policy=policy), "--format", "json")
    report = json.loads(out)
    assert (code, err) == (0, ""), report


# one injected bug per family, named at its stage: VESPO's (k, λ) taken by the wrong sign of A; OPSM's anchor
# swapped (slime's old where the bundle says rollout); the entropy mask's quantile taken as the kept share
# (q instead of 1 − q); the distillation term's estimator on teacher − student (the direction swapped)
BUGS = {
    "vespo": (dict(policy_loss="vespo"),
              dict(policy_loss="vespo", policy_loss_params={"k_pos": 3.0, "lambda_pos": 2.0, "k_neg": 2.0,
                                                            "lambda_neg": 3.0})),
    "opsm_rollout": (dict(opsm_delta=-0.12, opsm_anchor="rollout"), dict(opsm_delta=-0.12, opsm_anchor="old")),
    "entropy_mask": (dict(top_entropy_quantile=0.4), dict(top_entropy_quantile=0.6)),
}


@pytest.mark.parametrize("case", sorted(BUGS))
def test_an_injected_bug_diverges_at_loss_policy(tmp_path, cli, case):
    config, buggy = BUGS[case]
    policy = _produced(buggy)
    code, out, err = cli("replay", write_step(tmp_path / case, config=config, policy=policy), "--format", "json")
    report = json.loads(out)
    assert (code, report["first_divergent_stage"]) == (1, "loss.policy"), report


def test_opd_direction_swapped_diverges(tmp_path, cli):
    config = CASES["opd_loss"]
    policy = _produced(config)
    knobs = LossKnobs.of(RecomputeConfig(**config))
    wrong = opd_estimate(torch.tensor(TEACHER), torch.tensor(LOGP), knobs, torch.float32)  # teacher − student
    swapped = dict(policy, opd_loss=float(wrong[:2].mean() + wrong[2:].mean()))
    code, out, err = cli("replay", write_step(tmp_path / "b", config=config, policy=swapped), "--format", "json")
    report = json.loads(out)
    assert (code, report["first_divergent_stage"], report["first_divergence"]["field"]) == \
        (1, "loss.policy", "opd_loss"), report


@pytest.mark.parametrize("config, message", [
    (dict(policy_loss="nope"), "$.config.policy_loss='nope': not a known policy-loss family (known: ppo, cispo, "
                               "clip_cov, cross_entropy, dppo_kl, dppo_mu, dppo_tv, dro, geo_mean, gpg, icepop, "
                               "importance_sampling, ipo, kl_cov, "
                               "rollout_is, sapo, vespo) (stage loss.policy)"),
    (dict(policy_loss="vespo", policy_loss_params={"k": 1.0}),
     "$.config.policy_loss_params.k=1.0: not a parameter of policy_loss 'vespo' (its parameters: k_neg, k_pos, "
     "lambda_neg, lambda_pos) (stage loss.policy)"),
    (dict(policy_loss="vespo", policy_loss_params={"k_pos": "two"}),
     "$.config.policy_loss_params.k_pos='two': expected a finite number > 0 for policy_loss 'vespo' (stage "
     "loss.policy)"),
])
def test_an_unknown_family_or_parameter_is_refused_in_one_line(tmp_path, cli, config, message):
    path = write_step(tmp_path / "b", config=config, policy={"loss": 0.0})
    code, out, err = cli("replay", path)
    assert code == 4, (out, err)
    lines = (out + err).strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_opd_loss_without_the_teacher_payload_names_it(tmp_path, cli):
    path = write_step(tmp_path / "b", config=CASES["opd_loss"], policy=_produced(CASES["opd_loss"]))
    (path / "payloads" / "teacher_log_probs.safetensors").unlink()
    code, out, err = cli("validate", path)
    assert code == 3 and "teacher_log_probs" in out + err, (out, err)


# -------------------------------------------------------------- distillation in the advantages (slime)


REWARDS = [0.5, -0.25]


def write_advantage_step(path, *, config: dict, advantages, stages=(StageId.SAMPLE, StageId.ADVANTAGE_ESTIMATE)):
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=i, response_length=n, total_length=n + 4,
                            loss_mask=[1] * n, raw_reward=REWARDS[i], reward=REWARDS[i])
               for i, n in enumerate(LENGTHS)]
    index = BundleIndex(bundle_id="opd", identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0)),
                        samples=samples, config=RecomputeConfig(**config))
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id="opd", producer=producer(),
                        stage_contracts=stage_contracts(list(stages)), payloads={},
                        comparison_policy=ComparisonPolicy(), redaction={})
    writer = BundleWriter(path, manifest, index, {})
    for name, values in {"log_probs": LOGP, "old_log_probs": OLD, "advantages": advantages,
                         "teacher_log_probs": TEACHER}.items():
        writer.write_payload(name, torch.tensor(values, dtype=torch.float32))
    return writer.finalize(ranks=[0])


def _slime_opd_advantages(coef: float, student=OLD) -> list[float]:
    """slime ``apply_opd_kl_to_advantages`` (backends/megatron_utils/loss.py:694-697), in float32: each sample's
    broadcast return minus ``opd_kl_coef·(student − teacher)``, the student the trainer's old log-probs."""
    out, k = [], 0
    for i, n in enumerate(LENGTHS):
        adv = torch.full((n,), REWARDS[i], dtype=torch.float32)
        reverse_kl = torch.tensor(student[k:k + n], dtype=torch.float32) - torch.tensor(TEACHER[k:k + n],
                                                                                        dtype=torch.float32)
        out += (adv - coef * reverse_kl).tolist()
        k += n
    return out


OPD_ADV = dict(opd_placement="advantage", opd_kl_type="k1", opd_coef=0.5)


def test_opd_in_the_advantages_replays_clean_and_the_student_swapped_diverges(tmp_path, cli):
    code, out, err = cli("replay", write_advantage_step(tmp_path / "good", config=OPD_ADV,
                                                        advantages=_slime_opd_advantages(0.5)), "--format", "json")
    assert (code, err) == (0, ""), out
    # the bug: the current log-probs as the student where slime takes the old ones (sample 0: 0.5·0.1 apart)
    code, out, err = cli("replay", write_advantage_step(tmp_path / "bad", config=OPD_ADV,
                                                        advantages=_slime_opd_advantages(0.5, student=LOGP)),
                         "--format", "json")
    report = json.loads(out)
    assert (code, report["first_divergent_stage"]) == (1, "advantage.estimate"), report
    # without the term (coef 0 in the producer) the step diverges too: the replay applies it
    code, out, err = cli("replay", write_advantage_step(tmp_path / "off", config=OPD_ADV,
                                                        advantages=_slime_opd_advantages(0.0)), "--format", "json")
    assert code == 1, out


def test_opd_in_whitened_advantages_is_refused_naming_the_knob(tmp_path, cli):
    path = write_advantage_step(tmp_path / "b", config=dict(OPD_ADV, advantage_estimator="reinforce_plus_plus"),
                                advantages=_slime_opd_advantages(0.5))
    code, out, err = cli("replay", path)
    assert code == 4 and "opd_placement" in out + err, (out, err)


# ------------------------------------------------------------ SkyRL cross_entropy, importance_sampling, rollout_is


def _terms(cfg: RecomputeConfig, lengths=LENGTHS, logp=LOGP, old=OLD, adv=ADV, rollout=ROLLOUT):
    knobs = LossKnobs.of(cfg)
    terms = sample_log_terms(_t(logp), _t(old), _t(rollout), torch.ones(len(logp)), torch.tensor(lengths), knobs,
                             torch.float64)
    return policy_token_terms(_t(logp), _t(old), _t(adv), knobs, seg=_seg(lengths), sample_terms=terms,
                              dtype=torch.float64, rollout_log_probs=_t(rollout))


def test_skyrl_cross_entropy_and_importance_sampling_by_hand():
    # cross_entropy: −logp, whatever A and old (ppo_utils.py:1057-1092)
    assert _terms(RecomputeConfig(policy_loss="cross_entropy"))["pg"].tolist() == [0.1, 0.0, 0.5, 0.2, 1.0]
    # importance_sampling: −exp(logp − old)·A (ppo_utils.py:1095-1142): Δ = [−0.1, 0, −0.1, 0.1, 0.5]
    want = [-math.exp(-0.1), -1.0, 0.5 * math.exp(-0.1), 0.5 * math.exp(0.1), 0.5 * math.exp(0.5)]
    assert _terms(RecomputeConfig(policy_loss="importance_sampling"))["pg"].tolist() == pytest.approx(want, rel=1e-15)
    # summed over the loss tokens (reduce_loss, :1145-1149): the token_sum aggregation
    out = _fields(RecomputeConfig(policy_loss="importance_sampling", loss_agg_mode="token_sum"))
    assert out["pg_loss"] == pytest.approx(sum(want), rel=1e-14)


def _skyrl_rollout_is(logp, rollout, adv, eps_low, eps_high):
    """SkyRL ``rollout_is_policy_loss`` (ppo_utils.py:846-854), per token: ``ratio = exp(clamp(logp − rollout, ±20))``
    in float32 then back (``safe_exp_delta``, torch_utils.py:187-192), ``in_range = (1 − εl < r < 1 + εh)``, the
    loss ``−(where(in_range, r, 0)·A·logp)``."""
    ratio = torch.clamp((logp - rollout).to(torch.float32), -20.0, 20.0).exp().to(logp.dtype)
    in_range = (ratio > 1 - eps_low) & (ratio < 1 + eps_high)
    return -(torch.where(in_range, ratio, torch.zeros_like(ratio)) * adv * logp), (~in_range).to(logp.dtype)


def test_skyrl_rollout_is_matches_a_reference_from_its_code():
    lengths = [4, 2, 6, 3]
    logp, _, rollout, adv, _, _ = _random_step(11, lengths)
    rollout = rollout + torch.linspace(-0.3, 0.3, len(logp), dtype=torch.float64)  # some ratios out of range
    want, clip = _skyrl_rollout_is(logp.float(), rollout.float(), adv.float(), 0.2, 0.28)
    knobs = LossKnobs.of(RecomputeConfig(policy_loss="rollout_is", eps_clip=0.2, eps_clip_high=0.28))
    got = policy_token_terms(logp.float(), logp.float(), adv.float(), knobs, seg=_seg(lengths), sample_terms={},
                             dtype=torch.float32, rollout_log_probs=rollout.float())
    assert torch.equal(got["pg"], want) and torch.equal(got["clip"], clip) and 0 < int(clip.sum()) < len(logp)


# ------------------------------------------------------------------------------------------ prime-rl IPO


def _prime_ipo(logp, rollout, adv, ipo_threshold=0.1, adv_tau=1.0, kl_tau=1e-3):
    """prime-rl ``ipo_loss_fn`` (src/prime_rl/trainer/rl/loss.py:164-196 @ 559b44772e47), per token:
    ``log r = logp − inf``, ``r = exp(log r)`` (:100-106), ``is_masked = |exp(logp) − exp(inf)| > threshold``,
    ``−keep·adv_tau·A·r + kl_tau·(log r)²``."""
    lr = logp - rollout
    keep = ~((logp.exp() - rollout.exp()).abs() > ipo_threshold)
    return -(keep * (adv_tau * adv) * lr.exp()) + kl_tau * lr ** 2


def test_prime_rl_ipo_by_hand_and_against_a_reference_from_its_code():
    # token 4: |e^−1 − e^−1.2| = 0.0667 ≤ 0.1 kept; with ipo_threshold 0.05 it is masked, its (log r)² term stays
    lr = -1.0 + 1.2
    kept = -(-0.5 * math.exp(lr)) + 1e-3 * lr * lr
    assert _terms(RecomputeConfig(policy_loss="ipo"))["pg"][4].item() == pytest.approx(kept, rel=1e-14)
    masked = _terms(RecomputeConfig(policy_loss="ipo", policy_loss_params={"ipo_threshold": 0.05}))["pg"][4].item()
    assert masked == pytest.approx(1e-3 * lr * lr, rel=1e-12)
    lengths = [4, 2, 6, 3]
    logp, _, rollout, adv, _, _ = _random_step(5, lengths)
    rollout = rollout + torch.linspace(-0.6, 0.6, len(logp), dtype=torch.float64)
    for params in ({}, {"ipo_threshold": 0.05, "adv_tau": 0.5, "kl_tau": 0.01}):
        knobs = LossKnobs.of(RecomputeConfig(policy_loss="ipo", policy_loss_params=params))
        got = policy_token_terms(logp, logp, adv, knobs, seg=_seg(lengths), sample_terms={}, dtype=torch.float64,
                                 rollout_log_probs=rollout)["pg"]
        assert torch.allclose(got, _prime_ipo(logp, rollout, adv, **params), rtol=1e-14, atol=0), params


SKY_CASES = {
    "cross_entropy": dict(policy_loss="cross_entropy", loss_agg_mode="token_sum"),
    "importance_sampling": dict(policy_loss="importance_sampling", loss_agg_mode="token_sum"),
    "rollout_is": dict(policy_loss="rollout_is", loss_agg_mode="token_sum"),
    "ipo": dict(policy_loss="ipo", loss_agg_mode="token_sum"),
}


@pytest.mark.parametrize("case", sorted(SKY_CASES))
def test_skyrl_and_prime_rl_families_replay_clean_from_a_float32_producer(tmp_path, cli, case):
    policy = _produced(SKY_CASES[case])
    code, out, err = cli("replay", write_step(tmp_path / case, config=SKY_CASES[case], policy=policy),
                         "--format", "json")
    assert (code, err) == (0, ""), out


def test_ipo_with_the_old_policy_as_its_anchor_diverges(tmp_path, cli):
    # the typical bug: the ratio against the trainer's old log-probs where prime-rl has no old policy
    config = SKY_CASES["ipo"]
    cfg = RecomputeConfig(**config)
    buggy = policy_loss_fields(torch.tensor(LOGP), torch.tensor(OLD), torch.tensor(ADV), torch.tensor(ENT), torch.ones(5),
                               torch.tensor(LENGTHS), eps_clip=0.2, eps_clip_high=0.2, entropy_coef=0.0,
                               dtype=torch.float32, knobs=LossKnobs.of(cfg), rollout_log_probs=torch.tensor(OLD))
    code, out, err = cli("replay", write_step(tmp_path / "b", config=config,
                                              policy={k: float(v) for k, v in buggy.items()}), "--format", "json")
    report = json.loads(out)
    assert (code, report["first_divergent_stage"]) == (1, "loss.policy"), out
    assert report["explanations"][0]["hypothesis"] == "loss.ipo_old_anchor", report["explanations"]


# ------------------------------------------------------------------------------------- explanations


@pytest.mark.parametrize("case, hypothesis", [
    ("vespo", "loss.vespo_sign_swapped"),
    ("opsm_rollout", "loss.opsm_anchor_old"),
    ("entropy_mask", "loss.entropy_quantile_flipped"),
])
def test_the_injected_bug_is_explained_by_name(tmp_path, cli, case, hypothesis):
    config, buggy = BUGS[case]
    code, out, err = cli("replay", write_step(tmp_path / case, config=config, policy=_produced(buggy)),
                         "--format", "json")
    report = json.loads(out)
    assert code == 1 and report["explanations"], report
    assert report["explanations"][0]["hypothesis"] == hypothesis, report["explanations"]


def test_the_opd_direction_swap_is_explained(tmp_path, cli):
    config = CASES["opd_loss"]
    knobs = LossKnobs.of(RecomputeConfig(**config))
    wrong = opd_estimate(torch.tensor(TEACHER), torch.tensor(LOGP), knobs, torch.float32)
    policy = _produced(config)
    swapped = float(wrong[:2].mean() + wrong[2:].mean())
    policy = dict(policy, opd_loss=swapped, loss=policy["loss"] + 0.25 * (swapped - policy["opd_loss"]))
    code, out, err = cli("replay", write_step(tmp_path / "opd", config=config, policy=policy), "--format", "json")
    report = json.loads(out)
    assert code == 1 and report["explanations"][0]["hypothesis"] == "loss.opd_direction_swapped", report["explanations"]


# ----------------------------------------------------------------------------------------- why strip


def test_the_why_strip_of_a_vespo_token_spells_its_formula_and_weight(tmp_path):
    from replay_lib.bundle import open_bundle
    from replay_lib.explain.inputs import element_inputs
    from replay_lib.stages import StageContext

    config = CASES["vespo"]
    reader = open_bundle(write_step(tmp_path / "b", config=config, policy=_produced(config))).shards[0]
    ctx = StageContext(reader=reader, indices=[0, 1], partial=False)
    why = element_inputs(ctx, "pg_losses", 1, 2)  # sample 1's last token: logp −1, A −0.5, log w 0.5
    phi1 = math.exp(2 + 1.5 - 2 * math.exp(0.5))
    assert why.formula.startswith("pg = −φ(w)·A·logp")
    items = dict(why.items)
    assert float(items["φ(w)"]) == pytest.approx(phi1, rel=1e-5) and float(items["log w"]) == pytest.approx(0.5)
    assert float(why.formula.rsplit("= ", 1)[1]) == pytest.approx(-phi1 * -0.5 * -1.0, rel=1e-5)


def test_an_opsm_decision_at_its_edge_is_a_hazard_either_way(tmp_path, cli):
    # sample 1 (A < 0): its sequence KL old − logp, from the float32 payloads, is exactly δ: a producer may keep
    # or drop it within rounding; both replay clean, with a mask_boundary hazard on that sample
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).to(torch.float64)  # noqa: E731
    delta = float((f32(OLD[2:]) - f32(LOGP[2:])).sum() / 3)
    config = dict(opsm_delta=delta)
    for name, keep in (("kept", dict(opsm_delta=delta + 1e-3)), ("dropped", dict(opsm_delta=delta - 1e-3))):
        code, out, err = cli("replay", write_step(tmp_path / name, config=config, policy=_produced(keep)),
                             "--format", "json")
        report = json.loads(out)
        assert code == 0, (name, report["stages"])
        kinds = {(h["kind"], h.get("sample_id")) for h in report["hazards"]}
        assert ("mask_boundary", "s-1") in kinds, (name, report["hazards"])
    # a decision away from the edge is not admitted: δ 0.05 above the KL keeps sample 1, a producer dropping it fails
    code, out, err = cli("replay", write_step(tmp_path / "far", config=dict(opsm_delta=delta + 0.05),
                                              policy=_produced(dict(opsm_delta=delta - 0.05))), "--format", "json")
    assert code == 1, out


def test_a_short_teacher_payload_is_one_line_exit_3(tmp_path, cli):
    path = write_step(tmp_path / "b", config=CASES["opd_loss"], policy=_produced(CASES["opd_loss"]),
                      payloads={"teacher_log_probs": TEACHER[:4]})
    code, out, err = cli("validate", path)
    lines = (out + err).strip().splitlines()
    assert code == 3 and len(lines) == 1 and "teacher_log_probs" in lines[0] and "s-1" in lines[0], lines


def test_luspo_as_mapped_equals_trls_loss_written_from_its_code():
    """TRL 1.16 ``_compute_loss`` with ``loss_type="luspo"`` (grpo_trainer.py:3086-3123, 3175-3183): the sequence
    ratio ``exp(Σ_t Δ·m / clamp(Σ m, 1))``, ``−min(coef_1·A, clamp(coef_1, 1 − ε, 1 + ε_high)·A)`` per token,
    then ``(per_token_loss·mask).sum(-1).mean()`` — against the kernel under ``from_trl``'s mapping."""
    from replay_lib.frameworks.trl import from_trl

    lengths = [4, 2, 6, 3, 5]
    logp, old, _, adv, adv_s, _ = _random_step(13, lengths)
    mask = _mask(lengths)
    lp, ol = _padded(logp.tolist(), lengths), _padded(old.tolist(), lengths)
    log_w = (((lp - ol) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.28)
    a = adv_s.unsqueeze(1)
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    want = float((per_token * mask).sum(-1).mean())
    cfg = from_trl({"loss_type": "luspo", "importance_sampling_level": "sequence", "epsilon_high": 0.28,
                    "per_device_train_batch_size": len(lengths), "num_generations": 5})
    knobs = LossKnobs.of(cfg)
    got = policy_loss_fields(logp, old, adv, None, torch.ones(len(logp)), torch.tensor(lengths), eps_clip=0.2,
                             eps_clip_high=0.28, entropy_coef=0.0, dtype=torch.float64, knobs=knobs)
    assert float(got["pg_loss"]) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("case", sorted(CASES) + sorted(SKY_CASES))
def test_recorded_per_token_and_per_sample_terms_replay_clean(tmp_path, cli, case):
    # a producer that records its per-token surrogate (pg_losses) and per-sample sums: the loss terms compared
    # first (stages/loss_terms.py), under every family and mask
    config = {**CASES, **SKY_CASES}[case]
    knobs = LossKnobs.of(RecomputeConfig(**config))
    f32 = {k: torch.tensor(v, dtype=torch.float32) for k, v in
           (("logp", LOGP), ("old", OLD), ("adv", ADV), ("rollout", ROLLOUT), ("ent", ENT), ("teacher", TEACHER))}
    terms = sample_log_terms(f32["logp"], f32["old"], f32["rollout"], torch.ones(5), torch.tensor(LENGTHS), knobs,
                             torch.float32, entropy=f32["ent"])
    t = policy_token_terms(f32["logp"], f32["old"], f32["adv"], knobs, seg=_seg(LENGTHS), sample_terms=terms,
                           dtype=torch.float32, rollout_log_probs=f32["rollout"], entropy=f32["ent"],
                           teacher_log_probs=f32["teacher"])
    pg = t["pg"]
    policy = dict(_produced(config), per_sample={"pg_sum": [float(pg[:2].sum()), float(pg[2:].sum())],
                                                 "mask_count": [2.0, 3.0]})
    path = write_step(tmp_path / case, config=config, policy=policy, payloads={"pg_losses": pg.tolist()})
    code, out, err = cli("replay", path, "--format", "json")
    report = json.loads(out)
    loss = next(s for s in report["stages"] if s["stage"] == "loss.policy")
    assert (code, err, loss["status"]) == (0, "", "pass"), loss
    assert "loss term" in loss["reason"] or "term" in loss["reason"], loss["reason"]


# ------------------------------------------------------------------ the example trainer's OPSM, entropy mask, OPD

TRAINER_KNOBS = {
    "opsm": (["--opsm", "0.0001"], {"opsm_delta": 0.0001, "opsm_anchor": "old"}),
    "entropy-mask": (["--top-entropy-quantile", "0.2", "--entropy-coef", "0"], {"top_entropy_quantile": 0.2}),
    "opd": (["--opd", "k3:0.1"], {"opd_placement": "loss", "opd_kl_type": "k3", "opd_coef": 0.1}),
    # bf16 copies of the log-probs and the teacher's: opd_loss admits their rounding (error_model.StorageUnits.teacher)
    "opd-bf16": (["--opd", "k3:0.1", "--capture-dtype", "bfloat16"],
                 {"opd_placement": "loss", "opd_kl_type": "k3", "opd_coef": 0.1}),
}


def test_the_example_trainers_opsm_entropy_mask_and_opd_replay_clean(tmp_path, example_trainer):
    """``--opsm`` (slime's anchor), ``--top-entropy-quantile`` (TRL's mask) and ``--opd`` (verl's loss term, a
    frozen teacher's log-probs recorded): each run's config carries the keys the replay reads, and every bundle of
    two rollouts (an on-policy first step, then drifted ones) replays clean, per-token terms included."""
    from replay_lib.bundle import open_bundle
    from replay_lib.run.scan import ScanOptions, check_target, discover, link_partners

    grpo_trainer = example_trainer
    small = ["--prompts-per-rollout", "3", "--n-samples", "4", "--consumer-batch", "5", "--steps-per-rollout", "2",
             "--micro-batch", "3", "--hidden", "16", "--embed", "8", "--quiet", "--rollouts", "2"]
    threads = torch.get_num_threads()
    got = {}
    try:
        for name, (flags, keys) in TRAINER_KNOBS.items():
            directory = tmp_path / name
            env = {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(directory),
                   "RELAX_REPLAY_CAPTURE_TOKEN_TERMS": "1"}
            result = grpo_trainer.run([*small, *flags], env=env)
            assert result.capture_stats.errors == 0 and result.capture_flushed, name
            step = open_bundle(directory / "step-1-1").shards[0]
            cfg = step.index.config
            targets = discover(directory)
            partners = link_partners(targets)
            rows = [check_target(t, ScanOptions(), partners.get(t.path)) for t in targets]
            got[name] = ({k: getattr(cfg, k) for k in keys}, step.has_payload("teacher_log_probs"),
                         [(r.target.anchor, r.status) for r in rows if r.status != "pass"], len(rows))
    finally:
        torch.set_num_threads(threads)
    assert got == {name: (keys, name.startswith("opd"), [], 6) for name, (_, keys) in TRAINER_KNOBS.items()}


@pytest.mark.parametrize("flags, message", [
    (["--top-entropy-quantile", "0.2"], "--top-entropy-quantile needs --entropy-coef 0"),
    (["--top-entropy-quantile", "1", "--entropy-coef", "0"], "--top-entropy-quantile Q needs 0 < Q < 1"),
    (["--top-entropy-quantile", "0.5", "--entropy-coef", "0", "--entropy-quantile-bug"],
     "--entropy-quantile-bug needs --top-entropy-quantile other than 0.5"),
    (["--opsm-anchor-bug"], "--opsm-anchor-bug needs --opsm"),
    (["--opd-direction-bug"], "--opd-direction-bug needs --opd"),
    (["--opd", "k9:0.1"], "expected TYPE:COEF with TYPE one of k1, k2, k3, low_var_kl"),
])
def test_the_example_trainers_mask_and_distillation_flags_refuse_a_bad_combination_in_one_line(flags, message,
                                                                                                capsys, example_trainer):
    parser = example_trainer.build_parser()
    with pytest.raises(SystemExit) as exit_:
        example_trainer.check_args(parser, parser.parse_args(flags))
    err = capsys.readouterr().err
    assert (exit_.value.code, message in err, err.count("\n")) == (2, True, 1), err


def test_loss_grad_replays_the_masks_and_the_distillation_term_clean(tmp_path, cli, example_trainer):
    """The trainer's recorded gradient under OPSM, the entropy mask and the distillation loss term replays clean at
    loss.grad (its analytic gradient zeroes a dropped token and adds the term's own slope, SPEC §4.3), with loss.policy
    and loss.grad both compared."""
    grpo_trainer = example_trainer
    small = ["--prompts-per-rollout", "3", "--n-samples", "4", "--consumer-batch", "5", "--steps-per-rollout", "2",
             "--micro-batch", "3", "--hidden", "16", "--embed", "8", "--quiet", "--rollouts", "1"]
    threads = torch.get_num_threads()
    got = {}
    try:
        for name in ("opsm", "entropy-mask", "opd"):
            flags = TRAINER_KNOBS[name][0]
            directory = tmp_path / name
            grpo_trainer.run([*small, *flags], env={"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_GRAD": "1",
                                                    "RELAX_REPLAY_CAPTURE_DIR": str(directory)})
            step = directory / "step-0-1"
            code, out, err = cli("replay", step, "--format", "json")
            stages = {s["stage"]: s for s in json.loads(out)["stages"]}
            got[name] = (code, err, stages["loss.grad"]["status"], stages["loss.policy"]["status"],
                         stages["loss.grad"]["compared"] > 0)
    finally:
        torch.set_num_threads(threads)
    assert got == {name: (0, "", "pass", "pass", True) for name in ("opsm", "entropy-mask", "opd")}, got
