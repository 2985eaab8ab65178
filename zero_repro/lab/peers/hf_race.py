"""A model this project did not write, raced as its users would: a Hugging Face GPT-2 built from
a config (no download), stage 3 (``build_strategy``, units = the model's largest ModuleList,
a torch fused AdamW given as ``optimizer=``) against FSDP2 (``fully_shard`` per block, then the
root, the same AdamW), each framework in a spawn of its own (world 2, gloo, fp32). Per rank:
the live-storage peak over the build and two untimed steps (``live_peak.live_tracer``), the
process's max RSS and the median of the timed steps (the largest rank's of each).

python -m zero_repro.lab.peers.hf_race [--layers 6 --embd 256 --seq 128 --batch 4]
"""
from __future__ import annotations

import argparse
import collections
import resource
import statistics
import time

import torch

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.lab.live_peak import live_tracer
from zero_repro.runtime.comm import comm
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.zero import build_strategy

FRAMEWORKS = ("fsdp2", "zero_repro_s3")


def gpt2(layers: int, embd: int, seq: int):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=seq, n_embd=embd, n_layer=layers,
                                  n_head=max(1, embd // 64), resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, loss_type="ForCausalLM")
    return transformers.GPT2LMHeadModel(cfg).float()


def _build(which: str, model, world: int):
    """The framework around ``model`` and its step(ids)."""
    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    if which == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = adamw(model.parameters())

        def step(ids):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    strat = build_strategy(model, Topology.build(1), ZeroConfig(stage=3, grad_clip=0.0),
                           TrainConfig(), ZeroRConfig(constant_buffers=True,
                                                      contiguous_memory=True), optimizer=adamw)
    strat.measure_grad_norm = False

    def step(ids):
        strat.backward(strat.module(input_ids=ids, labels=ids).loss)
        strat.step()
        strat.zero_grad()
    return step


def worker(rank: int, world: int, which: str, shape: dict, steps: int = 6) -> dict:
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, 50257, (shape["batch"], shape["seq"]), generator=g)
            for _ in range(steps)]
    tracer = live_tracer(world)
    with tracer:
        step = _build(which, gpt2(shape["layers"], shape["embd"], shape["seq"]), world)
    times = []
    for i, ids in enumerate(data):
        if i < 2:  # untimed, tracked
            with tracer:
                step(ids)
            continue
        comm.barrier()
        t0 = time.perf_counter()
        step(ids)
        comm.barrier()
        times.append(time.perf_counter() - t0)
    return {"live_peak": tracer.peak, "step_s": statistics.median(times),
            "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 6), ("embd", 256), ("seq", 128), ("batch", 4)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args(argv)
    shape = {k: getattr(a, k) for k in ("layers", "embd", "seq", "batch")}
    out = collections.OrderedDict()
    for which in FRAMEWORKS:  # separate spawns: nothing of one framework in the other's process
        res = spawn(worker, a.world, which, shape, timeout_s=600)
        out[which] = {k: max(r[k] for r in res) for k in ("live_peak", "step_s", "max_rss")}
        r = out[which]
        print(f"{which:14s} live peak {r['live_peak'] / 2**20:7.1f} MiB  max RSS "
              f"{r['max_rss'] / 2**20:7.0f} MiB  step {r['step_s'] * 1e3:7.0f} ms (largest rank)")
    a_, b_ = out["zero_repro_s3"], out["fsdp2"]
    print(f"stage 3 / FSDP2: live peak {a_['live_peak'] / b_['live_peak']:.3f}x, max RSS "
          f"{a_['max_rss'] / b_['max_rss']:.3f}x, step {a_['step_s'] / b_['step_s']:.2f}x "
          f"(measured, world {a.world})")


if __name__ == "__main__":
    main()
