"""The debugger's memory grows with the step by less than its payloads do (issue 40: ≤ 1.5× the payload bytes).

The app keeps what its views draw, not the step: a per-token field judged over the whole step for the model (its
divergent marks, the kl the app opens on) lets its payload pages go behind the pass as the runner's stages do
(``FieldResult.release``), and the model's context keeps format 1.3's packed mask instead of the replay's float32
one (``StageContext.drop_mask``; the views read a window, ``mask_rows``). Measured in fresh processes at the first
frame of ``ReplayApp.run_test`` (120 × 40), as the growth between two bundle sizes per added payload byte
(``VmHWM``; the interpreter, torch and Textual cancel out): 1.30–1.36 before, ≈ 0.58 now; and the payload pages left
resident then (``RssFile``): 37 MiB of the 75 MiB added before (the kl and both log-prob payloads), none now.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from replay_lib.bundle import open_bundle
from replay_lib.demo.bundles import write_synthetic, write_verl_dapo
from replay_lib.kernels.loss import LossKnobs, agg_weights
from replay_lib.run.runner import replay_run
from replay_tui.model import build_model

ROOT = Path(__file__).resolve().parents[2]

# The child's own high-water mark since exec (VmHWM; ru_maxrss would start at the forking pytest's RSS).
CHILD = (
    "import asyncio, json, sys\n"
    "def status(key):\n"
    "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(key + ':'))\n"
    "from replay_tui.app import ReplayApp\n"
    "async def main():\n"
    "    app = ReplayApp(sys.argv[1])\n"
    "    async with app.run_test(size=(120, 40)) as pilot:\n"
    "        await app.wait_settled(pilot)\n"
    "        print(json.dumps({'code': app.exit_code, 'sample': app.debugger.sample_id, 'peak': status('VmHWM'),\n"
    "                          'file': status('RssFile')}))\n"
    "asyncio.run(main())\n"
)

# First-frame peak growth per added payload byte: ≈ 0.58 measured, 1.30–1.36 before (module docstring).
GROWTH_LIMIT = 1.0
# Payload pages still resident at the first frame, per added payload byte: ≈ 0 now, 0.47 before.
RESIDENT_LIMIT = 0.1


def _first_frame(bundle: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(bundle)], capture_output=True, text=True, env=env,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["code"] == 0 and result["sample"] == "s-0"  # the clean step, open on its first sample's kl
    return result


def _payload_bytes(bundle: Path) -> int:
    return sum(f.stat().st_size for f in (bundle / "payloads").iterdir())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status and MADV_DONTNEED")
def test_the_first_frame_grows_by_less_than_the_payloads_and_leaves_no_payload_page_resident(tmp_path):
    small = write_synthetic(tmp_path / "small", samples=128, tokens=8192, format_version="1.3.0")
    large = write_synthetic(tmp_path / "large", samples=512, tokens=8192, format_version="1.3.0")
    added = _payload_bytes(large) - _payload_bytes(small)
    assert added == 3 * 128 * 8192 * (6 * 4 + 1)  # six float32 payloads (kl and ref_log_probs too), the uint8 mask
    a, b = _first_frame(small), _first_frame(large)
    growth = (b["peak"] - a["peak"]) * 1024 / added
    assert growth <= GROWTH_LIMIT, f"the first frame's peak grew by {growth:.2f}× the added payload bytes"
    resident = (b["file"] - a["file"]) * 1024 / added
    assert resident <= RESIDENT_LIMIT, f"{resident:.2f}× the added payload bytes left resident at the first frame"


def _model(bundle: Path):
    bundles = open_bundle(bundle)
    report, contexts = replay_run(bundles)
    return build_model(bundles, report, contexts=contexts)


def test_the_model_keeps_the_packed_mask_and_its_views_read_the_same_values(tmp_path):
    """The model's context lets go of the replay's whole-step float32 mask (4 bytes a token, 512 MiB at 134M
    tokens); the why strip's mask and a sample's mask count read the packed payload and show the same values."""
    model = _model(write_synthetic(tmp_path / "b", samples=8, tokens=40, format_version="1.3.0", seed=3))
    shard = model.shards[0]
    ctx = shard.ctx
    assert ctx._mask is None
    packed = shard.reader.packed_mask.to(torch.float32)
    assert 0 < int(packed.sum()) < 320
    assert [int(ctx.mask_rows(t, t + 1)[0]) for t in range(320)] == packed.to(torch.int64).tolist()
    assert torch.equal(ctx.mask_rows(40, 80), packed[40:80])
    for t in (0, 45, 319):
        inputs = dict(model.element_inputs("kl", model.samples[t // 40].sample_id, t % 40).items)
        assert inputs["mask"] == str(int(packed[t]))
    assert ctx._mask is None
    assert ctx.loss_mask.dtype == torch.float32 and torch.equal(ctx.loss_mask, packed)  # a stage still gets it whole


def test_a_view_s_recompute_lets_the_whole_mask_go_and_counts_each_sample_s_mask_in_chunks(tmp_path):
    """pg_contribution (verl-dapo: token_mean over loss_token_count, loss_scale 4) weighs each sample's pg_sum by
    its mask count, counted a chunk of the packed mask at a time: the same weights as the whole float32 mask's
    index_add, and the context holds no whole-step mask afterwards."""
    model = _model(write_verl_dapo(tmp_path / "dapo"))
    shard = model.shards[0]
    ctx = shard.ctx
    terms = model.field_diff("pg_contribution")
    assert ctx._mask is None
    packed = shard.reader.packed_mask.to(torch.float64)
    counts = torch.zeros(16, dtype=torch.float64).index_add_(0, ctx.seg, packed)
    knobs = LossKnobs.of(ctx.config)
    weights = agg_weights(knobs.loss_agg_mode, counts, knobs) * knobs.loss_scale
    assert torch.equal(shard.results["pg_contribution"].actual, shard.results["pg_sum"].actual * weights)
    assert abs(terms.row(terms.labels.index("s-0"))[0] - float(shard.results["pg_sum"].expected[0]) * 4 / 824) < 1e-15



async def test_a_replay_run_again_holds_one_model(make_app):
    """The first replay's model reaches the screen once; the app keeps no second reference to it (its start-up
    hand-off held it for the app's life), so a replay run again (the rerun key, the error screen's retry) leaves
    the old model to the collector: two models of a large step never live side by side."""
    from replay_tui.app import release_frozen

    app = make_app("pr65-buggy")
    async with app.run_test(size=(120, 40)) as pilot:
        await app.wait_settled(pilot)
        first = weakref.ref(app.model)
        assert app._first_result is None
        app.start_replay()
        await app.wait_settled(pilot)
        assert app.model is not None and app.model is not first()
        release_frozen()
        assert first() is None


def test_a_view_of_one_field_materializes_no_other_field_s_columns(tmp_path):
    """The per-sample and cohort tables read their own field's columns (``ShardRecompute.values``/``errors``/``bad``
    per name): opening the loss table after a sample's kl and advantage no longer materialized every computed
    per-token field's float64 columns over the whole step (≈ 130 bytes a token for the two: 2,048 × 16,384 went
    from 330 MiB to 4.4 GiB on that key)."""
    model = _model(write_synthetic(tmp_path / "b", samples=40, tokens=8192, format_version="1.3.0"))
    shard = model.shards[0]
    sample = model.samples[3].sample_id
    for name in ("kl", "advantage"):
        assert model.field_diff(name, sample).bad_tensor.numel() == 8192
    for name in ("loss", "reward", "raw_reward"):
        assert model.field_diff(name).labels
    token_fields = [name for name, r in shard.results.items() if r.per == "token"]
    assert sorted(token_fields) == ["advantage", "kl"]
    assert all(shard.results[name]._full is None for name in token_fields)  # judged a chunk at a time, nothing kept
    assert set(shard.values) == set(shard.results) and "kl" in shard.bad and "loss" in shard.errors
    assert torch.equal(shard.values["kl"][0], shard.results["kl"].expected)  # looked up: that field's own columns
