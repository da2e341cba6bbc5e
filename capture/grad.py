"""Gradient capture (stage ``loss.grad``, SPEC §4.3), behind ``RELAX_REPLAY_CAPTURE_GRAD=1``: a tensor hook on the
log-prob tensor (and on the values, for PPO) that keeps the gradient backward hands it.

    tap = step.grad_tap(log_probs)          # None when gradient capture is off or the step is not captured
    loss.backward()
    step.add_micro_batch(..., grad_log_probs=tap.gradient() if tap else None)

The hook runs inside backward and only keeps a reference to the gradient tensor backward made (no copy, no
device synchronisation: a hook that returns ``None`` leaves the gradient flowing unchanged); ``add_micro_batch``
submits it like every other payload, and the device→host copy happens on the capture manager's side, off the
training thread's hot path. A tensor that receives gradient twice (two backward calls through it) keeps their
sum, as a leaf's ``.grad`` would.
"""

from __future__ import annotations

from typing import Optional

import torch


class GradTap:
    """Keeps the gradient ``tensor`` receives in backward (``grad``: ``None`` until backward reaches it)."""

    __slots__ = ("grad", "_handle", "_like")

    def __init__(self, tensor: torch.Tensor):
        if not tensor.requires_grad:
            raise ValueError("grad_tap: the tensor does not require grad (a log-prob tensor computed under "
                             "no_grad, or detached) — backward never reaches it")
        self.grad: Optional[torch.Tensor] = None
        self._like = (tensor.shape, tensor.dtype, tensor.device)
        self._handle = tensor.register_hook(self._hook)

    def _hook(self, grad: torch.Tensor) -> None:
        grad = grad.detach()
        self.grad = grad if self.grad is None else self.grad + grad

    def gradient(self) -> torch.Tensor:
        """The gradient backward gave the tensor; zeros when backward never reached it (no term of the loss
        depends on it: a detached ratio with no other term — its gradient is 0, and that is what is recorded)."""
        if self.grad is not None:
            return self.grad
        shape, dtype, device = self._like
        return torch.zeros(shape, dtype=dtype, device=device)

    def remove(self) -> None:
        self._handle.remove()
