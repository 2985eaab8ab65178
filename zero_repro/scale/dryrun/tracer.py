"""The dry run's allocation tracer (paper §10.5 memory figures): every storage an aten op creates or
frees, in program order (used by ``zero_repro.scale.dryrun.dryrun``; extended by
``stack.categories``).

``AllocationTracer`` is a ``TorchDispatchMode`` that sees every aten op: each output storage not
seen before is an allocation, a ``weakref.finalize`` on the storage object records its free. A storage
resized in place (``untyped_storage().resize_``, how ZeRO-3 releases a gathered unit) is no aten
op: the storages
the caller names (``watch``: the strategy's flat buffers) and those an op was seen resizing are
polled before every allocating op (a free + an alloc of the same ``sid`` per resize).
``on_meta=True`` (the dry run's default): tensors live on the ``meta`` device; placements on other
devices (``device="cpu"``: P_a+cpu host buffers; factories on the default device) are redirected
to ``meta`` and the dry run identifies host storages from the handles that own them; an op whose
output metadata was computed before for the same inputs is answered from ``_OutputCache``. Meta
kernels follow the CUDA kernels' dtype rules (``native_layer_norm`` of fp16 input keeps fp32
statistics, as ``layer_norm_kernel.cu``). ``on_meta=False``: on top of ``FakeTensorMode`` (fake
CPU tensors), the reference the meta path is tested against. Speeds:
``results/fig6_max_model/notes.md``.

``streams=True`` (PyTorch 1.x's ``recordStream`` on collectives, ``stack.streams``): a storage
an NCCL collective (a ``c10d`` op) touched is *used* on that process group's stream; freed
while its stream has work issued since the last synchronisation point (``sync``), its free is
recorded as ``free_held`` (the block returns to the pool only after the stream's event: at the
next ``sync`` event, or when an allocation fails, ``allocator``). Event kinds: ``alloc``,
``free``, ``free_held`` (a free: every consumer that only tells ``alloc`` from the rest sees
it as one) and ``sync`` (sid -1, 0 bytes).

A real run measured (real tensors: ``real_data``, ``poll_all``): ``live`` and ``peak`` follow
the events online (bytes held now, their peak), so one tracer can be entered again and again
(each untimed step of a framework) and read between. ``created_only``: a storage counts only
if an op creates it under the tracer (an output aliasing none of the op's inputs, not on the
meta device: a ``FakeTensor``'s storage is meta); one met first as an input (made before, or
under another tracer) is not the run's, and an input already counted is checked for a resize.
``shared_world=N``: a storage mapped from a file with ``from_file(shared=True)`` (memory the
N ranks of a group map) counts 1/N of its bytes, the kernel's proportional set size. An op
on a DTensor is declined (``NotImplemented``): DTensor runs its local ops under the tracer.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

ALLOC, FREE = "alloc", "free"
HELD, SYNC = "free_held", "sync"  # streams (module docstring)
SYNC_SID = -1


# ------------------------------------------------------------------------------ the tracer
class AllocationTracer(TorchDispatchMode):
    """Records storage allocations/frees of every aten op run inside it.

    ``events``: list of (kind, sid, nbytes, phase, iteration) in program order; ``sid`` is a
    sequence number per storage (Python ids are reused, sids are not)."""

    def __init__(self, on_meta: bool = False, cache: bool = True, poll_all: bool = False,
                 real_data: bool = False, streams: bool = False, created_only: bool = False,
                 shared_world: int = 1) -> None:
        super().__init__()
        self.on_meta = on_meta
        # a real run's own storages only (module docstring: a measured run)
        self.created_only = created_only
        self.shared_world = shared_world  # ranks mapping a shared file: 1/N of it counts here
        self._share: dict[int, int] = {}  # sid -> the divisor of a shared file mapping
        self.live = self.peak = 0  # bytes held now and their peak, online
        # a storage may die in another thread (gloo's worker drops a collective's last buffer
        # reference): its free is recorded there, so recording takes a (re-entrant) lock
        self._lock = threading.RLock()
        # recordStream semantics of PyTorch 1.x NCCL (module docstring)
        self.streams = streams
        self._uses: dict[int, set] = {}  # sid -> process groups whose stream used it
        self._busy: set = set()  # process groups with collectives since the last sync
        self._held = 0  # held frees since the last sync event
        # tensors with data (a real run measured): ``.item()`` reads them instead of answering 0
        self.real_data = real_data
        # every storage polled before every allocating op: blind to no resize, whoever makes it
        # (the reference a real run is measured with; ~N_storages checks per op)
        self.poll_all = poll_all
        self._cache = _OutputCache() if (on_meta and cache) else None
        self.events: list[tuple[str, int, int, str, int]] = []
        self.phase, self.iteration = "build", 0
        self._sid_of: dict[int, int] = {}  # id(live storage) -> sid
        self._size: dict[int, int] = {}  # sid -> bytes currently held
        self._resizable: dict[int, weakref.ref] = {}  # sid -> storage seen resizing in place
        self._next = 0
        self.n_ops = 0
        self._off = 0  # depth of ``untracked``
        self._watched: set[int] = set()  # sids named by ``watch``
        self._resized: set[int] = set()  # sids seen resizing in place
        self._how: dict = {}  # op -> "scalar" | "view" | "mutable" | "plain"

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: ``__torch_dispatch__`` is not wrapped to keep Dynamo out of it
        (``TorchDispatchMode.__init_subclass__``): nothing runs ``torch.compile`` under the
        tracer, and the wrapper's frame switch on every op was ~4% of a dry run (cProfile)."""
        return False

    @contextlib.contextmanager
    def in_phase(self, phase: str, iteration: int):
        old = self.phase, self.iteration
        self.phase, self.iteration = phase, iteration
        try:
            yield
        finally:
            self.phase, self.iteration = old

    @contextlib.contextmanager
    def untracked(self):
        """Ops inside pass through unrecorded (the storage-less model skeleton a real run
        builds on the ``meta`` device: no device memory)."""
        self._off += 1
        try:
            yield
        finally:
            self._off -= 1

    @contextlib.contextmanager
    def polling_all(self):
        """Poll every storage seen from now on before every allocating op, until the end of
        the block (the build, where a strategy resizes each unit's buffer as it goes: no
        release is missed, whatever the storage); afterwards only the watched ones stay
        polled. Cheap where few ops run (a build), not for a training step."""
        before = self.poll_all
        self.poll_all = True
        try:
            yield
        finally:
            self.poll_all = before
            if not before:  # keep what was watched or seen resizing
                self._resizable = {sid: ref for sid, ref in self._resizable.items()
                                   if sid in self._watched or sid in self._resized}

    def sid_of(self, t: torch.Tensor) -> int | None:
        return self._sid_of.get(id(t.untyped_storage()))

    def watch(self, t: torch.Tensor) -> None:
        """Poll ``t``'s storage for in-place resizes from now on (its size is checked at once:
        a release made before the call is recorded now)."""
        st = t.untyped_storage()
        self._see(st)
        sid = self._sid_of[id(st)]
        self._resizable[sid] = weakref.ref(st)
        self._watched.add(sid)
        self._check_size(sid, st)

    def sync(self) -> None:
        """A synchronisation point (``torch.cuda.synchronize()``, a blocking copy): every
        collective issued so far has finished; blocks held for them go back to the pool."""
        self._busy.clear()
        if self._held:
            self._held = 0
            self._record(SYNC, SYNC_SID, 0)

    def record_use(self, t: torch.Tensor, stream="copy") -> None:
        """``t``'s storage is used on ``stream`` (``recordStream`` made by PyTorch 1.x beyond
        the collective's own arguments, e.g. the copy-back of a list all-gather's outputs)."""
        if not self.streams:
            return
        st = t.untyped_storage()
        self._see(st)
        self._uses.setdefault(self._sid_of[id(st)], set()).add(stream)
        self._busy.add(stream)

    def _collective(self, args, kwargs) -> None:
        group = None
        for a in args:
            if isinstance(a, torch.ScriptObject):
                try:
                    pg = torch.distributed.ProcessGroup.unbox(a)
                except RuntimeError:  # the reduce op, not the group
                    continue
                group = getattr(pg, "group_name", None) or id(pg)
                break
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self.record_use(t, group)
        self._busy.add(group)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # the hot path: ~10^5 ops per iteration at paper scale, most of them views and
        # metadata queries (prim.device), which only pass through
        if types and any(t.__name__ == "DTensor" for t in types):
            return NotImplemented  # DTensor runs its local ops under this mode
        if self._off:
            return func(*args, **(kwargs or {}))
        self.n_ops += 1
        how = self._how.get(func)
        if how is None:
            how = self._how[func] = _classify(func)
        if how == "view":  # views and metadata queries share or touch no storage
            return func(*args, **(kwargs or {}))
        if how == "scalar":
            if self.real_data:
                return func(*args, **(kwargs or {}))
            return _neutral_scalar(args[0].dtype)  # no data under fake tensors
        if self._resizable:  # a resize between ops (a hook) before this op's allocations
            self._poll()
        kwargs = kwargs or {}
        if self.on_meta and kwargs.get("device") is not None:
            if torch.device(kwargs["device"]).type != "meta":
                kwargs = {**kwargs, "device": META}
                kwargs.pop("pin_memory", None)
        if how == "plain" and self._cache is not None:
            out = self._cache.call(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if self.streams and func.namespace == "c10d":
            self._collective(args, kwargs)
        if how == "file":  # every rank of a group maps it when shared: 1/N of it is this rank's
            shared = kwargs.get("shared", args[1] if len(args) > 1 else False)
            self._see(out.untyped_storage(), self.shared_world if shared else 1)
            return out
        if self.created_only:
            self._see_created(out, args, kwargs, how == "mutable")
            return out
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
        return out

    def _poll(self) -> None:
        while True:
            try:
                items = list(self._resizable.items())
                break
            except RuntimeError:  # a storage's finalizer (run by the collector) dropped an entry
                continue
        size = self._size
        for sid, ref in items:  # the hot loop of ``poll_all``: every storage, every op
            st = ref()
            if st is not None and st.nbytes() != size.get(sid):
                self._check_size(sid, st)

    def _see_created(self, out, args, kwargs, mutable: bool) -> None:
        """``created_only``: an output storage is new unless it is an input's (an in-place op,
        an alias); an input is only checked for a resize, and only if counted already."""
        inputs = None
        for t in _tensors(out, []):
            st = t.untyped_storage()
            sid = self._sid_of.get(id(st))
            if sid is not None:
                self._check_size(sid, st)
                continue
            if inputs is None:
                inputs = {x.untyped_storage()._cdata for x in _tensors((args, kwargs), [])}
            if st._cdata not in inputs and st.device.type != "meta":  # meta: no memory
                self._see(st)
        if mutable:
            for t in _tensors((args, kwargs), []):
                st = t.untyped_storage()
                sid = self._sid_of.get(id(st))
                if sid is not None:
                    self._check_size(sid, st)

    # ------------------------------------------------------------------ bookkeeping
    def _record(self, kind: str, sid: int, nbytes: int) -> None:
        with self._lock:
            self.live += nbytes if kind == ALLOC else -nbytes
            if self.live > self.peak:
                self.peak = self.live
            self.events.append((kind, sid, nbytes, self.phase, self.iteration))

    def _see(self, st, share: int = 1) -> None:
        sid = self._sid_of.get(id(st))
        if sid is not None:
            self._check_size(sid, st)
            return
        nbytes = st.nbytes() // share
        sid = self._next
        self._next += 1
        self._sid_of[id(st)] = sid
        self._size[sid] = nbytes
        if share != 1:
            self._share[sid] = share
        if nbytes:
            self._record(ALLOC, sid, nbytes)
        weakref.finalize(st, self._on_free, id(st), sid)
        if self.poll_all:
            self._resizable[sid] = weakref.ref(st)

    def _check_size(self, sid: int, st) -> None:
        nbytes = st.nbytes()
        if self._share:
            nbytes //= self._share.get(sid, 1)
        old = self._size[sid]
        if nbytes == old:
            return
        # an in-place storage resize (stage 3 release/materialize): free + allocate
        if old:
            self._record(self._free_kind(sid), sid, old)
        if nbytes:
            self._record(ALLOC, sid, nbytes)
        self._size[sid] = nbytes
        self._resizable[sid] = weakref.ref(st)
        self._resized.add(sid)

    def _on_free(self, key: int, sid: int) -> None:
        self._sid_of.pop(key, None)
        self._resizable.pop(sid, None)
        self._watched.discard(sid)
        self._resized.discard(sid)
        self._share.pop(sid, None)
        nbytes = self._size.pop(sid, 0)
        if nbytes:
            self._record(self._free_kind(sid), sid, nbytes)

    def _free_kind(self, sid: int) -> str:
        """``free_held`` when a stream that used ``sid`` has work issued since the last sync
        (its block waits for that work), else ``free``."""
        uses = self._uses.pop(sid, None)
        if uses and not uses.isdisjoint(self._busy):
            self._held += 1
            return HELD
        return FREE


META = torch.device("meta")
_UNCACHEABLE = object()


class _OutputCache:
    """Output metadata of aten ops on meta tensors, keyed by the op and its inputs' metadata
    (shape, strides, dtype, device of every tensor; type and value of every other argument).

    A hit builds fresh outputs with ``torch.empty_strided`` instead of running the meta kernel.
    Only ops that always return new storages can be answered this way: on its first call an op
    is checked (every output a dense tensor at storage offset 0 in a storage of exactly the
    size ``empty_strided`` would give, no output sharing a storage with an input or another
    output; no other outputs than tensors, None and plain scalars) and never cached if any check
    fails. Views and in-place ops do not come here (``AllocationTracer``)."""

    def __init__(self) -> None:
        self.specs: dict = {}
        self.bad: set = set()  # ops that failed the check once
        self.hits = self.misses = 0

    def call(self, func, args, kwargs):
        if func in self.bad:
            return func(*args, **kwargs)
        key = _key(func, args, kwargs)
        spec = self.specs.get(key) if key is not None else None
        if spec is not None:
            self.hits += 1
            return _build(spec)
        out = func(*args, **kwargs)
        if key is not None:
            self.misses += 1
            spec = _spec(out, args, kwargs)
            if spec is _UNCACHEABLE:
                self.bad.add(func)
            else:
                self.specs[key] = spec
        return out


def _leaf_key(a):
    if isinstance(a, torch.Tensor):
        return (a.shape, a.stride(), a.dtype, a.device.type, a.layout)
    if isinstance(a, (list, tuple)):
        return tuple(_leaf_key(x) for x in a)
    return (type(a), a)  # 2 and 2.0 and True differ in type promotion


def _key(func, args, kwargs):
    key = (func, tuple(_leaf_key(a) for a in args),
           tuple((k, _leaf_key(v)) for k, v in kwargs.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


_SCALARS = (int, float, bool, type(None), torch.dtype)


def _spec(out, args, kwargs):
    """(tree spec, leaves) of ``out`` for ``_build``, or ``_UNCACHEABLE``."""
    leaves, tree = tree_flatten(out)
    inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
              if isinstance(t, torch.Tensor)}
    seen: set = set()
    spec = []
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            if not isinstance(t, _SCALARS):
                return _UNCACHEABLE
            spec.append((False, t))
            continue
        if t.layout != torch.strided or t.device.type != "meta" or t.storage_offset() != 0:
            return _UNCACHEABLE
        st = t.untyped_storage()
        if st._cdata in inputs or st._cdata in seen:
            return _UNCACHEABLE
        seen.add(st._cdata)
        leaf = (True, (t.shape, t.stride(), t.dtype))
        if _build_leaf(leaf).untyped_storage().nbytes() != st.nbytes():
            return _UNCACHEABLE
        spec.append(leaf)
    if tree.is_leaf() and spec[0][0]:
        return spec[0]  # one tensor: the fast path of _build
    return tree, spec


def _build_leaf(leaf):
    is_tensor, v = leaf
    if not is_tensor:
        return v
    shape, stride, dtype = v
    return torch.empty_strided(shape, stride, dtype=dtype, device=META)


def _build(spec):
    if spec[0] is True:
        return _build_leaf(spec)
    tree, leaves = spec
    return tree_unflatten([_build_leaf(x) for x in leaves], tree)


def _tensors(x, out: list) -> list:
    """The tensors in ``x`` (nested tuples, lists, dicts: an op's arguments or outputs) appended
    to ``out``; a cheaper ``tree_flatten`` for the per-op path."""
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _tensors(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _tensors(y, out)
    return out


def _classify(func) -> str:
    if func is torch.ops.aten._local_scalar_dense.default:
        return "scalar"
    if getattr(func, "is_view", False) or func.namespace == "prim":
        return "view"
    if func is torch.ops.aten.from_file.default:
        return "file"
    return "mutable" if func._schema.is_mutable else "plain"


def _neutral_scalar(dtype: torch.dtype):
    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point or dtype.is_complex else 0
