"""The CUDA/NCCL path's host-side logic, checked without a GPU (CUDA calls mocked where they
cannot be avoided): the rank's GPU chosen and made current before the NCCL group exists, with
``device_id``, on sites that show each task one GPU; the training loop's windowed timing (one
host synchronisation per window, callbacks in step order, same losses); honest MFU/HFU; the GPU
clusters' defaults (bf16, C_B buckets in DeepSpeed's range); one process group per distinct set
of ranks however often a topology is rebuilt (on NCCL each is a communicator); the GPU count
pre-flight; no host read of a device value inside the optimizer step (the overflow skip, the
clip and the fp16 loss-scale decision stay on the device until asked)."""
from __future__ import annotations

import time

import pytest
import torch
from hydra import compose, initialize_config_dir

from zero_repro import config as C
from zero_repro import schema
from zero_repro import validation
from zero_repro.lab.cli import conf_dir
from zero_repro.runtime.comm import comm, launch
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.model import flops
from zero_repro.runtime.model.gpt import GPT
from zero_repro.runtime.train import loop
from zero_repro.runtime.train.data import make_source
from zero_repro.runtime.zero import build_strategy


@pytest.fixture
def fake_cuda(monkeypatch):
    """One visible GPU (as under Slurm's --gpus-per-task=1); set_device calls recorded."""
    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    return calls


def test_cuda_device_is_local_rank_modulo_visible_gpus(fake_cuda, monkeypatch):
    monkeypatch.delenv("ZR_TF32", raising=False)
    assert launch.cuda_device(3) == torch.device("cuda", 0)
    assert fake_cuda == [("set_device", torch.device("cuda", 0))]
    assert torch.backends.cuda.matmul.allow_tf32  # fp32 matmuls on TF32 by default
    monkeypatch.setenv("ZR_TF32", "0")
    launch.cuda_device(0)
    assert not torch.backends.cuda.matmul.allow_tf32
    monkeypatch.setenv("ZR_TF32", "yes")
    with pytest.raises(ValueError, match="ZR_TF32"):
        launch.cuda_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False


def test_nccl_group_made_after_set_device_with_device_id(fake_cuda, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    # init_from_env only fills MASTER_* in when unset: set here, so that teardown removes them
    # (left in os.environ they would steer every later Slurm job of this pytest to one port)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("ZR_TF32", "1")

    def init(backend, rank, world, **kw):
        fake_cuda.append(("init_process_group", backend, rank, world, kw.get("device_id")))

    monkeypatch.setattr(comm, "init_process_group", init)
    assert launch.init_from_env("nccl") == (5, 8, 1)
    assert fake_cuda == [("set_device", torch.device("cuda", 0)),
                         ("init_process_group", "nccl", 5, 8, torch.device("cuda", 0))]
    assert launch.rendezvous() == "slurm"
    fake_cuda.clear()
    launch.init_from_env("gloo")  # CPU ranks: no device, no device_id
    assert fake_cuda == [("init_process_group", "gloo", 5, 8, None)]
    torch.backends.cuda.matmul.allow_tf32 = False


class _FakeEvent:
    """A CUDA event on the host clock; counts the host synchronisations."""

    syncs = 0

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        _FakeEvent.syncs += 1

    def elapsed_time(self, other) -> float:
        return (other.t - self.t) * 1e3


def _run_loop(monkeypatch, cuda: bool, steps=10, warmup=2, save_every=0):
    cfg = C.Config()
    cfg.model = C.ModelConfig(n_layer=1, n_embd=32, n_head=2, seq_len=16, vocab_size=64,
                              vocab_pad_multiple=8)
    cfg.parallel.world_size = 1
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.micro_batch_size = steps, warmup, 2
    cfg.checkpoint.save_every = save_every
    if cuda:
        monkeypatch.setattr(loop._Clock, "__init__", lambda self, device: setattr(
            self, "cuda", True))
        monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    _FakeEvent.syncs = 0
    topo = Topology.build(1)
    model = GPT(cfg.model, topo.tp_group, seed=1)
    strategy = build_strategy(model, topo, cfg.zero, cfg.train)
    seen = []
    res = loop.train(strategy, make_source("synthetic", 16, 64, 1), cfg, topo,
                     torch.device("cpu"), on_step=lambda s, loss, dt, info: seen.append(s))
    strategy.remove_hooks()
    return res, seen, _FakeEvent.syncs


def test_loop_synchronises_once_per_window(monkeypatch):
    ref, seen_cpu, _ = _run_loop(monkeypatch, cuda=False)
    res, seen, syncs = _run_loop(monkeypatch, cuda=True)
    assert syncs == 2  # the warm-up's window (steps 0-1), then steps 2-9 (8 = CUDA_WINDOW)
    assert seen == seen_cpu == list(range(10))
    assert len(res.step_times) == 8 and all(t > 0 for t in res.step_times)
    assert res.losses == ref.losses and res.grad_norms == ref.grad_norms
    _, seen, syncs = _run_loop(monkeypatch, cuda=True, save_every=3)
    assert syncs == 5 and seen == list(range(10))  # windows end at steps 1, 2, 5, 8, 9


def test_mfu_counts_model_flops_hfu_the_recompute():
    b, s, l, h, v = 8, 1024, 48, 1600, 50304
    model = flops.model_flops_per_iteration(b, s, l, h, v)
    # causal attention: the s² terms at half of Megatron's full count (+4.8% for this model)
    assert flops.flops_per_iteration(b, s, l, h, v, recompute=False) / model == \
        pytest.approx(1.0481, rel=1e-3)
    assert flops.hardware_flops_per_iteration(b, s, l, h, v, recompute=True) / model == \
        pytest.approx(1.3169, rel=1e-3)
    assert flops.hardware_flops_per_iteration(b, s, l, h, v, recompute=False) == model


def _compose(*overrides) -> C.Config:
    schema.register_configs()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        return validation.validate(schema.to_config(compose("config", overrides=list(overrides))))


@pytest.mark.parametrize("cluster,dtype", [("h200", "bf16"), ("h100", "bf16"),
                                           ("dgx_a100_80g", "bf16"), ("dgx_a100_40g", "bf16"),
                                           ("dgx2_v100", "fp16")])
def test_gpu_clusters_default_to_low_precision_and_buckets(cluster, dtype):
    c = _compose(f"cluster={cluster}")
    assert (c.zero.dtype, c.zero_r.constant_buffers, c.zero.reduce_bucket_size,
            c.zero.allgather_bucket_size) == (dtype, True, 50_000_000, 50_000_000)
    assert c.zero_r.name == "custom" and not c.zero_r.activation_checkpointing
    # gpt_1p5b in buckets of C_B: ~32, not one model-size bucket (C_B off) nor 779 (2M)
    assert 30 <= -(-flops.param_count(C.ModelConfig(**_model("gpt_1p5b_48x1600")))
                   // c.zero.reduce_bucket_size) <= 33
    # every default yields to an explicit choice
    c3 = _compose(f"cluster={cluster}", "zero_r=c3")
    assert (c3.zero_r.name, c3.zero.stage, c3.zero.dtype) == ("c3", 2, dtype)
    off = _compose(f"cluster={cluster}", "zero_r=off", "zero.dtype=fp32")
    assert (off.zero_r.name, off.zero_r.constant_buffers, off.zero.dtype) == ("off", False,
                                                                               "fp32")
    assert _compose().zero.dtype == "fp32"  # cluster=local (CPU) keeps its defaults


def _model(name: str) -> dict:
    return schema.model_conf(name)


def test_gpu_count_check_yields_to_oversubscribe(monkeypatch, tmp_path):
    """More local ranks than GPUs is refused before anything starts, unless the point says it
    starts fewer processes than its world has ranks (``launcher.oversubscribe``: the GPU
    proof's paper points play rank 0 of 400 in one process)."""
    from zero_repro.lab import launcher
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = _compose("cluster=h100", "parallel.world_size=4")
    with pytest.raises(ValueError, match="needs 4 GPUs on this machine, which has 1.*"
                                         "launcher.oversubscribe=true"):
        launcher.check_runnable(cfg, str(tmp_path))
    cfg.launcher.oversubscribe = True
    assert launcher.check_runnable(cfg, str(tmp_path)) is None


def _groups_rank(rank: int, world: int) -> dict:
    """The GPU proof's topologies at world 4: TP 1 and TP 2 x DP 2 for each of four stages, and
    five more TP 1 ones (node part, probe); the process groups this rank is in afterwards."""
    from torch.distributed import distributed_c10d as c10d
    before = len(c10d._world.pg_map)
    topos = [Topology.build(tp) for tp in (1, 2) for _stage in range(4)]
    topos += [Topology.build(1) for _ in range(5)]
    sums = []
    for t in (topos[-1], topos[4]):  # a reused group still carries collectives
        for g in (t.world, t.tp_group, t.dp_group):
            x = torch.ones(1)
            comm.all_reduce(x, g)
            sums.append(float(x))
    default = c10d._get_default_group()
    return {"before": before, "after": len(c10d._world.pg_map), "sums": sums,
            "world_is_default": all(t.world.pg is default for t in topos),
            "dp_is_default_at_tp1": topos[0].dp_group.pg is default,
            "tp_shared": topos[4].tp_group.pg is topos[7].tp_group.pg}


def test_one_process_group_per_set_of_ranks():
    """13 topologies (the proof's equivalence and node parts at world 4) leave each rank in 3
    process groups -- the default one (the world, and DP at TP 1), its TP pair, its DP pair --
    not one more per topology: on NCCL with ``device_id`` each group is an eagerly made
    communicator with its device memory, never destroyed before the process ends."""
    for r in spawn(_groups_rank, 4):
        assert (r["before"], r["after"]) == (1, 3), r
        assert r["world_is_default"] and r["dp_is_default_at_tp1"] and r["tp_shared"]
        assert r["sums"] == [4.0, 1.0, 4.0, 4.0, 2.0, 2.0]


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that hand a tensor's value to the host (on CUDA: a synchronisation)."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
             torch.ops.aten.equal.default}

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in self.READS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype,clip,inf", [("fp32", 1.0, False), ("fp16", 1.0, False),
                                            ("bf16", 0.0, False), ("fp16", 1.0, True)])
def test_step_reads_nothing_from_the_device(dtype, clip, inf, monkeypatch):
    """``strategy.step()`` queues the norm all-reduce, the clip, the skip and Adam without
    reading a device value on the host (on CUDA: without waiting for the GPU), also for an
    overflowing fp16 step; ``StepInfo`` and the loss scale read the agreed flag afterwards and
    give the values of a host decision: the skip, the halved scale, unchanged parameters. On
    CPU ranks the numbers are read at once (gloo's all-reduce has waited already): the CUDA
    order is taken here (``clip.deferred``)."""
    from zero_repro.runtime.zero import clip as clip_module
    monkeypatch.setattr(clip_module, "deferred", lambda t: True)
    topo = Topology.build(1)
    model = GPT(C.ModelConfig(n_layer=1, n_embd=32, n_head=2, seq_len=16, vocab_size=64,
                              vocab_pad_multiple=8), topo.tp_group, seed=1)
    zero = C.ZeroConfig(stage=2, dtype=dtype, grad_clip=clip, hysteresis=1,
                        reduce_bucket_size=500, allgather_bucket_size=500)
    strategy = build_strategy(model, topo, zero, C.TrainConfig(micro_batch_size=2))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    before = [c.clone() for c in strategy.params.chunks()]
    scale = strategy.scaler.scale
    _, loss = strategy(x, torch.roll(x, 1, 1))
    strategy.backward(loss * (float("inf") if inf else 1.0))
    reads = _HostReads()
    with reads:
        info = strategy.step()
    assert reads.n == 0
    assert info.skipped is inf and (info.grad_norm == float("inf")) is inf
    assert (info.grad_norm > 0) and info.loss_scale == scale
    assert strategy.opt.step_count == (0 if inf else 1)
    moved = [not torch.equal(a, b) for a, b in zip(before, strategy.params.chunks())]
    assert not any(moved) if inf else any(moved)
    assert strategy.scaler.scale == (scale / 2 if inf else scale)  # fp16 with hysteresis 1
    strategy.remove_hooks()


def test_loss_scale_decided_when_read():
    """The fp16 scaler takes the step's agreed flag and applies it when the scale is next read:
    the scales of a run of bools."""
    from types import SimpleNamespace
    from zero_repro.runtime.zero.precision import DynamicLossScaler
    flags = [True, True, False, False, False, True, True, True]
    a, b = (DynamicLossScaler(2.0 ** 8, window=3, min_scale=1.0, hysteresis=2)
            for _ in range(2))
    for f in flags:
        a.update(f)
        b.update(SimpleNamespace(overflow=f))
        assert b._pending is not None
        assert a.scale == b.scale and b._pending is None
    assert a.state_dict() == b.state_dict()
