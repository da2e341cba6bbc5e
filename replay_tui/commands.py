"""Command palette provider: the same actions as the key bindings (one command per pane action)."""

from __future__ import annotations

from functools import partial

from textual.command import CommandPalette, DiscoveryHit, Hit, Hits, Provider, SearchIcon

from .keys import KeyAction, key_actions, key_display


def command_title(ka: KeyAction) -> str:
    """The binding's tooltip (its first clause), prefixed by the pane it acts in."""
    title = ka.tooltip.split(" (")[0].split(";")[0] or ka.description
    if ka.pane == "main":
        return title
    return f"{ka.section.split()[0]}: {title}"


def _help_line(keys: list[str], tooltip: str, title: str) -> str:
    """``key tab``, then what the tooltip says beyond the title (the title is not repeated under itself)."""
    rest = tooltip[len(title):].lstrip(" ;,") if tooltip.startswith(title) else tooltip
    rest = rest[1:-1] if rest.startswith("(") and rest.endswith(")") else rest
    return f"key {', '.join(keys)}" + (f" · {rest}" if rest else "")


class ReplayPalette(CommandPalette):
    """Textual's palette with an ASCII prompt mark: its magnifier emoji is a missing glyph in many terminal
    fonts (a box at 80×24 over SSH)."""

    def on_mount(self) -> None:
        self.query_one(SearchIcon).icon = ">"


class ReplayCommands(Provider):
    """Lists every binding's action; running one focuses its pane first, as the key would act there."""

    def _commands(self) -> list[tuple[str, str, KeyAction]]:
        """One command per title: two bindings of the same command (``q`` and ``ctrl+q`` both quit) are
        one entry listing both keys."""
        first: dict[str, KeyAction] = {}
        keys: dict[str, list[str]] = {}
        for ka in key_actions():
            if ka.pane == "runs":  # the run view's keys act on its table, not on the debugger the palette serves
                continue
            title = command_title(ka)
            first.setdefault(title, ka)
            keys.setdefault(title, []).extend(k for k in ka.keys if k not in keys.get(title, ()))
        # keys as the key bar and the help show them ("/", "^p"), not by their names ("slash", "ctrl+p")
        return [(title, _help_line([key_display(k) for k in keys[title]], ka.tooltip, title), ka)
                for title, ka in first.items()]

    async def _run(self, ka: KeyAction) -> None:
        from .screens.main import DebuggerScreen

        screen = self.app.screen
        if not isinstance(screen, DebuggerScreen):
            return
        if ka.pane == "main":
            await self.app.run_action(ka.action, screen)
            return
        target = screen.pane_widget(ka.pane)
        target.focus()
        await self.app.run_action(ka.action, target)

    async def discover(self) -> Hits:
        for title, help_text, ka in self._commands():
            yield DiscoveryHit(title, partial(self._run, ka), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, ka in self._commands():
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), partial(self._run, ka), text=title, help=help_text)
