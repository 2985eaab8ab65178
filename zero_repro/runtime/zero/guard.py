"""What a parameter of a ZeRO-wrapped model may do (paper §5: P_g moves a gradient out of
``p.grad`` into a reduced shard, P_p leaves a parameter without data between uses): a clear
error where plain torch code would silently do nothing or read freed storage.

``ParamGuard.install`` turns each wrapped parameter into an instance of a class made for its
strategy (a subclass of ``nn.Parameter``, the object and its identity kept, as torch's own
``UninitializedParameter.materialize`` does) whose ``__torch_function__`` checks two things
before any torch function runs on it, then runs it as plain torch:

* freed (stage 3): the parameter's unit is not gathered, its storage holds no data. Reading
  it (``p.sum()``, ``print(p)``, ``p.detach()`` from ``model.state_dict()``, ``torch.save``) raises
  ``ParameterNotGatheredError`` naming the parameter and ``strategy.gathered()`` /
  ``strategy.full_state_dict()``. Metadata (shape, dtype, device, hooks, ``requires_grad``) stays
  readable; a read through the model's own ``RowSource`` layers (a vocabulary table read in row
  slices) is the store's business and passes.
* gradient elsewhere (every stage): between ``strategy.backward`` and ``strategy.step`` /
  ``zero_grad`` the gradient of every wrapped parameter lives in the strategy's buffers and
  ``p.grad`` is None; reading ``p.grad`` then (a torch optimizer built on ``model.parameters()``,
  ``clip_grad_norm_``, ``model.zero_grad()``) raises ``GradientElsewhereError`` naming
  ``strategy.step()``, ``build_strategy(optimizer=...)`` and ``zero.grad_clip``.

* written (every stage): an in-place write to a parameter (``p.copy_``, ``p.mul_``,
  ``p[...] = ``, ``nn.init.*``, ``model.load_state_dict``) outside ``with
  strategy.gathered(writeback=True):`` raises ``ParameterWriteError``: the next step would
  overwrite it from the fp32 master (stages 0-2 in a 16-bit dtype), or it would land in a
  gathered copy that is freed (stage 3).
* a gradient read by ``torch.nn.utils.clip_grad_norm_`` (every stage, any time): the gradients
  are never in ``p.grad``, so it would clip nothing and return 0; it raises
  ``GradientElsewhereError`` naming ``zero.grad_clip`` and ``StepInfo.grad_norm``.

The runtime's own reads of a gradient (the post-accumulate hooks) run with the check off
(``unguarded``). Cost: one Python call per torch function that takes a wrapped parameter (the
module's own ops in forward, ~10 per block), none in backward (autograd runs in C++).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable

import torch
from torch import nn

# property getters that return a tensor sharing the parameter's storage: reads of the data
_DATA_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
# methods that read metadata only (or register hooks, set flags): safe on a freed parameter
_METADATA = frozenset({
    "__set__", "__hash__", "size", "dim", "numel", "nelement", "ndimension", "stride",
    "element_size", "is_contiguous", "storage_offset", "is_floating_point", "is_complex",
    "get_device", "untyped_storage", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "__len__", "_is_view", "is_shared", "is_pinned",
    # new tensors of the parameter's dtype and device: its values are not read
    "new_zeros", "new_empty", "new_ones", "new_full", "zeros_like", "empty_like", "ones_like",
    "full_like",
})


class ParameterNotGatheredError(RuntimeError):
    """A stage-3 parameter was read while its unit holds no gathered data."""


class GradientElsewhereError(RuntimeError):
    """``p.grad`` was read while the strategy holds the parameter's gradient."""


class ParameterWriteError(RuntimeError):
    """A parameter was written in place where the strategy would not keep the write."""


# in-place methods whose names do not end in a single underscore
_INPLACE_DUNDER = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    "__imatmul__"})
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad_"})
_CLIP_FILE = os.path.join("nn", "utils", "clip_grad.py")


def writes_to(func, args, kwargs, p) -> bool:
    """Whether torch function ``func`` called with ``args`` / ``kwargs`` writes ``p``'s
    values in place (an in-place method on it, or ``out=p``)."""
    name = getattr(func, "__name__", "")
    inplace = name in _INPLACE_DUNDER or (name.endswith("_") and not name.endswith("__")
                                         and name not in _NOT_WRITES)
    if inplace and args and (args[0] is p or isinstance(args[0], (list, tuple))
                             and any(x is p for x in args[0])):  # the _foreach_ ops
        return True
    out = kwargs.get("out")
    return out is p or (isinstance(out, (list, tuple)) and any(o is p for o in out))


def _called_from_clip() -> bool:
    """Whether torch's ``clip_grad_norm_`` / ``clip_grad_value_`` is reading the gradient."""
    f = sys._getframe(2)
    for _ in range(8):
        if f is None:
            return False
        if f.f_code.co_filename.endswith(_CLIP_FILE):
            return True
        f = f.f_back
    return False


def reads_data(func) -> bool:
    """Whether torch function ``func`` may read a tensor's values (not only its metadata)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") in _DATA_PROPERTIES
    return name not in _METADATA


def _is_grad_get(func) -> bool:
    return (getattr(func, "__name__", "") == "__get__"
            and getattr(getattr(func, "__self__", None), "__name__", "") in ("grad", "_grad"))


class _GuardedParameter(nn.Parameter):
    """Base of the per-strategy classes ``ParamGuard`` makes (``guard`` set there)."""

    guard: "ParamGuard"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cls.guard.check(func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


class ParamGuard:
    """The guard of one strategy's parameters.

    ``names``: id(parameter) -> its name in the model; ``freed(p)``: None when ``p`` holds
    its data, else the reason (stage 3's store answers; None for stages 0-2);
    ``passes(func)``: torch functions allowed to take a freed parameter (its layer's own
    sliced reads)."""

    def __init__(self, stage: int, names: dict[int, str],
                 freed: Callable[[torch.Tensor], str | None] | None = None,
                 passes: Callable[[object], bool] | None = None):
        self.stage, self.names = stage, names
        self.freed = freed
        self.passes = passes or (lambda func: False)
        self.grads_elsewhere = False  # between strategy.backward and step / zero_grad
        self.writable = False  # inside strategy.gathered(writeback=True)
        self.cls = type(f"ZeroStage{stage}Parameter", (_GuardedParameter,), {"guard": self})
        self._installed: list[nn.Parameter] = []

    def install(self, params: Iterable[nn.Parameter]) -> None:
        for p in params:
            if type(p) is nn.Parameter:
                p.__class__ = self.cls
                self._installed.append(p)

    def remove(self) -> None:
        for p in self._installed:
            if type(p) is self.cls:
                p.__class__ = nn.Parameter
        self._installed = []

    def check(self, func, args, kwargs) -> None:
        for p in _guarded_args(self.cls, args, kwargs):
            if not self.writable and writes_to(func, args, kwargs, p):
                name = getattr(func, "__name__", str(func))
                raise ParameterWriteError(
                    f"parameter {self._name(p)!r} is trained by ZeRO stage {self.stage}: a write "
                    f"into it ({name}) outside 'with strategy.gathered(writeback=True):' would "
                    f"be lost (the next step recomputes it from the fp32 master shard; stage 3 "
                    f"frees the gathered copy). Write parameters inside that block, or load "
                    f"weights before build_strategy")
            if _is_grad_get(func) and not self.grads_elsewhere and _called_from_clip():
                raise GradientElsewhereError(
                    f"clip_grad_norm_ / clip_grad_value_ on parameter {self._name(p)!r}, trained "
                    f"by ZeRO stage {self.stage}: its gradient is never in p.grad (the strategy "
                    f"holds it reduced and sharded), so torch would clip nothing and return 0. "
                    f"Clip with zero.grad_clip (ZeroConfig.grad_clip): the step clips by the "
                    f"global norm, and StepInfo.grad_norm is that norm")
            if self.grads_elsewhere and _is_grad_get(func):
                raise GradientElsewhereError(
                    f"parameter {self._name(p)!r} is trained by ZeRO stage {self.stage}: its "
                    f"gradient is in the strategy's reduced buffers, p.grad is None. Step with "
                    f"strategy.step() (your own torch optimizer: build_strategy(..., optimizer="
                    f"torch.optim.X(model.parameters(), ...)), then strategy.optimizer); clip "
                    f"with zero.grad_clip (ZeroConfig.grad_clip), not clip_grad_norm_ on "
                    f"model.parameters()")
            if self.freed is not None and reads_data(func) and not self.passes(func):
                why = self.freed(p)
                if why is not None:
                    name = getattr(func, "__name__", str(func))
                    raise ParameterNotGatheredError(
                        f"parameter {self._name(p)!r} is partitioned by ZeRO stage 3 and {why}: "
                        f"its storage holds no data ({name} read it). Read parameters inside "
                        f"'with strategy.gathered():', export with strategy.full_state_dict(), "
                        f"or run the module's forward (it gathers each unit it uses)")

    def _name(self, p) -> str:
        return self.names.get(id(p), "?")


def _guarded_args(cls, args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, cls):
            yield a
        elif isinstance(a, (list, tuple)):  # torch.cat, the _foreach_ ops
            for x in a:
                if isinstance(x, cls):
                    yield x


def unguarded():
    """A context in which no guard checks (the runtime's own reads of ``p.grad``)."""
    return torch._C.DisableTorchFunctionSubclass()

