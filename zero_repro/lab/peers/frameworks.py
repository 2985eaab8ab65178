"""The peer frameworks as runners of one training step each (``peers.runners`` drives them).

One ``Runner`` per framework (``RUNNERS``: name -> class), all training the same GPT from the same
seed on the same global batches: torch DDP, DDP + ``ZeroRedundancyOptimizer``, FSDP2
``fully_shard`` (resharding after forward or not), DeepSpeed ZeRO 1-3, this project's stages 0-3
(``ZeroRepro``), the single-process reference every framework is compared with (``Reference``:
``torch.optim.AdamW`` on the full global batch) and the floor (``LowerBound``: the micro-batch's
forward + backward without communication plus the fused AdamW on Ψ/N_d). ``CommCounter`` (a
``TorchDispatchMode`` seeing every c10d collective, DDP's C++ reducer included) counts a step's
communication; ``storage_bytes`` / ``optimizer_state_tensors`` measure a rank's distinct storages.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import replace

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from zero_repro.config import Config, ParallelConfig
from zero_repro.runtime.comm import comm
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.comm.transport import bucket_transport
from zero_repro.runtime.model.gpt import GPT
from zero_repro.runtime.train.trainer import Trainer
from zero_repro.lab.peers.spec import (  # noqa: F401 (the race's tables, named here too)
    DEEPSPEED_PEERS, FRAMEWORKS, LOWER_BOUND, OPTIMIZERS, OURS, PATCHES_TORCH, TORCH_PEERS,
    PeerSpec)


log = logging.getLogger(__name__)



def deepspeed_available() -> tuple[bool, str]:
    """(importable, reason). DeepSpeed is optional: CI does not install it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must precede the first import
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken op build
        return False, (f"DeepSpeed is not importable ({type(e).__name__}: {e}); install it with "
                       f"`DS_BUILD_OPS=0 pip install deepspeed` to add the DeepSpeed peers")
    return True, ""


# ------------------------------------------------------------------ communication counter
# c10d op -> (comm.py op name, which argument is the logical full-size tensor)
_C10D_OPS = {"allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
             "broadcast_": ("broadcast", 0), "_allgather_base_": ("all_gather", 0),
             "allgather_": ("all_gather", 0), "allgather_into_tensor_coalesced_": ("all_gather", 0),
             "_reduce_scatter_base_": ("reduce_scatter", 1),
             "reduce_scatter_": ("reduce_scatter", 1),
             "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1)}


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


class CommCounter(TorchDispatchMode):
    """Counts the collectives dispatched while active into ``ledger`` (group name "dp").

    Observation only: every op is passed through unchanged. It slows every op (Python
    dispatch), so it is only used on untimed steps."""

    def __init__(self, ledger: comm.CommLedger):
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[-1]
            op = _C10D_OPS.get(name)
            if op is not None and len(args) > op[1]:
                ts = list(_tensors(args[op[1]]))
                if ts:
                    self.ledger.record(op[0], "dp", sum(t.numel() for t in ts),
                                       ts[0].element_size())
        return func(*args, **kwargs)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views are counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        if hasattr(t, "to_local"):  # DTensor: this rank's shard
            t = t.to_local()
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def optimizer_state_tensors(opt) -> list:
    out = []
    for st in getattr(opt, "state", {}).values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def module_memory(model: torch.nn.Module, opt) -> dict:
    """Bytes of the distinct storages of ``model``'s parameters, their gradients and ``opt``'s
    state on this rank (peers whose parameters are the module's own, DDP- and FSDP2-style)."""
    ps = list(model.parameters())
    return {"params": storage_bytes(ps), "grads": storage_bytes(p.grad for p in ps),
            "optimizer": storage_bytes(optimizer_state_tensors(opt))}


def _strip(name: str) -> str:
    return name[len("module."):] if name.startswith("module.") else name


# ------------------------------------------------------------------------------ runners
class Runner:
    """One framework training its own copy of the GPT. Subclasses build and step."""

    name = ""

    def __init__(self, spec: PeerSpec, rank: int, world: int):
        self.spec, self.rank, self.world = spec, rank, world
        self.stage, self.family = FRAMEWORKS[self.name]
        self.model = GPT(spec.model, seed=spec.train.seed)

    def adamw_kwargs(self) -> dict:
        t = self.spec.train
        kw = {"lr": t.lr, "betas": (t.beta1, t.beta2), "eps": t.eps,
              "weight_decay": t.weight_decay}
        if self.spec.optimizer == "fused":
            kw["fused"] = True  # torch's fused AdamW kernel (CPU since torch 2.4)
        return kw

    def adamw(self, params):
        return torch.optim.AdamW(params, **self.adamw_kwargs())

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimizer step of a plain torch model + ``self.opt`` (overridden where the
        framework wraps the model or owns the step)."""
        _, loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def views(self):
        """(name, tensor this rank holds, row offset into the full tensor or None)."""
        for n, p in self.model.named_parameters():
            yield _strip(n), p.detach(), None

    def memory(self) -> dict:
        return {}

    def comm_ledger(self) -> comm.CommLedger | None:
        """A ledger the framework fills itself (the project's), else None (CommCounter)."""
        return None


class Reference(Runner):
    """Single process, TP=1 model, full global batch, torch.optim.AdamW (single-tensor path:
    the plainest arithmetic, independent of every framework's kernel).

    ``budget[name]``: per element, the parameter difference that fp32 rounding of the
    gradients can explain after the steps so far (the conditioning budget of report.py):
    sum over steps k of lr·min(2, 2δ_k/(√v̂_k + eps)), δ_k = grad_rounding_rel · max|g_k| of
    the tensor. Adam's update u = lr·m̂/(√v̂+eps) moves by at most lr·2δ/(√v̂+eps) when m̂ and
    √v̂ move by δ (|m̂| ≤ √v̂), and never by more than 2·lr (a sign flip): large where the
    gradient is below eps (Adam amplifies its rounding by lr/eps), ~0 elsewhere."""

    name = "reference"

    def __init__(self, spec, rank, world):  # noqa: D107
        self.spec, self.rank, self.world = spec, rank, world
        self.stage, self.family = -1, "reference"
        self.model = GPT(spec.model, seed=spec.train.seed)
        t = spec.train
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2),
                                     eps=t.eps, weight_decay=t.weight_decay, foreach=False)
        self.budget = {n: torch.zeros_like(p) for n, p in self.model.named_parameters()}

    def step(self, x, y):
        _, loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self._grow_budget()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    @torch.no_grad()
    def _grow_budget(self) -> None:
        t = self.spec.train
        for n, p in self.model.named_parameters():
            st = self.opt.state.get(p)
            if p.grad is None or not st:
                continue
            k = float(st["step"])
            v_hat_sqrt = (st["exp_avg_sq"] / (1 - t.beta2 ** k)).sqrt_()
            delta = self.spec.grad_rounding_rel * float(p.grad.abs().max())
            self.budget[n].add_((2 * delta / (v_hat_sqrt + t.eps)).clamp_(max=2.0), alpha=t.lr)


class TorchDDP(Runner):
    name = "torch_ddp"

    def __init__(self, spec, rank, world):  # noqa: D107
        super().__init__(spec, rank, world)
        self.ddp = DDP(self.model, gradient_as_bucket_view=True)
        self.opt = self._optimizer()

    def _optimizer(self):
        return self.adamw(self.ddp.parameters())

    def step(self, x, y):
        _, loss = self.ddp(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)  # keep the gradients as views of DDP's buckets
        return float(loss.detach())

    def memory(self):
        return module_memory(self.model, self.opt)


class TorchDDPShm(TorchDDP):
    """torch DDP whose bucket all-reduce is a comm hook (``DDP.register_comm_hook``, torch's
    API for replacing DDP's communication) on the DP group's bucket transport: on one host the
    shared-memory one (``runtime.comm.cpu.shm``) zero_repro's stages use. Each bucket is
    averaged and waited in the hook (DDP takes the hook's completed future)."""

    name = "torch_ddp_shm"

    def __init__(self, spec, rank, world):  # noqa: D107
        super().__init__(spec, rank, world)
        self.topo = Topology.build(tp=1, ledger=comm.CommLedger())
        self.transport = bucket_transport(self.topo.dp_group)
        self.ddp.register_comm_hook(None, self._all_reduce)

    def _all_reduce(self, state, bucket):
        buf = bucket.buffer()
        buf.div_(self.topo.dp)
        self.transport.all_reduce(buf).wait()
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    def comm_ledger(self):
        return self.topo.ledger


class TorchZeroRedundancy(TorchDDP):
    """DDP for the gradients + ZeroRedundancyOptimizer: optimizer state partitioned (P_os)."""

    name = "torch_zero_redundancy"

    def _optimizer(self):
        return ZeroRedundancyOptimizer(self.ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                       **self.adamw_kwargs())

    def memory(self):
        out = super().memory()
        out["optimizer"] = storage_bytes(optimizer_state_tensors(self.opt.optim))
        return out


class FSDP2(Runner):
    """fully_shard per block, then the root; reshard_after_forward selects the stage."""

    reshard = True

    def __init__(self, spec, rank, world):  # noqa: D107
        super().__init__(spec, rank, world)
        mesh = init_device_mesh("cpu", (world,))
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=self.reshard)
        self.opt = self.adamw(self.model.parameters())

    def views(self):
        # FSDP2 shards dim 0 in torch.chunk pieces: rank r holds rows [r*c, r*c + local rows)
        for n, p in self.model.named_parameters():
            local = p.detach().to_local()
            c = math.ceil(p.shape[0] / self.world)
            yield _strip(n), local, self.rank * c

    def memory(self):
        return module_memory(self.model, self.opt)


class FSDP2HSDP(FSDP2):
    """FSDP2's HSDP: ``fully_shard`` per block, then the root, on a 2-D (replicate, shard)
    mesh of R x G ranks (rank = replicate index · G + shard index, this project's DP mesh
    order); reduce-scatter over the shard dimension, all-reduce over the replicate one."""

    name = "fsdp2_hsdp"

    def __init__(self, spec, rank, world):  # noqa: D107
        Runner.__init__(self, spec, rank, world)
        g = spec.hsdp_shard_size
        if world % g:
            raise ValueError(f"hsdp_shard_size={g} must divide the world size {world}")
        self.shards = g
        mesh = init_device_mesh("cpu", (world // g, g), mesh_dim_names=("replicate", "shard"))
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=True)
        self.opt = self.adamw(self.model.parameters())

    def views(self):
        for n, p in self.model.named_parameters():
            local = p.detach().to_local()
            c = math.ceil(p.shape[0] / self.shards)
            yield _strip(n), local, (self.rank % self.shards) * c


class FSDP2NoReshard(FSDP2):
    name = "fsdp2_no_reshard"
    reshard = False


class FSDP2Reshard(FSDP2):
    name = "fsdp2_reshard"
    reshard = True


class DeepSpeedZero(Runner):
    """DeepSpeed engine, ZeRO stage k, fp32, a plain torch AdamW as the client optimizer."""

    ds_stage = 1
    hpz = False  # ZeRO++'s hpZ: zero_hpz_partition_size = spec.hsdp_shard_size (stage 3)
    # DeepSpeed's overlap_comm (its reductions on a side stream while backward runs); the
    # committed peers race ran with it on
    overlap_comm = True

    def __init__(self, spec, rank, world):  # noqa: D107
        ok, why = deepspeed_available()
        if not ok:
            raise RuntimeError(why)
        import deepspeed

        super().__init__(spec, rank, world)
        threads = torch.get_num_threads()
        deepspeed.init_distributed(dist_backend="gloo")
        if self.ds_stage == 3:
            # the tied LM head reads wte.weight in the root's forward, outside the embedding
            # module whose hooks gather it
            deepspeed.zero.register_external_parameter(self.model, self.model.wte.weight)
        z = spec.zero
        cfg = {"train_micro_batch_size_per_gpu": spec.train.micro_batch_size,
               "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
               "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30,
               "zero_optimization": {"stage": self.ds_stage, "overlap_comm": self.overlap_comm,
                                     "contiguous_gradients": True,
                                     "reduce_bucket_size": z.reduce_bucket_size,
                                     "allgather_bucket_size": z.allgather_bucket_size}}
        if self.hpz:
            cfg["zero_optimization"]["zero_hpz_partition_size"] = spec.hsdp_shard_size
        self.engine, self.opt, _, _ = deepspeed.initialize(
            model=self.model, optimizer=self.adamw(self.model.parameters()), config=cfg)
        torch.set_num_threads(threads)  # keep the same intra-op threads as every other peer

    def step(self, x, y):
        _, loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.detach())

    def views(self):
        if self.ds_stage != 3:
            yield from super().views()
            return
        import deepspeed

        named = list(self.model.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            for n, p in named:
                yield _strip(n), p.detach().clone(), None

    def memory(self):
        ps = list(self.model.parameters())
        held = [getattr(p, "ds_tensor", p) for p in ps]
        inner = getattr(self.opt, "optimizer", self.opt)
        fp32 = [t for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
                for t in getattr(self.opt, name, [])]
        out = {"params": storage_bytes(held), "fp32_partitions": storage_bytes(fp32),
               "optimizer": storage_bytes(optimizer_state_tensors(inner))}
        if self.hpz:  # hpZ's secondary partitions (ds_secondary_tensor), where present
            out["params_secondary"] = storage_bytes(
                getattr(p, "ds_secondary_tensor", None) for p in ps)
        return out


class DeepSpeedZ1(DeepSpeedZero):
    name, ds_stage = "deepspeed_z1", 1


class DeepSpeedZ2(DeepSpeedZero):
    name, ds_stage = "deepspeed_z2", 2


class DeepSpeedZ3(DeepSpeedZero):
    name, ds_stage = "deepspeed_z3", 3


class DeepSpeedZ3HPZ(DeepSpeedZero):
    name, ds_stage, hpz = "deepspeed_z3_hpz", 3, True


class LowerBound(Runner):
    """The floor of any ZeRO-DP stage on this machine: this rank's micro-batch forward +
    backward with no communication, then the fused AdamW kernel on Ψ/N_d elements (the shard
    every stage >= 1 updates). Not a framework: it trains nothing (its update runs on flat
    stand-in tensors), so it has no equivalence verdict."""

    name = LOWER_BOUND

    def __init__(self, spec, rank, world):  # noqa: D107
        super().__init__(spec, rank, world)
        psi = sum(p.numel() for p in self.model.parameters())
        shard = -(-psi // world)
        self.flat = torch.nn.Parameter(torch.zeros(shard))
        self.flat.grad = torch.full((shard,), 1e-3)
        kw = self.adamw_kwargs()
        kw["fused"] = True  # the fastest kernel: a bound, whatever the peers run
        self.opt = torch.optim.AdamW([self.flat], **kw)

    def step(self, x, y):
        _, loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.model.zero_grad(set_to_none=True)
        return float(loss.detach())

    def views(self):
        return iter(())


class ZeroRepro(Runner):
    """This project's ZeRO-DP stage (zero_repro.runtime.zero.strategy), fp32, no clipping; its DP
    buckets on the transport ``cpu_transport`` asks for (``ZR_CPU_TRANSPORT``, ``""``: this
    process's setting, shared memory by default)."""

    cpu_transport = ""
    hsdp = False  # zero.shard_size = spec.hsdp_shard_size (else plain ZeRO)
    hpz = False  # zero.hpz with the secondary over spec.hsdp_shard_size ranks (stage 3)

    def __init__(self, spec, rank, world):  # noqa: D107
        super().__init__(spec, rank, world)
        self.topo = Topology.build(tp=1, ledger=comm.CommLedger())
        zero = replace(spec.zero, stage=self.stage, grad_clip=0.0)
        if self.hsdp or self.hpz:
            zero = replace(zero, shard_size=str(spec.hsdp_shard_size), hpz=self.hpz)
        cfg = Config(model=spec.model, parallel=ParallelConfig(world_size=world, tp=1),
                     zero=zero, train=spec.train, zero_r=spec.zero_r)
        saved = os.environ.get("ZR_CPU_TRANSPORT")
        if self.cpu_transport:  # read once, when the strategy builds its transport
            os.environ["ZR_CPU_TRANSPORT"] = self.cpu_transport
        try:  # the race's one model, shared with the other frameworks, wrapped as it is
            self.trainer = Trainer(cfg, self.topo, model=self.model)
            self.strategy = self.trainer.strategy
        finally:
            if saved is None:
                os.environ.pop("ZR_CPU_TRANSPORT", None)
            else:
                os.environ["ZR_CPU_TRANSPORT"] = saved
        # no clipping, fp32: the norm would only be logged, and DDP / FSDP2 compute none
        self.strategy.measure_grad_norm = False

    def step(self, x, y):
        losses: list[torch.Tensor] = []
        self.trainer.step([(x, y)], on_loss=losses.append)
        return float(losses[0])

    def views(self):
        for n, p in self.strategy.full_parameters().items():
            yield n, p, None

    def memory(self):
        return self.strategy.memory_ledger().as_dict()

    def comm_ledger(self):
        return self.topo.ledger


def _ours(stage: int, transport: str = ""):
    tail = {"": "", "pairwise": "_p2p"}[transport]
    return type(f"ZeroReproS{stage}{tail}", (ZeroRepro,),
                {"name": f"zero_repro_s{stage}{tail}", "cpu_transport": transport})


class ZeroReproS3HSDP(ZeroRepro):
    name = "zero_repro_s3_hsdp"
    hsdp = True


class ZeroReproS3HPZ(ZeroRepro):
    name = "zero_repro_s3_hpz"
    hpz = True


RUNNERS: dict[str, type] = {c.name: c for c in (
    TorchDDP, TorchDDPShm, TorchZeroRedundancy, FSDP2NoReshard, FSDP2Reshard, FSDP2HSDP,
    DeepSpeedZ1, DeepSpeedZ2, DeepSpeedZ3, DeepSpeedZ3HPZ, LowerBound, ZeroReproS3HSDP,
    ZeroReproS3HPZ,
    *(_ours(k, t) for t in ("", "pairwise") for k in range(4)))}
