"""Slurm facts for the sweep: a job's final state, the record status it means, the job log's last
error lines, waiting for jobs that may die without a result, the sbatch template for a cluster.

A point submitted with ``launcher=slurm`` writes its own record from inside its job; when it
cannot (cancelled, out of time, a lost node, a hard kill) the submitter records it with Slurm's
state (``sacct``, else ``scontrol show job``): CANCELLED -> ``cancelled``, TIMEOUT/DEADLINE ->
``timeout``, NODE_FAIL -> ``node_fail``, PREEMPTED -> ``preempted``, OUT_OF_MEMORY -> ``oom``,
else ``failed``, the reason quoting the job log's last error lines and naming the log. A record a
job did write is corrected the same way when Slurm says it was cancelled or ran out of time (the
job itself saw only "srun exited with status 143").
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from typing import Any, Callable

from zero_repro import config as C

log = logging.getLogger(__name__)

# Slurm job state (base name, as sacct prints it: "CANCELLED by 0" -> CANCELLED) -> record status
STATUS_OF_STATE = {"COMPLETED": "ok", "CANCELLED": "cancelled", "TIMEOUT": "timeout",
                   "DEADLINE": "timeout", "NODE_FAIL": "node_fail", "PREEMPTED": "preempted",
                   "OUT_OF_MEMORY": "oom", "BOOT_FAIL": "failed", "FAILED": "failed"}
ACTIVE_STATES = {"PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING", "RESIZING",
                 "SUSPENDED", "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT",
                 "RESV_DEL_HOLD", "STOPPED"}
# states that say the job was stopped from outside: they override what the job itself recorded
EXTERNAL_END = {"CANCELLED", "TIMEOUT", "DEADLINE", "NODE_FAIL", "PREEMPTED"}


def _run(cmd: list[str]) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return p.stdout if p.returncode == 0 else ""


def job_states(job_ids: list[str]) -> dict[str, tuple[str, str]]:
    """{job id: (state, exit code)} of the jobs' allocations, e.g. ("CANCELLED", "0:15"), from
    one ``sacct`` call; ``scontrol show job`` for those sacct does not know (no accounting, or
    not yet). A job neither knows is left out."""
    ids = [str(j) for j in job_ids]
    out: dict[str, tuple[str, str]] = {}
    if ids:
        text = _run(["sacct", "-X", "-n", "-P", "-j", ",".join(ids), "-o", "JobID,State,ExitCode"])
        for line in text.splitlines():
            parts = line.strip().split("|")
            if len(parts) >= 3 and parts[0] in ids and parts[1]:
                out[parts[0]] = (parts[1].split()[0].rstrip("+"), parts[2])
    for job in ids:
        if job not in out:
            text = _run(["scontrol", "-o", "show", "job", job])
            state = re.search(r"\bJobState=(\S+)", text)
            code = re.search(r"\bExitCode=(\S+)", text)
            if state:
                out[job] = (state[1], code[1] if code else "")
    return out


def job_state(job_id: str) -> tuple[str, str]:
    """(state, exit code) of one job; ("", "") if Slurm does not know it."""
    return job_states([job_id]).get(str(job_id), ("", ""))


def status_of(state: str) -> str:
    return STATUS_OF_STATE.get(state, "failed")


def job_logs(job_id: str) -> list[str]:
    """The job's stdout/stderr paths as Slurm knows them (``scontrol show job``)."""
    out = _run(["scontrol", "-o", "show", "job", str(job_id)])
    paths = [m[1] for m in re.finditer(r"\bStd(?:Err|Out)=(\S+)", out)]
    return list(dict.fromkeys(p for p in paths if p != "/dev/null"))


_ERROR_WORDS = ("error", "exception", "traceback", "killed", "cancelled", "failed", "denied",
                "no such file", "signal", "timeout", "due to time limit", "oom")


def last_error_lines(path: str, n: int = 6, scan_bytes: int = 64_000) -> list[str]:
    """The last ``n`` lines of a log that look like an error (else its last ``n`` lines)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - scan_bytes))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    lines = [ln.rstrip() for ln in lines if ln.strip()]
    hits = [ln for ln in lines if any(w in ln.lower() for w in _ERROR_WORDS)]
    return (hits or lines)[-n:]


def describe_end(job_id: str, state: str, exit_code: str, logs: list[str]) -> str:
    """Reason text: Slurm's state and exit code, then each log's path and last error lines."""
    parts = [f"Slurm job {job_id} ended {state or 'UNKNOWN'} (exit code {exit_code or '?'})"]
    for path in logs:
        lines = last_error_lines(path)
        if lines:
            parts.append(f"last error lines of {path}:\n" + "\n".join(lines))
        else:
            parts.append(f"log: {path}")
    return "\n".join(parts)


def correct_status(status: str, reason: str, job_id: str, logs: list[str] | None = None
                   ) -> tuple[str, str]:
    """A record's (status, reason) with Slurm's word on how the job ended: a point whose job was
    cancelled / timed out / lost a node is recorded as such, not as a generic failure."""
    if status == "ok" or not job_id:
        return status, reason
    state, code = job_state(job_id)
    if state not in EXTERNAL_END:
        return status, reason
    logs = job_logs(job_id) if logs is None else logs
    return status_of(state), describe_end(job_id, state, code, logs) + "\n" + reason


def in_job(status: str, reason: str) -> tuple[str, str]:
    """A point's failure as recorded from inside its own Slurm job (``SLURM_JOB_ID`` set):
    Slurm's state if it stopped the job, and the job log's path."""
    job = os.environ.get("SLURM_JOB_ID", "")
    if not job or status == "ok":
        return status, reason
    logs = job_logs(job)
    status, reason = correct_status(status, reason, job, logs)
    if logs and "log" not in reason.split("\n", 1)[0]:
        reason += "\njob log: " + " ".join(logs)
    return status, reason


def wait_for_jobs(jobs: list[tuple[Any, Any]], on_result: Callable[[Any, Any], None],
                  on_lost: Callable[[Any, Any, str, str], None], poll_s: float = 2.0,
                  grace_s: float = 10.0) -> None:
    """Wait for submitit ``jobs`` [(item, job)] in any order. A job with a result file ->
    ``on_result(item, result_or_exception)``; a job Slurm says has ended without one (after
    ``grace_s`` for a slow shared filesystem) -> ``on_lost(item, job, state, exit_code)``.

    Slurm is asked directly (sacct, else scontrol) every ``poll_s``: submitit's own wait backs
    off to a minute between polls and, without accounting, never sees a killed job end."""
    pending = list(jobs)
    ended_at: dict[str, float] = {}
    while pending:
        for item, job in list(pending):
            if job.paths.result_pickle.exists():
                try:
                    value = job.result()
                except Exception as e:  # noqa: BLE001 - the job's own exception: data
                    value = e
                on_result(item, value)
                pending.remove((item, job))
        states = job_states([job.job_id for _, job in pending])
        for item, job in list(pending):
            state, code = states.get(str(job.job_id), ("", ""))
            if state and state not in ACTIVE_STATES:
                first = ended_at.setdefault(job.job_id, time.monotonic())
                if time.monotonic() - first >= grace_s:
                    on_lost(item, job, state, code)
                    pending.remove((item, job))
        if pending:
            time.sleep(poll_s)


# ---------------------------------------------------------------------- sbatch templates
TEMPLATES = {16: "slurm/dgx2_v100.sbatch", 8: "slurm/a100.sbatch"}
# what a CPU partition needs on top of a GPU template (no gres request; one task per rank)
CPU_OVERRIDES = "--gpus-per-node=0 --ntasks-per-node={per_node} --cpus-per-task=1"


def sbatch_command(cfg: C.Config, nodes: int) -> str:
    """``sbatch ... slurm/<template> FILE`` for a point of ``cfg`` (the plan's hint)."""
    per_node = min(cfg.cluster.gpus_per_node, cfg.parallel.world_size)
    template = TEMPLATES.get(cfg.cluster.gpus_per_node, "slurm/a100.sbatch")
    extra = "" if cfg.cluster.device == "cuda" else " " + CPU_OVERRIDES.format(per_node=per_node)
    return f"sbatch --nodes={nodes}{extra} {template} FILE"
