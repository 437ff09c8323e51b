"""The dynamic loss scale of float16 parameters (`params.dtype: float16`).

`tm.backward(loss)` multiplies the loss by the scale; the step divides the gradients by it, skips itself when
one of them is inf or nan, and then moves the scale as torch.amp.GradScaler moves its own, with its defaults
(2**16 to start, halved at an overflow, doubled after 2000 good steps in a row) and by the same kernel,
`torch._amp_update_scale_`, so the two cannot drift apart. The scale only moves when the step's losses were
scaled: a step whose backwards were plain `loss.backward()` calls carries no scale (a warning says once that
small float16 gradients may then underflow), and one that mixes both cannot be unscaled (an error).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from tiermem.errors import OptimizerError

log = logging.getLogger(__name__)


class LossScale:
    """The scale, its growth tracker and the bookkeeping of which backwards applied it."""

    def __init__(self, enabled: bool, init: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        # float32 and int32 tensors, as GradScaler keeps them, for torch's kernel
        self._scale = torch.full((), init if enabled else 1.0, dtype=torch.float32)
        self._growth = torch.zeros((), dtype=torch.int32)  # good steps since the scale last changed
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.skipped = 0  # steps skipped for inf/nan gradients
        self.scaled: list[bool] = []  # for each backward since the last step, whether tm.backward scaled its loss
        self.scaling_next = False  # set by tm.backward just before it calls backward
        self._warned = False

    @property
    def value(self) -> float:
        return float(self._scale)

    @value.setter
    def value(self, scale: float) -> None:
        self._scale.fill_(scale)

    @property
    def good_steps(self) -> int:
        return int(self._growth)

    @good_steps.setter
    def good_steps(self, n: int) -> None:
        self._growth.fill_(n)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the scale when enabled, else itself."""
        return loss * self.value if self.enabled else loss

    def backward_began(self) -> None:
        """A backward reached the model: note whether tm.backward scaled its loss."""
        self.scaled.append(self.scaling_next)
        self.scaling_next = False

    def forget_backwards(self) -> None:
        self.scaled.clear()

    def now(self) -> float:
        """What this step's gradients carry of the scale: the scale when tm.backward applied it to every
        backward, 1 when to none (with a warning, once); a mix is an OptimizerError."""
        if not self.enabled:
            return 1.0
        if all(self.scaled):
            return self.value
        if any(self.scaled):
            raise OptimizerError("params.dtype float16: this step's gradients come from backwards both with "
                                 "tm.backward(loss) (loss scaled) and with loss.backward() (not), and their sum "
                                 "cannot be unscaled; call tm.backward(loss) for every micro-batch")
        if not self._warned:
            log.warning("params.dtype float16: loss.backward() was called without tm.backward(loss), so the loss "
                        "was not scaled and small float16 gradients may underflow to zero; call tm.backward(loss) "
                        "(the step divides by the scale only when it was applied)")
            self._warned = True
        return 1.0

    def applied(self) -> bool:
        """Whether tm.backward scaled every loss of this step (only then does the scale move)."""
        return self.enabled and all(self.scaled)

    def update(self, found_inf: bool, applied: bool) -> None:
        """After a step: count a skipped one, and where the step's losses were scaled move the scale as
        GradScaler.update() does."""
        if found_inf:
            self.skipped += 1
        if applied:
            torch._amp_update_scale_(self._scale, self._growth, torch.tensor(float(found_inf)),
                                     self.growth_factor, self.backoff_factor, self.growth_interval)

    def state(self) -> dict[str, float | int] | None:
        """For checkpoints; None when disabled."""
        if not self.enabled:
            return None
        return {"scale": self.value, "good_steps": self.good_steps, "skipped_steps": self.skipped}

    def load_state(self, state: Any) -> None:
        """Put back what `state` returned (nothing to do for None or when disabled)."""
        if not self.enabled or not isinstance(state, Mapping):
            return
        self.value = float(state.get("scale", self.value))
        self.good_steps = int(state.get("good_steps", 0))
        self.skipped = int(state.get("skipped_steps", 0))
