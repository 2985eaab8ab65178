"""The HSDP race: FSDP2's HSDP against this project's stage 3 with ``zero.shard_size`` = G
(``spec.HSDP``), interleaved step by step in one spawn (``runners.run_peers``, gloo, fp32,
torch's fused AdamW for both), with the single-process reference for equivalence. Prints each
framework's median step time (slowest rank per step, after warm-up), their ratio, and each
rank's live-storage peak (``lab.live_peak.live_tracer``, build + untimed steps).

python -m zero_repro.lab.peers.hsdp_race --world 4 --shard-size 2 [--layers 10 --embd 256]
"""
from __future__ import annotations

import argparse

from zero_repro import config as C
from zero_repro.lab.peers import report
from zero_repro.lab.peers.runners import run_peers
from zero_repro.lab.peers.spec import HSDP, PeerSpec
from zero_repro.runtime.comm.launch import spawn


def race(world: int, shard_size: int, layers: int, embd: int, steps: int) -> dict:
    model = C.ModelConfig(name=f"gpt_{layers}x{embd}", n_layer=layers, n_embd=embd,
                          n_head=max(1, embd // 64), seq_len=64, vocab_size=50257)
    train = C.TrainConfig(steps=steps, warmup_steps=2, micro_batch_size=4, lr=3e-4, eps=1e-8,
                          progress=False)
    spec = PeerSpec(model, train, C.ZeroConfig(grad_clip=0.0), frameworks=HSDP,
                    hsdp_shard_size=shard_size)
    results = spawn(run_peers, world, spec, timeout_s=600)
    sp = report.speed(results, warmup_steps=2)
    eq = report.equivalence(results, lr=train.lr)
    peaks = {n: [r["frameworks"][n]["live_peak"] for r in sorted(results, key=lambda r: r["rank"])]
             for n in HSDP}
    return {"speed": sp, "equivalence": eq, "live_peak": peaks}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--shard-size", type=int, default=2)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args(argv)
    out = race(a.world, a.shard_size, a.layers, a.embd, a.steps)
    fsdp, ours = (out["speed"][n]["step_time_s"] for n in HSDP)
    for n in HSDP:
        e = out["equivalence"][n]
        print(f"{n:20s} step {out['speed'][n]['step_time_s'] * 1e3:8.1f} ms  live peak per rank "
              f"{[round(p / 2**20, 1) for p in out['live_peak'][n]]} MiB  first divergence "
              f"{e['first_divergence']}  max|dloss| {max(e['abs_dloss']):.2e}")
    print(f"zero_repro_s3_hsdp / fsdp2_hsdp step time: {ours / fsdp:.2f}x (measured, world "
          f"{a.world}, G = {a.shard_size})")


if __name__ == "__main__":
    main()
