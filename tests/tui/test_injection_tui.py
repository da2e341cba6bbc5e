"""No bundle string reaches the terminal unescaped in the debugger (SPEC §5.2), nor is it read as markup.

Each test opens a bundle whose strings carry one terminal escape sequence (OSC 52, ``ESC[2J``, OSC 8, a C1
CSI, U+202E; see ``injection_bundles``) and reads the screen back from the compositor, cell by cell as
the terminal would get it: no raw control character anywhere, and the escaped text where each string is
shown (title, verdict, identity pane, sample tree, diff title and rows, toasts, the jump dialog, the
error screen)."""

from __future__ import annotations

import pytest

from replay_tui.app import ReplayApp
from replay_tui.screens.error import ErrorScreen
from replay_tui.screens.jump import JumpScreen
from replay_tui.widgets.diff_view import DiffPanel
from replay_tui.widgets.identity_pane import IdentityPane
from replay_tui.widgets.sample_tree import SampleTree

from injection_bundles import SEQUENCES, in_name, is_clean, shown, write_hostile

SIZE = (200, 60)  # wide and tall: the identity pane is shown and long values are not cut


def screen_lines(app) -> list[str]:
    """The screen as the terminal shows it: one string per row, from the compositor's segments."""
    return [strip.text for strip in app.screen._compositor.render_strips()]


def region_text(app, widget) -> str:
    """The cells of ``widget``'s region (border included), row by row."""
    r = widget.region
    strips = app.screen._compositor.render_strips()
    return "\n".join(strip.crop(r.x, r.right).text for strip in strips[r.y:r.bottom])


async def scrolled_text(pilot, pane) -> str:
    """Every row of a scrolling pane, read off the screen a pageful at a time."""
    app = pilot.app
    rows: dict[int, str] = {}
    height = pane.scrollable_content_region.height
    for top in range(0, max(pane.virtual_size.height, 1), height):
        pane.scroll_to(y=top, animate=False, immediate=True)
        await pilot.pause()
        r = pane.scrollable_content_region
        strips = app.screen._compositor.render_strips()
        for i, strip in enumerate(strips[r.y:r.bottom]):
            rows[round(pane.scroll_offset.y) + i] = strip.crop(r.x, r.right).text
    return "\n".join(rows[k] for k in sorted(rows))


def squeezed(text: str) -> str:
    """``text`` without whitespace: a value wrapped over several rows compares as one string."""
    return "".join(text.split())


@pytest.fixture(params=list(SEQUENCES), ids=list(SEQUENCES))
def seq(request) -> str:
    return SEQUENCES[request.param]


@pytest.fixture
def hostile(tmp_path, seq, bundle_tools):
    """A hostile bundle inside a capture directory, under a directory name carrying ``seq`` too."""
    return write_hostile(tmp_path / "capture" / f"bundle{in_name(seq)}", seq, bundle_tools.reseal)


async def ready(pilot) -> None:
    await pilot.app.wait_settled(pilot)


def assert_clean_screen(app) -> str:
    text = "\n".join(screen_lines(app))
    assert is_clean(text), [line for line in screen_lines(app) if not is_clean(line)]
    return text


async def test_every_pane_shows_bundle_strings_escaped(hostile, seq):
    app = ReplayApp(hostile)
    esc = shown(seq)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        text = assert_clean_screen(app)
        lines = screen_lines(app)
        # title: the bundle id and the directory's name
        assert f"replay-tui  b{esc}1 · bundle{shown(in_name(seq))} · rollout-level rollout_id=120" in lines[0]
        # verdict: the first divergence line, exactly as the CLI prints it
        verdict = f"✗ first divergence in reward.post_process — reward s{esc}0: expected=-5.5 actual=-1.0 abs_err=4.5"
        assert verdict in text
        # identity: bundle id, producer commit, weight lineage, micro-batch ids, the warnings' keys and file
        identity = squeezed(await scrolled_text(pilot, app.debugger.query_one(IdentityPane)))
        for value in (f"bundle b{esc}1", f"producer commit c0ffee{esc}", f"micro-batch mb{esc}0, mb{esc}1",
                      f"consumer cb{esc}0", f"weights rollout=w{esc}41 actor=w{esc}42",
                      f"$.config.knob{esc}x: unknown field (ignored)", f"$.extra{esc}field: unknown field (ignored)",
                      f"$.note{esc}: unknown field (ignored)",
                      f"payloads/stray{shown(in_name(seq))}.pt: file not listed in manifest.json (ignored)"):
            assert squeezed(value) in identity, value
        # the sample tree: ids and micro-batches escaped before they are cut to their columns
        tree = region_text(app, app.debugger.query_one(SampleTree))
        assert f"✗ s{esc}"[:10] in tree  # (cut with "…" where the id is wider than its column)
        assert f"mb{esc}"[:7] in tree
        # the diff: a per-sample table of the rewards (its labels), then a sample's tokens (its title)
        diff = region_text(app, app.debugger.query_one(DiffPanel))
        assert f"s{esc}0"[:20] in diff
        await pilot.press("f")  # kl: per token, the panel's title names the sample
        await pilot.pause()
        assert app.debugger.field == "kl"
        diff = region_text(app, app.debugger.query_one(DiffPanel))
        assert f"Diff · kl · s{esc}0" in diff
        assert_clean_screen(app)


async def test_the_jump_dialog_offers_and_takes_the_escaped_ids(hostile, seq):
    app = ReplayApp(hostile)
    esc = shown(seq)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("slash")
        assert isinstance(app.screen, JumpScreen)
        assert f"sample id, e.g. s{esc}0" in "\n".join(screen_lines(app))
        box = app.screen.query_one("#jump-input")
        box.value = f"s{esc}"  # the completion is drawn from the escaped ids
        await pilot.pause()
        await pilot.pause()
        text = assert_clean_screen(app)
        assert f"s{esc}0" in text
        box.value = f"s{seq}9"  # a raw control character typed (or pasted) is quoted escaped
        await pilot.press("enter")
        assert isinstance(app.screen, JumpScreen)
        assert_clean_screen(app)
        assert f"no sample 's{esc}9' in this bundle" in "\n".join(screen_lines(app))
        box.value = f"s{esc}2"  # the escaped form, as the tree shows it, jumps to the sample
        await pilot.press("enter")
        await pilot.pause()
        assert not isinstance(app.screen, JumpScreen)
        assert app.debugger.sample_id == f"s{seq}2"
        assert app.debugger.tree.selected_sample == f"s{seq}2"
        assert_clean_screen(app)


async def test_a_toast_quoting_the_bundle_is_escaped_and_not_markup(hostile, seq):
    app = ReplayApp(hostile)
    esc = shown(seq)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await ready(pilot)
        app.debugger.say(f"[b]no[/b] divergence in s{seq}0", timeout=30)
        await pilot.pause()
        await pilot.pause()
        text = assert_clean_screen(app)
        assert squeezed(f"[b]no[/b] divergence in s{esc}0") in squeezed(text)


async def test_the_error_screen_shows_the_error_line_escaped(tmp_path, seq):
    empty = tmp_path / f"run{in_name(seq)}"
    empty.mkdir()
    app = ReplayApp(empty)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert isinstance(app.screen, ErrorScreen)
        text = assert_clean_screen(app)
        line = f"replay-tui: error: {tmp_path}/run{shown(in_name(seq))}: empty directory"
        assert app.error == (line + " (no manifest.json, no COMPLETE, no bundles)", 3)
        assert squeezed(line) in squeezed(text)
        await pilot.press("q")
    assert app.return_code == 3


MARKUP_IDS = ("[red]x[/red]", "[link=http://x]y[/link]", "[@click=app.quit]z[/]")


@pytest.mark.parametrize("markup", MARKUP_IDS, ids=["style", "link", "action"])
async def test_markup_in_a_sample_id_is_shown_literally(tmp_path, markup, bundle_tools):
    bundle = write_hostile(tmp_path / "b", markup, bundle_tools.reseal)
    app = ReplayApp(bundle)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await ready(pilot)
        await pilot.press("f")  # a token field: the panel's border title names the sample
        await pilot.pause()
        diff = region_text(app, app.debugger.query_one(DiffPanel))
        assert f"Diff · kl · s{markup}0" in diff
        assert f"reward s{markup}0: expected=-5.5" in "\n".join(screen_lines(app))
        app.debugger.say(f"about s{markup}0", timeout=30)
        await pilot.pause()
        await pilot.pause()
        assert squeezed(f"about s{markup}0") in squeezed("\n".join(screen_lines(app)))
        assert app.is_running  # "[@click=app.quit]" did not become an action
