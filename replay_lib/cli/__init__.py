"""``trajectory-replay``: the headless command line (never imports Textual).

* ``entry`` — the entry point (:func:`main`; the console script :func:`console_main`): the parser, the dispatch, ``inspect`` / ``validate`` / ``replay`` / ``demo``;
* one module per other command: ``scan``, ``diff``, ``importing`` (``import``), ``config``;
* ``options`` — the replay arguments ``replay``, ``scan`` and ``replay-tui`` share;
* ``output`` — :func:`emit`, below every command, so no command imports the entry point.

The top room of ``replay_lib``: it may import every other room; none imports it.
"""

from .entry import build_parser, console_main, end_process, error_line, main, print_internal_error, run_check
from .options import add_replay_arguments, add_selection_arguments, replay_options
from .output import emit

__all__ = ["add_replay_arguments", "add_selection_arguments", "build_parser", "console_main", "emit", "end_process",
           "error_line", "main",
           "print_internal_error", "replay_options", "run_check"]
