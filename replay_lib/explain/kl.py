"""``advantage.kl`` hypotheses: another estimator, swapped arguments, the current log-probs for the old ones,
the coefficient applied.

With ``r = old − ref`` the stage computes ``kl_loss_type`` of ``r``; the hypotheses are each other estimator
of ``r`` (k1, k2, k3, low_var_kl), the declared one of ``ref − old`` (arguments swapped; k2 is symmetric, so
it never differs), of ``logp − ref`` when the bundle has the current ``log_probs`` (a trainer that took the
current policy's log-probs for the rollout's), and ``kl_coef`` times the declared one. Each with its own rounding
bound (``error_model.kl_bound``), evaluated a block of tokens at a time.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..judge.error_model import kl_bound, storage_error, storage_unit, unit_roundoff
from ..judge.fields import FieldResult
from ..kernels import KL_TYPES, compute_approx_kl
from ..stages import StageContext
from .base import Hypothesis

STAGE = "advantage.kl"


def _estimate(a: torch.Tensor, b: torch.Tensor, kl_type: str, u_token: float, u_store: float, scale: float = 1.0,
              u_input: float = 0.0):
    def columns(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = a[lo:hi].to(torch.float64), b[lo:hi].to(torch.float64)
        value = compute_approx_kl(x, y, kl_type, dtype=torch.float64)
        e_r = storage_error(u_input, x, y) if u_input else None
        return value * scale, kl_bound(x - y, value, kl_type, u_token, u_store, input_error=e_r) * abs(scale)

    cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def part(k: int) -> Callable[[int, int], torch.Tensor]:
        def read(lo: int, hi: int) -> torch.Tensor:
            if (lo, hi) not in cache:
                cache.clear()
                cache[(lo, hi)] = columns(lo, hi)
            return cache[(lo, hi)][k]
        return read

    return part(0), part(1)


def hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    cfg = ctx.config
    declared = cfg.kl_penalty_type or cfg.kl_loss_type  # the estimator of advantage.kl (verl may set its own)
    if cfg.kl_coef == 0 or declared not in KL_TYPES or not any(f.name == "kl" for f in fields):
        return []
    if not (ctx.has("old_log_probs") and ctx.has("ref_log_probs")):
        return []
    old, ref = ctx.payload("old_log_probs"), ctx.payload("ref_log_probs")
    u_token, u_store = ctx.precision.token, unit_roundoff(ctx.reader.payload("kl"))
    out: list[Hypothesis] = []

    def add(hid: str, detail: str, a: torch.Tensor, b: torch.Tensor, kl_type: str, scale: float = 1.0) -> None:
        # inputs stored coarser than the declared compute: the stage's own storage term (stages.advantage)
        values, bound = _estimate(a, b, kl_type, u_token, u_store, scale, storage_unit(ctx.precision.compute, a, b))
        out.append(Hypothesis(stage=STAGE, id=hid, detail=detail, values={"kl": values}, bounds={"kl": bound}))

    for other in KL_TYPES:
        if other != declared:
            add(f"kl.type_{other}", f"the recorded KL is {other} of (old − ref) where the config declares {declared}",
                old, ref, other)
    if declared != "k2":
        add("kl.arguments_swapped", f"the recorded KL is {declared} with its arguments swapped (ref − old)",
            ref, old, declared)
    if ctx.has("log_probs"):
        add("kl.current_log_probs", f"the recorded KL is {declared} of the current log-probs instead of the old "
            f"ones (logp − ref)", ctx.payload("log_probs"), ref, declared)
    if cfg.kl_coef != 1:
        add("kl.scaled_by_coef", f"the recorded KL is {declared} multiplied by kl_coef={cfg.kl_coef:g}",
            old, ref, declared, cfg.kl_coef)
    return out
