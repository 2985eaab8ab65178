"""Peer runners: the same GPT, seed and global batches trained by torch DDP, DDP +
ZeroRedundancyOptimizer, FSDP2 ``fully_shard``, DeepSpeed ZeRO 1-3 and this project's stages
0-3, each in lock step with a single-process reference (paper §5: every ZeRO-DP stage trains
*the same model* as baseline DP; §7: stages 0-2 move 2Ψ elements per step, stage 3 moves 3Ψ).

Equivalence: after every step s each framework's parameters θ_f(s) are compared with the
reference θ_ref(s) (``torch.optim.AdamW`` on the TP=1 model over the full global batch):
``max |θ_f(s) - θ_ref(s)|`` per tensor, over the elements this rank holds (a full replica for
DDP-like peers, the local shard for FSDP2, the gathered parameters for the project's stages and
DeepSpeed ZeRO-3). The reference runs on every rank (redundantly, not timed), so no reference
snapshot is stored or sent anywhere.

Speed: frameworks are interleaved step by step (the order rotates every step) inside one set of
processes, so load from other programs on the machine hits every framework alike. A timed step
is barrier -> forward/backward/step/zero_grad -> clock; the step time of a step is the slowest
rank's. Like with like: with ``optimizer="fused"`` every peer runs ``torch.optim.AdamW(
fused=True)``, the kernel of this project's ShardAdamW (``"as_shipped"``: the peers' defaults).
``lower_bound`` is the floor: the same micro-batch's forward + backward with no communication
plus the fused AdamW on Ψ/N_d elements.

Isolation: a framework that replaces a torch function for the whole process (``PATCHES_TORCH``:
DeepSpeed ZeRO-3 sets ``torch.nn.functional.linear``, measured) runs in its own process set
(``process_sets``), so no other framework runs through its functions; the lower bound runs in
every set and puts the sets on one scale (report.py).

Communication: one untimed warm-up step per framework runs under ``CommCounter`` (a
``TorchDispatchMode`` that sees every c10d collective, including DDP's C++ reducer calls) and is
counted in a ``comm.CommLedger`` with comm.py's paper-volume convention. Memory: bytes of the
distinct storages of parameters, gradients and optimizer state this rank holds after a step.

Entry points (module level, usable with ``launch.spawn``): ``run_peers(rank, world, spec)``
and one ``run_<framework>`` per framework.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field, replace

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from zero_repro.config import ModelConfig, TrainConfig, ZeroConfig
from zero_repro.distributed import comm
from zero_repro.distributed.topology import Topology
from zero_repro.model.gpt import GPT
from zero_repro.train.data import make_source, rank_batch
from zero_repro.train.step import train_step
from zero_repro.zero import build_strategy

log = logging.getLogger(__name__)

# framework -> (ZeRO stage it is the peer of, family)
FRAMEWORKS: dict[str, tuple[int, str]] = {
    "torch_ddp": (0, "torch"),
    "torch_zero_redundancy": (1, "torch"),
    "fsdp2_no_reshard": (2, "torch"),
    "fsdp2_reshard": (3, "torch"),
    "deepspeed_z1": (1, "deepspeed"),
    "deepspeed_z2": (2, "deepspeed"),
    "deepspeed_z3": (3, "deepspeed"),
    "zero_repro_s0": (0, "zero_repro"),
    "zero_repro_s1": (1, "zero_repro"),
    "zero_repro_s2": (2, "zero_repro"),
    "zero_repro_s3": (3, "zero_repro"),
    "lower_bound": (-1, "bound"),  # compute only: not a framework, the floor of every stage
}
TORCH_PEERS = ("torch_ddp", "torch_zero_redundancy", "fsdp2_no_reshard", "fsdp2_reshard")
DEEPSPEED_PEERS = ("deepspeed_z1", "deepspeed_z2", "deepspeed_z3")
OURS = ("zero_repro_s0", "zero_repro_s1", "zero_repro_s2", "zero_repro_s3")
LOWER_BOUND = "lower_bound"
# frameworks that replace a torch function for the whole process (measured: DeepSpeed 0.19.8's
# ZeRO-3 engine sets torch.nn.functional.linear to its own autograd function; stages 1-2 leave
# torch's functions alone). Every framework sharing the process would run through it, so they
# run in a process set of their own (``process_sets``).
PATCHES_TORCH: dict[str, str] = {"deepspeed_z3": "torch.nn.functional.linear"}
OPTIMIZERS = ("fused", "as_shipped")


def process_sets(frameworks, anchors=(LOWER_BOUND,), by_stage: bool = False
                 ) -> list[tuple[str, ...]]:
    """Split ``frameworks`` into process sets: one for every framework that does not patch
    torch (one per ZeRO stage with ``by_stage``: fewer model copies per process for large
    models), one per patching framework. ``anchors`` (the lower bound) run in every set, so
    each set's times can be put on one scale (ratios across sets divide by the set's bound)."""
    fws = [f for f in frameworks if f not in anchors]
    plain = [f for f in fws if f not in PATCHES_TORCH]
    if by_stage:
        stages = sorted({FRAMEWORKS[f][0] for f in plain})
        sets = [[f for f in plain if FRAMEWORKS[f][0] == k] for k in stages]
    else:
        sets = [plain] if plain else []
    sets += [[f] for f in fws if f in PATCHES_TORCH]
    anchors = [a for a in anchors if a in frameworks]
    return [tuple(s + anchors) for s in sets] or ([tuple(anchors)] if anchors else [])


@dataclass
class PeerSpec:
    """Everything a run needs (picklable: travels to spawned ranks)."""

    model: ModelConfig
    train: TrainConfig  # lr, betas, eps, weight_decay, micro_batch_size, steps, warmup, seed
    zero: ZeroConfig  # bucket sizes for the project's stages and DeepSpeed; dtype must be fp32
    frameworks: tuple = ()
    digest_every: int = 1  # compare with the reference every k steps (and at the last step)
    comm_step: int = -1  # step counted by CommCounter (untimed); -1: the last warm-up step
    param_tol_rel_lr: float = 0.05  # |Δθ| floor at step s: param_tol_rel_lr · lr · (s + 1)
    # "fused": every peer's AdamW is torch.optim.AdamW(fused=True), the kernel this project's
    # ShardAdamW runs (like with like); "as_shipped": the peers' defaults (on CPU torch's
    # AdamW then takes its single-tensor path). The project's stages run fused in both.
    optimizer: str = "fused"
    reference: bool = True  # train the single-process reference and compare (equivalence)
    # fp32 rounding of a gradient, relative to the largest gradient of its tensor, that the
    # conditioning budget assumes (report.py: principled parameter tolerance)
    grad_rounding_rel: float = 1e-5

    def __post_init__(self) -> None:
        unknown = [f for f in self.frameworks if f not in FRAMEWORKS]
        if unknown:
            raise ValueError(f"unknown peer frameworks {unknown}: choose from {list(FRAMEWORKS)}")
        if self.zero.dtype != "fp32":
            raise ValueError("peer comparisons run in fp32: set zero.dtype=fp32")
        if self.train.grad_accum != 1:
            raise ValueError("peer comparisons use train.grad_accum=1")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}: choose from {list(OPTIMIZERS)}")


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
        ps = list(self.model.parameters())
        return {"params": storage_bytes(ps), "grads": storage_bytes(p.grad for p in ps),
                "optimizer": storage_bytes(optimizer_state_tensors(self.opt))}


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
        ps = list(self.model.parameters())
        return {"params": storage_bytes(ps), "grads": storage_bytes(p.grad for p in ps),
                "optimizer": storage_bytes(optimizer_state_tensors(self.opt))}


class FSDP2NoReshard(FSDP2):
    name = "fsdp2_no_reshard"
    reshard = False


class FSDP2Reshard(FSDP2):
    name = "fsdp2_reshard"
    reshard = True


class DeepSpeedZero(Runner):
    """DeepSpeed engine, ZeRO stage k, fp32, a plain torch AdamW as the client optimizer."""

    ds_stage = 1

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
               "zero_optimization": {"stage": self.ds_stage, "overlap_comm": z.overlap_comm,
                                     "contiguous_gradients": True,
                                     "reduce_bucket_size": z.reduce_bucket_size,
                                     "allgather_bucket_size": z.allgather_bucket_size}}
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
        return {"params": storage_bytes(held), "fp32_partitions": storage_bytes(fp32),
                "optimizer": storage_bytes(optimizer_state_tensors(inner))}


class DeepSpeedZ1(DeepSpeedZero):
    name, ds_stage = "deepspeed_z1", 1


class DeepSpeedZ2(DeepSpeedZero):
    name, ds_stage = "deepspeed_z2", 2


class DeepSpeedZ3(DeepSpeedZero):
    name, ds_stage = "deepspeed_z3", 3


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
    """This project's ZeRO-DP stage (zero_repro.zero.strategy), fp32, no clipping."""

    def __init__(self, spec, rank, world):  # noqa: D107
        super().__init__(spec, rank, world)
        self.topo = Topology.build(tp=1, ledger=comm.CommLedger())
        zero = replace(spec.zero, stage=self.stage, grad_clip=0.0)
        self.strategy = build_strategy(self.model, self.topo, zero, spec.train)

    def step(self, x, y):
        losses: list[torch.Tensor] = []
        train_step(self.strategy, [(x, y)], on_loss=losses.append)
        return float(losses[0])

    def views(self):
        for n, p in self.strategy.full_parameters().items():
            yield n, p, None

    def memory(self):
        return self.strategy.memory_ledger().as_dict()

    def comm_ledger(self):
        return self.topo.ledger


def _ours(stage: int):
    return type(f"ZeroReproS{stage}", (ZeroRepro,), {"name": f"zero_repro_s{stage}"})


RUNNERS: dict[str, type] = {c.name: c for c in (
    TorchDDP, TorchZeroRedundancy, FSDP2NoReshard, FSDP2Reshard, DeepSpeedZ1, DeepSpeedZ2,
    DeepSpeedZ3, LowerBound, *(_ours(k) for k in range(4)))}


# ------------------------------------------------------------------------------ the driver
@dataclass
class Trace:
    """What one framework did on this rank."""

    losses: list = field(default_factory=list)
    step_times: list = field(default_factory=list)  # every step (warm-up included)
    dparam: list = field(default_factory=list)  # per step: (max |Δ|, tensor) or None
    comm: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    build_s: float = 0.0


def digest(runner: Runner, ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """(max |θ_f - θ_ref| over the elements this rank holds, the tensor where it is largest)."""
    c = compare(runner, ref)
    return c[0], c[1]


def compare(runner: Runner, ref: dict[str, torch.Tensor],
            budget: dict[str, torch.Tensor] | None = None, abs_tol: float = 0.0
            ) -> tuple[float, str, float, int]:
    """(max |Δθ|, its tensor, max over elements of |Δθ| / (abs_tol + budget), elements beyond
    ``abs_tol`` but within their budget) over the elements this rank holds, Δθ = θ_f - θ_ref.

    The third value is the verdict (<= 1: equivalent); without ``budget`` it is
    max |Δθ| / abs_tol (inf when abs_tol is 0 and Δθ is not)."""
    worst, where, ratio, n_cond = 0.0, "", 0.0, 0
    for name, t, row0 in runner.views():
        if t.numel() == 0:
            continue
        r = ref[name]
        b = budget.get(name) if budget is not None else None
        if row0 is not None:
            rows = t.shape[0] if t.dim() else 0
            r = r.narrow(0, min(row0, r.shape[0]), rows) if rows else r[:0]
            if b is not None:
                b = b.narrow(0, min(row0, b.shape[0]), rows) if rows else b[:0]
        diff = (t.float() - r.reshape(t.shape)).abs()
        d = float(diff.max())
        if d > worst or not where or math.isnan(d):
            worst, where = d, name
        allowed = abs_tol + (b.reshape(t.shape) if b is not None else 0.0)
        if isinstance(allowed, float) and allowed == 0.0:
            q = 0.0 if d == 0 else math.inf
        else:
            q = float((diff / allowed).max()) if not math.isnan(d) else math.nan
        if not q <= ratio:  # NaN counts as the worst
            ratio = q
        if b is not None:
            n_cond += int(((diff > abs_tol) & (diff <= allowed)).sum())
    return worst, where, ratio, n_cond


def _timed_step(runner: Runner, x, y, world: comm.Group) -> tuple[float, float]:
    comm.barrier(world)
    t0 = time.perf_counter()
    loss = runner.step(x, y)
    return loss, time.perf_counter() - t0


def run_peers(rank: int, world_size: int, spec: PeerSpec) -> dict:
    """Train every framework of ``spec`` (and the reference, unless ``spec.reference`` is
    false) in lock step on this rank.

    Returns ``{"frameworks": {name: Trace as dict}, "reference_losses": [...], "rank": r}``;
    losses are this rank's local losses (the global loss is the mean over ranks). ``dparam``
    entries are ``compare``'s (max |Δθ|, tensor, tolerance ratio, elements within budget
    only)."""
    t = spec.train
    world = None  # comm.barrier(None): the default group, every rank
    source = make_source(t.data, spec.model.seq_len, spec.model.vocab_size, t.seed)
    ref = Reference(spec, rank, world_size) if spec.reference else None
    runners: dict[str, Runner] = {}
    traces: dict[str, Trace] = {}
    for name in spec.frameworks:
        t0 = time.perf_counter()
        runners[name] = RUNNERS[name](spec, rank, world_size)
        traces[name] = Trace(build_s=time.perf_counter() - t0)
    comm_step = spec.comm_step if spec.comm_step >= 0 else max(0, t.warmup_steps - 1)
    ref_losses = []
    names = list(runners)
    for step in range(t.steps):
        ref_params = None
        if ref is not None:
            gx, gy = rank_batch(source, step, t.micro_batch_size * world_size, 1, 0)
            ref_losses.append(ref.step(gx, gy))
            ref_params = {n: p.detach() for n, p in ref.model.named_parameters()}
        x, y = rank_batch(source, step, t.micro_batch_size, world_size, rank)
        k = step % max(1, len(names))
        last = step == t.steps - 1
        for name in names[k:] + names[:k]:  # rotate: no framework always runs first
            r, tr = runners[name], traces[name]
            if step == comm_step:
                tr.losses.append(_counted_step(r, tr, x, y))
                tr.step_times.append(float("nan"))
            else:
                loss, dt = _timed_step(r, x, y, world)
                tr.losses.append(loss)
                tr.step_times.append(dt)
            check = ref_params is not None and name != LOWER_BOUND and (
                last or step % spec.digest_every == 0)
            abs_tol = spec.param_tol_rel_lr * t.lr * (step + 1)
            tr.dparam.append(compare(r, ref_params, ref.budget, abs_tol) if check else None)
            if last:
                tr.memory = r.memory()
    return {"rank": rank, "reference_losses": ref_losses,
            "frameworks": {n: vars(tr) for n, tr in traces.items()}}


def _counted_step(runner: Runner, trace: Trace, x, y) -> float:
    comm.barrier(None)
    own = runner.comm_ledger()
    if own is not None:
        own.reset()
        loss = runner.step(x, y)
        trace.comm = {"source": "zero_repro.distributed.comm ledger", **own.as_dict()}
        return loss
    ledger = comm.CommLedger()
    with CommCounter(ledger):
        loss = runner.step(x, y)
    trace.comm = {"source": "c10d dispatch counter", **ledger.as_dict()}
    return loss


def _single(name: str):
    def run(rank: int, world_size: int, spec: PeerSpec) -> dict:
        return run_peers(rank, world_size, replace(spec, frameworks=(name,)))

    run.__name__ = run.__qualname__ = f"run_{name}"
    run.__doc__ = f"``run_peers`` with the single framework {name!r} (usable with spawn)."
    return run


run_torch_ddp = _single("torch_ddp")
run_torch_zero_redundancy = _single("torch_zero_redundancy")
run_fsdp2_no_reshard = _single("fsdp2_no_reshard")
run_fsdp2_reshard = _single("fsdp2_reshard")
run_deepspeed_z1 = _single("deepspeed_z1")
run_deepspeed_z2 = _single("deepspeed_z2")
run_deepspeed_z3 = _single("deepspeed_z3")
run_zero_repro_s0 = _single("zero_repro_s0")
run_zero_repro_s1 = _single("zero_repro_s1")
run_zero_repro_s2 = _single("zero_repro_s2")
run_zero_repro_s3 = _single("zero_repro_s3")
run_lower_bound = _single(LOWER_BOUND)
