"""Step-time benchmark of the ZeRO-DP stages (paper §5/§7, measured on local gloo ranks).

``python -m zero_repro.bench [--model tiny|<conf/model name>] [--world 2] [--steps N]`` spawns
``world`` CPU ranks, trains the same model on the same random tokens with each stage 0-3 in turn
(TP 1, no ZeRO-R) and prints the median step time (after warm-up) per stage and its ratio to
stage 0. Times are *measured* on this machine's CPUs over gloo; they say nothing about GPU
clusters (gloo has no reduce-scatter / all-gather of flat buffers: stages 1-3 run them as N_d
rooted reduces / broadcasts, ``zero.flat_buffer.rooted_collectives``, slower than all-reduce).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from omegaconf import OmegaConf

from zero_repro.config import ModelConfig, TrainConfig, ZeroConfig
from zero_repro.distributed.launch import spawn
from zero_repro.distributed.topology import Topology
from zero_repro.model.gpt import GPT
from zero_repro.train.step import train_step
from zero_repro.paths import conf_group_dir
from zero_repro.zero import build_strategy


def model_config(name: str) -> ModelConfig:
    if name == "tiny":
        return ModelConfig(n_layer=2, n_embd=64, n_head=4, seq_len=32, vocab_size=512,
                           vocab_pad_multiple=8)
    path = conf_group_dir("model") / f"{name}.yaml"
    if path.exists():
        raw = {k: v for k, v in OmegaConf.to_container(OmegaConf.load(path)).items()
               if k != "defaults"}
        return ModelConfig(**raw)
    if name == "gpt_20m":
        return ModelConfig(name="gpt_20m", n_layer=6, n_embd=512, n_head=8, seq_len=128,
                           vocab_size=50257)
    raise ValueError(f"--model {name!r}: use tiny or gpt_20m (or add conf/model/{name}.yaml)")


def _bench_worker(rank: int, world: int, mcfg: ModelConfig, steps: int, warmup: int,
                  micro: int, dtype: str) -> dict:
    out = {}
    for stage in range(4):
        topo = Topology.build(1)
        model = GPT(mcfg, topo.tp_group)
        model.init_weights(0)
        strat = build_strategy(model, topo, ZeroConfig(stage=stage, dtype=dtype),
                               TrainConfig(micro_batch_size=micro))
        g = torch.Generator().manual_seed(rank)
        times, losses = [], []
        for step in range(warmup + steps):
            idx = torch.randint(0, mcfg.vocab_size, (micro, mcfg.seq_len), generator=g)
            t0 = time.perf_counter()
            step_losses: list[torch.Tensor] = []
            train_step(strat, [(idx, idx)], on_loss=step_losses.append)
            dt = time.perf_counter() - t0
            if step >= warmup:
                times.append(dt)
            losses.append(step_losses[0].item())
        out[stage] = {"median_s": statistics.median(times), "last_loss": losses[-1],
                      "psi": sum(p.numel() for p in model.parameters())}
        strat.remove_hooks()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    a = ap.parse_args(argv)
    mcfg = model_config(a.model)
    res = spawn(_bench_worker, a.world, mcfg, a.steps, a.warmup, a.micro, a.dtype)
    # a step ends when the slowest rank ends: take the max over ranks of each stage's median
    med = {s: max(r[s]["median_s"] for r in res) for s in range(4)}
    psi = res[0][0]["psi"]
    print(f"measured on local CPU ranks (gloo): model={a.model} Ψ={psi:,} world={a.world} "
          f"micro_batch={a.micro} dtype={a.dtype} steps={a.steps} (+{a.warmup} warm-up)")
    print(f"{'stage':>5} {'median step (ms)':>17} {'ratio to stage 0':>17} {'last loss':>10}")
    for s in range(4):
        print(f"{s:>5} {med[s] * 1e3:>17.1f} {med[s] / med[0]:>17.2f} "
              f"{res[0][s]['last_loss']:>10.4f}")


if __name__ == "__main__":
    main()
