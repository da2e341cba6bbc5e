"""The on-disk layout of a bundle, cohort and capture directory: names only (no torch), shared by the
verifying reader and the tolerant ``inspect``."""

from __future__ import annotations

import os
import re
import secrets

METADATA_FILES = ("manifest.json", "index.json", "expected.json")
PAYLOAD_DIR = "payloads"
PAYLOAD_SUFFIX = ".pt"
# Names read from a bundle or a directory listing are matched whole: ``\A…\Z`` (``$`` also matches before a
# final newline, so ``"evil\n"`` would pass) and ASCII digits only (``\d`` matches any Unicode digit).
_PAYLOAD_NAME = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
_RANK_DIR = re.compile(r"\Arank-([0-9]+)\Z")
_RANK_SENTINEL = re.compile(r"\ACOMPLETE\.([0-9]+)\Z")
# A writer's hidden staging directory or temporary file beside ``name``: ``.<name>.tmp-<pid>-<8 hex>`` (the
# pid lets a later writer tell a killed writer's leftovers from a live one's: capture/directory.py).
STAGING_NAME = re.compile(r"\A\.[^/]+\.tmp-([0-9]+)-[0-9a-f]{8}\Z")


def staging_name(name: str) -> str:
    """The hidden staging name of ``name`` for this process (matches :data:`STAGING_NAME`)."""
    return f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
# What each payload a stage reads holds (SPEC §2): its kind (``float``: a real floating dtype; ``int``: an
# integer one) and its dimensions. Per-token payloads are 1-D, side channels ``[Σ response_length, …]``
# (stages/support.py: ids and logits [Σ T, K], routed experts [Σ T, layers, topk]). A payload of any other
# name (an extension no stage reads) is a real float or integer tensor of any rank.
TOKENS = "Σ response_length"
_PER_TOKEN_FLOAT = ("old_log_probs", "log_probs", "ref_log_probs", "rollout_log_probs", "entropy", "kl",
                    "advantages", "pg_losses", "values", "old_values", "returns", "full_log_probs",
                    "grad_log_probs", "grad_values", "teacher_log_probs")
PAYLOAD_FORMS: dict[str, tuple[str, tuple[str, ...]]] = {
    **{name: ("float", (TOKENS,)) for name in _PER_TOKEN_FLOAT},
    "support_ids": ("int", (TOKENS, "K")),
    "support_logits": ("float", (TOKENS, "K")),
    "sampled_token_ids": ("int", (TOKENS,)),
    "routed_experts": ("int", (TOKENS, "layers", "topk")),
    "cp_shard": ("int", (TOKENS,)),
    # the policy version that sampled each token (partial / async rollouts mix versions): logprob.mismatch's lints
    "policy_versions": ("int", (TOKENS,)),
    # Clip-Cov's random draw (policy_loss="clip_cov"): 1 where the producer zeroed the token's term (corr = 0)
    "clip_cov_mask": ("int", (TOKENS,)),
}
# Payloads that are masks: 0 or 1 at every token (the reader refuses any other value, exit 3)
MASK_PAYLOADS = ("clip_cov_mask",)
# A cohort COMPLETE's shard key: a rank number as ``str(rank)`` writes it (no sign, space or leading zero).
_RANK_KEY = re.compile(r"\A(?:0|[1-9][0-9]*)\Z")
