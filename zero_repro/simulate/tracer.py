"""The dry run's allocation tracer (paper §10.5 memory figures): every storage an aten op creates
or frees, in program order, under ``FakeTensorMode`` (moved out of ``simulate.dryrun`` so that
the software-stack modules, ``simulate.stack``, can extend it without an import cycle).

Mechanism (see ``simulate.dryrun``): a ``TorchDispatchMode`` stacked inside ``FakeTensorMode``
sees every aten op; each output storage not seen before is an allocation and a
``weakref.finalize`` on the storage object records its free; storages resized in place are
detected when an op touches them and polled afterwards.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ALLOC, FREE = "alloc", "free"


# ------------------------------------------------------------------------------ the tracer
class AllocationTracer(TorchDispatchMode):
    """Records storage allocations/frees of every aten op run inside it.

    ``events``: list of (kind, sid, nbytes, phase, iteration) in program order; ``sid`` is a
    sequence number per storage (Python ids are reused, sids are not)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int, int, str, int]] = []
        self.phase, self.iteration = "build", 0
        self._sid_of: dict[int, int] = {}  # id(live storage) -> sid
        self._size: dict[int, int] = {}  # sid -> bytes currently held
        self._resizable: dict[int, weakref.ref] = {}  # sid -> storage seen resizing in place
        self._next = 0
        self.n_ops = 0
        self._how: dict = {}  # op -> "scalar" | "view" | "mutable" | "plain"

    @contextlib.contextmanager
    def in_phase(self, phase: str, iteration: int):
        old = self.phase, self.iteration
        self.phase, self.iteration = phase, iteration
        try:
            yield
        finally:
            self.phase, self.iteration = old

    def sid_of(self, t: torch.Tensor) -> int | None:
        return self._sid_of.get(id(t.untyped_storage()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # the hot path: ~10^5 ops per iteration at paper scale, most of them views and
        # metadata queries (prim.device), which only pass through
        self.n_ops += 1
        how = self._how.get(func)
        if how is None:
            how = self._how[func] = _classify(func)
        if how == "view":  # views and metadata queries share or touch no storage
            return func(*args, **(kwargs or {}))
        if how == "scalar":
            return _neutral_scalar(args[0].dtype)  # no data under fake tensors
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # outputs: new storages; mutated inputs: storages that may have been resized in place
        if how == "mutable":
            flat = tree_flatten((out, args, kwargs))[0]
        else:
            flat = out if isinstance(out, (list, tuple)) else (out,)
            if any(isinstance(t, (list, tuple)) for t in flat):
                flat = tree_flatten(out)[0]
        for t in flat:
            if isinstance(t, torch.Tensor):
                self._see(t.untyped_storage())
        if self._resizable:
            for sid, ref in list(self._resizable.items()):
                st = ref()
                if st is not None:
                    self._check_size(sid, st)
        return out

    # ------------------------------------------------------------------ bookkeeping
    def _record(self, kind: str, sid: int, nbytes: int) -> None:
        self.events.append((kind, sid, nbytes, self.phase, self.iteration))

    def _see(self, st) -> None:
        sid = self._sid_of.get(id(st))
        if sid is not None:
            self._check_size(sid, st)
            return
        nbytes = st.nbytes()
        sid = self._next
        self._next += 1
        self._sid_of[id(st)] = sid
        self._size[sid] = nbytes
        if nbytes:
            self._record(ALLOC, sid, nbytes)
        weakref.finalize(st, self._on_free, id(st), sid)

    def _check_size(self, sid: int, st) -> None:
        nbytes = st.nbytes()
        old = self._size[sid]
        if nbytes == old:
            return
        # an in-place storage resize (stage 3 release/materialize): free + allocate
        if old:
            self._record(FREE, sid, old)
        if nbytes:
            self._record(ALLOC, sid, nbytes)
        self._size[sid] = nbytes
        self._resizable[sid] = weakref.ref(st)

    def _on_free(self, key: int, sid: int) -> None:
        self._sid_of.pop(key, None)
        self._resizable.pop(sid, None)
        nbytes = self._size.pop(sid, 0)
        if nbytes:
            self._record(FREE, sid, nbytes)


def _classify(func) -> str:
    if func is torch.ops.aten._local_scalar_dense.default:
        return "scalar"
    if getattr(func, "is_view", False) or func.namespace == "prim":
        return "view"
    return "mutable" if func._schema.is_mutable else "plain"


def _neutral_scalar(dtype: torch.dtype):
    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point or dtype.is_complex else 0
