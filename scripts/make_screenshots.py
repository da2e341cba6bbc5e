"""Regenerate ``screenshots/``: SVGs of the debugger's main states, taken from the app itself (Pilot +
``App.save_screenshot``), and a PNG of each when ``rsvg-convert`` (librsvg2-bin) is on the PATH.

    python scripts/make_screenshots.py [--out screenshots] [--no-png]

The bundles are the shipped demos (``replay-tui --demo NAME`` opens each one a screenshot shows) and one broken
copy of pr65-buggy, written to a temporary directory by this torch: the identity pane shows the live torch version
(the snapshot tests use a fixed label instead); only bundle basenames appear on screen.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.pop("NO_COLOR", None)
os.environ["TEXTUAL_ANIMATIONS"] = "none"

# (file stem, bundle, terminal size, keys pressed after the replay finished, caption[, judging: Rules(**it)])
SHOTS = [
    ("overview-120x40", "pr65-buggy", (120, 40), (),
     "replay-tui --demo: the PR #65 bundle opens on its first divergence (reward.post_process, reward s-0)"),
    ("overview-80x24", "pr65-buggy", (80, 24), (),
     "The same at 80×24: identity pane folded away, the divergence line kept whole"),
    ("token-diff", "kl-bug", (120, 40), ("n",),
     "Token diff viewer on a diverging sample after n: kl s-5@7, |err| strip above the rows"),
    ("advantage-diff", "pr65-buggy", (120, 40), ("f", "f", "n"),
     "replay-tui --chain: PR #65 advantages per token (s-0) recomputed from the recomputed rewards: expected "
     "−5.5, −1.0 on every token (teacher-forced, the default, they pass: they broadcast the recorded rewards)",
     {"chain": True}),
    ("error-model", "loose-kl", (120, 40), (),
     "tol and ×noise per row: the bundle's atol 0.1 on advantage.kl; s-1@2 is 2.5× its tolerance (a divergence), "
     "s-1@5 0.5× (noise); the DAG shows each stage's largest ×noise"),
    ("hazards", "hazard-clean", (120, 40), ("z",),
     "A passing bundle with a hazard (group g-1's raw rewards are equal: its advantages are all 0): ⚠ on the "
     "verdict line and in the sample tree; z lists the hazards, enter shows the sample"),
    ("samples-diverging", "kl-bug", (120, 40), ("2", "d"),
     "Sample tree filtered to diverging samples (d), with mismatch counts per sample"),
    ("loss-table", "loss-bug", (120, 40), ("1",),
     "Stage DAG on a step bundle whose loss.policy diverges; the cohort loss table below"),
    ("cohort-pass", "cohort-2rank", (120, 40), ("f", "f"),
     "A passing two-rank cohort: loss fields per rank, all within tolerance"),
    ("support-row", "support-fullvocab", (120, 40), ("n",),
     "replay-tui --demo support-fullvocab: log-probs scored over the full vocabulary; under the diff, the "
     "support row of the token under the cursor (members by logit, the sampled one highlighted)"),
    ("verl-dapo", "verl-dapo", (120, 40), (),
     "replay-tui --demo verl-dapo: a token-mean + dual-clip + clip-higher step whose denominator is wrong: the "
     "recorded scalars disagree with the recorded per-sample terms aggregated over the all-reduced token count"),
    ("nemo-loo", "nemo-loo", (120, 40), (),
     "replay-tui --demo nemo-loo: leave-one-out baseline; a zero-std group (a hazard, never failed) beside a real "
     "divergence"),
    ("help", "pr65-buggy", (120, 40), ("question_mark",), "? / F1: the legend, then every key by pane"),
    ("palette", "pr65-buggy", (120, 40), ("ctrl+p", *"diverg"),
     "ctrl+p: the command palette lists the same actions as the key bindings"),
    ("error-invalid-bundle", "broken", (120, 40), (),
     "An invalid bundle: the CLI's one-line error and exit code 3, in the app"),
]


def png_from_svg(svg: Path, png: Path) -> None:
    """librsvg collapses Textual's non-breaking spaces; give it plain, preserved spaces instead."""
    text = svg.read_text(encoding="utf-8").replace("&#160;", " ")
    text = re.sub(r"<svg ", '<svg xml:space="preserve" ', text, count=1)
    with tempfile.NamedTemporaryFile("w", suffix=".svg", delete=False, encoding="utf-8") as tmp:
        tmp.write(text)
    try:
        subprocess.run(["rsvg-convert", "-o", str(png), tmp.name], check=True)
    finally:
        os.unlink(tmp.name)


async def shoot(bundle: Path, size, keys, out: Path, stem: str, judging: Optional[dict] = None) -> None:
    from replay_lib.judge.error_model import Rules
    from replay_tui.app import ReplayApp

    app = ReplayApp(bundle, rules=Rules(**(judging or {})))
    async with app.run_test(size=size) as pilot:
        await app.wait_settled(pilot)
        if keys:
            await pilot.press(*keys)
            await app.workers.wait_for_complete()
            await pilot.pause()
        app.save_screenshot(f"{stem}.svg", path=str(out))


def main() -> int:
    p = argparse.ArgumentParser(description="Regenerate the debugger screenshots.")
    p.add_argument("--out", type=Path, default=ROOT / "screenshots")
    p.add_argument("--no-png", action="store_true")
    args = p.parse_args()
    from replay_lib.demo import write_demos, write_pr65

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    make_png = not args.no_png and shutil.which("rsvg-convert") is not None
    with tempfile.TemporaryDirectory(prefix="replay-shots-") as tmp:
        root = Path(tmp)
        write_demos(root)
        (write_pr65(root / "broken") / "COMPLETE").unlink()  # an unpublished bundle: the error screen
        cwd = os.getcwd()
        os.chdir(root)  # the error screen names the bundle by the (relative) path it was given
        try:
            for stem, name, size, keys, caption, *judging in SHOTS:
                asyncio.run(shoot(Path(name), size, keys, out, stem, *judging))
                if make_png:
                    png_from_svg(out / f"{stem}.svg", out / f"{stem}.png")
                print(f"{stem}: {caption}")
        finally:
            os.chdir(cwd)
    if not make_png and not args.no_png:
        print("rsvg-convert not found: SVGs only (apt-get install librsvg2-bin for PNGs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
