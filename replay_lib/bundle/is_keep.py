"""The 0/1 keep masks of an off-policy correction (SkyRL ``off_policy_correction``: the outlier, token and sequence
masks, ``skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py`` @ a9564572, below ``opc.py``; OpenRLHF
0.11.2's divergence gates, ``openrlhf/models/loss.py:216-250``), read without torch. SPEC §4.4.

Each mask tests the importance ratio ``exp(clamp(old − rollout, ±20))`` against ``[low, high]`` (``low ≤ x ≤ high``
keeps, a null bound none; opc.py:108-121, 176, 222-229, 243-245) and multiplies the loss mask by 0/1 in this order (opc.py:319, 327, 345):
``outlier`` drops a whole sample with any loss token out of bounds (either bound may be null), ``token`` drops a
token (both bounds), then ``geometric`` (the exp of the mean log-ratio over the loss tokens the first two kept,
the count floored at 1) or ``product`` (the exp of their sum) drops a whole sample (one of its bounds may be null:
OpenRLHF's ``is_correction_level=seq`` with a single threshold, ``[0, delta]``). ``binary_kl`` and ``tv`` drop a
token whose sampled-token divergence between the rollout and the old policy lies outside ``[low, high]``: with
``p = clamp(exp(rollout), 1e-6, 1 − 1e-6)`` and ``q`` the same of ``old``, ``p·log(p/q) + (1 − p)·log((1 − p)/(1 − q))``
or ``|p − q|`` (OpenRLHF ``is_correction_gating`` at token level, loss.py:224-239; bounds ``≥ 0``, either may be null). The result weighs each token's
policy-loss term by 0/1; the reduction's normalizer and the clip metric keep the recorded mask (SkyRL divides the
advantages by the unmasked count before the loss, ``ppo_utils.py:1152-1220``, and takes ``clip_ratio`` before the
correction, ``ppo_utils.py:571``)."""

from __future__ import annotations

import math
from typing import Any, Optional

KINDS = ("outlier", "token", "binary_kl", "tv", "geometric", "product")
# the token-level gates on a divergence (not the ratio): a bound may be 0
DIVERGENCES = ("binary_kl", "tv")
# OpenRLHF's clamp of both probabilities (loss.py:227-228)
PROB_CLAMP = 1e-6
ORDER = {k: i for i, k in enumerate(KINDS)}
# the clamp of every log-ratio before its exp (opc.py: safe_exp_delta(…, clip=20.0))
LOG_CLAMP = 20.0

Spec = tuple[tuple[str, Optional[float], Optional[float]], ...]


def parse_is_keep(value: Any) -> Spec:
    """``((kind, low, high), …)`` in application order from ``{"outlier": [low, high], "token": [low, high],
    "geometric" | "product": [low, high]}``: bounds positive and finite, ``low ≤ high``; only ``outlier`` takes a
    null bound (not both); one sequence kind at most. Raises ValueError naming the field."""
    if not isinstance(value, dict) or not value:
        raise ValueError(f"is_keep: expected an object with any of {', '.join(KINDS)}, got {value!r}")
    out = []
    for kind, bounds in value.items():
        if kind not in KINDS:
            raise ValueError(f"is_keep: expected keys among {', '.join(KINDS)}; unknown key {kind!r}")
        where = f"is_keep.{kind}"
        if not isinstance(bounds, (list, tuple)) or len(bounds) != 2:
            raise ValueError(f"{where}: expected [low, high], got {bounds!r}")
        low, high = bounds
        for b in (low, high):
            if b is None and kind == "outlier":
                continue
            if b is None and kind in ("geometric", "product"):  # a one-sided sequence mask (OpenRLHF's [0, delta])
                continue
            if kind in DIVERGENCES:
                if b is None:
                    continue
                if isinstance(b, bool) or not isinstance(b, (int, float)) or not (math.isfinite(b) and b >= 0):
                    raise ValueError(f"{where}: expected finite bounds >= 0 (null for none), got {bounds!r}")
                continue
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not (math.isfinite(b) and b > 0):
                raise ValueError(f"{where}: expected positive finite bounds"
                                 + (" (null for none)" if kind == "outlier" else "") + f", got {bounds!r}")
        if low is None and high is None:
            raise ValueError(f"{where}: expected at least one bound, got {bounds!r}")
        if low is not None and high is not None and low > high:
            raise ValueError(f"{where}: low {low!r} is above high {high!r}")
        out.append((kind, None if low is None else float(low), None if high is None else float(high)))
    if sum(k in ("geometric", "product") for k, _, _ in out) > 1:
        raise ValueError("is_keep: expected one sequence mask (geometric or product), got both")
    return tuple(sorted(out, key=lambda t: ORDER[t[0]]))


__all__ = ["DIVERGENCES", "KINDS", "LOG_CLAMP", "PROB_CLAMP", "Spec", "parse_is_keep"]
