"""Error classes; each carries the documented process exit code (SPEC §5)."""

from __future__ import annotations

EXIT_PASS = 0
EXIT_DIVERGENCE = 1
EXIT_USAGE = 2
EXIT_INVALID = 3
EXIT_UNSUPPORTED = 4
# A bug in this tool (an exception nobody expected): one line naming the saved traceback, never 1.
EXIT_INTERNAL = 5


class ReplayError(Exception):
    """Base class. ``str(err)`` is the one line printed on stderr."""

    exit_code = EXIT_INVALID


class BundleError(ReplayError):
    """The bundle is invalid, incomplete, unsafe or ambiguous; nothing was recomputed (exit 3)."""

    exit_code = EXIT_INVALID


class SelectionError(ReplayError):
    """A selection (--sample/--group/--batch/--step/--rollout) cannot be satisfied exactly (exit 3)."""

    exit_code = EXIT_INVALID


class UnsupportedError(ReplayError):
    """The topology, stage or a config knob is not implemented; nothing was guessed (exit 4)."""

    exit_code = EXIT_UNSUPPORTED


class UsageError(ReplayError):
    """Bad command line (exit 2)."""

    exit_code = EXIT_USAGE


class FrameworkConfigError(ReplayError):
    """A framework's configuration or dump is malformed (a value of the wrong type, a missing key, another
    format version): one line naming the file and the key (exit 3)."""

    exit_code = EXIT_INVALID


class UnsupportedFrameworkConfig(UnsupportedError):
    """A framework setting whose math this tool cannot recompute, or a key the mapping does not know whose
    value could change the math: refused by name, never mapped to a silent default (exit 4)."""

    exit_code = EXIT_UNSUPPORTED
