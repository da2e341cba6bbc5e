"""The rejection-sampling knobs of the train/rollout correction (verl ``rollout_rs`` / ``rollout_rs_threshold``,
``verl/trainer/ppo/rollout_corr_helper.py:77-195``), read without torch: a comma-separated chain of options, each
with its bounds. SPEC §4.4."""

from __future__ import annotations

import math
from typing import Optional, Union

OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
           "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def parse_rollout_rs(options: str, threshold: Union[str, float, int, None]
                     ) -> list[tuple[str, Optional[float], float]]:
    """``[(option, lower, upper)]`` in chain order (duplicates dropped, as verl does): a k1 option's bounds are
    log-ratios (``log lower``, ``log upper``; ``"lo_hi"``, or one number ``u`` meaning ``1/u_u``), the others'
    one upper bound (``lower`` None). One threshold entry for every option, or one shared. Raises ValueError
    with the knob's name."""
    if not isinstance(options, str) or not options.strip():
        raise ValueError(f"rollout_rs: expected a comma-separated chain of {', '.join(OPTIONS)}, got {options!r}")
    chain: list[str] = []
    for opt in (o.strip() for o in options.split(",")):
        if not opt:
            continue
        if opt not in OPTIONS:
            raise ValueError(f"rollout_rs: expected options among {', '.join(OPTIONS)}; unknown option {opt!r}")
        if opt not in chain:
            chain.append(opt)
    if threshold is None or isinstance(threshold, bool):
        raise ValueError(f"rollout_rs_threshold: expected a threshold with rollout_rs (required), got {threshold!r}")
    specs = [str(threshold)] if isinstance(threshold, (int, float)) else \
        [p.strip() for p in str(threshold).split(",") if p.strip()]
    if len(specs) not in (1, len(chain)):
        raise ValueError(f"rollout_rs_threshold: expected one threshold shared, or one per option; {len(specs)} "
                         f"entries for {len(chain)} option(s)")
    specs = specs * len(chain) if len(specs) == 1 else specs
    out = []
    for opt, spec in zip(chain, specs):
        try:
            if opt.endswith("k1"):
                low_s, _, high_s = spec.partition("_") if "_" in spec else (str(1.0 / float(spec)), "", spec)
                low, high = float(low_s), float(high_s)
                if not (0 < low <= high and math.isfinite(high)):
                    raise ValueError
                out.append((opt, math.log(low), math.log(high)))
            else:
                high = float(spec)
                if not (high > 0 and math.isfinite(high)):
                    raise ValueError
                out.append((opt, None, high))
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"rollout_rs_threshold: expected "
                             + ("'low_high' (0 < low <= high) or one positive number" if opt.endswith("k1")
                                else "one positive number") + f" for {opt}, got {spec!r}") from None
    return out


__all__ = ["OPTIONS", "parse_rollout_rs"]
