"""Policy-loss families beyond PPO's clipped surrogate (``RecomputeConfig.policy_loss``): one module per family,
each registering a :class:`PolicyFamily` at import.

``token_terms(log_probs, old_log_probs, advantages, knobs, *, seg, sample_terms, rollout_log_probs,
ref_log_probs, dtype) -> dict`` returns the keys ``kernels.loss.policy_token_terms`` returns for PPO (``pg``,
``clip``, ``ppo_kl``, ``ratio``, ``log_ratio``, optional ``clip_lower``) and the family's own per-token columns;
``kernels.loss.policy_token_terms`` then applies the importance weight and the KL term of the loss as for PPO.
``sample_terms``, when the family needs per-sample quantities first, has the signature and return of
``kernels.loss.sample_log_terms`` (plus the ``advantages`` keyword) and is merged into its output.

Optional columns the replay's error model reads (``stages/loss.py``):

* ``edge_gap`` — per token, the distance of the quantity a discrete decision compares (a clip, a mask, a
  truncation) to its nearest edge, relative to that quantity's rounding scale; ``inf`` where no decision is taken.
  A token whose gap is within the rounding slack is a hazard (``clip_boundary``), admitted in the clip fractions;
* ``edge_open`` — per token, ``|Δpg|`` if that decision went the other way (a mask dropping the term: the whole
  term); admitted in ``pg_loss`` for the tokens at an edge;
* ``pg_err`` — per token, the rounding scale of ``pg`` in units of the unit roundoff where ``|pg|·|log_ratio|``
  is not it (SAPO's sigmoid gate, DRO's difference of two terms).
"""

from __future__ import annotations

from dataclasses import dataclass
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


FAMILIES: dict[str, PolicyFamily] = {}


def register(f: PolicyFamily) -> PolicyFamily:
    FAMILIES[f.name] = f
    FAMILY_DEFAULTS[f.name] = dict(f.defaults)
    return f


def family(name: str) -> PolicyFamily:
    """The registered family ``name`` (``KeyError`` naming the known ones)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown policy_loss {name!r} (known: ppo, {', '.join(sorted(FAMILIES))})") from None


from . import cispo  # noqa: E402,F401
from . import sapo  # noqa: E402,F401
from . import geo_mean  # noqa: E402,F401
from . import dppo_tv  # noqa: E402,F401
from . import dppo_kl  # noqa: E402,F401
from . import dro  # noqa: E402,F401
from . import gpg  # noqa: E402,F401
