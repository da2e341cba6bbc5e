"""Cost of explanations (SPEC §10): ``replay`` of a failing bundle with and without ``replay_lib.explain``.

Builds (in a child process) a ``write_synthetic``-style step bundle of ``--samples`` × ``--tokens`` (default
256 × 8,192 ≈ 2.1M tokens, k3 KL) with four failing stages — the worst case, each stage's hypotheses run:

* reward.post_process — the recorded rewards normalized over the whole batch (and advantages consistent with
  them, so advantage.estimate fails only by the next bug);
* advantage.kl — the KL payload is k1 where the config declares k3;
* advantage.estimate — the advantages payload negated;
* loss.policy — the recorded loss fields a token mean of the surrogate of those advantages.

Then times, interleaved, fresh processes of ``replay(path, explain=False)`` and ``replay(path, explain=True)``
(median wall and CPU time of ``--reps`` runs after a warm-up each) and prints the explanations found. PASS when
the extra CPU time with explanations is ≤ 0.3× the replay's without them (one thread: the CPU time is the work;
the wall time of a shared machine varies by half between runs and is printed beside it).

The timed children run torch with ``--threads`` intra-op threads (default 1): on a shared machine the chunked
kernels' tiny parallel regions wait on busy cores (an ``exp`` of 16,384 values measured 4 ms with 2 threads on
a loaded 2-core host, 14 µs with one), which times the contention, not the work.

    python bench/bench_explain.py [--samples 256] [--tokens 8192] [--reps 5] [--threads 1] [--keep DIR]

Exit status 0 when the target passes, 1 otherwise.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import bundle_args, measure, report, workdir  # noqa: E402

LIMIT = 0.3

BUILD_CODE = """
import sys, torch
from replay_lib.demo import synthetic_parts, write_bundle
from replay_lib.kernels import compute_approx_kl, compute_policy_loss, group_normalize, segment_ids
path, samples, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
manifest, index, expected, payloads = synthetic_parts(samples=samples, tokens=tokens, kl_coef=0.05,
                                                      kl_loss_type="k3", bundle_id="explain-bench")
raw = torch.tensor([s.raw_reward for s in index.samples], dtype=torch.float64)
lengths = torch.tensor([s.response_length for s in index.samples])
rewards = group_normalize(raw, torch.zeros(samples, dtype=torch.int64), True, dtype=torch.float32)
expected["reward.post_process"] = {"rewards": rewards.double().tolist()}
payloads["kl"] = compute_approx_kl(payloads["old_log_probs"], payloads["ref_log_probs"], "k1")
adv = -torch.repeat_interleave(rewards, lengths)
payloads["advantages"] = adv
mask = torch.tensor([m for s in index.samples for m in s.loss_mask], dtype=torch.float64)
ppo_kl = payloads["old_log_probs"].double() - payloads["log_probs"].double()
pg, clip = compute_policy_loss(ppo_kl, adv.double(), index.config.eps_clip, index.config.eps_clip_high)
ent = payloads["entropy"].double()
t = mask.sum()
fields = {"pg_loss": float((pg * mask).sum() / t), "entropy_loss": float((ent * mask).sum() / t),
          "pg_clipfrac": float((clip * mask).sum() / t), "ppo_kl": float((ppo_kl * mask).sum() / t)}
fields["loss"] = fields["pg_loss"] - index.config.entropy_coef * fields["entropy_loss"]
expected["loss.policy"] = fields
write_bundle(path, manifest, index, expected, payloads)
"""

RUN_CODE = """
import sys, torch
torch.set_num_threads(int(sys.argv[3]))
from replay_lib.run.runner import replay
report = replay(sys.argv[1], explain=sys.argv[2] == "1")
assert not report.passed
"""

SHOW_CODE = """
import sys
from replay_lib.run.runner import replay
from replay_lib.judge.report import explanation_line
report = replay(sys.argv[1])
for s in report.stages:
    print(f"  {s.stage:<20} {s.status}")
for e in report.explanations:
    print(f"  {e.stage:<20} {explanation_line(e)}")
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    threads = 1
    if "--threads" in argv:  # torch's intra-op threads in the timed children (harness.bundle_args has no such option)
        at = argv.index("--threads")
        threads = int(argv[at + 1])
        del argv[at:at + 2]
    args = bundle_args(__doc__.splitlines()[0], argv)
    args.threads = threads
    with workdir(args.keep, "bench-explain-") as root:
        path = root / "failing"
        if not path.exists():
            subprocess.run([sys.executable, "-c", BUILD_CODE, str(path), str(args.samples), str(args.tokens)],
                           check=True)
        print(f"bundle: {args.samples} samples × {args.tokens} tokens, four failing stages")
        subprocess.run([sys.executable, "-c", SHOW_CODE, str(path)], check=True)
        threads = str(args.threads)
        cmds = {
            "replay without explanations": [sys.executable, "-c", RUN_CODE, str(path), "0", threads],
            "replay with explanations": [sys.executable, "-c", RUN_CODE, str(path), "1", threads],
        }
        med, med_cpu, _ = measure(cmds, args.reps)
        without, with_ = "replay without explanations", "replay with explanations"
        extra, extra_cpu = med[with_] - med[without], med_cpu[with_] - med_cpu[without]
        print(f"extra time of the explanations: wall {extra:.3f} s = {extra / med[without]:.2f}× the replay "
              f"({med[without]:.3f} s); cpu {extra_cpu:.3f} s = {extra_cpu / med_cpu[without]:.2f}× "
              f"({med_cpu[without]:.3f} s)")
        ratio = extra_cpu / med_cpu[without]
        return report([(f"explanations add ≤ {LIMIT}× the replay's CPU time ({ratio:.2f}×)", ratio <= LIMIT)])


if __name__ == "__main__":
    raise SystemExit(main())
