"""The names of the shipped demo bundles and what each shows: no torch here, so the command lines' help can
list them without importing the generators (``replay_lib.demo`` builds them)."""

from __future__ import annotations

DEMO_NAMES = ("pr65-buggy", "pr65-fixed", "step-loss", "cohort-2rank", "support-fullvocab", "kl-bug", "loss-bug",
              "loose-kl", "hazard-clean", "nemo-loo", "verl-dapo")
# One line per demo for the command lines' help (``demo write-all --help``, ``replay-tui --help``).
DEMO_HELP = {
    "pr65-buggy": "PR #65: rewards normalized over the physical batch; the default",
    "pr65-fixed": "the same step as the fixed code wrote it",
    "step-loss": "a step-level loss.policy bundle",
    "cohort-2rank": "a passing two-rank cohort",
    "support-fullvocab": "log-probs scored over the full vocabulary instead of the sampler support",
    "kl-bug": "recorded kl off by +0.25 at four tokens",
    "loss-bug": "recorded pg_loss off by +0.5",
    "loose-kl": "a bundle tolerance (atol 0.1): one divergence and one value within it",
    "hazard-clean": "a passing step with a hazard (a group of equal rewards)",
    "nemo-loo": "NeMo-RL leave-one-out: a zero-std group's hazard beside a group normalized by its mean",
    "verl-dapo": "verl DAPO (token mean, dual-clip, clip-higher): a per-micro-batch token-mean denominator",
}


def demo_list() -> str:
    """``name (what it shows), …`` of every demo, for help texts."""
    return ", ".join(f"{n} ({DEMO_HELP[n]})" if n in DEMO_HELP else n for n in DEMO_NAMES)
