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

A family names where its math was read (``source``) and the payloads its terms read beyond ``log_probs``,
``old_log_probs`` and the advantages (``payloads``: loss.policy requires them).
"""

from __future__ import annotations

import math
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
    # its ``sample_terms`` takes ``weights=``: each sample's aggregation weight ``w_i`` under ``loss_agg_mode``
    # (``kernels.loss.agg_weights``), for a framework that pre-scales its advantages by it (SkyRL); a callable
    # ``(knobs) -> bool`` says for which parameters
    weights: object = False


# Payloads a family may read that every loss path already carries; any other name in ``PolicyFamily.payloads`` is
# one of the family's own per-token payloads (e.g. ``clip_cov_mask``), handed to its ``sample_terms`` (whole) and
# ``token_terms`` (the run of tokens) as ``tokens={name: tensor}`` (:func:`token_payloads`).
SHARED_PAYLOADS = ("rollout_log_probs", "ref_log_probs")


def token_payloads(name: str) -> tuple[str, ...]:
    """The family ``name``'s own per-token payloads (``()`` for ``ppo`` or an unknown name)."""
    f = FAMILIES.get(name)
    return tuple(p for p in f.payloads if p not in SHARED_PAYLOADS) if f is not None else ()


def slice_tokens(tokens, at):
    """``tokens`` (a family's own per-token payloads by name, or None) at the token index ``at`` (a slice, an
    index tensor)."""
    return None if tokens is None else {k: v[at] for k, v in tokens.items()}


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


def family_refusals(cfg) -> list[tuple[str, str]]:
    """``(knob, why)`` for each thing of ``cfg``'s policy-loss family loss.policy cannot recompute (exit 4): an
    unknown family, a parameter the family does not have, of the wrong type or value, or a knob it does not
    combine with (``PolicyFamily`` checks: ``check(cfg, params) -> list[(knob, why)]`` where a module defines it)."""
    name = getattr(cfg, "policy_loss", "ppo") or "ppo"
    params = dict(getattr(cfg, "policy_loss_params", None) or {})
    if name == "ppo":
        return [("policy_loss_params", f"{params!r}: policy_loss 'ppo' takes no parameters")] if params else []
    if name not in FAMILIES:
        return [("policy_loss", f"{name!r}: not a known policy-loss family (known: ppo, "
                                f"{', '.join(sorted(FAMILIES))})")]
    fam = FAMILIES[name]
    out = []
    for key, value in sorted(params.items()):
        if key not in fam.defaults:
            known = ", ".join(sorted(fam.defaults)) or "none"
            out.append((f"policy_loss_params.{key}", f"{value!r}: not a parameter of policy_loss {name!r} (its "
                                                      f"parameters: {known})"))
            continue
        default = fam.defaults[key]
        allowed = CHOICES.get((name, key))
        if allowed is not None:
            if value not in allowed:
                out.append((f"policy_loss_params.{key}", f"{value!r}: expected one of {', '.join(allowed)} for "
                                                          f"policy_loss {name!r}"))
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value <= 0:
            if not (default is None and value is None):
                out.append((f"policy_loss_params.{key}", f"{value!r}: expected a finite number > 0 for "
                                                          f"policy_loss {name!r}"))
    for key, default in sorted(fam.defaults.items()):
        if default is None and params.get(key) is None and not any(k == f"policy_loss_params.{key}" for k, _ in out):
            out.append((f"policy_loss_params.{key}", f"None: policy_loss {name!r} needs it (a number > 0)"))
    if getattr(cfg, "eps_clip_c", None) is not None:
        out.append(("eps_clip_c", f"{cfg.eps_clip_c!r}: dual-clip is PPO's; policy_loss {name!r} does not apply it"))
    if getattr(cfg, "importance_level", "token") != "token":
        out.append(("importance_level", f"{cfg.importance_level!r}: the sequence ratio is GSPO's (policy_loss "
                                        f"'ppo'); policy_loss {name!r} takes its own ratio"))
    if name == "kl_cov" and isinstance(params.get("kl_cov_ratio"), (int, float)) and params["kl_cov_ratio"] > 1:
        out.append(("policy_loss_params.kl_cov_ratio", f"{params['kl_cov_ratio']!r}: expected a fraction ≤ 1"))
    for knob, why in LIMITS.get(name, ()):
        value = getattr(cfg, knob, None)
        if value:
            out.append((knob, f"{value!r}: {why}"))
    return out


def check_params(name: str, params) -> Optional[tuple[str, str]]:
    """The first ``(knob, why)`` :func:`family_refusals` gives for the family ``name`` and its parameters
    (``(key, value)`` items) alone, or None."""
    from types import SimpleNamespace

    out = family_refusals(SimpleNamespace(policy_loss=name, policy_loss_params=dict(params)))
    return out[0] if out else None


# (family, parameter) → its allowed values, for the parameters that are words
CHOICES: dict[tuple[str, str], tuple[str, ...]] = {}
# family → (knob, why) for the knobs it does not combine with (refused when set)
LIMITS: dict[str, tuple[tuple[str, str], ...]] = {}


from . import cispo  # noqa: E402,F401
from . import sapo  # noqa: E402,F401
from . import geo_mean  # noqa: E402,F401
from . import dppo_tv  # noqa: E402,F401
from . import dppo_kl  # noqa: E402,F401
from . import dro  # noqa: E402,F401
from . import gpg  # noqa: E402,F401
from . import kl_cov  # noqa: E402,F401
from . import vespo  # noqa: E402,F401
from . import ipo  # noqa: E402,F401
from . import rollout_is  # noqa: E402,F401
from . import importance_sampling  # noqa: E402,F401
from . import cross_entropy  # noqa: E402,F401
from . import dppo_mu  # noqa: E402,F401
from . import clip_cov  # noqa: E402,F401
from . import icepop  # noqa: E402,F401
