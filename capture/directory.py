"""What a capture directory already holds when a producer starts (SPEC §6).

Two things a job meets in a directory it did not just create:

* **A previous run's bundles.** A restarted job writes the same names again (``rollout-<R>``,
  ``step-<R>-<S>``, ``<bundle>/rank-<r>/``); the writer never overwrites, so without a check every record
  would fail on the writer thread while the job runs on and captures nothing. :func:`check_fresh_directory`
  refuses at enable time instead, in one line, with the two ways out: a fresh directory, or
  ``RELAX_REPLAY_CAPTURE_RUN_ID=<id>`` (bundles under ``<DIR>/<id>/``; an id already used refuses the same
  way). Only names this producer could write count: those its step/rollout filters select, and for a
  cohort rank, the cohorts it would publish a shard into.

  Several ranks of one job enable concurrently into one directory, and a fast rank may publish its first
  shard before a slow one enables, so "present at enable" cannot mean "a previous run's". A cohort
  directory counts as taken by an earlier run when it holds what this rank would publish itself
  (``rank-<r>/`` or ``COMPLETE.<r>``), a final ``COMPLETE`` (which needs this rank's shard, so it cannot be
  this job's yet), a single-producer bundle, or another rank's shard written before this *process*
  started: the ranks of one job start before any of them publishes (they join one process group before
  they train), so a peer's shard is never older than this process. No marker file and no clock shared
  between ranks is needed; a small allowance covers coarse file-system timestamps and clock skew between
  the hosts of one job. A single producer has no peers: every selected name counts.

* **Staging left by killed writers.** ``BundleWriter`` stages in hidden siblings
  ``.<name>.tmp-<pid>-<hex>`` (and writes sentinels through ``.<name>.tmp-<pid>-<hex>`` files); a writer
  killed mid-write leaves them behind for good. :func:`remove_stale_staging` removes those whose writer is
  gone: its pid is not alive on this host *and* the entry is older than this process. A live pid keeps its
  staging (a reused pid errs on the side of keeping). The pid is only meaningful on this host: a directory
  shared by writers on several hosts relies on the age rule for theirs.

Both run once per producer: the check on the training thread at enable time (one listing of the
directory, plus one per cohort a rank would write into), the clean-up on the writer thread.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import stat
import time
from pathlib import Path
from typing import Iterable, Optional

from replay_lib.bundle.layout import _RANK_DIR, _RANK_SENTINEL, METADATA_FILES, STAGING_NAME
from replay_lib.safe_text import safe

from .bundles import rollout_bundle_id, step_bundle_id
from .config import ENV_DIR, ENV_RUN_ID, CaptureConfig

logger = logging.getLogger("capture")

# A peer's shard this much older than this process still counts as this job's: timestamps of 1-2 s
# granularity on some file systems, and clocks of the hosts of one job that disagree by a little.
CLOCK_ALLOWANCE_S = 2.0
_LISTED = 3  # bundle names named in the refusal

# Names from a directory listing are matched whole (``\Z``: ``$`` would let a final newline through) and
# with ASCII digits only.
_ROLLOUT = re.compile(r"\Arollout-([0-9]+)\Z")
_STEP = re.compile(r"\Astep-([0-9]+)-([0-9]+)\Z")

_IMPORTED_AT = time.time()


class CaptureDirectoryError(ValueError):
    """The capture directory cannot be used as it is: it holds bundles this job would write (a restarted
    job) or it cannot be listed. A configuration error, raised at enable time like a malformed
    ``RELAX_REPLAY_CAPTURE*`` value."""


@functools.lru_cache(maxsize=1)
def process_start_time() -> Optional[float]:
    """When this process started (wall clock, seconds), from ``/proc/self/stat``; ``None`` where that is
    not available (no peer shard then counts as an earlier run's by its age alone)."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read()
        # Fields after the command name (which may hold spaces and parentheses): state is field 3, the start
        # time (clock ticks after boot, on the boot-time clock) field 22.
        ticks = int(fields.rsplit(b")", 1)[1].split()[19])
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - since_start


# ------------------------------------------------------------------------------------ a previous run


def _selected(config: CaptureConfig, name: str) -> Optional[tuple[int, ...]]:
    """The sort key of ``name`` if it is a bundle this configuration would write, else ``None``."""
    m = _ROLLOUT.match(name)
    if m and rollout_bundle_id(int(m.group(1))) == name and config.wants_rollout(int(m.group(1))):
        return (0, int(m.group(1)))
    m = _STEP.match(name)
    if m and step_bundle_id(int(m.group(1)), int(m.group(2))) == name \
            and config.wants_step(int(m.group(1)), int(m.group(2))):
        return (1, int(m.group(1)), int(m.group(2)))
    return None


def _earlier_cohort(path: Path, rank: int, started: float) -> bool:
    """Whether cohort directory ``path`` holds an earlier run's output for producer ``rank`` (see the
    module docstring); anything that is not a plain directory is a name the writer cannot use either."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return True
        names = set(os.listdir(path))
    except FileNotFoundError:  # gone since the directory was listed
        return False
    if {f"rank-{rank}", f"COMPLETE.{rank}", "COMPLETE"} & names or names & set(METADATA_FILES):
        return True
    for name in names:
        if (_RANK_DIR.match(name) or _RANK_SENTINEL.match(name)) is None:
            continue
        try:
            if os.lstat(path / name).st_mtime < started - CLOCK_ALLOWANCE_S:
                return True
        except FileNotFoundError:
            continue
    return False


def earlier_bundles(config: CaptureConfig, producer_rank: Optional[int] = None,
                    started: Optional[float] = None) -> list[str]:
    """The bundle names in ``config.directory`` that a previous run left and this producer would write,
    in (kind, rollout, step) order. ``producer_rank``: ``None`` for the single producer, else its rank in
    the cohort. Raises ``OSError`` when the directory exists but cannot be listed."""
    started = process_start_time() if started is None else started
    if started is None:  # unknown: only the rules that need no clock decide
        started = float("-inf")
    try:
        entries = os.listdir(config.directory)
    except FileNotFoundError:
        return []
    found = []
    for name in entries:
        key = _selected(config, name)
        if key is None:
            continue
        if producer_rank is None or _earlier_cohort(config.directory / name, producer_rank, started):
            found.append((key, name))
    return [name for _key, name in sorted(found)]


def check_fresh_directory(config: CaptureConfig, producer_rank: Optional[int] = None) -> None:
    """Refuse (:class:`CaptureDirectoryError`, one line) a capture directory that holds a previous run's
    bundles this producer would write, or that cannot be listed. Call once per process, at enable time:
    afterwards the directory holds this job's own output."""
    if config.run_id is None:
        where = f"{ENV_DIR}={str(config.directory)!r}:"
        way_out = f"set {ENV_RUN_ID}=<id> to write under {safe(config.directory)}/<id>/"
    else:
        where = f"{ENV_RUN_ID}={config.run_id!r}: {safe(config.directory)}"
        way_out = f"set another {ENV_RUN_ID}"
    try:
        names = earlier_bundles(config, producer_rank)
    except OSError as exc:
        raise CaptureDirectoryError(f"{where} cannot be listed ({exc.strerror or exc}); "
                                    "expected a directory this job can write to") from None
    if not names:
        return
    shown = ", ".join(names[:_LISTED]) + (", …" if len(names) > _LISTED else "")
    rank = "" if producer_rank is None else f" as rank {producer_rank}"
    raise CaptureDirectoryError(
        f"{where} already holds {len(names)} bundle(s) this job would write{rank} ({shown}), left by an "
        f"earlier run; use a fresh directory, or {way_out}"
    )


# ----------------------------------------------------------------------------- killed writers' staging


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a live process on this host; anything uncertain counts as alive."""
    if pid <= 0 or os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # EPERM: alive, owned by someone else
        return True
    return True


def _stale_entries(parent: Path, started: float) -> Iterable[os.DirEntry]:
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return []
    stale = []
    for entry in entries:
        m = STAGING_NAME.match(entry.name)  # a writer's staging directory or temporary sentinel
        if m is None or entry.is_symlink():
            continue
        try:
            old = entry.stat(follow_symlinks=False).st_mtime < started
        except OSError:
            continue
        if old and not _pid_alive(int(m.group(1))):
            stale.append(entry)
    return stale


def _bundle_dirs(directory: Path) -> list[Path]:
    """The directories a cohort writer stages in: the bundle-named children of ``directory``."""
    try:
        return [Path(e.path) for e in os.scandir(directory)
                if (_ROLLOUT.match(e.name) or _STEP.match(e.name)) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def remove_stale_staging(directories: Iterable[Path], started: Optional[float] = None) -> int:
    """Remove the staging entries killed writers left in ``directories`` and in their bundle (cohort)
    directories; log one line when there were any. Returns how many were removed. Never raises."""
    started = process_start_time() if started is None else started
    if started is None:  # unknown: the import of this module (later, but the dead pid decides first)
        started = _IMPORTED_AT
    directories = list(dict.fromkeys(Path(d) for d in directories))
    removed = 0
    for directory in directories:
        for parent in (directory, *_bundle_dirs(directory)):
            for entry in _stale_entries(parent, started):
                try:
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path)
                    else:
                        os.unlink(entry.path)
                except OSError:
                    continue
                removed += 1
    if removed:
        logger.warning("replay capture: removed %d stale staging item(s) left by killed writers under %s",
                       removed, safe(directories[0]))
    return removed
