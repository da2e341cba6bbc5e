"""``replay --executor ray``: the rank shards of one cohort replayed in parallel as Ray tasks, one task a shard,
merged by the runner into the report the local loop makes (``run.runner.ShardRunner``).

The caller opens (verifies) the cohort as for any replay, so a refused input is refused the same way, with the
same line and exit code, before any task starts; each task opens its shard again where it runs (a worker of
another machine has only the path) — the shard's files checked again there —, replays its stages on one thread
and sends back its stage reports, hazards and selected sample ids, not its tensors. Ray is the optional extra
``[ray]``; the cluster is ``--ray-address``, else ``RAY_ADDRESS``, else a local one started for the replay.
"""

from __future__ import annotations

from typing import Iterator, Optional

from ..errors import BundleError, ReplayError
from .ray_executor import _import_ray, connect


def _replay_shard(path: str, rank: Optional[int], indices, partial: bool, keep: int, rules, plan):
    """One shard, on a Ray worker: ``([(stage id, StageReport)], hazards, sample ids if partial)``."""
    import torch

    from ..bundle.gcpause import gc_paused
    from ..bundle.reader import BundleReader
    from ..stages import StageContext
    from .runner import _run_shard
    from .threads import replay_threads, single_pass_thread

    single_pass_thread()  # one CPU asked per task (run.threads)
    with gc_paused(), replay_threads(), torch.inference_mode():
        reader = BundleReader(path, defer_payloads=partial)  # a selection: only its rows' chunks verified
        if reader.rank != rank:
            raise BundleError(f"{path}: opened as rank {reader.rank}, expected the cohort's rank {rank}")
        if partial:
            reader.verify_samples(indices)
        ctx = StageContext(reader=reader, indices=indices, partial=partial, keep=keep, rules=rules)
        reports = _run_shard(ctx, reader, plan)
        return [(s.value, r) for s, r in reports], list(ctx.hazards), list(ctx.sample_ids) if partial else []


def ray_shard_runner(address: Optional[str] = None):
    """A ``ShardRunner`` for :func:`replay_lib.run.runner.replay`: every shard submitted at once (Ray runs as many
    at a time as the cluster has CPUs, one CPU a task), the results taken in shard order. A task's own error
    (a shard changed on disk since the caller verified it: exit 3) is raised as itself; Ray's (a worker lost)
    as an internal error."""
    ray = _import_ray()

    def run(jobs, keep, rules) -> Iterator[tuple[list, list, list]]:
        from ..bundle.schema import StageId

        started = connect(ray, address)
        try:
            task = ray.remote(num_cpus=1, max_retries=0)(_replay_shard)
            refs = [task.remote(str(shard.path), shard.rank, res.indices, res.partial, keep, rules, plan)
                    for _, shard, res, plan in jobs]
            out = []
            for ref in refs:
                try:
                    reports, hazards, ids = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, ReplayError):
                        raise cause from None
                    raise
                out.append(([(StageId(s), r) for s, r in reports], hazards, ids))
        finally:
            if started:
                ray.shutdown()
        return iter(out)

    return run
