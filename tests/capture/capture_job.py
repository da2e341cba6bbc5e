"""A training job that captures rollouts: for the tests of two jobs in one directory and of SIGTERM.

Usage: python capture_job.py MODE [ROLLOUTS]   (capture configured by the RELAX_REPLAY_CAPTURE* variables)

``job``      prints ``ready`` and waits for the file ``$GO_FILE`` if set (two jobs then enable at the same
             instant), enables with
             ``maybe_enable_for_actor``, prints ``enabled`` or ``disabled``, waits for a line on stdin if
             ``$HOLD`` is set, captures rollouts 0 … ROLLOUTS-1, closes and prints
             ``written=<n> errors=<n> dropped=<n>``; exit 0 (the capture never ends the job).
``sigterm``  publishes rollout-0, prints ``published``, then submits rollout-1 whose first payload write is
             slow (``$SLOW_S`` seconds, after printing ``staging <path>``) and trains on (sleeps in a loop)
             until a signal ends the process. ``$SIGTERM_WAIT_S`` overrides the handler's wait.
"""

import os
import sys
import time
from pathlib import Path

import torch

import capture.terminate
from capture import maybe_enable_for_actor
from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import RecomputeConfig

CFG = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=2, grpo_std_normalization=False,
                      kl_coef=0.0)


def rollout(cap, rollout_id: int) -> bool:
    rewards = [-1.0, 1.0, -1.0, 1.0]
    return cap.capture_rollout(
        rollout_id, sample_ids=[f"s-{i}" for i in range(4)], group_index=[0, 0, 1, 1],
        response_lengths=[2] * 4, total_lengths=[5] * 4, loss_mask=[[1, 1]] * 4,
        raw_rewards=[1.0, 3.0, 10.0, 12.0], rewards=rewards, old_log_probs=torch.full((8,), -0.5),
        kl=torch.zeros(8), advantages=torch.tensor(rewards).repeat_interleave(2),
    )


def job(rollouts: int) -> int:
    go = os.environ.get("GO_FILE")
    if go:
        print("ready", flush=True)
    while go and not Path(go).exists():
        time.sleep(0.001)
    cap = maybe_enable_for_actor(CFG)
    print("enabled" if cap.enabled else "disabled", flush=True)
    if os.environ.get("HOLD"):
        sys.stdin.readline()
    for r in range(rollouts):
        rollout(cap, r)
    cap.close(timeout=60)
    s = cap.stats
    print(f"written={s.written} errors={s.errors} dropped={s.dropped}", flush=True)
    return 0


def sigterm() -> int:
    if os.environ.get("SIGTERM_WAIT_S"):
        capture.terminate.SIGTERM_WAIT_S = float(os.environ["SIGTERM_WAIT_S"])
    slow_s = float(os.environ.get("SLOW_S", "0.5"))
    original = BundleWriter.write_payload

    def slow_disk(self, name, tensor):
        if self.index.bundle_id == "rollout-1" and not self.payloads:
            print(f"staging {self.staging}", flush=True)
            time.sleep(slow_s)
        return original(self, name, tensor)

    BundleWriter.write_payload = slow_disk
    cap = maybe_enable_for_actor(CFG)
    assert cap.enabled and rollout(cap, 0) and cap.flush(60)
    print("published", flush=True)
    assert rollout(cap, 1)
    while True:  # training goes on until the launcher stops the job
        time.sleep(0.01)


if __name__ == "__main__":
    mode = sys.argv[1]
    sys.exit(job(int(sys.argv[2])) if mode == "job" else sigterm())
