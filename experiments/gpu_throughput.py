"""GPU throughput check: one GPU, bf16, a ~1.5B GPT, ZeRO stages 0 and 3 through the real trainer
(``zero_repro.lab.launcher.run_training``); writes TFLOPs/GPU and MFU to ``results/gpu/``.

Model FLOPs per iteration without recompute: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)); MFU =
achieved TFLOPs / the device's dense bf16 peak (``conf/cluster/<name>.yaml``, from the CUDA device
name or ``--cluster``). Targets (exit 1 when missed): MFU >= 0.50 on H100/H200-class devices;
stage 3's overhead at world 1 (gather/release of every block, nothing to shard) <= 5% of a step.
Without CUDA: exit 2, never a CPU fallback.

    python -m experiments.gpu_throughput [--model gpt_1p5b_48x1600] [--batch 8] [--steps 12]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from zero_repro import config as C
from zero_repro.scale.hardware import load_cluster
from zero_repro.lab.launcher import run_training

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# CUDA device name fragment -> conf/cluster/<name>.yaml (for the peak)
DEVICE_CLUSTERS = [("H200", "h200"), ("H100", "h100"), ("A100-SXM4-80GB", "dgx_a100_80g"),
                   ("A100", "dgx_a100_40g"), ("V100", "dgx2_v100")]
MFU_TARGET_DEVICES = ("h100", "h200")


def cluster_for(device_name: str) -> str | None:
    return next((c for frag, c in DEVICE_CLUSTERS if frag in device_name), None)


def make_config(model: str, stage: int, batch: int, steps: int, warmup: int, cluster: str,
                checkpointing: bool):
    from omegaconf import OmegaConf

    raw = OmegaConf.load(os.path.join(REPO, "conf", "model", f"{model}.yaml"))
    raw.pop("defaults", None)
    cfg = C.Config()
    cfg.model = C.ModelConfig(**OmegaConf.to_container(raw))
    cfg.parallel = C.ParallelConfig(world_size=1, tp=1)
    cfg.zero.stage, cfg.zero.dtype = stage, "bf16"
    cfg.zero.reduce_bucket_size = cfg.zero.allgather_bucket_size = 500_000_000
    cfg.zero_r.activation_checkpointing = checkpointing
    cfg.train.micro_batch_size, cfg.train.steps, cfg.train.warmup_steps = batch, steps, warmup
    cfg.train.progress = False
    cfg.cluster = load_cluster(cluster)
    cfg.experiment.name = "gpu_throughput"
    return C.validate(cfg)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt_1p5b_48x1600")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--cluster", default="", help="conf/cluster name for the peak (default: "
                                                 "from the device name)")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--out", default=os.path.join(REPO, "results", "gpu"))
    ap.add_argument("--min-mfu", type=float, default=0.50)
    ap.add_argument("--max-stage3-overhead", type=float, default=0.05)
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("error: experiments/gpu_throughput.py needs a CUDA GPU and none is visible "
              "(torch.cuda.is_available() is False); nothing was run", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0)
    cluster = args.cluster or cluster_for(device)
    if not cluster:
        print(f"error: unknown device {device!r}: pass --cluster NAME (conf/cluster/)",
              file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    results = {}
    for stage in args.stages:
        cfg = make_config(args.model, stage, args.batch, args.steps, args.warmup, cluster,
                          args.checkpointing)
        t0 = time.perf_counter()
        res = run_training(cfg, os.path.join(args.out, "runs", f"stage{stage}"))
        m = res["metrics"]
        results[stage] = {"stage": stage, "step_time_s": m["step_time_s"],
                          "tflops_per_gpu": m["tflops_per_gpu"], "mfu": m.get("mfu"),
                          "tokens_per_s": m["tokens_per_s"], "params": m["params_total"],
                          "loss_first": m["loss_first"], "loss_last": m["loss_last"],
                          "cuda_max_allocated": res["memory"].get("cuda_max_allocated"),
                          "wall_s": time.perf_counter() - t0}
        print(f"stage {stage}: {m['tflops_per_gpu']:.1f} TFLOPs/GPU, MFU {m.get('mfu', 0):.3f},"
              f" step {m['step_time_s'] * 1e3:.1f} ms")
    checks = {}
    if cluster in MFU_TARGET_DEVICES and 0 in results:
        checks["mfu_stage0>=target"] = results[0]["mfu"] >= args.min_mfu
    if 0 in results and 3 in results:
        overhead = results[3]["step_time_s"] / results[0]["step_time_s"] - 1
        results["stage3_overhead"] = overhead
        checks["stage3_overhead<=target"] = overhead <= args.max_stage3_overhead
    doc = {"device": device, "cluster": cluster, "torch": torch.__version__,
           "model": args.model, "batch": args.batch, "dtype": "bf16", "world_size": 1,
           "checkpointing": args.checkpointing, "targets": {"min_mfu": args.min_mfu,
           "max_stage3_overhead": args.max_stage3_overhead}, "results": results,
           "checks": checks, "kind": "measured"}
    path = os.path.join(args.out, "throughput.json")
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    print(f"checks: {checks} -> {path}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
