"""The host step's rate (ZeRO-Offload, ``runtime.zero.offload``): elements per second one host
core (or ``--threads`` of them) updates with the runtime's own host step, measured on this
machine -- what ``scale.offload_time`` takes as its per-core rate.

    python -m zero_repro.lab.host_adam [--elements 64M] [--threads 1,2] [--dtype bf16]
        [--repeats 7] [--block N] [--json PATH]

Times ``HostAdamW.update_chunk`` over a shard of ``--elements`` (far larger than the last-level
cache: fp32 master, m, v and the lp staging are streamed from DRAM, as a billion-parameter
shard is): the gradient upcast and multiplied by the clip factor, torch's fused CPU AdamW, the
cast back into the staging. The copies over PCIe are not in it (a GPU's copy engines do them;
``scale.offload_time`` times them apart). Prints, per thread count, the minimum / median /
maximum over ``--repeats`` of elements/s (per core: divided by the threads) and the DRAM
traffic it implies (``offload_time.HOST_BYTES`` per element). Measured, with no side effect.
Also ``--compare``: torch's ``AdamW(fused=True)`` and ``(foreach=False)`` on an fp32 tensor of the
same size, each step as torch runs it (the host step measured against them).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

import torch

from zero_repro.runtime.zero.offload import BLOCK, HostAdamW
from zero_repro.scale.hardware import cpu_model
from zero_repro.scale.offload_time import HOST_BYTES

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False,
             maximize=False)


def parse_count(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise ValueError(f"--elements {text!r}: give a count like 64M")
    return int(float(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[
        m.group(2).lower()])


def measure(elements: int, threads: int, dtype: torch.dtype, repeats: int,
            block: int = BLOCK) -> list[float]:
    """Seconds of one host step over ``elements`` (one chunk per 2^24 elements), per repeat,
    after one untimed step; ``block`` elements per thread (the runtime's rule)."""
    torch.set_num_threads(threads)
    sizes = [min(1 << 24, elements - a) for a in range(0, elements, 1 << 24)]
    lp = [torch.randn(n).to(dtype) for n in sizes]
    chunks, off = [], 0
    for n in sizes:
        chunks.append((off, n))
        off += n
    opt = HostAdamW(chunks, lp, dtype, block=block * threads)
    out = []
    for r in range(repeats + 1):
        for i, g in enumerate(lp):  # a fresh gradient in the staging, as the copy-in leaves it
            opt.grad_ready(i, g)
        opt._step_t.fill_(r + 1)
        t0 = time.perf_counter()
        for i in range(len(chunks)):
            opt.update_chunk(i, 0.5, HYPER)
        if r:
            out.append(time.perf_counter() - t0)
    return out


def measure_torch(elements: int, threads: int, repeats: int, **kw) -> list[float]:
    """Seconds of ``torch.optim.AdamW(**kw).step()`` on one fp32 parameter of ``elements``."""
    torch.set_num_threads(threads)
    p = torch.nn.Parameter(torch.randn(elements))
    p.grad = torch.randn(elements)
    opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, **kw)
    out = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        opt.step()
        if r:
            out.append(time.perf_counter() - t0)
    return out


def _line(label: str, elements: int, threads: int, secs: list[float]) -> dict:
    rates = sorted(elements / s for s in secs)
    row = {"what": label, "threads": threads, "elements": elements,
           "per_core_min": rates[0] / threads, "per_core_median":
               statistics.median(rates) / threads, "per_core_max": rates[-1] / threads}
    print(f"  {label:<34} threads {threads}: {statistics.median(rates) / 1e9:6.3f} G elem/s "
          f"({rates[0] / 1e9:.3f}-{rates[-1] / 1e9:.3f}); per core "
          f"{row['per_core_median'] / 1e9:.3f} G/s = "
          f"{row['per_core_median'] * HOST_BYTES / 1e9:.1f} GB/s of DRAM traffic")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zero_repro.lab.host_adam",
                                 description="the ZeRO-Offload host step's rate, measured here")
    ap.add_argument("--elements", default="64M")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--block", type=int, default=BLOCK, help="elements per thread and call")
    ap.add_argument("--compare", action="store_true",
                    help="also torch's AdamW(fused=True) and (foreach=False)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    try:
        n = parse_count(args.elements)
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"host step of ZeRO-Offload on {cpu_model()} ({torch.get_num_threads()} threads "
          f"available), {n:,} elements, {args.dtype} gradients, block {args.block}, torch "
          f"{torch.__version__} (measured)")
    rows = []
    for t in threads:
        rows.append(_line("HostAdamW.update_chunk (runtime)", n, t,
                          measure(n, t, DTYPES[args.dtype], args.repeats, args.block)))
        if args.compare:
            rows.append(_line("torch AdamW(fused=True), fp32 grad", n, t,
                              measure_torch(n, t, args.repeats, fused=True)))
            rows.append(_line("torch AdamW(foreach=False)", n, t,
                              measure_torch(n, t, max(1, args.repeats // 3), foreach=False)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "torch": torch.__version__, "dtype": args.dtype,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
