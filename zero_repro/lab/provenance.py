"""Whose numbers a record holds, and when a record may stand for a run the user asked for (paper
§10's figures are reproduced only from numbers computed here, at this code).

``signature_of`` (``Record.provenance``): ``machine`` (device kind and model, core or GPU count,
OS/architecture, torch version; on CPU the ranks' malloc and bucket transport, ``ZR_HOST_HEAP``
and ``ZR_CPU_TRANSPORT``; no hostname; for Slurm points the cluster config and torch version) and
``code`` (git trees of ``zero_repro/`` and ``experiments/`` plus a digest of uncommitted changes
to them; outside git, the package version). Rule (``reusable``): an ``ok``/``oom`` record counts
as done only at this code signature and, if ``measured``, at the machine signature this point
would be measured on (``simulated``/``analytic``: code only); records without signatures are
never reused.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import platform
import subprocess

import torch

from zero_repro import paths
from zero_repro.runtime.comm.cpu import host_heap, shm
from zero_repro.scale.hardware import cpu_model

CODE_DIRS = ("zero_repro", "experiments")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=str(paths.REPO_ROOT), capture_output=True,
                          text=True, timeout=20, check=True).stdout


@functools.lru_cache(maxsize=None)
def code_signature() -> str:
    """``tree:<sha of zero_repro/>,<sha of experiments/>[+dirty:<digest>]`` in a git checkout,
    else ``package:<version>``."""
    try:
        trees = [_git("rev-parse", f"HEAD:{d}").strip()[:12] for d in CODE_DIRS]
        diff = _git("diff", "HEAD", "--", *CODE_DIRS)
        untracked = _git("ls-files", "--others", "--exclude-standard", "--", *CODE_DIRS)
    except (OSError, subprocess.SubprocessError):
        try:
            return f"package:{importlib.metadata.version('zero-repro')}"
        except importlib.metadata.PackageNotFoundError:
            return "unknown"
    sig = "tree:" + ",".join(trees)
    if diff or untracked.strip():
        h = hashlib.sha256(diff.encode())
        for rel in sorted(untracked.split()):
            if rel.endswith(".py"):
                with open(paths.REPO_ROOT / rel, "rb") as f:
                    h.update(rel.encode() + f.read())
        sig += f"+dirty:{h.hexdigest()[:12]}"
    return sig


def this_machine() -> dict:
    """The hardware this process measures on (see the module docstring)."""
    info = {"os": f"{platform.system()}-{platform.machine()}",
            "torch": importlib.metadata.version("torch")}
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        info.update(device="cuda", device_name=" + ".join(names),
                    device_count=torch.cuda.device_count())
    else:
        info.update(device="cpu", device_name=cpu_model(), device_count=os.cpu_count(),
                    host_heap=host_heap.mode(), cpu_transport=shm.mode())
    return info


def machine_signature(cfg) -> dict:
    """The machine a point of ``cfg`` is measured on: this one, or for points Slurm runs on
    compute nodes the cluster named by ``cluster.name`` (the same on the submitting side and in
    the job, so a job's record is reusable by the sweep that submitted it)."""
    if cfg.launcher.name == "slurm":
        return {"cluster": cfg.cluster.name, "torch": importlib.metadata.version("torch")}
    return this_machine()


def signature_of(record_mode: str, cfg) -> dict:
    """What a new record of ``cfg`` in ``record_mode`` is stamped with."""
    out = {"code": code_signature()}
    if record_mode == "measured":
        out["machine"] = machine_signature(cfg)
    return out


def reusable(record, cfg) -> bool:
    """True when ``record`` (done) may stand for running its point now (the rule above)."""
    prov = getattr(record, "provenance", None) or {}
    if prov.get("code") != code_signature():
        return False
    if record.mode == "measured":
        return prov.get("machine") == machine_signature(cfg)
    return True


def machine_label(record) -> str:
    """Short hardware label of a record for legends: ``2 x NVIDIA H100``, ``Intel Xeon (2
    cores)``; simulated records name their cluster."""
    m = (getattr(record, "provenance", None) or {}).get("machine") or {}
    hw = record.hardware or {}
    if record.mode != "measured":
        return f"simulated {(record.config.get('cluster') or {}).get('name', '')}".strip()
    if "cluster" in m and "device_name" not in m:
        return f"cluster {m['cluster']}"
    device = m.get("device") or hw.get("device") or ""
    name = m.get("device_name") or hw.get("cpu_model") or hw.get("device_name") or "?"
    if device == "cuda" or "cuda" in str(hw.get("device", "")):
        world = (record.topology or {}).get("world_size", "?")
        return f"{world} x {name}"
    cores = m.get("device_count") or hw.get("cpu_count") or "?"
    return f"{name} ({cores} cores)"
