"""Mixed precision for ZeRO-DP (paper §3.1): fp16/bf16 parameters and gradients, fp32 master
weights and Adam states, dynamic loss scaling for fp16.

Memory: 2Ψ (fp16 params) + 2Ψ (grads) + 4Ψ (fp32 master) + 4Ψ (m) + 4Ψ (v) = 16Ψ bytes; in fp32
mode the parameters are the master (4Ψ + 4Ψ + 8Ψ, the ledger's master_fp32 = 0).

Loss scaling (``DynamicLossScaler``, ``StaticScaler``, ``build_scaler``): the loss is multiplied
by ``scale`` before backward and gradients divided by it in the step. The overflow decision is
agreed over the world (DP × TP) before ``update``, so every rank skips or none does; a skipped
step changes nothing but the scaler. ``update`` takes the flag as a bool or as the step's
``clip.Agreed`` (a device value): the decision is then taken when the scale is next read (the
next backward), so the step itself never waits for the host -- the same sequence of scales. Hysteresis (DeepSpeed's delayed shift, Megatron's
``hysteresis``): the overflow that exhausts a budget of ``hysteresis`` halves the scale, as does
every further overflow until the budget is restored, which happens only when the scale doubles
after ``window`` good steps; backing off from a scale 2^k too large costs hysteresis - 1 + k
skipped steps, not hysteresis × k (halving must not refill the budget).
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
        self._scale = float(initial_scale)
        self.window, self.min_scale, self.hysteresis = int(window), float(min_scale), hysteresis
        self._hysteresis_left = hysteresis
        self._good_steps = 0
        self._pending = None  # the last step's clip.Agreed, applied when the scale is read

    @property
    def scale(self) -> float:
        self._settle()
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._settle()
        self._scale = float(value)

    def _settle(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._apply(pending.overflow)

    def update(self, overflow) -> None:
        """Call once per step with the overflow flag agreed over the world: a bool, or the
        step's ``clip.Agreed`` (read when the scale is next needed)."""
        self._settle()
        if isinstance(overflow, bool):
            self._apply(overflow)
        else:
            self._pending = overflow

    def _apply(self, overflow: bool) -> None:
        if overflow:
            self._good_steps = 0
            # the budget stays exhausted after a halving (refilled only by a clean window below):
            # refilling it here would double the skipped steps of every further back-off
            self._hysteresis_left = max(self._hysteresis_left - 1, 0)
            if self._hysteresis_left == 0:
                self._scale = max(self._scale / 2.0, self.min_scale)
            return
        self._good_steps += 1
        if self._good_steps >= self.window:
            self._scale *= 2.0
            self._good_steps = 0
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        self._settle()
        return {"scale": self._scale, "good_steps": self._good_steps,
                "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self._pending = None
        self._scale = float(state["scale"])
        self._good_steps = int(state.get("good_steps", 0))
        self._hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))


def build_scaler(zero: ZeroConfig):
    if zero.dtype == "fp16":
        return DynamicLossScaler(2.0 ** zero.initial_scale_power, zero.loss_scale_window,
                                 zero.min_loss_scale, zero.hysteresis)
    return StaticScaler()
