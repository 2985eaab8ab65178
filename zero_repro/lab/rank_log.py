"""What a rank says and records about its training run: the step line (rank 0, every
``train.log_every`` steps), the live W&B series, the end-of-point summary line and the result
(metrics, memory, comm, topology, hardware) the launcher turns into a record. Beside the
ledger's model states per rank, Table 1's (paper §5: (2 + 2 + K)Ψ at stage 0, down to
(2 + 2 + K)Ψ/N_d at stage 3). ``RankLog`` holds it for one run, built once by the rank program
(``lab.rank``).
"""
from __future__ import annotations

import logging
import os
import platform
import resource

import torch

from zero_repro import config as C
from zero_repro.lab import wandb_runs
from zero_repro.runtime.comm import comm, launch
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.model import flops
from zero_repro.runtime.zero.ledger import MODEL_STATE_CATEGORIES, is_host
from zero_repro.scale.paper.table1 import K_ADAM, model_state_bytes, offload_bytes

log = logging.getLogger(__name__)


def hardware_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "host": platform.node(), "cpu_count": os.cpu_count(), "device": device.type,
            "threads_per_rank": torch.get_num_threads()}
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["tf32"] = bool(torch.backends.cuda.matmul.allow_tf32)
    else:
        info["device_name"] = platform.processor() or platform.machine()
    return info


def placement(topo: Topology) -> dict:
    """Where the ranks ran (collective over the world): every rank's host in rank order, the
    number of hosts, whether each TP group stayed on one host (Megatron's TP needs the node's
    links) and how the default group met (spawn | torchrun | slurm)."""
    hosts = comm.all_gather_object(platform.node(), topo.world)
    tp_groups = [hosts[d * topo.tp:(d + 1) * topo.tp] for d in range(topo.dp)]
    return {"hosts": hosts, "nodes": len(set(hosts)),
            "tp_within_node": all(len(set(g)) == 1 for g in tp_groups),
            "rendezvous": launch.rendezvous() or "none"}


def memory_series(device: torch.device) -> dict:
    """This step's memory numbers (bytes) for the live W&B series."""
    if device.type == "cuda":
        return {"memory/allocated": torch.cuda.memory_allocated(device),
                "memory/reserved": torch.cuda.memory_reserved(device),
                "memory/max_allocated": torch.cuda.max_memory_allocated(device),
                "memory/max_reserved": torch.cuda.max_memory_reserved(device)}
    # Linux reports ru_maxrss in KiB
    return {"memory/max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


BUFFER_CATEGORIES = ("comm_buffers", "fused_buffers")  # bucket / gather buffers at capacity


def table1_model_states(cfg: C.Config) -> dict:
    """Table 1's model-state bytes per rank for this run (paper §5): Ψ = parameters of one TP
    shard (``flops.param_count_per_tp_rank``), N_d = DP degree, the run's stage, and the
    precision's bytes (fp16/bf16: 2-byte params and grads, K = 12 of fp32 master + Adam;
    fp32: 4-byte params and grads, K = 8, the parameters being the master). Returns {"psi",
    "n_d", "bytes", "formula"} (formula like ``16Ψ/N_d``)."""
    psi = flops.param_count_per_tp_rank(cfg.model, cfg.parallel.tp)
    n_d = cfg.parallel.world_size // cfg.parallel.tp
    lp, k = (4, 8) if cfg.zero.dtype == "fp32" else (2, K_ADAM)
    stage = cfg.zero.stage
    opt, par = cfg.zero.offload_optimizer, cfg.zero.offload_param
    if "cpu" in (opt, par):  # ZeRO-Offload: the device's part of the column
        k = K_ADAM if par == "cpu" else k  # the host shard: the device's optimizer keeps a master
        formula = ({0: f"{lp}Ψ", 1: f"{lp}Ψ", 2: f"{lp}Ψ", 3: f"{lp}Ψ/N_d"}[stage]
                   if opt == "cpu" else f"{lp + k}Ψ/N_d")
        formula = ("0" if opt == "cpu" and par == "cpu" else formula) + " (offload)"
        return {"psi": psi, "n_d": n_d, "formula": formula,
                "bytes": offload_bytes(psi, stage, n_d, K=k, lp_bytes=lp, optimizer=opt,
                                       param=par)["device"]}
    formula = {0: f"{2 * lp + k}Ψ", 1: f"{2 * lp}Ψ+{k}Ψ/N_d", 2: f"{lp}Ψ+{lp + k}Ψ/N_d",
               3: f"{2 * lp + k}Ψ/N_d"}[stage]
    return {"psi": psi, "n_d": n_d, "formula": formula,
            "bytes": model_state_bytes(psi, stage, n_d, K=k, lp_bytes=lp)}


def memory_parts(ledger: dict) -> dict:
    """A ledger (category -> bytes) as Table 1's model states, buffers, gathered parameters
    (stage 3) and the rest (ZeRO-R: checkpoints, arena) on the device, and what the host holds
    (``host``, where anything)."""
    states = sum(ledger.get(c, 0) for c in MODEL_STATE_CATEGORIES)
    buffers = sum(ledger.get(c, 0) for c in BUFFER_CATEGORIES)
    gathered = ledger.get("params_gathered", 0)
    host = sum(v for k, v in ledger.items() if isinstance(v, (int, float)) and is_host(k))
    rest = sum(v for k, v in ledger.items() if isinstance(v, (int, float))
               and not k.startswith("cuda_")) - states - buffers - gathered - host
    out = {"states": states, "buffers": buffers, "gathered": gathered, "other": rest}
    if host:  # held in host memory (ZeRO-Offload's optimizer, P_a+cpu's checkpoints)
        out["host"] = host
    return out


def _unit(nbytes: float) -> tuple[float, str]:
    return (2**30, "GiB") if nbytes >= 2**30 else (2**20, "MiB")


def memory_text(parts: dict, table1: dict, long: bool = False) -> str:
    """``model states X MiB/rank (Table 1 16Ψ/N_d: Y)`` + buffers, gathered parameters and
    the rest apart; ``long``: the ratio, Ψ and N_d too (the summary line)."""
    div, unit = _unit(max(parts["states"], table1["bytes"]))
    states, ref = parts["states"] / div, table1["bytes"] / div
    if long:
        ratio = parts["states"] / table1["bytes"] if table1["bytes"] else float("nan")
        text = (f"model states {states:.3g} {unit}/rank = {ratio:.3f} x Table 1 "
                f"({table1['formula']}, Ψ {table1['psi']:,}, N_d {table1['n_d']}: {ref:.3g})")
    else:
        text = f"model states {states:.3g} {unit}/rank (Table 1 {table1['formula']}: {ref:.3g})"
    for key, name in (("buffers", "buffers"), ("gathered", "gathered params"),
                      ("other", "other"), ("host", "host memory")):
        if parts.get(key):
            d, u = _unit(parts[key])
            text += f", {name} {parts[key] / d:.3g} {u}"
    return text


def step_line(step: int, steps: int, loss: float, info, dt: float, tokens_per_step: int,
              tflops: float, peak_tflops: float, memory: str,
              device: torch.device, dp: int = 1, dtype: str = "fp32",
              model_tflops: float = 0.0, transport_note: str = "") -> str:
    """The per-step log line (rank 0, every ``train.log_every`` steps): rank 0's loss (its own
    micro-batches; ``rank-0 loss`` when DP > 1), the loss scale (fp16 only: fp32/bf16 have
    none), gradient norm, tokens/s, TFLOPs/GPU (the paper's convention,
    ``flops.flops_per_iteration``; + MFU from the model's FLOPs ``model_tflops`` when
    ``cluster.peak_tflops`` is known), ``memory`` (``memory_text``: model states per rank
    beside Table 1's, buffers and gathered parameters apart), on CUDA the caching
    allocator's allocated/reserved bytes, and ``transport_note`` (a DP group on one host that
    fell back from shared memory to gloo, and why)."""
    which = "rank-0 loss" if dp > 1 else "loss"
    scale = f"scale {float(info.loss_scale):g}  " if dtype == "fp16" else ""
    line = (f"step {step + 1:>4}/{steps}  {which} {loss:.4f}  {scale}"
            f"grad_norm {float(info.grad_norm):.3g}  {tokens_per_step / dt:,.0f} tok/s  "
            f"{tflops:.4g} TFLOPs/GPU")
    if peak_tflops > 0 and model_tflops > 0:
        line += f" (MFU {100 * model_tflops / peak_tflops:.1f}%)"
    line += f"  {memory}"
    if device.type == "cuda":
        line += (f"  alloc {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB"
                 f"  reserved {torch.cuda.memory_reserved(device) / 2**30:.2f} GiB")
    line += f"  {dt:.3f} s" + ("  (skipped)" if info.skipped else "")
    return line + (f"  [{transport_note}]" if transport_note else "")


def summary_line(cfg: C.Config, metrics: dict, ledger: dict) -> str:
    """The end-of-point line (rank 0): losses, speed, model states per rank against Table 1
    (``memory_text``), topology."""
    t = cfg.train
    dp = cfg.parallel.world_size // cfg.parallel.tp
    which = f"loss (mean of {dp} DP ranks)" if dp > 1 else "loss"
    line = (f"done: {len(metrics['losses'])} steps ({t.warmup_steps} warm-up), {which} "
            f"{metrics['loss_first']:.4f} -> {metrics['loss_last']:.4f}, median step "
            f"{metrics['step_time_s']:.3f} s, {metrics['tokens_per_s']:,.0f} tok/s, "
            f"{metrics['tflops_per_gpu']:.4g} TFLOPs/GPU")
    if "mfu" in metrics:
        line += f" (MFU {100 * metrics['mfu']:.1f}%, HFU {100 * metrics['hfu']:.1f}%)"
    line += (f", {memory_text(memory_parts(ledger), table1_model_states(cfg), long=True)}; "
             f"{metrics['skipped_steps']} skipped; world {cfg.parallel.world_size} = TP {cfg.parallel.tp} x DP "
             f"{cfg.parallel.world_size // cfg.parallel.tp}, stage {cfg.zero.stage}, "
             f"{cfg.zero.dtype}")
    return line


def dp_transport_note(dp_group, transport: str) -> tuple[str, str]:
    """(why shared memory was refused, the step line's note) for a DP group on one host whose
    buckets fell back from shared memory (``runtime.comm.cpu.shm``: the reason kept on the
    group) to ``transport``; ("", "") where nothing fell back."""
    refused = getattr(dp_group, "channel_refused", "") if dp_group else ""
    if not refused or transport == "shm":
        return "", ""
    return refused, f"dp {transport} (shared memory refused: {refused})"


class RankLog:
    """One rank's reporting of its run (module doc): built once the trainer is (and resumed);
    ``on_step`` is a step callback of ``Trainer.fit``, ``failed`` closes the W&B run of a run
    that raised, ``result`` is the rank's result of a finished one."""

    def __init__(self, cfg: C.Config, trainer, device: torch.device, run_dir: str):
        self.cfg, self.device = cfg, device
        self.topo, self.strategy = trainer.topo, trainer.strategy
        self.rates = flops.Rates.of(cfg, self.topo.dp)
        self.table1 = table1_model_states(cfg)
        self.every = cfg.train.log_every if self.topo.rank == 0 else 0
        self.refused, self.transport_note = dp_transport_note(self.topo.dp_group,
                                                              self.strategy.transport.name)
        # W&B: one run per point, logged live by rank 0 (a no-op unless logging.wandb=true)
        self.live = wandb_runs.StepLogger.start(cfg, run_dir, enabled=self.topo.rank == 0)

    def on_step(self, step: int, loss: float, dt: float, info) -> None:
        """The step line every ``train.log_every`` steps and the last; the W&B series."""
        cfg, rates = self.cfg, self.rates
        if self.every and ((step + 1) % self.every == 0 or step == cfg.train.steps - 1):
            memory = memory_text(memory_parts(self.strategy.memory_ledger().as_dict()),
                                 self.table1)
            log.info(step_line(step, cfg.train.steps, loss, info, dt, rates.tokens_per_step,
                               rates.tflops(dt), cfg.cluster.peak_tflops, memory, self.device,
                               self.topo.dp, cfg.zero.dtype, rates.model_tflops(dt),
                               self.transport_note))
        if self.live.active:
            self.live.log_step(step, loss=loss, grad_norm=float(info.grad_norm),
                               loss_scale=float(info.loss_scale), step_time_s=dt,
                               tokens_per_s=rates.tokens_per_step / dt,
                               tflops_per_gpu=rates.tflops(dt), **memory_series(self.device))

    def failed(self, e: BaseException) -> None:
        self.live.finish({"status": "failed", "reason": f"{type(e).__name__}: {e}"[:500]}, 1)

    def metrics(self, res, mem, resumed: str | None, history: dict) -> dict:
        """The record's metrics of a finished run: losses, speed, Table 1 beside the ledger."""
        cfg, rates, table1 = self.cfg, self.rates, self.table1
        step_s = res.median_step_time
        metrics = {
            "losses": res.losses, "loss_first": res.losses[0], "loss_last": res.losses[-1],
            "step_time_s": step_s, "step_times_s": res.step_times,
            "tokens_per_s": rates.tokens_per_step / step_s,
            "tflops_per_gpu": rates.tflops(step_s),
            "skipped_steps": res.skipped_steps, "skipped_at": res.skipped_at,
            "start_step": res.start_step, "resumed_from": resumed or "",
            "losses_before_start": history["losses"],
            "skipped_before_start": history["skipped_at"],
            "grad_norms": res.grad_norms,
            "loss_scales": res.loss_scales,
            "params_total": flops.param_count(cfg.model),
            # Table 1 (paper §5) for this run beside the ledger's model states
            "model_state_bytes": mem.model_states(), "table1_model_state_bytes": table1["bytes"],
            "table1_formula": table1["formula"], "psi": table1["psi"],
            # the last timed step's §7 volume in bytes, by link (this rank's groups that span
            # nodes: inter; ``CommLedger.link_bytes``)
            "comm_inter_node_bytes": res.comm_by_link.get("inter_node", 0),
            "comm_intra_node_bytes": res.comm_by_link.get("intra_node", 0),
        }
        # utilisation (flops module docstring): MFU from the model's FLOPs (no recompute, causal
        # attention), HFU from what ran (recompute included); tflops_per_gpu is the paper's
        # convention
        rated = rates.at(step_s, cfg.cluster.peak_tflops)
        metrics.update({k: rated[k] for k in ("model_tflops_per_gpu", "hardware_tflops_per_gpu",
                                              "mfu", "hfu") if k in rated})
        return metrics

    def result(self, rank: int, res, mem, metrics: dict, where: dict, build_peak: int) -> dict:
        """The rank's result (the launcher's record of rank 0's): its metrics, memory ledger,
        communication per step, topology and hardware; rank 0 logs the summary line."""
        device = self.device
        if self.topo.rank == 0:
            log.info(summary_line(self.cfg, metrics, mem.as_dict()))
        out = {"rank": rank, "metrics": metrics, "memory": mem.as_dict(),
               "comm": res.comm_per_step, "topology": self.topo.describe(),
               "hardware": {**hardware_info(device), **where,
                            # how the DP buckets travelled (gloo on one host: shared memory),
                            # and why not where a group on one host fell back
                            "dp_transport": self.strategy.transport.name,
                            **({"dp_transport_refused": self.refused}
                               if self.transport_note else {})}}
        if device.type == "cuda":
            # the training steps' peaks (reset after the build); the build's own beside them
            out["memory"]["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
            out["memory"]["cuda_max_reserved"] = torch.cuda.max_memory_reserved(device)
            out["memory"]["cuda_max_allocated_build"] = build_peak
        if self.live.active:
            metrics["wandb_run"] = self.live.finish(wandb_runs.summary_of(out), 0)
        self.strategy = None  # drop the reference (teardown: no gloo user alive)
        return out
