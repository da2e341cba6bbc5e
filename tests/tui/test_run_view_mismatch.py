"""The run view's mismatch plot (``widgets/mismatch_plot.py``): the rollout-vs-old log-prob mismatch of each
step over a real capture directory, scanned by the real library in a worker process.

Five step bundles written by the capture, each with two of its four loss tokens at rollout = old − δ, δ =
0.125, 0.125, 0.125, 1.0, 0.125: max |Δ| = δ, k3 = 2·(e^δ − 1 − δ)/4 (0.00407 for 0.125, 0.359 for 1.0), and the
series jumps at step 0:3 (change 0.875 = the whole range; the other changes are 0)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SIZE = (140, 40)
DELTAS = [0.125, 0.125, 0.125, 1.0, 0.125]


@pytest.fixture(scope="module")
def mismatch_run(tmp_path_factory) -> Path:
    from capture import CaptureConfig, ReplayCapture
    from replay_lib.bundle.schema import RecomputeConfig

    root = tmp_path_factory.mktemp("mismatch-run") / "capture"
    cfg = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=2, grpo_std_normalization=False,
                          kl_loss_type="k1", kl_coef=0.0, eps_clip=0.2, eps_clip_high=0.2, entropy_coef=0.0)
    cap = ReplayCapture(CaptureConfig(enabled=True, directory=root), cfg, register_atexit=False)
    for s, delta in enumerate(DELTAS):
        step = cap.begin_step(0, s)
        assert step.add_micro_batch(
            sample_ids=[f"s{s}-0", f"s{s}-1"], group_index=[0, 0], response_lengths=[3, 2], total_lengths=[8, 7],
            loss_mask=torch.tensor([1, 1, 1, 1, 0]), log_probs=torch.zeros(5), old_log_probs=torch.zeros(5),
            advantages=torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0]), entropy=torch.zeros(5),
            raw_rewards=[0.0, 1.0], rewards=[-1.0, 1.0], rollout_log_probs=torch.tensor([0.0, -delta, 0.0, -delta, -7.0]),
        )
        assert step.finish({"loss": 0.0, "pg_loss": 0.0, "entropy_loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0})
    assert cap.close(timeout=60)
    return root


async def _scanned(pilot) -> None:
    app = pilot.app
    for _ in range(400):
        await app.workers.wait_for_complete()
        await pilot.pause()
        if app.settled:
            return
    raise TimeoutError("the scan never finished on screen")


def _screen_text(app) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


async def test_the_run_view_plots_the_mismatch_and_names_the_jump(mismatch_run):
    from replay_tui.screens.run import RunApp
    from replay_tui.widgets.mismatch_plot import MismatchPlot

    app = RunApp(mismatch_run, jobs=1)
    async with app.run_test(size=SIZE) as pilot:
        await _scanned(pilot)
        plot = app.run_screen.query_one(MismatchPlot)
        assert plot.display is True
        text = _screen_text(app)
        assert "rollout≠old max|Δ| ▂▂▂█▂  0:0…0:4  peak 1 · k3 peak 0.359 · jump at step 0:3" in text
        assert "change 0.875 at step 0:3 ≥ 0.5 × range 0.875 and ≥ 5 × the other changes' median 0" in text
        # the line under the table: the row under the cursor (step 0:0) with its mismatch
        assert "step-0-0 · step 0:0 · rollout≠old 2/4 max|Δ| 0.125 k3 0.00407" in text
        await pilot.press("down", "down", "down")
        assert "step-0-3 · step 0:3 · rollout≠old 2/4 max|Δ| 1 k3 0.359" in _screen_text(app)
        assert app.exit_code == 0
        await pilot.press("q")


async def test_the_plot_is_hidden_when_no_step_records_rollout_log_probs(tmp_path):
    from replay_lib.demo import bundles as demo
    from replay_lib.bundle.schema import ActorStepId
    from replay_tui.screens.run import RunApp
    from replay_tui.widgets.mismatch_plot import MismatchPlot

    for r in (1, 2):
        parts = demo.synthetic_parts(samples=4, tokens=3, seed=r, bundle_id=f"b{r}",
                                     anchor=ActorStepId(rollout_id=r, step_id=0), settle=True)
        demo.write_bundle(tmp_path / f"b{r}", *parts)
    app = RunApp(tmp_path, jobs=1)
    async with app.run_test(size=SIZE) as pilot:
        await _scanned(pilot)
        assert app.run_screen.query_one(MismatchPlot).display is False
        assert "rollout≠old" not in _screen_text(app)
        await pilot.press("q")


def test_plot_lines_without_an_app():
    from replay_lib.run.rows import ScanRow, ScanTarget
    from replay_tui.widgets.mismatch_plot import plot_lines

    def row(step, m):
        t = ScanTarget(Path(f"/x/{step}"), f"s{step}", "step", 0, step, f"0:{step}")
        return ScanRow(target=t, status="pass", exit_code=0,
                       mismatch={"max_abs": m, "k3": m / 10, "count": 1, "tokens": 4})

    # given out of order: drawn in the scan's order; a steady rise is a drift (τ = +1)
    lines = plot_lines([row(2, 0.3), row(0, 0.1), row(1, 0.2), row(3, 0.4)])
    assert lines == ("rollout≠old max|Δ| ▃▅▆█  0:0…0:3  peak 0.4 · k3 peak 0.04 · drift",
                     "Kendall τ +1.00 (|τ| ≥ 0.6): growing")
    assert plot_lines([]) is None
