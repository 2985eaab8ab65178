"""The rank program of one training run: what runs in every rank (``rank_main``: load the
config, build, resume, train; its log lines and result are ``lab.rank_log``'s).

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
import signal
import sys
import threading
import time

import torch

from zero_repro.runtime.train import checkpoint
from zero_repro import config as C
from zero_repro import schema
from zero_repro.runtime.comm import launch
from zero_repro.runtime.train import data, loop
from zero_repro.runtime.train.trainer import Trainer
from zero_repro.runtime.train.build import device_for
from zero_repro.lab.rank_log import RankLog, placement

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
    run_dir = os.path.dirname(os.path.abspath(config_path))
    watchdog = Watchdog(run_dir, rank, world_size, cfg.launcher.collective_timeout_s)
    device = device_for(cfg, rank if local_rank is None else local_rank)
    watchdog.start()
    try:
        return _rank_run(cfg, rank, device, run_dir, watchdog)
    finally:
        watchdog.stop()


def _rank_run(cfg: C.Config, rank: int, device: torch.device, run_dir: str,
              watchdog: Watchdog) -> dict:
    """Build, resume, train and report (``rank_log.RankLog``) one run on this rank."""
    resumed = resume_path(cfg, run_dir)
    save_to, extra = checkpoint_root(cfg, run_dir), {"model": model_identity(cfg.model)}
    trainer = Trainer(cfg, device=device)
    build_peak = reset_peaks(device)
    where = placement(trainer.topo)
    source = data.make_source(cfg.train.data, cfg.model.seq_len, cfg.model.vocab_size,
                              cfg.train.seed, cfg.train.data_path)
    if resumed is not None:
        trainer.resume(resumed, cfg.checkpoint.verify, trust=cfg.checkpoint.allow_untrusted)
    report = RankLog(cfg, trainer, device, run_dir)

    def watch(step, loss, dt, info):
        watchdog.step = step + 1

    try:
        res = trainer.fit(source, [watch, report.on_step],
                          before_update=functools.partial(inject_fault, cfg.fault, trainer.topo.rank),
                          checkpoint_root=save_to, checkpoint_extra=extra)
    except BaseException as e:
        if isinstance(e, loop.Diverged):
            _note_divergence(run_dir, trainer.topo.rank, str(e), trainer.history["losses"],
                             trainer.local_losses, trainer.start_step)
        report.failed(e)
        raise
    finally:
        mem = trainer.memory_ledger()
        trainer.close()
    metrics = report.metrics(res, mem, resumed, trainer.history)
    if _signals_seen:
        metrics["signals"] = list(_signals_seen)
    return report.result(rank, res, mem, metrics, where, build_peak)


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
