"""SkyRL's Clip-Cov and KL-Cov as the producer, from a reference written from its code (SkyRL cannot be
pip-installed here): NovaSky-AI/SkyRL @ a9564572, ``skyrl/backends/skyrl_train/utils/ppo_utils.py``
(``ppo_utils.py``) ``compute_policy_loss_clip_cov`` (:938-999), ``compute_policy_loss_kl_cov`` (:1001-1053),
``reduce_loss`` (:1145-1149), ``apply_loss_reduction_to_advantages_minibatch`` (:1152-1220), and
``skyrl/train/config/config.py`` ``ClipCovConfig`` / ``KLCovConfig`` (:727-745). Each function below is that
code's formula in float64 torch, cited by line; none calls ``replay_lib.kernels``.

Where SkyRL differs from verl (core_algos.py:1744-1925 in 0.9.1): its loss function is handed the advantages
already divided by the loss reduction's normalizer and sums, so the covariance ranks the pre-scaled advantages
(under ``sequence_mean`` a different order than the raw ones) and KL-Cov's penalty ``ppo_kl_coef·|Δ|`` is not
normalized; KL-Cov reports ``clip_ratio`` 0.0 (no metric); ``kl_cov_frac`` defaults to 0.2 (verl's
``kl_cov_ratio`` 0.0002). Clip-Cov's random draw is recorded as the bundle's ``clip_cov_mask``. Every bundle is
mapped by ``from_skyrl`` and replays with 0 divergences in float32 and bf16; taken with verl's semantics
(``advantages="raw"``) it diverges at loss.policy."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, ComparisonPolicy, Identity, Manifest,
                                      SampleRecord, stage_contracts)
from replay_lib.demo import producer
from replay_lib.frameworks import from_skyrl

from .test_skyrl import B, F64, N, STAGES, _step, approx_kl, grpo, loss_reduction, masked_mean

# name → (trainer.algorithm, micro_train_batch_size_per_gpu). The pre-scaled advantages are ~A/T: Clip-Cov's
# bounds are set where their covariances lie (the default (1, 5) selects nothing at this scale)
CONFIGS = {
    "clip-cov-token-mean": ({"policy_loss_type": "clip_cov", "clip_cov": {
        "clip_ratio": 0.1, "clip_cov_lb": 1e-4, "clip_cov_ub": 0.05}}, 3),
    "clip-cov-sequence-mean": ({"policy_loss_type": "clip_cov", "loss_reduction": "sequence_mean",
                                "eps_clip_high": 0.28, "clip_cov": {"clip_ratio": 0.1, "clip_cov_lb": 1e-4,
                                                                    "clip_cov_ub": 0.05}}, 3),
    "kl-cov-token-mean": ({"policy_loss_type": "kl_cov"}, 3),  # config.py:739-745 defaults: 0.2, 1.0
    "kl-cov-sequence-mean": ({"policy_loss_type": "kl_cov", "loss_reduction": "sequence_mean",
                              "kl_cov": {"kl_cov_frac": 0.1, "ppo_kl_coef": 0.5}}, 4),
}


def skyrl_config(name: str) -> dict:
    algo, micro = CONFIGS[name]
    return {"trainer": {"algorithm": {"use_kl_loss": True, "kl_loss_coef": 0.001, **algo},
                        "micro_train_batch_size_per_gpu": micro}, "generator": {"n_samples_per_prompt": N}}


def clip_cov_loss(logp, old, adv, loss_mask, algo, g):
    """ppo_utils.py:938-999: r = exp(logp − old) (:959-960, no clamp); surr1 −A·r, surr2 −A·clamp(r, 1 − εl,
    1 + εh) (:962-964); clip_by_origin = (surr2 > surr1) ∧ mask (:965); cov = (A − masked_mean(A))·(logp −
    masked_mean(logp)) over the micro-batch (:968-970), −inf at masked or clipped tokens (:971-972); clip_num =
    max(int(ratio·Σ mask), 1) (:975); a randperm draw of that many of the tokens with lb < cov < ub (:976-982);
    corr 0 there (:985-987); clip_ratio = masked_mean(corr == 0) (:990); Σ max(surr1, surr2)·corr·mask
    (:993-995, reduce_loss :1145-1149). Returns the loss, clip_ratio and the corr == 0 tokens."""
    cc = algo.get("clip_cov", {})
    ratio_k, lb, ub = cc.get("clip_ratio", 0.0002), cc.get("clip_cov_lb", 1.0), cc.get("clip_cov_ub", 5.0)
    ratio = torch.exp(logp - old)
    surr1 = -adv * ratio
    surr2 = -adv * ratio.clamp(1 - algo.get("eps_clip_low", 0.2), 1 + algo.get("eps_clip_high", 0.2))
    clip_by_origin = (surr2 > surr1) & (loss_mask > 0)
    cov = (adv - masked_mean(adv, loss_mask)) * (logp - masked_mean(logp, loss_mask))
    cov[loss_mask == 0] = -torch.inf
    cov[clip_by_origin] = -torch.inf
    clip_num = max(int(ratio_k * loss_mask.sum().item()), 1)
    idx = torch.nonzero((cov < ub) & (cov > lb) & (loss_mask > 0))
    if len(idx) > 0:
        idx = idx[torch.randperm(len(idx), generator=g)[: min(clip_num, len(idx))]]
    corr = torch.ones_like(adv)
    corr[idx[:, 0], idx[:, 1]] = 0
    clip_ratio = masked_mean((corr == 0).to(F64), loss_mask)
    return (torch.maximum(surr1, surr2) * corr * loss_mask).sum(), float(clip_ratio), corr == 0


def kl_cov_loss(logp, old, adv, loss_mask, algo):
    """ppo_utils.py:1001-1053: Δ = logp − old, r = exp(Δ) (:1019-1021, no clamp); −A·r, + ppo_kl_coef·|Δ| on the
    top max(1, int(n·kl_cov_frac)) loss tokens by (A − mean A)·(logp − mean logp) over the micro-batch's loss tokens
    (:1027-1048); Σ loss·mask (:1050); clip_ratio 0.0 (:1053)."""
    kc = algo.get("kl_cov", {})
    frac, coef = kc.get("kl_cov_frac", 0.2), kc.get("ppo_kl_coef", 1.0)
    d = logp - old
    pg = -adv * torch.exp(d)
    valid = loss_mask > 0
    a, lp = adv[valid], logp[valid]
    if len(a) > 0:
        cov = (a - a.mean()) * (lp - lp.mean())
        k = max(1, int(len(cov) * frac))
        top = torch.topk(cov, min(k, len(cov)), largest=True).indices
        flat = torch.nonzero(valid.reshape(-1), as_tuple=True)[0][top]
        pg = pg.reshape(-1).clone()
        pg[flat] = pg[flat] + coef * d.reshape(-1)[flat].abs()
        pg = pg.reshape(adv.shape)
    return (pg * loss_mask).sum(), 0.0


def train_step(algo, micro, logp, old, ref, scaled, loss_mask, seed, *, verl_penalty=False):
    """worker.py:876-898 / :913-1110 per micro-batch (test_skyrl.train_step): the policy loss summed, the KL term
    coef·mean_i(masked_mean_t(k3)) weighted by len(mb)/len(batch), clip_ratio averaged over the micro-batches."""
    g = torch.Generator().manual_seed(seed)
    pg = kl_term = 0.0
    clips = []
    selected = torch.zeros_like(loss_mask, dtype=torch.bool)
    for start in range(0, B, micro):
        sl = slice(start, min(start + micro, B))
        if algo["policy_loss_type"] == "clip_cov":
            policy, clip, sel = clip_cov_loss(logp[sl], old[sl], scaled[sl], loss_mask[sl], algo, g)
            selected[sl] = sel
        else:
            policy, clip = kl_cov_loss(logp[sl], old[sl], scaled[sl], loss_mask[sl], algo)
        pg += float(policy)
        clips.append(clip)
        kl = approx_kl(logp[sl], ref[sl], loss_mask[sl], "k3")
        kl_term += float(masked_mean(kl, loss_mask[sl], dim=-1).mean()) * (sl.stop - sl.start) / B
    out = {"pg_loss": pg, "loss": pg + 0.001 * kl_term, "kl_loss": kl_term}
    if algo["policy_loss_type"] == "clip_cov":
        out["pg_clipfrac"] = sum(clips) / len(clips)
    return out, selected


def write_cov_bundle(path, name: str, seed: int, dtype: torch.dtype, params=None) -> str:
    """The step's bundle; ``params``: policy_loss_params written instead of the mapping's (a wrong mapping)."""
    algo, micro = CONFIGS[name]
    lengths, response_mask, loss_mask, old, logp, ref, scores = _step(seed, dtype)
    index = [i // N for i in range(B)]
    adv, normalized = grpo(scores, response_mask, index)
    scaled = loss_reduction(adv, loss_mask, algo.get("loss_reduction", "token_mean"), micro, None)
    policy, selected = train_step(algo, micro, logp, old, ref, scaled, loss_mask, seed)
    cfg = from_skyrl(skyrl_config(name))
    cfg = msgspec.structs.replace(cfg, loss_token_count=int(loss_mask.sum()), loss_seq_count=B)
    if params is not None:
        cfg = msgspec.structs.replace(cfg, policy_loss_params={**cfg.policy_loss_params, **params})
    mb_of = {i: f"mb-{i // micro}" for i in range(B)}
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=index[i], response_length=int(lengths[i]),
                            total_length=int(lengths[i]) + 7, loss_mask=[int(v) for v in loss_mask[i, :lengths[i]]],
                            raw_reward=float(scores[i]), micro_batch_id=mb_of[i]) for i in range(B)]
    bundle_index = BundleIndex(bundle_id=f"skyrl-{name}", samples=samples, config=cfg, identity=Identity(
        actor_step_id=ActorStepId(rollout_id=1, step_id=0), micro_batch_ids=sorted(set(mb_of.values()))))
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=f"skyrl-{name}", producer=producer(),
                        stage_contracts=stage_contracts(STAGES), payloads={}, comparison_policy=ComparisonPolicy(),
                        redaction={})
    expected = {"reward.post_process": {"rewards": [float(v) for v in normalized]}, "loss.policy": policy}
    writer = BundleWriter(path, manifest, bundle_index, expected)
    valid = response_mask.bool()
    for pname, values in {"log_probs": logp, "old_log_probs": old, "advantages": adv, "ref_log_probs": ref}.items():
        writer.write_payload(pname, values[valid].to(dtype))
    if algo["policy_loss_type"] == "clip_cov":
        assert int(selected.sum()) >= 1
        writer.write_payload("clip_cov_mask", selected[valid].to(torch.uint8))
    return writer.finalize(ranks=[0])


def _replay(cli, bundle):
    code, out, err = cli("replay", bundle, "--format", "json")
    return code, json.loads(out), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [7, 8])
def test_skyrl_cov_step_replays_clean(tmp_path, cli, name, dtype, seed):
    code, report, err = _replay(cli, write_cov_bundle(tmp_path / "b", name, seed, dtype))
    loss = next(s for s in report["stages"] if s["stage"] == "loss.policy")
    assert (code, err, report["first_divergent_stage"]) == (0, "", None), loss
    # clip_cov: loss, pg_loss, pg_clipfrac, kl_loss and the draw's size in each of the 3 micro-batches
    assert loss["compared"] == (4 + 3 if name.startswith("clip") else 3)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_verl_semantics_on_a_skyrl_step_diverge(tmp_path, cli, name):
    """The same bundle read with verl's semantics (the raw advantages' covariance, the penalty normalized)
    diverges at loss.policy: the difference is real on these steps."""
    code, report, _ = _replay(cli, write_cov_bundle(tmp_path / "b", name, 7, torch.float32,
                                                    params={"advantages": "raw"}))
    assert (code, report["first_divergent_stage"]) == (1, "loss.policy"), report["first_divergence"]
    if name.startswith("kl"):  # Clip-Cov's draw-size field has no hypothesis value: only KL-Cov's is named
        assert report["explanations"][0]["hypothesis"] == "loss.cov_advantage_scaling", report["explanations"]


def test_from_skyrl_maps_the_cov_losses_with_their_defaults():
    cfg = from_skyrl({"trainer": {"algorithm": {"policy_loss_type": "kl_cov"}}})
    assert (cfg.policy_loss, cfg.policy_loss_params, cfg.log_ratio_clamp) == (
        "kl_cov", {"kl_cov_ratio": 0.2, "ppo_kl_coef": 1.0, "advantages": "prescaled"}, None)
    cfg = from_skyrl({"trainer": {"algorithm": {"policy_loss_type": "clip_cov"}}})
    assert (cfg.policy_loss, cfg.policy_loss_params, cfg.log_ratio_clamp) == (
        "clip_cov", {"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "advantages": "prescaled"},
        None)
    # the off-policy correction is not applied by either loss function: not mapped onto them
    cfg = from_skyrl({"trainer": {"algorithm": {"policy_loss_type": "kl_cov", "off_policy_correction": {
        "tis_ratio_type": "token"}}}})
    assert (cfg.is_level, bool(cfg.is_keep)) == (None, False)
