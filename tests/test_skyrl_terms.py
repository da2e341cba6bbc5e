"""Per-term aggregation of the loss (``kl_loss_agg_mode``, ``entropy_agg_mode``): SkyRL's loss mixes a
mini-batch token mean (its policy term) with a per-sequence mean (its KL term) and a micro-batch token mean (its
entropy term).

The hand-worked step is ``test_loss_knobs``'s table step (two samples, two loss tokens each):
``S_pg = [−2.28, 2.5]``, ``S_clip = [1, 0]``, ``S_ppo_kl = [−ln 2, −ln 4]``, ``n = [2, 2]``; with the
reference ``ref = logp − r``, ``r = [1, 0 | 0, 30]``, the clamped k3 KL per token is ``[e^−1, 0 | 0, 10]``
(``r = 30`` clamps to 20, its k3 ``e^−20 + 19`` to 10), so ``S_kl_loss = [e^−1, 10]``.
"""

from __future__ import annotations

import dataclasses
import json
import math

import msgspec
import pytest
import torch
from test_loss_knobs import LN2, LN4, LOGP, fields, write_step

from replay_lib.errors import UnsupportedFrameworkConfig
from replay_lib.frameworks.skyrl import from_skyrl
from replay_lib.kernels.loss import LossKnobs, policy_loss_fields
from replay_lib.bundle.schema import RecomputeConfig

E1 = math.exp(-1.0)
REF = [LN2 - 1.0, 0.0, 0.0, LN4 - 30.0, 0.0]
KL = dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3", kl_loss_input_clamp=20.0, kl_loss_output_clamp=10.0)
# policy term token_mean over T = 10 tokens, KL term seq_mean_token_mean over N = 4 samples, no producer scale
MIXED = dict(KL, loss_agg_mode="token_mean", kl_loss_agg_mode="seq_mean_token_mean", loss_token_count=10,
             loss_seq_count=4)
# pg_loss = (−2.28 + 2.5)/10 = 0.022; pg_clipfrac = (1 + 0)/10 = 0.1; ppo_kl = (−ln 2 − ln 4)/10 = −0.3·ln 2
# (the metrics follow loss_agg_mode); kl_loss = (e^−1/2 + 10/2)/4 = (e^−1 + 10)/8 ≈ 1.272992;
# loss = 0.022 + 0.1·(e^−1 + 10)/8 ≈ 0.149299
HAND = {"loss": 0.022 + 0.1 * (E1 + 10.0) / 8.0, "pg_loss": 0.022, "entropy_loss": 0.0, "pg_clipfrac": 0.1,
        "ppo_kl": -0.3 * LN2, "kl_loss": (E1 + 10.0) / 8.0}
TERMS = {"pg_sum": [-2.28, 2.5], "kl_sum": [-LN2, -LN4], "clip_count": [1.0, 0.0], "mask_count": [2.0, 2.0],
         "kl_loss_sum": [E1, 10.0], "loss_weight": [0.1, 0.1]}  # loss_weight: the policy term's 1/T


def test_token_mean_policy_with_a_seq_mean_kl_term_by_hand():
    out = fields(ref=REF, **MIXED)
    assert out == pytest.approx(HAND, rel=1e-12, abs=1e-15)
    # one mode for every term (kl_loss_agg_mode unset): the KL term is a token mean too, (e^−1 + 10)/10
    single = fields(ref=REF, **dict(MIXED, kl_loss_agg_mode=None))
    assert single["kl_loss"] == pytest.approx((E1 + 10.0) / 10.0, rel=1e-12)
    assert single["pg_loss"] == pytest.approx(0.022, rel=1e-12)


def test_entropy_term_in_its_own_mode_by_hand():
    # entropy [1, 3 | 2, 4, (9 masked)] → S_ent = [4, 6]. entropy_agg_mode seq_mean_token_mean over N = 4:
    # (4/2 + 6/2)/4 = 1.25, where the policy's token_mean would give 10/10 = 1; loss = 0.022 − 0.01·1.25 = 0.0095
    cfg = RecomputeConfig(eps_clip=0.2, eps_clip_high=0.28, loss_agg_mode="token_mean", loss_token_count=10,
                          loss_seq_count=4, entropy_coef=0.01, entropy_agg_mode="seq_mean_token_mean")
    mask = torch.tensor([1, 1, 1, 1, 0], dtype=torch.float32)
    ent = torch.tensor([1.0, 3.0, 2.0, 4.0, 9.0], dtype=torch.float64)
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in (("logp", LOGP), ("old", [0.0] * 5),
                                                                ("adv", [1.0, 1.0, -0.5, -0.5, -0.5]))}
    out = policy_loss_fields(t["logp"], t["old"], t["adv"], ent, mask, torch.tensor([2, 3]), eps_clip=0.2,
                             eps_clip_high=0.28, entropy_coef=0.01, dtype=torch.float64, knobs=LossKnobs.of(cfg))
    assert float(out["entropy_loss"]) == pytest.approx(1.25, rel=1e-12)
    assert float(out["loss"]) == pytest.approx(0.0095, rel=1e-12)


def _replay(cli, path) -> tuple[int, dict]:
    code, out, err = cli("replay", path, "--format", "json")
    assert err == "", err
    return code, json.loads(out)


def test_the_hand_bundle_replays_clean_and_a_token_mean_kl_term_is_a_loss_policy_divergence(tmp_path, cli):
    payloads = {"ref_log_probs": REF}
    good = write_step(tmp_path / "good", config=MIXED, policy=dict(HAND, per_sample=TERMS), payloads=payloads)
    code, report = _replay(cli, good)
    assert code == 0, report
    loss = next(s for s in report["stages"] if s["stage"] == "loss.policy")
    # the recorded scalars against the recorded terms (kl_loss_sum under seq_mean_token_mean) and the recompute
    assert loss["reason"] == "6 field(s) and 6 loss term(s) over 2 sample(s) compared"
    # a producer that aggregated its KL term like its policy term: kl_loss = (e^−1 + 10)/10 ≈ 1.036788 and
    # loss = 0.022 + 0.1·1.036788 ≈ 0.125679 instead of 1.272992 and 0.149299
    wrong_kl = (E1 + 10.0) / 10.0
    wrong = dict(HAND, kl_loss=wrong_kl, loss=0.022 + 0.1 * wrong_kl, per_sample=TERMS)
    code, report = _replay(cli, write_step(tmp_path / "bad", config=MIXED, policy=wrong, payloads=payloads))
    assert code == 1 and report["first_divergent_stage"] == "loss.policy"
    loss = next(s for s in report["stages"] if s["stage"] == "loss.policy")
    # the per-sample terms pass; the two fields the wrong mode wrote fail, against the terms and the recompute
    assert [d["field"] for d in loss["divergences"]] == ["loss_from_terms", "kl_loss_from_terms", "loss", "kl_loss"]
    assert "the recorded loss, kl_loss under token_mean, kl_loss seq_mean_token_mean)" in loss["reason"], loss
    first = report["first_divergence"]
    assert first["field"] == "loss_from_terms"
    assert (first["expected"], first["actual"]) == (pytest.approx(0.022 + 0.1 * wrong_kl, rel=1e-6),
                                                    pytest.approx(HAND["loss"], rel=1e-12))
    kl_row = loss["divergences"][1]
    assert (kl_row["expected"], kl_row["actual"]) == (pytest.approx(wrong_kl, rel=1e-6),
                                                      pytest.approx((E1 + 10.0) / 8.0, rel=1e-12))


@pytest.mark.parametrize("config,message", [
    (dict(KL, kl_loss_agg_mode="seq_mean_token_mean"),
     "index.json $.config.loss_seq_count (kl_loss_agg_mode='seq_mean_token_mean' aggregates over the producer's "
     "recorded loss_seq_count)"),
    (dict(entropy_coef=0.01, entropy_agg_mode="token_mean"),
     "index.json $.config.loss_token_count (entropy_agg_mode='token_mean' aggregates over the producer's "
     "recorded loss_token_count)"),
])
def test_validate_names_the_knob_whose_count_is_missing(tmp_path, cli, config, message):
    payloads = {"ref_log_probs": REF} if "use_kl_loss" in config else {"entropy": [0.5] * 5}
    code, out, err = cli("validate", write_step(tmp_path / "b", config=config, policy={"loss": 0.0},
                                                payloads=payloads))
    assert (code, out) == (3, "") and err.count("\n") == 1, err
    assert "dependency closure incomplete" in err and message in err, err


@pytest.mark.parametrize("key", ["kl_loss_agg_mode", "entropy_agg_mode"])
def test_an_unknown_term_mode_is_a_one_line_schema_error(tmp_path, cli, bundle_tools, key):
    path = write_step(tmp_path / "b", config={}, policy=fields(), payloads={})
    bundle_tools.edit_json(path, "index.json", lambda doc: doc["config"].update({key: "seq-mean"}))
    for command in ("validate", "replay"):
        code, out, err = cli(command, path)
        assert (code, out) == (3, ""), err
        assert err.count("\n") == 1 and "Traceback" not in err and str(path / "index.json") in err
        assert (f"{key}: expected null or one of sum_of_sample_means, seq_mean_token_mean, token_mean, "
                f"seq_mean_token_sum, seq_mean_token_sum_norm, token_sum, micro_batch_token_mean, prompt_mean, got 'seq-mean'") in err, err


def test_the_term_modes_round_trip_and_default_to_the_loss_mode():
    cfg = RecomputeConfig(loss_agg_mode="token_mean", loss_token_count=7, loss_seq_count=3,
                          kl_loss_agg_mode="seq_mean_token_mean", entropy_agg_mode="token_mean")
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=RecomputeConfig) == cfg
    knobs = LossKnobs.of(cfg)
    assert (knobs.kl_mode, knobs.entropy_mode) == ("seq_mean_token_mean", "token_mean")
    plain = LossKnobs.of(RecomputeConfig(loss_agg_mode="token_mean", loss_token_count=7))
    assert (plain.kl_mode, plain.entropy_mode) == ("token_mean", "token_mean")


# --------------------------------------------------------------------------------------------- SkyRL


def test_skyrl_default_and_use_entropy_loss_map_to_the_term_modes():
    """SkyRL's default: ``use_kl_loss=True``, ``kl_loss_coef=0.001`` (skyrl/train/config/config.py:833,836), k3
    (config.py:828) clamped ±20 on the log-ratio and ±10 on the value (ppo_utils.py ``compute_approx_kl``), a
    per-sequence masked mean averaged over the micro-batch (skyrl/backends/skyrl_train/workers/worker.py:1077);
    ``use_entropy_loss`` (config.py:838) with ``entropy_loss_coef=0.01`` (config.py:841), a masked token mean
    over the micro-batch (worker.py:1062)."""
    cfg = from_skyrl({})
    assert (cfg.use_kl_loss, cfg.kl_loss_coef, cfg.kl_loss_type, cfg.kl_loss_input_clamp,
            cfg.kl_loss_output_clamp) == (True, 0.001, "k3", 20.0, 10.0)
    assert (cfg.loss_agg_mode, cfg.kl_loss_agg_mode, cfg.entropy_coef, cfg.entropy_agg_mode) == (
        "token_mean", "seq_mean_token_mean", 0.0, None)
    ent = from_skyrl({"trainer": {"algorithm": {"use_entropy_loss": True, "use_kl_loss": False}}})
    assert (ent.entropy_coef, ent.entropy_agg_mode, ent.use_kl_loss, ent.kl_loss_agg_mode) == (
        0.01, "token_mean", False, None)
    k2 = from_skyrl({"trainer": {"algorithm": {"kl_estimator_type": "k2", "kl_loss_coef": 0.02,
                                               "loss_reduction": "sequence_mean"}}})
    assert (k2.kl_loss_type, k2.kl_loss_coef, k2.kl_loss_input_clamp, k2.loss_agg_mode, k2.kl_loss_agg_mode) == (
        "k2", 0.02, None, "seq_mean_token_mean", "seq_mean_token_mean")
    # abs = |logp − ref| (ppo_utils.py:106-107), unclamped
    absolute = from_skyrl({"trainer": {"algorithm": {"kl_estimator_type": "abs"}}})
    assert (absolute.kl_loss_type, absolute.kl_loss_input_clamp, absolute.kl_loss_output_clamp) == ("abs", None, None)
    with pytest.raises(UnsupportedFrameworkConfig, match=r"kl_estimator_type='k4': not mapped \(k1, abs, k2, k3 are\)"):
        from_skyrl({"trainer": {"algorithm": {"kl_estimator_type": "k4"}}})


def _skyrl_reference(logp, old, ref, adv, ent, mask, *, eps_low, eps_high, kl_coef, ent_coef) -> dict[str, float]:
    """SkyRL's loss for one micro-batch that is the whole mini-batch, on one DP rank, in float64, written from
    NovaSky-AI/SkyRL:

    * policy term, ``loss_reduction="token_mean"``: the advantages divided by the mini-batch's
      ``loss_mask.sum()`` on the driver (skyrl/backends/skyrl_train/utils/ppo_utils.py:1180-1181), the regular
      PPO surrogate ``max(−A·ρ, −A·clamp(ρ, 1−ε_low, 1+ε_high))`` with ``ρ = exp(clamp(logp − old, ±20))``
      (ppo_utils.py:567), summed over the masked tokens (``reduce_loss``, ppo_utils.py:1145-1149);
    * KL term: k3 ``exp(c) − c − 1`` with ``c = clamp(ref − logp, ±20)``, the value clamped to ±10
      (ppo_utils.py ``compute_approx_kl``), then ``masked_mean(kl, mask, dim=-1).mean()`` (worker.py:1077);
    * entropy term: ``masked_mean(entropy, mask)`` over the whole micro-batch (worker.py:1062);
    * ``masked_mean`` divides by ``mask.sum().clamp(min=1)`` (skyrl/backends/skyrl_train/utils/torch_utils.py
      ``masked_mean``);
    * ``loss = policy·dp + (kl_coef·kl − ent_coef·entropy)·microbatch_weight``, reported ÷ dp
      (worker.py:1082-1089): with dp = 1 and one micro-batch (weight 1), ``policy + kl_coef·kl − ent_coef·ent``.
    """
    tokens = mask.sum()
    a = adv / tokens
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    surrogate = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high))
    policy = (surrogate * mask).sum()
    c = torch.clamp(ref - logp, -20.0, 20.0)
    k3 = torch.clamp(torch.exp(c) - c - 1.0, -10.0, 10.0)
    kl = ((k3 * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)).mean()
    entropy = (ent * mask).sum() / mask.sum().clamp(min=1.0)
    loss = policy + kl_coef * kl - ent_coef * entropy
    return {"pg_loss": float(policy), "kl_loss": float(kl), "entropy_loss": float(entropy), "loss": float(loss)}


def test_the_skyrl_mapping_matches_skyrls_own_loss_formula():
    """Three sequences of 4, 2 and 3 loss tokens (padded to 5, one masked token inside the first), log-ratios
    large enough to clip both ways and one KL log-ratio beyond the ±20 clamp; the config is SkyRL's default
    plus ``use_entropy_loss`` (coefficients 0.001 and 0.01), the bundle's counts those of the mini-batch."""
    g = torch.Generator().manual_seed(7)
    shape = (3, 5)
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.float64)
    logp = -torch.rand(shape, generator=g, dtype=torch.float64) * 2.0
    old = logp + (torch.rand(shape, generator=g, dtype=torch.float64) - 0.5) * 0.8
    ref = logp + (torch.rand(shape, generator=g, dtype=torch.float64) - 0.5) * 3.0
    ref[0, 1] = logp[0, 1] + 25.0  # k3 of a clamped 20: e^20 − 21, clamped to 10
    adv = torch.tensor([[1.5] * 5, [-0.7] * 5, [0.3] * 5], dtype=torch.float64)
    ent = torch.rand(shape, generator=g, dtype=torch.float64) * 3.0
    expected = _skyrl_reference(logp, old, ref, adv, ent, mask, eps_low=0.2, eps_high=0.2, kl_coef=0.001,
                                ent_coef=0.01)

    cfg = from_skyrl({"trainer": {"algorithm": {"use_entropy_loss": True}}})
    cfg = msgspec.structs.replace(cfg, loss_token_count=int(mask.sum()), loss_seq_count=3)
    lengths = torch.tensor([5, 2, 3])  # the response lengths; the padding past them is not a token

    def flat(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[i, :int(n)] for i, n in enumerate(lengths)])

    one_micro_batch = dataclasses.replace(LossKnobs.of(cfg), micro_batch=(0, 0, 0))  # clip_ratio's partition
    out = policy_loss_fields(flat(logp), flat(old), flat(adv), flat(ent), flat(mask).to(torch.float32), lengths,
                             eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, entropy_coef=cfg.entropy_coef,
                             dtype=torch.float64, knobs=one_micro_batch, ref_log_probs=flat(ref))
    assert {k: float(out[k]) for k in expected} == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # the clamped KL token dominates: its sequence mean is ≥ 10/4, so SkyRL's kl_loss is ≥ 2.5/3
    assert expected["kl_loss"] > 2.5 / 3
    # one mode for every term (the old refusal's reason) is measurably wrong here
    single = policy_loss_fields(flat(logp), flat(old), flat(adv), flat(ent), flat(mask).to(torch.float32), lengths,
                                eps_clip=0.2, eps_clip_high=0.2, entropy_coef=0.01, dtype=torch.float64,
                                knobs=dataclasses.replace(one_micro_batch, kl_loss_agg_mode=None),
                                ref_log_probs=flat(ref))
    assert abs(float(single["kl_loss"]) - expected["kl_loss"]) > 0.1
