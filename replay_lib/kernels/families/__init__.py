"""Policy-loss families other than the clipped surrogate (``ppo``, :mod:`replay_lib.kernels.loss`).

A family is a :class:`PolicyFamily` registered by its module at import (one module per family, imported at the
bottom of this file). ``kernels.loss.policy_token_terms`` dispatches to ``token_terms`` when
``knobs.policy_loss != "ppo"``; the KL-loss term and the train/rollout importance weight stay applied by the
shared code after the family's ``pg``. ``sample_terms``, when a family needs per-sample quantities first, has the
signature and return of ``kernels.loss.sample_log_terms`` and is merged into its output.

``token_terms(log_probs, old_log_probs, advantages, knobs, *, seg, sample_terms, rollout_log_probs,
ref_log_probs, dtype) -> dict`` returns the keys of the PPO terms (``pg``, ``clip``, ``ppo_kl``, ``ratio``,
``log_ratio``, optional ``clip_lower``) and the family's own per-token columns (the why strip shows them);
optionally ``cond``, the condition of ``pg`` in the log-ratios (the error model's exponent condition, replacing
``|log_ratio|``), and a gate — ``gate`` (the per-token value a keep/drop decision compares), ``gate_edges`` (the
values it is compared with) and ``gate_open`` (the magnitude of ``pg`` the decision keeps or drops): a token whose
gate lies within rounding of an edge is a hazard, its term admitted in the bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from ...bundle.loss_knobs import FAMILY_DEFAULTS


@dataclass(frozen=True)
class PolicyFamily:
    name: str
    defaults: Mapping[str, object]
    token_terms: Callable
    sample_terms: Optional[Callable] = None
    metrics: tuple[str, ...] = ("pg_clipfrac", "ppo_kl")
    formula: str = ""
    # the frameworks (and where) this family's math was read from, for a report and the README's table
    source: str = field(default="", compare=False)
    # the payloads its terms read beyond log_probs, old_log_probs and advantages (e.g. rollout_log_probs)
    payloads: tuple[str, ...] = ()


FAMILIES: dict[str, PolicyFamily] = {}


def register(f: PolicyFamily) -> PolicyFamily:
    FAMILIES[f.name] = f
    FAMILY_DEFAULTS[f.name] = dict(f.defaults)
    return f


def family(name: str) -> PolicyFamily:
    """The registered family ``name``; ``KeyError`` naming the known ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown policy_loss {name!r} (known: ppo, {', '.join(sorted(FAMILIES))})") from None


def check_params(name: str, params) -> Optional[tuple[str, str]]:
    """``(knob, why)`` for what is wrong with a family and its recorded parameters, or None: an unknown family
    (naming the known ones), an unknown parameter (naming the family's), a value whose type differs from its
    default's. ``why`` starts with the value, as a refusal's ``$.config.<knob>=<why>`` line reads."""
    if name == "ppo":
        return None if not params else (f"policy_loss_params.{params[0][0]}",
                                        f"{params[0][1]!r}: the ppo family has no parameters")
    if name not in FAMILIES:
        return "policy_loss", f"{name!r}: not a known family (known: ppo, {', '.join(sorted(FAMILIES))})"
    defaults = FAMILIES[name].defaults
    for key, value in params:
        if key not in defaults:
            return (f"policy_loss_params.{key}", f"{value!r}: not a parameter of the {name} family "
                                                 f"(its parameters: {', '.join(sorted(defaults)) or 'none'})")
        want = defaults[key]
        numeric = isinstance(want, (int, float)) and not isinstance(want, bool)
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) if numeric else \
            (want is None or type(value) is type(want))
        if not ok:
            return f"policy_loss_params.{key}", f"{value!r}: the {name} family expects a {type(want).__name__}"
    return None


from . import cross_entropy, importance_sampling, ipo, rollout_is, vespo  # noqa: E402,F401
