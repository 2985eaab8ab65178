"""The host memory a point's CPU ranks may use, and whether the kernel's OOM killer took a rank.

Three limits bound the memory local ranks can have; the pre-flight (``lab.preflight``) takes the
smallest of them (``available``) and names it:

* ``MemAvailable`` of ``/proc/meminfo`` (psutil): the machine's;
* the memory cgroup the process runs in (a container's limit, Slurm's ``--mem`` under
  ``ConstrainRAMSpace``, a systemd slice): headroom = limit - (usage - inactive file pages), the
  smallest over the cgroup and every ancestor whose files are readable. cgroup v1:
  ``memory.limit_in_bytes``, ``memory.usage_in_bytes``, ``memory.stat`` ``total_inactive_file``;
  v2: ``memory.max`` (``max``: none), ``memory.current``, ``memory.stat`` ``inactive_file``;
* Slurm's ``--mem`` of the job (``SLURM_MEM_PER_NODE``, or ``SLURM_MEM_PER_CPU`` x
  ``SLURM_CPUS_ON_NODE``; MiB), less this process's resident bytes: enforced by Slurm even where
  no cgroup holds it.

OOM kills (``OomWatch``): a process the OOM killer ends dies of SIGKILL and nothing of it reports
why; the kernel counts the kill (``oom_kill``) in the victim's memory cgroup (v1:
``memory.oom_control``, kernels >= 4.13; v2: ``memory.events``, which also counts the cgroup's
descendants), for a cgroup limit and for the machine running out alike. Ranks start in the
launcher's cgroup, so a rise of its count between the start of the ranks and a rank's SIGKILL
means the OOM killer took it. Without a memory cgroup (the root one): ``/proc/vmstat``
``oom_kill``, the machine's count.
"""
from __future__ import annotations

import dataclasses
import os

import psutil

GB = 1e9
UNLIMITED = 1 << 60  # v1 writes "no limit" as PAGE_COUNTER_MAX pages (~9.2e18 bytes)
PROC_CGROUP = "/proc/self/cgroup"
MOUNTINFO = "/proc/self/mountinfo"
VMSTAT = "/proc/vmstat"


@dataclasses.dataclass(frozen=True)
class MemoryCgroup:
    """The memory cgroup of this process: ``version`` 1 or 2, its directory ``path`` inside
    the hierarchy mounted at ``mount``."""
    version: int
    path: str
    mount: str

    def levels(self) -> list[str]:
        """``path`` and its ancestors up to the mount point (the root cgroup), innermost first."""
        out, d = [], os.path.normpath(self.path)
        top = os.path.normpath(self.mount)
        while True:
            out.append(d)
            if d == top or not d.startswith(top + os.sep):
                return out
            d = os.path.dirname(d)

    def _files(self) -> tuple[str, str, str]:
        if self.version == 1:
            return "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
        return "memory.max", "memory.current", "inactive_file"

    def headroom(self) -> tuple[int, int, str] | None:
        """(bytes still free under the tightest limit, that limit, its cgroup directory), or
        None where no level has a limit one can read."""
        limit_f, usage_f, inactive_key = self._files()
        best = None
        for d in self.levels():
            limit = _read_int(os.path.join(d, limit_f))
            usage = _read_int(os.path.join(d, usage_f))
            if limit is None or limit >= UNLIMITED or usage is None:
                continue
            inactive = _stat(os.path.join(d, "memory.stat")).get(inactive_key, 0)
            free = max(0, limit - max(0, usage - inactive))
            if best is None or free < best[0]:
                best = (free, limit, d)
        return best

    def oom_kills(self) -> int | None:
        """The kernel's OOM-kill count of this cgroup (module docstring), None if unreadable."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        return _stat(os.path.join(self.path, name)).get("oom_kill")


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: str) -> dict[str, int]:
    """``key value`` lines (memory.stat, memory.events, memory.oom_control, /proc/vmstat)."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if value.strip().lstrip("-").isdigit():
                    out[key] = int(value)
    except OSError:
        pass
    return out


def find(proc_cgroup: str = PROC_CGROUP, mountinfo: str = MOUNTINFO) -> MemoryCgroup | None:
    """This process's memory cgroup: v1 where a v1 hierarchy has the memory controller (also
    on hybrid hosts), else v2; None where neither is mounted or readable."""
    try:
        with open(proc_cgroup) as f:
            lines = [ln.rstrip("\n").split(":", 2) for ln in f if ln.count(":") >= 2]
        with open(mountinfo) as f:
            mounts = [ln.split() for ln in f]
    except OSError:
        return None
    v1 = next((p for _, ctl, p in lines if "memory" in ctl.split(",")), None)
    for version, rel in ((1, v1), (2, next((p for h, ctl, p in lines if h == "0" and not ctl),
                                           None))):
        if rel is None:
            continue
        for m in mounts:
            sep = m.index("-") if "-" in m else -1
            if sep < 0 or len(m) < sep + 4:
                continue
            fstype, opts = m[sep + 1], m[sep + 3].split(",")
            if (version == 1 and fstype == "cgroup" and "memory" in opts) or \
                    (version == 2 and fstype == "cgroup2"):
                root, point = m[3], m[4]
                # the part of the cgroup path below the mounted root (a container sees "/")
                inner = rel[len(root):] if root != "/" and rel.startswith(root) else rel
                path = os.path.join(point, inner.lstrip("/"))
                if os.path.isdir(path):
                    return MemoryCgroup(version, path, point)
    return None


def slurm_mem_bytes(env=None) -> int | None:
    """The job's ``--mem`` on this node (``--mem-per-cpu`` x its CPUs here), bytes; None
    outside Slurm or without one."""
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env:
        return None
    per_node = env.get("SLURM_MEM_PER_NODE", "")
    if per_node.isdigit() and int(per_node) > 0:
        return int(per_node) << 20
    per_cpu, cpus = env.get("SLURM_MEM_PER_CPU", ""), env.get("SLURM_CPUS_ON_NODE", "")
    if per_cpu.isdigit() and cpus.isdigit() and int(per_cpu) > 0:
        return (int(per_cpu) << 20) * int(cpus)
    return None


def available(cgroup: MemoryCgroup | None = None, env=None) -> tuple[float, str]:
    """(bytes the ranks may still use, what bounds it in words): the smallest of the three
    limits of the module docstring."""
    cgroup = find() if cgroup is None else cgroup
    have = [(float(psutil.virtual_memory().available), "this machine's MemAvailable")]
    room = cgroup.headroom() if cgroup is not None else None
    if room is not None:
        free, limit, where = room
        have.append((float(free), f"the memory cgroup's limit of {limit / GB:.2f} GB "
                                  f"({where})"))
    slurm = slurm_mem_bytes(env)
    if slurm is not None:
        own = psutil.Process().memory_info().rss
        have.append((float(max(0, slurm - own)), f"Slurm's --mem of {slurm / GB:.2f} GB "
                                                 f"(this job)"))
    return min(have, key=lambda h: h[0])


@dataclasses.dataclass
class OomWatch:
    """The OOM-kill count taken before the ranks start (module docstring)."""
    cgroup: MemoryCgroup | None
    before: int | None

    @classmethod
    def start(cls) -> "OomWatch":
        cg = find()
        return cls(cg, _count(cg))

    def verdict(self, reason: str) -> str | None:
        """A one-line reason naming the OOM killer (and the cgroup's limit) when a rank that
        failed with ``reason`` died of SIGKILL and the count rose since ``start``; else None."""
        if self.before is None or not killed_by_sigkill(reason):
            return None
        after = _count(self.cgroup)
        if after is None or after <= self.before:
            return None
        if self.cgroup is None:
            where = f"the machine ran out of memory (/proc/vmstat oom_kill {self.before} -> {after})"
        else:
            room = self.cgroup.headroom()
            limit = "no limit readable" if room is None else f"limit {room[1] / GB:.2f} GB" + (
                f" at {room[2]}" if room[2] != os.path.normpath(self.cgroup.path) else "")
            where = (f"memory cgroup {self.cgroup.path} ({limit}; oom_kill {self.before} -> "
                     f"{after})")
        return f"out of memory: a rank was killed by the kernel's OOM killer (SIGKILL): {where}"


def _count(cgroup: MemoryCgroup | None) -> int | None:
    if cgroup is not None:
        n = cgroup.oom_kills()
        if n is not None:
            return n
    return _stat(VMSTAT).get("oom_kill")


# how a SIGKILLed rank shows in a failure's reason: spawn's exit code, torchrun's and a shell's
_SIGKILL = ("exited with code -9 ", "SIGKILL", "Signal 9 ", "status 137")


def killed_by_sigkill(reason: str) -> bool:
    return any(m in reason for m in _SIGKILL)
