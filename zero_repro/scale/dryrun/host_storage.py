"""Which storages of a dry run's trace are host memory, not device (``dry_run``'s ``host`` set of
storage ids), and which storages the tracer must poll because they are resized in place: P_a+cpu's
checkpoints, the DeepSpeed 0.2 build's host copies, ZeRO-Offload's host tier, the flat buffers
stage 3 releases and gathers again."""
from __future__ import annotations

import torch

from zero_repro.scale.dryrun.tracer import AllocationTracer


def checkpoint_host(tracer: AllocationTracer, ckpt, host: set[int]) -> None:
    """Storages the checkpointing handle keeps in host memory (P_a+cpu)."""
    if ckpt is None or not getattr(ckpt, "cpu", False):
        return
    arena = getattr(ckpt, "arena", None)
    for block in getattr(arena, "blocks", ()):  # one, or pinned power-of-two blocks
        sid = tracer.sid_of(block)
        if sid is not None:
            host.add(sid)
    for ref in list(getattr(ckpt, "_live_cpu", {}).values()):  # M_D off: per-block copies
        stored = ref()
        if stored is not None:
            sid = tracer.sid_of(stored.data)
            if sid is not None:
                host.add(sid)


def build_host(tracer: AllocationTracer, strategy, host: set[int]) -> None:
    """Storages the DeepSpeed 0.2 build moved to the host (its fp16 parameters, "to free up GPU
    space for creating flat buffer"): host memory, not device; then released."""
    tensors = getattr(strategy, "host_tensors", None)
    if not tensors:
        return
    for t in tensors:
        sid = tracer.sid_of(t)
        if sid is not None:
            host.add(sid)
    strategy.release_host()


def offload_host(tracer: AllocationTracer, strategy, host: set[int]) -> None:
    """Storages ZeRO-Offload keeps in host memory (``zero.offload``: master, Adam moments, the
    gradient staging, its scratch; ``zero.offload_param``: stage 3's parameter shards): host
    memory, not device."""
    opt = getattr(getattr(strategy, "opt", None), "host_tensors", lambda: ())()
    params = getattr(getattr(strategy, "params", None), "host_tensors", lambda: ())()
    for t in [*opt, *params]:
        sid = tracer.sid_of(t)
        if sid is not None:
            host.add(sid)


def watch_flat_buffers(tracer: AllocationTracer, strategy) -> None:
    """The strategy's flat parameter buffers (and stage 3's slice buffers) are the storages it
    may resize in place (stage 3 releases a gathered unit with ``untyped_storage().resize_(0)``,
    ``zero.flat_buffer``),
    which no dispatch mode sees: the tracer polls them (``AllocationTracer.watch``); the
    build's own releases are recorded here, at the end of the build."""
    for g in getattr(strategy, "groups", ()):
        flat = getattr(g, "flat", None)
        if isinstance(flat, torch.Tensor):
            tracer.watch(flat)
    # stage 3's vocabulary table read a row slice at a time: two slice buffers, resized alike
    for buf in getattr(getattr(strategy, "params", None), "row_buffers", ()):
        tracer.watch(buf)
