"""The GPU proof's ZeRO-Offload part (``zero_offload``; ``experiments/gpu_proof/`` plans it
with the others): what one GPU proves about ``zero.offload_optimizer=cpu``
(``runtime.zero.offload``; Ren et al. 2021).

Stage 2 at world 1 (DP 1), C_B + M_D, the same seeds and batches, each dtype of
``experiment.params.zero_offload.dtypes`` with the optimizer on the device, then on the host:

* equivalence: max |θ_offload - θ_device| of the fp32 parameters (the master) after ``steps``
  steps: fp32 within ``param_atol_fp32`` (the proof's equivalence tolerance: the device's
  backward is not bitwise reproducible, and the host's AdamW kernel is the CPU one), a
  training dtype within ``steps`` x lr (what AdamW can move an element: its step noise);
* memory: the device's peak allocated falls by at least ``saving_fraction`` of the optimizer
  state the device no longer holds (12Ψ bytes mixed precision, 8Ψ in fp32: m and v), and the
  ledger's device and host model states equal Table 1's offload column
  (``table1.offload_bytes``);
* the copies: the staging is pinned (CUDA), lp·Ψ bytes each way per step (the runtime's
  counters);
* measured, not judged: the step time with and without offload (median, CUDA-synchronised) and
  the host step's rate on this GPU host's cores (``lab.host_adam.measure``, the runtime's host
  step over Ψ elements), beside the estimate's per-core constant (``scale.offload_time``).

``device: cpu`` (the CI dry path): the same at tiny sizes on one gloo rank, where host and device
are the same memory (the peak is not judged there).
"""
from __future__ import annotations

import gc
import statistics
import time

import torch

from zero_repro import config as C
from zero_repro.lab.host_adam import measure as host_step_seconds
from zero_repro.lab.points import Point
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.train.trainer import Trainer
from zero_repro.scale import offload_time as OT
from zero_repro.scale.paper.table1 import offload_bytes

PART = "zero_offload"
SEED = 7
K_DEVICE = {"fp32": 8, "bf16": 12, "fp16": 12}  # optimizer bytes per element the device saves
LP = {"fp32": 4, "bf16": 2, "fp16": 2}


def points(p, cuda: bool, base: dict, tag: dict, model_overrides) -> list[Point]:
    """The part's one point (``experiment.params.zero_offload``)."""
    z = dict(p.get(PART) or {})
    if not z:
        return []
    return [Point(name="zero_offload stage 2", params={
        "part": PART, **tag, "steps": int(z.get("steps", 4) if cuda else 2),
        "dtypes": list(z.get("dtypes", ["fp32", "bf16"])),
        "param_atol_fp32": float(z.get("param_atol_fp32", 1e-5)),
        "saving_fraction": float(z.get("saving_fraction", 0.9)),
        "bucket": int(z.get("bucket", 50_000_000) if cuda else 6000)},
        overrides={**base, **model_overrides(z.get("model" if cuda else "cpu_model", "tiny")),
                   "train.micro_batch_size": int(z.get("batch", 4) if cuda else 2)})]


def estimate_s(q: dict, psi: float, compute: float, spawn_s: float, init_per_s: float
               ) -> float:
    """Seconds on a GPU: per dtype and setting a build and the steps (a host step of Ψ at
    ~1 G elements/s per core), and the host-rate measurement."""
    runs = 2 * len(q["dtypes"])
    return spawn_s + runs * (psi / init_per_s + q["steps"] * (compute + psi / 4e9) + 5) + 10


def _device(dev: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dev == "cuda" \
        else torch.device("cpu")


def _batch(m: C.ModelConfig, step: int, rows: int):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, m.vocab_size, (rows, m.seq_len), generator=g),
            torch.randint(0, m.vocab_size, (rows, m.seq_len), generator=g))


def _one(cfg: C.Config, q: dict, device: torch.device, dtype: str, offload: str,
         stage: int = 2, param: str = "none") -> dict:
    """``q["steps"]`` steps of ``cfg``'s model at ``stage``, world 1, with the optimizer on the
    device or the host (``offload``) and, at stage 3, the parameters too (``param``)."""
    c = C.Config(model=cfg.model, train=C.TrainConfig(
        micro_batch_size=cfg.train.micro_batch_size, lr=1e-3, seed=SEED))
    c.parallel.world_size, c.cluster = 1, cfg.cluster
    c.zero = C.ZeroConfig(stage=stage, dtype=dtype, reduce_bucket_size=q["bucket"],
                          allgather_bucket_size=q["bucket"], offload_optimizer=offload,
                          offload_param=param)
    c.zero_r = C.ZeroRConfig(name="custom", constant_buffers=True, contiguous_memory=True)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = Trainer(c, Topology.build(1), device, warn_dp1=False)
    strategy = trainer.strategy
    times = []
    for step in range(q["steps"]):
        idx, tgt = _batch(c.model, step, c.train.micro_batch_size)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        trainer.step([(idx.to(device), tgt.to(device))])
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    led = strategy.memory_ledger()
    opt = strategy.opt
    out = {"theta": {n: p.float().cpu() for n, p in strategy.full_parameters().items()},
           "step_s": statistics.median(times[1:] or times),
           "peak_allocated": torch.cuda.max_memory_allocated(device) if cuda else 0,
           "device_model_states": led.model_states(), "host_model_states":
           led.host_model_states(), "psi_padded": sum(g.partition.padded_numel
                                                       for g in strategy.groups)}
    if offload == "cpu":
        out.update(pinned=bool(opt.staging.is_pinned()) if cuda else None,
                   pcie_bytes_per_step={k: v / q["steps"] for k, v in opt.copied.items()})
    trainer.close()
    del trainer, strategy, opt
    gc.collect()
    return out


def zero_offload_rank(rank: int, world: int, cfg: C.Config, q: dict) -> dict:
    """One rank, each dtype with the optimizer on the device and on the host (module doc)."""
    device = _device(q["device"])
    if device.type == "cuda":  # full fp32 matmuls for the fp32 comparison
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    out = {}
    for dtype in q["dtypes"]:
        a, b = (_one(cfg, q, device, dtype, off) for off in ("none", "cpu"))
        psi = b["psi_padded"]
        want = offload_bytes(psi, 2, 1, lp_bytes=LP[dtype])
        out[dtype] = {
            "max_abs_param_diff": max(float((a["theta"][n] - b["theta"][n]).abs().max())
                                      for n in a["theta"]),
            "step_s_device_optimizer": a["step_s"], "step_s_offload": b["step_s"],
            "peak_allocated_device_optimizer": a["peak_allocated"],
            "peak_allocated_offload": b["peak_allocated"],
            "optimizer_bytes_moved": K_DEVICE[dtype] * psi,
            "ledger_device": b["device_model_states"], "ledger_host": b["host_model_states"],
            "formula_device": want["device"], "formula_host": want["host"],
            "pinned": b["pinned"], "pcie_bytes_per_step": b["pcie_bytes_per_step"],
            "lp_shard_bytes": LP[dtype] * psi, "psi_padded": psi}
    n = min(out[q["dtypes"][0]]["psi_padded"], 1 << 28)
    secs = host_step_seconds(n, torch.get_num_threads(), torch.bfloat16, 3)
    out["host_step"] = {"elements": n, "threads": torch.get_num_threads(),
                        "elements_per_s": n / min(secs),
                        "estimate_per_core": OT.HOST_ADAM_PER_CORE["mid"]}
    return out


def checks(q: dict, m: dict) -> dict:
    """Pass/fail of the part (module doc)."""
    out = {}
    lr_steps = 1e-3 * q["steps"]
    for dtype in q["dtypes"]:
        r = m[dtype]
        tol = q["param_atol_fp32"] if dtype == "fp32" else lr_steps
        out[f"{dtype}_parameters"] = r["max_abs_param_diff"] <= tol
        out[f"{dtype}_ledger"] = (r["ledger_device"] == r["formula_device"]
                                  and r["ledger_host"] == r["formula_host"])
        out[f"{dtype}_pcie_bytes"] = r["pcie_bytes_per_step"] == {
            "d2h": r["lp_shard_bytes"], "h2d": r["lp_shard_bytes"]}
        if q["device"] == "cuda":
            saved = r["peak_allocated_device_optimizer"] - r["peak_allocated_offload"]
            out[f"{dtype}_device_peak_saving"] = (
                saved >= q["saving_fraction"] * r["optimizer_bytes_moved"])
            out[f"{dtype}_pinned"] = bool(r["pinned"])
    return out
