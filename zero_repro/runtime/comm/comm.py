"""The only caller of torch.distributed collectives; it counts what each one moves (paper §7).

Every collective goes through here so that the *communication ledger* can count what each
step moves, per collective and per process group, and so that API renames between torch
versions live in one place (torch 2.13 deprecates ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` in favour of ``all_gather_single`` / ``reduce_scatter_single``;
older cluster installs only have the former; the c10d ops' meta kernels, below).

Counting convention (§7 "communication volume", in elements): ``all_reduce`` of n counts 2n
(a reduce-scatter plus an all-gather, §7.1); ``reduce_scatter`` counts its full input n,
``all_gather`` its full output n, ``broadcast`` and ``reduce`` n. Invariant: baseline DP, P_os
and P_os+g move 2Ψ elements per step, P_os+g+p 3Ψ. Raw bytes and call counts are kept too; a
group of size 1 communicates nothing and records nothing.
"""
from __future__ import annotations

import datetime
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as tdist

if not torch._C._dispatch_has_kernel_for_dispatch_key("c10d::allreduce_", "Meta"):
    # older torch (2.7.1 among them) registers the c10d collectives' meta kernels only when this
    # module is imported (newer ones at ``import torch``, and then it is not imported: it pulls in
    # seconds of torch.distributed); the paper-scale dry run runs collectives on meta tensors
    try:
        import torch.distributed._tools.fake_collectives  # noqa: F401
    except ImportError:  # torch 2.6 and older: no meta kernels, the dry run's meta backend fails
        pass

_REDUCE_OPS = {"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN}
if hasattr(tdist.ReduceOp, "AVG"):
    _REDUCE_OPS["avg"] = tdist.ReduceOp.AVG

# paper-volume multiplier per op (see module docstring)
_VOLUME_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1,
                  "reduce": 1}


@dataclass
class OpCount:
    calls: int = 0
    elements: int = 0  # raw elements of the logical (full-size) tensor
    volume: int = 0  # paper §7 volume in elements (all_reduce counts 2x)
    bytes: int = 0  # raw bytes of the logical tensor


@dataclass
class CommLedger:
    """Counts elements/bytes per (op, group name). Pure bookkeeping, no side effects.

    By link: a group this rank belongs to whose ranks sit on more than one node (``node_size``
    consecutive ranks per node, set by ``Topology.build``; 0: unknown, every group inside one)
    is ``inter_node``; ``link_bytes`` splits the §7 volume in bytes between the two."""

    counts: dict = field(default_factory=lambda: defaultdict(OpCount))
    enabled: bool = True
    node_size: int = 0
    inter_node: set = field(default_factory=set)  # names of this rank's groups across nodes

    def place(self, group_name: str, ranks: Sequence[int]) -> None:
        """Note whether the group ``group_name`` of ``ranks`` crosses a node boundary."""
        if self.node_size and len({r // self.node_size for r in ranks}) > 1:
            self.inter_node.add(group_name)

    def link_bytes(self) -> dict[str, int]:
        """{"intra_node": bytes, "inter_node": bytes}: §7 volume (all-reduce counted twice)
        times the element size, per kind of link."""
        out = {"intra_node": 0, "inter_node": 0}
        for (o, g), c in self.counts.items():
            out["inter_node" if g in self.inter_node else "intra_node"] += \
                c.bytes * _VOLUME_FACTOR[o]
        return out

    def record(self, op: str, group_name: str, numel: int, element_size: int) -> None:
        if not self.enabled:
            return
        c = self.counts[(op, group_name)]
        c.calls += 1
        c.elements += numel
        c.volume += numel * _VOLUME_FACTOR[op]
        c.bytes += numel * element_size

    def reset(self) -> None:
        self.counts.clear()

    def volume(self, group_name: str | None = None, op: str | None = None) -> int:
        return sum(
            c.volume
            for (o, g), c in self.counts.items()
            if (group_name is None or g == group_name) and (op is None or o == op)
        )

    def as_dict(self) -> dict:
        return {f"{o}/{g}": vars(c).copy() for (o, g), c in sorted(self.counts.items())}


@dataclass
class Group:
    """A process group plus what code needs to know about it. ``pg=None`` means single-rank."""

    name: str
    ranks: tuple[int, ...]
    rank: int  # this process's index inside ``ranks``
    pg: object | None
    ledger: CommLedger
    backend: str = "none"  # the backend its collectives run on (picks the bucket transport)
    # the backend whose bucket transport a dry run models on this group ("" = its own): a dry
    # run of a gloo configuration runs on ``fake`` but accounts gloo's transport
    models: str = ""
    # the shared-memory channel of a gloo group on one host (``cpu.shm``), once built
    channel: object | None = field(default=None, repr=False, compare=False)
    # why a gloo group on one host has no such channel ("" where it was not asked or it has
    # one): said on the step line, never silent
    channel_refused: str = field(default="", repr=False, compare=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]


class _Done:
    """Handle for a collective that needed no communication (group of size 1)."""

    def wait(self) -> None:  # noqa: D401 - mimic torch Work
        return None

    def is_completed(self) -> bool:
        return True


# ---------------------------------------------------------------- process-group management
def is_initialized() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def init_process_group(backend: str, rank: int, world_size: int, timeout_s: float = 300.0,
                       init_method: str | None = None, store=None,
                       device_id: torch.device | None = None) -> None:
    """The default group. ``device_id`` (NCCL: this rank's current GPU) binds it to one device:
    its communicators are created eagerly here, sub-groups split from them (``ncclCommSplit``)."""
    kwargs = dict(backend=backend, rank=rank, world_size=world_size,
                  timeout=datetime.timedelta(seconds=timeout_s))
    if device_id is not None:
        kwargs["device_id"] = device_id
    if store is not None:
        kwargs["store"] = store
    elif init_method is not None:
        kwargs["init_method"] = init_method
    _one_rank_prefix()
    tdist.init_process_group(**kwargs)


_plain_excepthook = sys.excepthook


def _one_rank_prefix() -> None:
    """torch wraps ``sys.excepthook`` at every ``init_process_group`` to prefix "[rankN]: " to a
    traceback's lines; a process that makes one group after another (the dry runs of a sweep,
    each on a ``fake`` group) would pile one prefix per group on every line. Before each group
    the hook torch wrapped first is put back, so the new group's is the only prefix."""
    global _plain_excepthook
    if getattr(sys.excepthook, "__name__", "") == "_distributed_excepthook":
        sys.excepthook = _plain_excepthook
    else:
        _plain_excepthook = sys.excepthook


def default_timeout() -> datetime.timedelta | None:
    """The collective timeout the default (world) group was initialised with, or None."""
    if not is_initialized():
        return None
    try:
        pg = tdist.distributed_c10d._get_default_group()
        return pg._get_backend(torch.device("cpu" if backend() == "gloo" else "cuda"))\
            .options._timeout
    except (AttributeError, RuntimeError):  # other backends / torch versions: torch's default
        return None


def destroy_process_group() -> None:
    _made.clear()
    if is_initialized():
        tdist.destroy_process_group()


def world_rank() -> int:
    return tdist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return tdist.get_world_size() if is_initialized() else 1


def backend() -> str:
    return str(tdist.get_backend()) if is_initialized() else "none"


def group_backend(pg) -> str:
    """The backend of process group ``pg``; ``None`` (a single-rank group): the world's."""
    return str(tdist.get_backend(pg)) if pg is not None else backend()


# the process groups ``new_group`` made, by their ranks, for the default group under "default"
# (a rank outside a group keeps torch's non-member marker: every rank skips the same calls);
# emptied by ``destroy_process_group``, and when the default group it belongs to is gone
_made: dict = {}


def _process_group(ranks: tuple[int, ...]):
    """The torch process group of ``ranks``: the default group for the whole world, else one
    made once per default group and reused. On NCCL bound to a device every group is an
    eagerly created communicator holding device memory and seconds of set-up; a topology
    rebuilt per layout and stage would otherwise add a communicator per group each time."""
    default = tdist.distributed_c10d._get_default_group()
    if _made.get("default") is not default or default not in tdist.distributed_c10d._world.pg_map:
        _made.clear()
        _made["default"] = default
    if ranks == tuple(range(tdist.get_world_size())):
        return default
    if ranks not in _made:
        # torch gives a new group its backend's *default* timeout (30 min on gloo), not the one
        # the world was initialised with: a dead peer would then hang DP/TP collectives for
        # half an hour. Every group inherits the world's timeout instead.
        _made[ranks] = tdist.new_group(list(ranks), timeout=default_timeout())
    return _made[ranks]


def new_group(name: str, ranks: Sequence[int], ledger: CommLedger, my_rank: int) -> Group:
    """A group of ``ranks`` (its torch process group shared with every earlier group of the
    same ranks, the default group for the whole world: ``_process_group``). Every process must
    call this for every group, in the same order (torch requirement); processes outside
    ``ranks`` get ``None`` back."""
    ranks = tuple(int(r) for r in ranks)
    pg = None
    if is_initialized() and len(ranks) > 1:
        pg = _process_group(ranks)
    if my_rank not in ranks:
        return None  # type: ignore[return-value]
    ledger.place(name, ranks)
    return Group(name=name, ranks=ranks, rank=ranks.index(my_rank), pg=pg, ledger=ledger,
                 backend=group_backend(pg))


def single_group(name: str, ledger: CommLedger) -> Group:
    return Group(name=name, ranks=(world_rank(),), rank=0, pg=None, ledger=ledger,
                 backend=backend())


# ---------------------------------------------------------------- collectives
def _op(op: str):
    try:
        return _REDUCE_OPS[op]
    except KeyError as e:
        raise ValueError(f"unknown reduce op {op!r}; use one of {sorted(_REDUCE_OPS)}") from e


def all_reduce(t: torch.Tensor, group: Group, op: str = "sum", async_op: bool = False):
    if group.size == 1:
        return _Done() if async_op else None
    group.ledger.record("all_reduce", group.name, t.numel(), t.element_size())
    return tdist.all_reduce(t, op=_op(op), group=group.pg, async_op=async_op)


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` start at the same element of one storage (not by ``data_ptr``,
    which is 0 for every meta tensor of the dry run)."""
    return (a.untyped_storage()._cdata == b.untyped_storage()._cdata
            and a.storage_offset() == b.storage_offset())


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False):
    """``out`` (size * inp.numel(), contiguous) <- concatenation of every rank's ``inp``."""
    if group.size == 1:
        if not same_memory(out, inp):
            out.copy_(inp.reshape(out.shape))
        return _Done() if async_op else None
    group.ledger.record("all_gather", group.name, out.numel(), out.element_size())
    fn = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    return fn(out, inp, group=group.pg, async_op=async_op)


def all_gather_list(tensors: list[torch.Tensor], inp: torch.Tensor, group: Group,
                    async_op: bool = False):
    if group.size == 1:
        tensors[0].copy_(inp)
        return _Done() if async_op else None
    group.ledger.record("all_gather", group.name, inp.numel() * group.size, inp.element_size())
    return tdist.all_gather(tensors, inp, group=group.pg, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: Group, op: str = "sum",
                        async_op: bool = False):
    """``out`` <- this rank's 1/size chunk of the element-wise reduction of every ``inp``."""
    if group.size == 1:
        if not same_memory(out, inp):
            out.copy_(inp.reshape(out.shape))
        if op == "avg":
            pass  # average over one rank is the identity
        return _Done() if async_op else None
    group.ledger.record("reduce_scatter", group.name, inp.numel(), inp.element_size())
    fn = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
    return fn(out, inp, op=_op(op), group=group.pg, async_op=async_op)


def broadcast(t: torch.Tensor, src_group_rank: int, group: Group, async_op: bool = False):
    if group.size == 1:
        return _Done() if async_op else None
    group.ledger.record("broadcast", group.name, t.numel(), t.element_size())
    return tdist.broadcast(t, src=group.global_rank(src_group_rank), group=group.pg,
                          async_op=async_op)


def reduce(t: torch.Tensor, dst_group_rank: int, group: Group, op: str = "sum",
           async_op: bool = False):
    """``t`` on group rank ``dst_group_rank`` <- element-wise reduction of every rank's ``t``
    (in place; the other ranks' ``t`` is undefined afterwards)."""
    if group.size == 1:
        return _Done() if async_op else None
    group.ledger.record("reduce", group.name, t.numel(), t.element_size())
    return tdist.reduce(t, dst=group.global_rank(dst_group_rank), op=_op(op), group=group.pg,
                       async_op=async_op)


def exchange(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
             group: Group, tag: int) -> list:
    """Point-to-point: an async send of every ``(tensor, group rank)`` of ``sends`` and an async
    receive into every one of ``recvs``; returns their work handles. Messages between two ranks
    with one ``tag`` match in the order they are posted, so every rank posts its exchanges in
    the same order (as it issues collectives). Not counted in the ledger: the caller records
    the collective the exchanges make up (``record``). On the ``fake`` backend nothing moves."""
    if group.size == 1 or group.backend == "fake":
        return []
    works = [tdist.isend(t, group.global_rank(q), group=group.pg, tag=tag) for t, q in sends]
    works += [tdist.irecv(t, group.global_rank(q), group=group.pg, tag=tag) for t, q in recvs]
    # gloo waits for a point-to-point message without end unless told: a dead or hung peer
    # must fail the wait after the world's collective timeout, as a collective would
    timeout = default_timeout()
    return works if timeout is None else [_TimedWork(w, timeout) for w in works]


class _TimedWork:
    """A work handle whose ``wait()`` gives up after ``timeout`` (raises, naming the wait)."""

    def __init__(self, work, timeout: datetime.timedelta):
        self.work, self.timeout = work, timeout

    def wait(self) -> None:
        self.work.wait(self.timeout)

    def is_completed(self) -> bool:
        return self.work.is_completed()


def record(op: str, group: Group, numel: int, element_size: int) -> None:
    """Count a collective made of ``exchange``s: ``op`` of the logical ``numel`` elements."""
    if group.size > 1:
        group.ledger.record(op, group.name, numel, element_size)


def barrier(group: Group | None = None) -> None:
    if is_initialized() and (group is None or group.size > 1):
        tdist.barrier(group=None if group is None else group.pg)


def all_gather_object(obj, group: Group) -> list:
    """Small Python objects (e.g. shapes, error strings). Not counted in the ledger."""
    if group.size == 1:
        return [obj]
    out = [None] * group.size
    tdist.all_gather_object(out, obj, group=group.pg)
    return out


def ranks_per_node() -> int:
    """Ranks on this rank's node: torchrun's ``LOCAL_WORLD_SIZE``, else Slurm's
    ``SLURM_NTASKS_PER_NODE`` (its first count: "8(x2)" -> 8), else every rank (one host)."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        v = os.environ.get(key, "")
        digits = v.split("(")[0].split(",")[0]
        if digits.isdigit() and int(digits) > 0:
            return int(digits)
    return world_size()


def env_rank_info() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) from torchrun or SLURM variables, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                int(os.environ.get("LOCAL_RANK", 0)))
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        return (int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]),
                int(os.environ.get("SLURM_LOCALID", 0)))
    return None
