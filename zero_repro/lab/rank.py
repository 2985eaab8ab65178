"""The rank program of one training run: what runs in every rank (``rank_main``, log lines, resume).

Ranks read the config the CLI resolved into the run directory (never ``@hydra.main``);
``rank_main`` runs in each process the local launcher spawns (``zero_repro.lab.launcher``), or
under torchrun / srun through ``main`` (``python -m zero_repro.lab.rank --config resolved.yaml``).
Parallelism is applied by ``runtime.train.build`` (TP -> activation checkpointing -> ZeRO ->
optimizer). Checkpoints (``zero_repro.runtime.train.checkpoint``) are saved every
``checkpoint.save_every`` steps; ``checkpoint.resume`` continues from the saved data position at
any stage or DP size. Invariant: a resumed run's record (``losses`` from ``start_step``,
``losses_before_start`` from the checkpoint's ``extra.history``) draws the same table as the
uninterrupted run's. ``fault.*`` injects a rank failure mid-step (tests).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import platform
import resource
import signal
import sys
import threading
import time

import torch

from zero_repro.runtime.train import checkpoint
from zero_repro import config as C
from zero_repro import schema
from zero_repro.runtime.comm import comm, launch
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.model import flops
from zero_repro.runtime.train import data, loop
from zero_repro.runtime.train.trainer import Trainer
from zero_repro.runtime.train.build import device_for
from zero_repro.runtime.zero.ledger import MODEL_STATE_CATEGORIES, is_host
from zero_repro.scale.paper.table1 import K_ADAM, model_state_bytes, offload_bytes
from zero_repro.lab import wandb_runs

log = logging.getLogger(__name__)

# Slurm's time-limit warning (submitit submits with --signal=USR2@<launcher.signal_delay_s>):
# Slurm sends it to every task of the job's steps, i.e. to these ranks, which would die of it
# (SIGUSR2's default action). submitit's own handler lives in the batch process, which does not
# get the signal. The ranks note it and go on: the point ends at its time limit at the latest.
TIME_LIMIT_SIGNAL = signal.SIGUSR2
_signals_seen: list[dict] = []
DIVERGED_FILE = "diverged.json"  # in the run directory: a diverged run's losses and reason
WAIT_REPORT_S = 30.0  # rank 0 reports a wait on its peers this long, and again every 30 s
BEAT_S = 5.0  # how often each rank notes its progress for rank 0's report


def _note_time_limit_signal(signum, frame) -> None:
    _signals_seen.append({"signal": signal.Signals(signum).name, "time": time.time()})
    log.warning("%s received (Slurm's time-limit warning): ignored, training goes on; the job "
                "is killed at its time limit", signal.Signals(signum).name)


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
    if cfg.zero.offload_optimizer == "cpu":  # ZeRO-Offload: the device's part of the column
        formula = {0: f"{2 * lp}Ψ", 1: f"{2 * lp}Ψ", 2: f"{lp}Ψ+{lp}Ψ/N_d",
                   3: f"{2 * lp}Ψ/N_d"}[stage] + " (offload)"
        return {"psi": psi, "n_d": n_d, "formula": formula,
                "bytes": offload_bytes(psi, stage, n_d, lp_bytes=lp)["device"]}
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


def dp_transport_note(dp_group, transport: str) -> tuple[str, str]:
    """(why shared memory was refused, the step line's note) for a DP group on one host whose
    buckets fell back from shared memory (``runtime.comm.cpu.shm``: the reason kept on the
    group) to ``transport``; ("", "") where nothing fell back."""
    refused = getattr(dp_group, "channel_refused", "") if dp_group else ""
    if not refused or transport == "shm":
        return "", ""
    return refused, f"dp {transport} (shared memory refused: {refused})"


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


def reset_peaks(device: torch.device) -> int:
    """CUDA: the build's peak allocated bytes, then the peak statistics reset, so that the
    record's ``cuda_max_*`` describe the training steps (0 on CPU)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def _rank_logging(cfg: C.Config, rank: int) -> None:
    """Spawned ranks start without logging handlers: give them one (stderr, like the CLI's),
    tagged with the rank, so rank 0's step lines reach the user."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=cfg.logging.level.upper(),
                            format=f"[rank {rank}] %(message)s")


def checkpoint_root(cfg: C.Config, run_dir: str) -> str:
    return cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")


def resume_path(cfg: C.Config, run_dir: str) -> str | None:
    """The checkpoint to resume from (None: start fresh). ValueError if ``resume=latest`` and
    there is none; called before any rank starts, so that is a user error. ``auto`` and
    ``latest`` take the newest *committed* checkpoint (an interrupted save is passed over)."""
    how = cfg.checkpoint.resume
    if not how:
        return None
    if how in ("auto", "latest"):
        root = checkpoint_root(cfg, run_dir)
        path = checkpoint.latest(root)
        if path is None:
            broken = checkpoint.uncommitted(root)
            why = (f"holds {len(broken)} step directories but none is committed (no "
                   f"{checkpoint.MANIFEST}: the save was interrupted or the manifest deleted)"
                   if broken else "holds no committed checkpoint")
            if how == "latest":
                raise ValueError(f"checkpoint.resume=latest but {root!r} {why}; use "
                                 f"checkpoint.resume=auto to start fresh when there is none")
            if broken:
                log.warning("checkpoint.resume=auto: %s %s; starting from step 0", root, why)
        return path
    return how


def model_identity(model: C.ModelConfig) -> dict:
    """What a checkpoint's parameters depend on (shapes), for the compatibility check."""
    d = dataclasses.asdict(model)
    return {k: d[k] for k in ("n_layer", "n_embd", "n_head", "seq_len", "vocab_size",
                              "vocab_pad_multiple", "bias")}


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # zero_repro/
_COMM = os.path.join("runtime", "comm")  # a rank whose innermost project frame is here waits


def where_is(thread_id: int | None) -> tuple[str, bool]:
    """(``path:line function`` of the innermost frame of thread ``thread_id`` in this
    package, whether that is inside the communication layer: a collective or its wait)."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    while frame is not None and not frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None:
        return "?", False
    rel = os.path.relpath(frame.f_code.co_filename, _PACKAGE)
    return f"{rel}:{frame.f_lineno} {frame.f_code.co_name}", rel.startswith(_COMM)


class Watchdog(threading.Thread):
    """Every rank notes where its main thread is (steps done, the innermost frame of this
    package, whether that is a collective) in ``<run dir>/progress/rank<r>`` every ``BEAT_S``
    s. Rank 0, once it has waited in one collective for ``WAIT_REPORT_S`` s, logs one
    warning line naming the peers that are not in a collective (where they are) or noted
    nothing for as long, and again every ``WAIT_REPORT_S`` s, until the wait ends or the
    collective timeout ends the run."""

    def __init__(self, run_dir: str, rank: int, world: int, timeout_s: float):
        super().__init__(name="zr-watchdog", daemon=True)
        self.folder = os.path.join(run_dir, "progress")
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.main = threading.main_thread().ident
        self.step = 0  # steps done
        self.stopped = threading.Event()
        os.makedirs(self.folder, exist_ok=True)

    def stop(self) -> None:
        self.stopped.set()

    def _note(self, where: str, waiting: bool) -> None:
        path = os.path.join(self.folder, f"rank{self.rank}")
        with open(path + ".tmp", "w") as f:
            json.dump({"step": self.step, "where": where, "waiting": waiting,
                       "time": time.time()}, f)
        os.replace(path + ".tmp", path)

    def _peers(self) -> dict[int, dict]:
        out = {}
        for r in range(1, self.world):
            try:
                with open(os.path.join(self.folder, f"rank{r}")) as f:
                    out[r] = json.load(f)
            except (OSError, ValueError):
                continue
        return out

    def run(self) -> None:
        since, at, reported = None, None, 0
        while not self.stopped.wait(BEAT_S):
            where, waiting = where_is(self.main)
            try:
                self._note(where, waiting)
            except OSError:
                return
            if self.rank != 0:
                continue
            now = time.monotonic()
            if not waiting or where != at:  # computing, or a new wait
                since, at, reported = (now if waiting else None), where, 0
                continue
            if now - since < WAIT_REPORT_S * (reported + 1):
                continue
            reported += 1
            log.warning("rank 0 has waited %.0f s in a collective (%s, step %d): %s; the run "
                        "fails if this goes on for launcher.collective_timeout_s=%g s",
                        now - since, where, self.step + 1, self._who(), self.timeout_s)

    def _who(self) -> str:
        peers, out = self._peers(), []
        for r in range(1, self.world):
            p = peers.get(r)
            if p is None or time.time() - p["time"] > WAIT_REPORT_S:
                out.append(f"rank {r} has noted nothing for over {WAIT_REPORT_S:.0f} s")
            elif not p["waiting"]:
                out.append(f"rank {r} is not in a collective (at {p['where']}, "
                           f"{p['step']} steps done)")
        return "; ".join(out) or "every peer waits in a collective too"


def inject_fault(fault: C.FaultConfig, rank: int, step: int) -> None:
    """``fault.rank`` fails at ``fault.step``, after backward, before the optimizer step (its
    peers are then blocked in the step's collectives): the failure path under test."""
    if rank != fault.rank or step != fault.step:
        return
    log.error("fault injection: rank %d %s at step %d", rank, fault.mode, step)
    if fault.mode == "kill":
        os._exit(9)  # no cleanup, like the OOM killer or a lost node
    if fault.mode == "raise":
        raise RuntimeError(f"fault injection: rank {rank} raised at step {step}")
    while True:  # hang: alive but silent; peers must time out, not wait forever
        time.sleep(60)


def rank_main(rank: int, world_size: int, config_path: str, local_rank: int | None = None) -> dict:
    cfg = schema.load(config_path)
    _rank_logging(cfg, rank)
    device = device_for(cfg, rank if local_rank is None else local_rank)
    run_dir = os.path.dirname(os.path.abspath(config_path))
    watchdog = Watchdog(run_dir, rank, world_size, cfg.launcher.collective_timeout_s)
    watchdog.start()
    try:
        return _rank_run(cfg, rank, device, run_dir, watchdog)
    finally:
        watchdog.stop()


def _rank_run(cfg: C.Config, rank: int, device: torch.device, run_dir: str,
              watchdog: Watchdog) -> dict:
    trainer = Trainer(cfg, device=device)
    topo, strategy = trainer.topo, trainer.strategy
    build_peak = reset_peaks(device)
    where = placement(topo)
    source = data.make_source(cfg.train.data, cfg.model.seq_len, cfg.model.vocab_size,
                              cfg.train.seed, cfg.train.data_path)
    resumed = resume_path(cfg, run_dir)
    if resumed is not None:
        trainer.resume(resumed, cfg.checkpoint.verify,
                       trust=cfg.checkpoint.allow_untrusted)

    rates = flops.Rates.of(cfg, topo.dp)
    # W&B: one run per point, logged live by rank 0 (a no-op unless logging.wandb=true)
    live = wandb_runs.StepLogger.start(cfg, run_dir, enabled=topo.rank == 0)

    every_log = cfg.train.log_every if topo.rank == 0 else 0
    table1 = table1_model_states(cfg)
    refused, transport_note = dp_transport_note(topo.dp_group, strategy.transport.name)

    def watch(step, loss, dt, info):
        watchdog.step = step + 1

    def step_log(step, loss, dt, info):
        if every_log and ((step + 1) % every_log == 0 or step == cfg.train.steps - 1):
            log.info(step_line(step, cfg.train.steps, loss, info, dt, rates.tokens_per_step,
                               rates.tflops(dt), cfg.cluster.peak_tflops,
                               memory_text(memory_parts(strategy.memory_ledger().as_dict()),
                                           table1),
                               device, topo.dp, cfg.zero.dtype,
                               rates.model_tflops(dt), transport_note))

    def metrics_log(step, loss, dt, info):
        if live.active:
            live.log_step(step, loss=loss, grad_norm=float(info.grad_norm),
                          loss_scale=float(info.loss_scale), step_time_s=dt,
                          tokens_per_s=rates.tokens_per_step / dt,
                          tflops_per_gpu=rates.tflops(dt),
                          **memory_series(device))

    try:
        res = trainer.fit(source, [watch, step_log, metrics_log],
                          before_update=functools.partial(inject_fault, cfg.fault, topo.rank),
                          checkpoint_root=checkpoint_root(cfg, run_dir),
                          checkpoint_extra={"model": model_identity(cfg.model)})
    except BaseException as e:
        if isinstance(e, loop.Diverged):
            _note_divergence(run_dir, topo.rank, str(e), trainer.history["losses"],
                             trainer.local_losses, trainer.start_step)
        live.finish({"status": "failed", "reason": f"{type(e).__name__}: {e}"[:500]}, 1)
        raise
    finally:
        mem = trainer.memory_ledger()
        trainer.close()
    step_s = res.median_step_time
    metrics = {
        "losses": res.losses, "loss_first": res.losses[0], "loss_last": res.losses[-1],
        "step_time_s": step_s, "step_times_s": res.step_times,
        "tokens_per_s": rates.tokens_per_step / step_s, "tflops_per_gpu": rates.tflops(step_s),
        "skipped_steps": res.skipped_steps, "skipped_at": res.skipped_at,
        "start_step": res.start_step, "resumed_from": resumed or "",
        "losses_before_start": trainer.history["losses"],
        "skipped_before_start": trainer.history["skipped_at"],
        "grad_norms": res.grad_norms,
        "loss_scales": res.loss_scales,
        "params_total": flops.param_count(cfg.model),
        # Table 1 (paper §5) for this run beside the ledger's model states
        "model_state_bytes": mem.model_states(), "table1_model_state_bytes": table1["bytes"],
        "table1_formula": table1["formula"], "psi": table1["psi"],
    }
    # utilisation (flops module docstring): MFU from the model's FLOPs (no recompute, causal
    # attention), HFU from what ran (recompute included); tflops_per_gpu is the paper's convention
    rated = rates.at(step_s, cfg.cluster.peak_tflops)
    metrics.update({k: rated[k] for k in ("model_tflops_per_gpu", "hardware_tflops_per_gpu",
                                          "mfu", "hfu") if k in rated})
    if _signals_seen:
        metrics["signals"] = list(_signals_seen)
    if topo.rank == 0:
        log.info(summary_line(cfg, metrics, mem.as_dict()))
    out = {"rank": rank, "metrics": metrics, "memory": mem.as_dict(),
           "comm": res.comm_per_step, "topology": topo.describe(),
           "hardware": {**hardware_info(device), **where,
                        # how the DP buckets travelled (gloo on one host: shared memory),
                        # and why not where a group on one host fell back
                        "dp_transport": strategy.transport.name,
                        **({"dp_transport_refused": refused} if transport_note else {})}}
    if device.type == "cuda":
        # the training steps' peaks (reset after the build); the build's own beside them
        out["memory"]["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
        out["memory"]["cuda_max_reserved"] = torch.cuda.max_memory_reserved(device)
        out["memory"]["cuda_max_allocated_build"] = build_peak
    if live.active:
        metrics["wandb_run"] = live.finish(wandb_runs.summary_of(out), 0)
    strategy = None  # noqa: F841 - drop the reference (teardown: no gloo user alive)
    return out


def _note_divergence(run_dir: str, rank: int, reason: str, history: list, losses: list,
                     start: int) -> None:
    """This rank's losses so far and the reason, for the ``diverged`` record (the first rank
    to write it wins: ranks diverge together, their peers' losses are not at hand)."""
    path = os.path.join(run_dir, DIVERGED_FILE)
    doc = {"reason": f"rank {rank}: {reason}",
           "metrics": {"losses": list(losses), "losses_of": f"rank {rank}'s micro-batches",
                       "start_step": start, "losses_before_start": list(history)}}
    tmp = f"{path}.{rank}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f)
        if not os.path.exists(path):
            os.replace(tmp, path)
        else:
            os.unlink(tmp)
    except OSError as e:
        log.warning("could not note the divergence in %s: %s", path, e)


def main(argv=None) -> None:
    """``python -m zero_repro.lab.rank --config resolved.yaml [--out result.json]`` on every rank
    (torchrun / srun)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    signal.signal(TIME_LIMIT_SIGNAL, _note_time_limit_signal)
    cfg = schema.load(args.config)
    cpus = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if cfg.cluster.device == "cpu" and cpus.isdigit():
        # CPU ranks under srun: as many threads as the task has cores (env.sh's OMP_NUM_THREADS
        # is for GPU ranks; oversubscribed gloo ranks run ~50x slower)
        torch.set_num_threads(int(cpus))
    # under srun rank 0 hands its rendezvous port on through the run directory (shared)
    rank, world, local = launch.init_from_env(
        cfg.cluster.backend, cfg.launcher.collective_timeout_s,
        rendezvous_dir=os.path.dirname(os.path.abspath(args.config)))
    try:
        result = rank_main(rank, world, args.config, local)
    finally:
        launch.teardown()
    if rank == 0 and args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
