"""Mixed precision for ZeRO-DP (paper §3.1): fp16/bf16 parameters and gradients, fp32 master
weights and Adam states, and dynamic loss scaling for fp16.

Memory: 2Ψ (fp16 params) + 2Ψ (fp16 grads) + 4Ψ (fp32 master) + 4Ψ (m) + 4Ψ (v) = 16Ψ bytes.
In fp32 mode the parameters themselves are the master copy: no separate fp32 copy is kept
(4Ψ params + 4Ψ grads + 8Ψ Adam = 16Ψ; the ledger reports master_fp32 = 0).

Loss scaling: the loss is multiplied by ``scale`` before backward and gradients are divided by
it in the step. The overflow decision must be the same on every rank of the world (DP × TP):
the strategy all-reduces a flag over ``topo.world`` before calling ``update``, so either every
rank skips the step or none does. A skipped step changes nothing but the scaler: parameters,
fp32 master, Adam m/v and the Adam step count stay as they were.

Hysteresis (DeepSpeed's ``hysteresis`` = delayed shift, Megatron's ``hysteresis``): a budget of
``hysteresis`` overflows; the overflow that exhausts it halves the scale, and so does every
further overflow until the budget is restored, which happens only when the scale doubles after
``window`` consecutive good steps (1 = halve on every overflow). Backing off from a scale that
is 2^k too large thus costs hysteresis - 1 + k skipped steps, not hysteresis × k: halving must
not refill the budget.
"""
from __future__ import annotations

import torch

from zero_repro.config import ZeroConfig

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def lp_dtype(name: str) -> torch.dtype:
    """Training (parameter/gradient) dtype for ``zero.dtype``."""
    try:
        return _DTYPES[name]
    except KeyError as e:
        raise ValueError(f"zero.dtype={name!r} is not one of {sorted(_DTYPES)}") from e


def needs_master(name: str) -> bool:
    """A separate fp32 master copy is kept only when parameters are low precision."""
    return lp_dtype(name) != torch.float32


class StaticScaler:
    """Scale 1, never changes (fp32 and bf16: bf16 has fp32's exponent range)."""

    scale = 1.0

    def update(self, overflow: bool) -> None:
        return None

    def state_dict(self) -> dict:
        return {"scale": 1.0}

    def load_state_dict(self, state: dict) -> None:
        return None


class DynamicLossScaler:
    """fp16 dynamic loss scale: the first ``hysteresis - 1`` overflows are tolerated, every one
    after that halves the scale (never below ``min_scale``); ``window`` consecutive good steps
    double it and restore the hysteresis budget (module docstring)."""

    def __init__(self, initial_scale: float, window: int, min_scale: float, hysteresis: int):
        if initial_scale <= 0 or window < 1 or min_scale <= 0 or hysteresis < 1:
            raise ValueError("loss scaler needs initial_scale > 0, loss_scale_window >= 1, "
                             "min_loss_scale > 0 and hysteresis >= 1")
        self.scale = float(initial_scale)
        self.window, self.min_scale, self.hysteresis = int(window), float(min_scale), hysteresis
        self._hysteresis_left = hysteresis
        self._good_steps = 0

    def update(self, overflow: bool) -> None:
        """Call once per step with the overflow flag agreed over the world."""
        if overflow:
            self._good_steps = 0
            # the budget stays exhausted after a halving (refilled only by a clean window below):
            # refilling it here would double the skipped steps of every further back-off
            self._hysteresis_left = max(self._hysteresis_left - 1, 0)
            if self._hysteresis_left == 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self._good_steps += 1
        if self._good_steps >= self.window:
            self.scale *= 2.0
            self._good_steps = 0
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps,
                "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state.get("good_steps", 0))
        self._hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))


def build_scaler(zero: ZeroConfig):
    if zero.dtype == "fp16":
        return DynamicLossScaler(2.0 ** zero.initial_scale_power, zero.loss_scale_window,
                                 zero.min_loss_scale, zero.hysteresis)
    return StaticScaler()
