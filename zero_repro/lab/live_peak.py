"""The live-storage peak of a real training run on CPU ranks over gloo, two counters for two
users. The estimate and the dry run are held to ``measure`` / ``compare``: the training steps'
peak, the build's survivors included, the build's transients not (the quantity the dry run's
live peak predicts), counted by PyTorch's CPU allocator (``scale.dryrun.allocator_peak``: the
profiler's memory reports), not by the dry run's tracer -- a counter the estimate is built on
cannot check it. The peers race measures every framework with ``live_tracer``
(``lab.peers.runners``: one tracer per framework, entered for its build and each untimed step,
its peak read online).

Mechanism of ``live_tracer``: the dry run's allocation tracer (``scale.dryrun.tracer``) on real
tensors: data-dependent values are the real ones (``real_data``: ``.item()`` is not answered
with 0), and before every op the size of every live storage is read again (``poll_all``), so a
storage resized in place (stage 3 and FSDP2 release a gathered unit by resizing its storage to
0 bytes and materialise it again before the next use) is seen at the op after it happened,
whether or not an op touches it. Only the storages created under the tracer count
(``created_only``: the outputs of an op that alias none of its inputs, on a device with memory
-- a ``FakeTensor`` made by DTensor's sharding propagation has a meta storage: none), so what
existed before (the race's batches, another framework's state) is not a framework's. A file
every rank of a group maps shared (``from_file(shared=True)``: zero_repro's shared-memory
buckets) counts 1/``world`` of its bytes on each of the ``world`` ranks, as the kernel's
proportional set size does. DTensor ops pass through to their local ops. torch's
``MemTracker`` (torch/distributed/_tools/mem_tracker.py) takes the same approach, with
per-module attribution neither user needs.

``measure`` runs the runtime's build and step (``Trainer``; two steps by default, the second
the steady one), the buckets travelling point-to-point over gloo (``ZR_CPU_TRANSPORT=pairwise``:
the dry run accounts it with ``transport_of="gloo"``; the allocator does not see a shared file).
"""
from __future__ import annotations

import os
import secrets

import torch
from omegaconf import OmegaConf

from zero_repro import config as C
from zero_repro import schema
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.train.trainer import Trainer
from zero_repro.runtime.zero import offload
from zero_repro.scale import estimate as E
from zero_repro.scale.dryrun.allocator_peak import AllocatorPeak
from zero_repro.scale.dryrun.tracer import AllocationTracer

TRANSPORT = "pairwise"  # ZR_CPU_TRANSPORT of the measured ranks
MODELS_AS = "gloo"  # the dry run's transport_of for them


def live_tracer(world: int = 1) -> AllocationTracer:
    """The tracer a real run is measured with (module docstring): real tensors and scalars,
    every storage polled before every op, no output cache, only the storages created under
    it; a file ``world`` ranks map shared counts 1/``world`` of its bytes."""
    return AllocationTracer(on_meta=False, cache=False, poll_all=True, real_data=True,
                            created_only=True, shared_world=world)


def _batches(cfg: C.Config, step: int):
    m, t = cfg.model, cfg.train
    g = torch.Generator().manual_seed(1000 + step)
    return ((torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_len), generator=g),
             torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_len), generator=g))
            for _ in range(t.grad_accum))


def _counted(cfg: C.Config, iterations: int, at_rest=None) -> tuple:
    """Build ``cfg``'s trainer and train ``iterations`` steps under the CPU allocator's count
    (windows "build", "iteration IT", and "rest" after the steps, where ``at_rest()`` is
    called); (counter, what ``at_rest`` returned, the transport's name, the ledger)."""
    with AllocatorPeak() as counter:
        with counter.window("build"):
            trainer = Trainer(cfg)
        for it in range(iterations):
            with counter.window(f"iteration {it}"):
                trainer.step(_batches(cfg, it))
        with counter.window("rest"):
            rest = at_rest() if at_rest is not None else None
        transport, ledger = trainer.strategy.transport.name, trainer.memory_ledger()
        trainer.close()
        del trainer
    return counter, rest, transport, ledger


def measure(rank: int, world: int, cfg_dicts: list[dict], iterations: int = 2) -> list[dict]:
    """On an initialised gloo group (``launch.spawn``): for each config, build and train
    ``iterations`` steps, counted by the CPU allocator (``scale.dryrun.allocator_peak``: not
    the dry run's tracer, whose errors the estimate would share); per config {"live_peak"
    (bytes, training steps, the build's survivors included), "by_iteration", "build_peak"
    (the build's own peak), "transport"}. Module level, for ``launch.spawn``."""
    os.environ["ZR_CPU_TRANSPORT"] = TRANSPORT  # read when a stage picks its transport
    out = []
    for d in cfg_dicts:
        counter, _, transport, _ = _counted(schema.to_config(d), iterations)
        by_iter = {it: counter.peaks[f"iteration {it}"] for it in range(iterations)}
        out.append({"live_peak": max(by_iter.values()), "by_iteration": by_iter,
                    "build_peak": counter.peaks["build"], "transport": transport})
    return out


HOST_TIER_PREFIX = "zr-host-"  # the host tier's files under /dev/shm (unlinked once mapped)


def shm_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeroed memory of ``numel`` elements in a file of its own under /dev/shm (unlinked at
    once, mapped shared): ``measure_tiers``' host tier (``offload.HOST_ALLOCATOR``), a memory
    apart from the "device" as host memory is beside a GPU."""
    nbytes = max(1, numel * dtype.itemsize)
    path = os.path.join("/dev/shm", HOST_TIER_PREFIX + secrets.token_hex(8))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # a full tmpfs fails here, not mid-step
        t = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    finally:
        os.unlink(path)
        os.close(fd)
    return t[:numel * dtype.itemsize].view(dtype)


def host_tier_bytes() -> tuple[int, int]:
    """(bytes, mappings) of this process's host tier as the kernel maps it: its mappings of
    ``shm_zeros``' files, from /proc/self/maps (each rounded up to whole pages)."""
    total, n = 0, 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "/" + HOST_TIER_PREFIX in line:
                lo, hi = line.split()[0].split("-")
                total, n = total + int(hi, 16) - int(lo, 16), n + 1
    return total, n


def measure_tiers(rank: int, world: int, cfg_dicts: list[dict], iterations: int = 2
                  ) -> list[dict]:
    """``measure`` with the host tier in memory of its own (``shm_zeros`` as
    ``offload.HOST_ALLOCATOR``): per config
    {"device_rest", "device_peak"} -- the CPU allocator's live bytes at rest after the steps
    (the model states and buffers that persist) and at the steps' peak, less the host tier
    -- and "host" (the host tier's mapped bytes, ``host_tier_bytes``), beside the runtime's
    own ledger ("ledger_device", "ledger_host"). Neither counter is the ledger's nor the dry
    run's: the allocator reports every block (the host files' mappings included), the
    kernel's map names the host's. Each host mapping is whole pages: "host" over-counts, and
    the device's figures under-count, by less than a page per mapping ("host_mappings")."""
    os.environ["ZR_CPU_TRANSPORT"] = TRANSPORT
    offload.HOST_ALLOCATOR, out = shm_zeros, []
    try:
        for d in cfg_dicts:
            counter, (host, maps), _, ledger = _counted(schema.to_config(d), iterations,
                                                        host_tier_bytes)
            peak = max(counter.peaks[f"iteration {it}"] for it in range(iterations))
            out.append({"device_rest": counter.peaks["rest"] - host, "device_peak": peak - host,
                        "host": host, "host_mappings": maps, "ledger_device": ledger.device_total(),
                        "ledger_host": ledger.host_total(), "ledger": ledger.as_dict()})
    finally:
        offload.HOST_ALLOCATOR = None
    return out


def estimated(cfg: C.Config, rank: int, transport_of: str = MODELS_AS) -> int:
    """The estimator's live peak for rank ``rank`` of ``cfg`` (``scale.estimate``: one dry run
    at the prime batch, the trace written at ``cfg``'s micro-batch)."""
    bt, r = E.prime_trace(cfg, rank, transport_of)
    return E.memory_picture(bt.events(cfg.train.micro_batch_size), bt.rep, r.category_of,
                            r.ledger, cfg.zero.stage)["live_peak"]


def compare(cfgs: list[C.Config], iterations: int = 2) -> list[dict]:
    """Every config of ``cfgs`` (one world size) run for real on CPU ranks (``measure``) and
    estimated, per rank: {model, stage, world, tp, zero_r, dtype, batch, rank, estimate,
    measured, ratio} (bytes; ratio = estimate / measured)."""
    world = cfgs[0].parallel.world_size
    dicts = [OmegaConf.to_container(OmegaConf.structured(c)) for c in cfgs]
    real = spawn(measure, world, dicts, iterations)
    rows = []
    for i, cfg in enumerate(cfgs):
        for rank in range(world):
            est = estimated(cfg, rank, MODELS_AS)
            got = real[rank][i]["live_peak"]
            rows.append({"model": cfg.model.name, "family": cfg.model.family,
                         "stage": cfg.zero.stage, "world": world, "tp": cfg.parallel.tp,
                         "zero_r": _zero_r(cfg.zero_r), "dtype": cfg.zero.dtype,
                         "batch": cfg.train.micro_batch_size, "rank": rank, "estimate": est,
                         "measured": got, "ratio": est / got})
    return rows


def _zero_r(zr: C.ZeroRConfig) -> str:
    """The ``scale.estimate.ZERO_R`` name of a ZeRO-R setting."""
    if not zr.activation_checkpointing:
        return "none"
    return "pa_cpu" if zr.cpu_checkpointing else "pa" if zr.partition_activations else "ckpt"
