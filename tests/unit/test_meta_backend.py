"""The dry run's meta backend (``scale.dryrun.tracer``, ``dry_run(backend="meta")``): the runtime on
PyTorch's meta device with the tracer's output cache, checked against the uncached meta kernels
(exact) and against the original FakeTensorMode mechanism (equal but for two CUDA rules the
CPU fake tensors did not follow); and the runtime's buffers on the model's device."""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from zero_repro import config as C
from zero_repro import validation
from zero_repro.runtime.comm import comm, launch
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.model.gpt import causal_attention
from zero_repro.scale.paper.overrides import paper_overrides
from zero_repro.scale.paper.table3 import zero_r_config
from zero_repro.scale.dryrun.dryrun import apply_overrides, dry_run, one_step
from zero_repro.scale.dryrun.tracer import AllocationTracer
from zero_repro.runtime.train.trainer import Trainer
from torch.utils._python_dispatch import TorchDispatchMode


class _NoData(TorchDispatchMode):
    """Answers ``.item()`` (no data on meta) like the dry run's tracer, and nothing else."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return False if args[0].dtype == torch.bool else 0
        return func(*args, **(kwargs or {}))


def _paper(n_layer: int, zc: str, stack: str, stage: int | None = None) -> C.Config:
    ov = paper_overrides(n_layer, 8192, 64, 400, 16, 2, zc)
    if stage is not None:
        ov["zero.stage"] = stage
    return apply_overrides(C.Config(), {**ov, "simulate.stack": stack})


def _events(r):
    """Device events up to storage ids: (kind, bytes, phase, iteration, category)."""
    return [(k, n, ph, it, r.category_of.get(sid)) for k, sid, n, ph, it in r.trace
            if sid not in r.host_sids]


@pytest.mark.parametrize("zc,stack,stage", [("c1", "paper2020", None), ("c4", "modern", None),
                                            ("c5", "paper2020", None), ("c3", "modern", 3)])
def test_output_cache_is_exact(zc, stack, stage):
    """Answering an op from the cache gives the trace the meta kernels give, event for event."""
    cfg = _paper(3, zc, stack, stage)
    cached, uncached = dry_run(cfg, backend="meta"), dry_run(cfg, backend="meta_uncached")
    assert cached.cached_ops > 500 and uncached.cached_ops == 0
    assert _events(cached) == _events(uncached)
    assert cached.min_capacity() == uncached.min_capacity()
    assert cached.breakdown == uncached.breakdown


@pytest.mark.parametrize("zc,stack", [("c1", "paper2020"),
                                      pytest.param("c4", "modern", marks=pytest.mark.slow)])
def test_meta_and_fake_tensors_differ_only_in_the_cuda_dtype_rules(zc, stack):
    """Meta kernels follow CUDA's dtype rules; the CPU fake tensors of the original mechanism
    did not. The traces differ in exactly two ways, everything else event for event:
      * layer norm's saved mean / rstd of fp16 input: fp32 on CUDA (and meta), fp16 on CPU --
        (b, s, 1) elements, 2·b·s bytes under fake tensors, twice that under meta;
      * (modern layer) the memory-efficient attention kernel's RNG seed and offset (8-byte
        scalars) where the CPU flash kernel has none."""
    cfg = _paper(2, zc, stack)
    meta, fake = dry_run(cfg, backend="meta"), dry_run(cfg, backend="fake")
    b, s = cfg.train.micro_batch_size, cfg.model.seq_len
    stat = 2 * b * s  # fp16 (b, s, 1)
    em, ef = collections.Counter(_events(meta)), collections.Counter(_events(fake))
    only_fake, only_meta = ef - em, em - ef
    assert only_fake and {e[1] for e in only_fake} == {stat}
    # every fp16 statistic of the fake trace is an fp32 one in the meta trace
    as_fp32 = collections.Counter({(k, 2 * n, *rest): c for (k, n, *rest), c in only_fake.items()})
    rng = only_meta - as_fp32
    assert only_meta - rng == as_fp32
    assert {e[1] for e in rng} <= ({8} if stack == "modern" else set())
    assert len(_events(meta)) - len(_events(fake)) == sum(rng.values())


def test_attention_on_meta_runs_the_fused_cuda_kernel():
    """No s² scores: the memory-efficient kernel keeps the output and an fp32 log-sum-exp."""
    b, h, s, d = 2, 4, 256, 64
    q, k, v = (torch.empty(b, h, s, d, dtype=torch.float16, device="meta", requires_grad=True)
               for _ in range(3))
    tr = AllocationTracer(on_meta=True)
    with tr:
        y = causal_attention(q, k, v, 0.0)
        y.float().sum().backward()
    assert y.shape == (b, h, s, d) and y.dtype == torch.float16
    sizes = [n for kind, _sid, n, _p, _i in tr.events if kind == "alloc"]
    assert max(sizes) < b * h * s * s * 2  # nothing of the scores' size
    assert b * h * s * 4 in sizes  # the log-sum-exp (fp32)


@pytest.mark.parametrize("stage,zr,dtype", [(0, "off", "fp16"), (1, "c1", "fp16"),
                                            (2, "c5", "bf16"), (3, "c4", "fp32"),
                                            (2, "off", "fp32")])
def test_strategies_put_every_buffer_on_the_model_device(stage, zr, dtype):
    """Build and step each stage on meta parameters with no tracer and no default device: a
    buffer made on the default (CPU) device instead of the parameters' device would meet a meta
    tensor in the step and fail (a GPU run would put it in host memory)."""
    cfg = C.Config()
    cfg.parallel = C.ParallelConfig(world_size=4, tp=1)
    cfg.zero = dataclasses.replace(cfg.zero, stage=stage, dtype=dtype)
    cfg.zero_r = dataclasses.replace(zero_r_config(zr), cpu_checkpointing=False)
    cfg.train = dataclasses.replace(cfg.train, micro_batch_size=2)
    cfg = validation.validate(cfg)
    launch.init_fake(0, 4)
    try:
        trainer = Trainer(cfg, Topology.build(1), torch.device("meta"))
        model, strategy = trainer.model, trainer.strategy
        tensors = []
        for _ in range(2):
            # the default device is set for the batch only (the backward hooks run in the
            # autograd engine's thread, where it is not set)
            with torch.device("meta"), _NoData():
                one_step(trainer, None, set(), cfg, 0)
        opt = strategy.opt
        tensors += [t for t in (opt.master, opt.exp_avg, opt.exp_avg_sq, opt._step_t)
                    if t is not None]
        tensors += [g.flat for g in strategy.groups]
        tensors += [p for p in model.parameters()]
        assert tensors and all(t.device.type == "meta" for t in tensors)
    finally:
        comm.destroy_process_group()
