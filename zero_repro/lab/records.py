"""Run records: one ``Record`` per run point, kept in ``results/<exp>/points.jsonl``; every number
the suite reports (paper §10) is derived from them.

A record carries what is needed to trust and regenerate its number: the resolved config, git SHA,
host and hardware, topology, ``mode`` (measured | simulated | analytic), metrics, the memory and
communication ledgers, a status (``STATUSES``: ok | oom | diverged | cancelled | timeout |
node_fail | failed, + reason) and the machine's load while the point ran (``load``: load
average at start and end, the share of the machine's CPU time this process tree and all others
took; ``heavy_load`` judges it).

Durability (``RecordStore.put``): under an inter-process file lock, read the file, drop any
earlier record with the same key, write the whole file to a temporary file in the same
directory, fsync, ``os.replace`` it over ``points.jsonl``. A kill at any moment leaves the old or
the new file; at most one record per key; a record that is not ``ok`` never replaces an ``ok``
one unless ``put(..., replace_ok=True)``; a temporary file found under the lock was left by a
killed writer and is removed.

Point key: the first 16 hex digits of SHA-256 over the canonical JSON of the point's params,
its mode and the identifying fields of its config after the point's overrides
(``config.identity``: declared on the schema's fields). The same command re-run gives the same
keys (so done points are skipped); changing a knob that changes the numbers gives new keys. A
schema change that alters identities (a knob removed, one added whose default is not what
older records ran with) is followed by ``migrate`` over the committed records
(``python -m zero_repro.lab.records migrate results/*/points.jsonl``): it rewrites each
record's ``key`` from its own params, mode and config and nothing else.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable

import psutil
from filelock import FileLock

from zero_repro import identity
from zero_repro.paths import REPO_ROOT
from zero_repro.scale.paper import table3

log = logging.getLogger(__name__)

# ok: measured; oom: does not fit (a result); diverged: non-finite loss / nothing trained;
# cancelled (SIGINT/SIGTERM, scancel), timeout (wall-clock limit), node_fail / preempted (Slurm's
# own state, zero_repro.lab.slurm) and failed (anything else) are not results: the point
# runs again next time
STATUSES = ("ok", "oom", "diverged", "cancelled", "timeout", "node_fail", "preempted", "failed")
DONE_STATUSES = ("ok", "oom")  # an OOM is a result (the point does not fit), not an error
SCHEMA_VERSION = 1


@dataclass
class Record:
    key: str  # point key (see module docstring)
    experiment: str
    point: str  # point name
    params: dict  # identifying parameters of the point
    mode: str  # measured | simulated | analytic
    status: str  # one of STATUSES
    reason: str = ""  # why a point is oom/failed (first lines of the error)
    metrics: dict = field(default_factory=dict)  # loss_first, losses, tokens_per_s, ...
    memory: dict = field(default_factory=dict)  # memory ledger: category -> bytes
    comm: dict = field(default_factory=dict)  # communication ledger
    topology: dict = field(default_factory=dict)  # world_size, tp, dp, nodes, ...
    hardware: dict = field(default_factory=dict)  # torch, device name, cpu count, ...
    hostname: str = ""
    config: dict = field(default_factory=dict)  # the point's resolved Config
    git_sha: str = ""
    sweep_id: str = ""
    timestamp: str = ""  # ISO-8601 UTC, when the record was written
    duration_s: float = 0.0
    schema: int = SCHEMA_VERSION
    # machine and code signatures (zero_repro.lab.provenance): when the record may be reused
    provenance: dict = field(default_factory=dict)
    # the machine's load while the point ran (``load_between``); {} in older records
    load: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(_jsonable(dataclasses.asdict(self)), sort_keys=True, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict) -> "Record":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def done(self) -> bool:
        return self.status in DONE_STATUSES


def _jsonable(x: Any) -> Any:
    """JSON-safe copy: NaN/inf become None, tuples lists, numpy/torch scalars Python numbers."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if hasattr(x, "item"):  # numpy / torch scalar
        return _jsonable(x.item())
    return str(x)


# ----------------------------------------------------------------------------------- keys
def point_key(params: dict, mode: str, config: dict | None = None) -> str:
    """The key of a point: its params, mode and ``config.identity`` of its resolved config."""
    payload = {"params": _jsonable(params), "mode": mode,
               "config": _jsonable(identity.identity(config or {}))}
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def migrate(path: str) -> tuple[int, int]:
    """Rewrite the ``key`` of every record in the JSONL file ``path`` to today's key scheme
    (``point_key`` of its own params, mode and config); every other byte of a record is kept,
    lines that are not records are kept as they are, the order too. Idempotent. Returns
    (records, keys changed)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    out, changed, n = [], 0, 0
    for line in lines:
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            out.append(line)
            continue
        if not isinstance(doc, dict) or "key" not in doc:
            out.append(line)
            continue
        n += 1
        key = point_key(doc.get("params") or {}, doc.get("mode", ""), doc.get("config") or {})
        if key != doc["key"]:
            changed += 1
            # the key's own text only: the rest of the line stays byte for byte
            old = json.dumps(doc["key"])
            head, sep, tail = line.partition(f'"key": {old}')
            if not sep:
                raise ValueError(f"{path}: a record whose key is not written as '\"key\": "
                                 f"{old}'")
            new = head + f'"key": {json.dumps(key)}' + tail
            if json.loads(new) != {**doc, "key": key}:
                raise ValueError(f"{path}: the key of record {doc.get('point')!r} is not "
                                 f"where it can be rewritten alone")
            line = new
        out.append(line)
    if changed:
        _atomic_write_lines(path, out)
    return n, changed


# ------------------------------------------------------------------------------ provenance
@functools.lru_cache(maxsize=None)
def git_sha(repo_dir: str | None = None) -> str:
    """HEAD's SHA, with ``-dirty`` when tracked files differ; ``unknown`` outside a checkout."""
    repo_dir = repo_dir or str(REPO_ROOT)
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_dir, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=repo_dir, capture_output=True, text=True, timeout=10).stdout
        return sha + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def host_info() -> dict:
    """Host and software facts. Imports nothing heavy: torch is asked about devices only when
    the process has already imported it (a CPU-only analytic point should not pay for it)."""
    info: dict[str, Any] = {"hostname": socket.gethostname(), "platform": platform.platform(),
                            "python": platform.python_version(), "cpu_count": os.cpu_count()}
    try:
        info["torch"] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        info["torch"] = None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(0)
        info["device_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    else:
        info["device_name"] = platform.processor() or platform.machine()
    for var in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES"):
        if var in os.environ:
            info[var.lower()] = os.environ[var]
    return info


# ------------------------------------------------------------------------------ machine load
# other processes' share of the machine's CPU time above which a measured point's timings are
# suspect (2 cores: one busy process elsewhere is 0.5)
HEAVY_LOAD_SHARE = 0.25
MIN_LOAD_WINDOW_S = 1.0  # shorter windows: CPU-time shares are too coarse (10 ms ticks)


def _own_cpu_s() -> float:
    """CPU seconds of this process and its finished (waited-for) children, e.g. its ranks."""
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (all CPUs)."""
    t = psutil.cpu_times()._asdict()
    total = sum(v for k, v in t.items() if k not in ("guest", "guest_nice"))  # in user/nice
    return total - t.get("idle", 0.0) - t.get("iowait", 0.0), total


def load_snapshot() -> dict:
    """The state ``load_between`` measures a point's window from."""
    busy, total = _machine_cpu_s()
    return {"wall": datetime.datetime.now().timestamp(), "busy": busy, "total": total,
            "own": _own_cpu_s(), "loadavg": os.getloadavg()[0]}


def load_between(start: dict) -> dict:
    """The machine's load from ``start`` (``load_snapshot``) to now: 1-min load average at
    both ends, CPUs, and (windows of at least ``MIN_LOAD_WINDOW_S``) the shares of all CPU time
    that were busy, spent by this process tree, and spent by every other process."""
    end = load_snapshot()
    wall = end["wall"] - start["wall"]
    out = {"cpus": psutil.cpu_count() or os.cpu_count(), "wall_s": round(wall, 3),
           "loadavg_start": round(start["loadavg"], 2), "loadavg_end": round(end["loadavg"], 2)}
    total = end["total"] - start["total"]
    if wall >= MIN_LOAD_WINDOW_S and total > 0:
        busy, own = end["busy"] - start["busy"], end["own"] - start["own"]
        out.update(busy_share=round(min(1.0, busy / total), 3),
                   own_share=round(min(1.0, own / total), 3),
                   others_share=round(min(1.0, max(0.0, busy - own) / total), 3))
    return out


def heavy_load(load: dict) -> str:
    """'' for a record measured on a quiet machine; else what loaded it, in words."""
    if not load:
        return ""
    others = load.get("others_share")
    avg = max(load.get("loadavg_start", 0.0), load.get("loadavg_end", 0.0))
    cpus = load.get("cpus") or 1
    if others is not None:
        if others < HEAVY_LOAD_SHARE:
            return ""
        return (f"other processes took {100 * others:.0f}% of the machine's CPU time (load "
                f"average {load.get('loadavg_start')} -> {load.get('loadavg_end')} on {cpus} "
                f"CPUs)")
    if avg <= cpus:  # a short window: only the load average can tell
        return ""
    return f"the load average was {avg:g} on {cpus} CPUs"


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------- OOM / errors
# CUDA's OutOfMemoryError, Python's MemoryError, the CPU allocator's failure
# ("DefaultCPUAllocator: can't allocate memory"), the kernel's OOM killer (lab.host_memory's
# reason; slurmstepd's "Detected 1 oom-kill event(s) ... killed by the cgroup out-of-memory
# handler" quoted from srun's error output); a remote rank's error arrives as text
_OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "MemoryError", "out of memory",
                "can't allocate memory", "DefaultCPUAllocator: not enough memory",
                "oom-kill event", "out-of-memory handler")
# exception type names a rank raises that are statuses of their own (train.loop.Diverged); a
# rank's error reaches this process as text, so they are matched by name
_STATUS_MARKERS = (("Diverged", "diverged"),)


def classify_failure(exc: BaseException) -> tuple[str, str]:
    """(status, reason) for an exception raised by a point: ``oom``, ``diverged`` or
    ``failed`` (KeyboardInterrupt and the CLI's SIGTERM, ``launch.Terminated``: ``cancelled``;
    ``timeout`` / ``node_fail`` come from Slurm's job state)."""
    text = f"{type(exc).__name__}: {exc}"
    status = "failed"
    if isinstance(exc, (KeyboardInterrupt, SystemExit)) or type(exc).__name__ == "Cancelled":
        status = "cancelled"
    elif isinstance(exc, MemoryError) or any(m in text for m in _OOM_MARKERS):
        status = "oom"
    else:
        status = next((st for marker, st in _STATUS_MARKERS if marker in text), "failed")
    reason = text.strip().splitlines()
    # keep the head (the error) and the last line (often the real cause in a remote traceback)
    short = "\n".join(reason[:3] + (reason[-1:] if len(reason) > 3 else []))[:2000]
    return status, short


# ---------------------------------------------------------------------------------- store
DEFERRED_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
_reported: set = set()  # (path, unreadable lines) already reported by this process


@contextlib.contextmanager
def signals_deferred():
    """SIGINT/SIGTERM/SIGHUP held back while the block runs (in the main thread), delivered
    when it ends: a record being written is finished before an interrupt unwinds."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, DEFERRED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class RecordStore:
    """``results/<exp>/points.jsonl``: load, query and atomically put records."""

    UNREADABLE = ".unreadable"  # suffix of the file unreadable lines are moved to

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        # the lock file lives in the git-ignored runs/ folder, not beside the committed JSONL
        self.lock_path = os.path.join(os.path.dirname(self.path), "runs", ".points.jsonl.lock")
        self.aside_path = self.path + self.UNREADABLE

    @classmethod
    def for_experiment(cls, results_dir: str, experiment: str) -> "RecordStore":
        return cls(os.path.join(results_dir, experiment, "points.jsonl"))

    def load(self) -> list[Record]:
        return self._read()[0]

    def _read(self) -> tuple[list[Record], list[tuple[int, str, str]]]:
        """(records, unreadable lines as (line number, text, why)); the unreadable ones are
        reported once per process."""
        if not os.path.exists(self.path):
            return [], []
        out, bad = [], []
        with open(self.path, encoding="utf-8", errors="surrogateescape") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                    if not isinstance(doc, dict):
                        raise TypeError(f"a JSON {type(doc).__name__}, not an object")
                    out.append(Record.from_dict(doc))
                except (json.JSONDecodeError, TypeError, ValueError) as e:
                    bad.append((i, line.rstrip("\n"), str(e)))
        self._report(bad)
        return out, bad

    def _report(self, bad: list) -> None:
        seen = (self.path, tuple(text for _, text, _ in bad))
        if not bad or seen in _reported:
            return
        _reported.add(seen)
        lines = ", ".join(str(i) for i, _, _ in bad[:5]) + (" ..." if len(bad) > 5 else "")
        log.error("error: %s: %d unreadable line%s (line %s: %s) skipped; the next record "
                  "written moves %s to %s", self.path, len(bad), "s" * (len(bad) > 1), lines,
                  bad[0][2], "them" if len(bad) > 1 else "it", self.aside_path)

    def _rewrite(self, records: list["Record"], bad: list) -> None:
        """Under the lock: the unreadable lines appended to ``aside_path`` (durably), then the
        file rewritten with ``records``."""
        if bad:
            with open(self.aside_path, "a", encoding="utf-8", errors="surrogateescape") as f:
                for _, text, _ in bad:
                    f.write(text + "\n")
                f.flush()
                os.fsync(f.fileno())
            # (the user was told when they were read: ``_report``)
            log.debug("%s: moved %d unreadable line(s) to %s", self.path, len(bad),
                      self.aside_path)
        _atomic_write_lines(self.path, [r.to_json() for r in records])

    def done_keys(self) -> set[str]:
        """Keys with an ok/oom record, whoever made it (``lab.sweep.reusable_keys`` adds
        the machine/code rule that decides what a sweep skips)."""
        return {r.key for r in self.load() if r.done}

    def done_records(self) -> dict[str, Record]:
        return {r.key: r for r in self.load() if r.done}

    def put(self, record: Record, replace_ok: bool = False) -> bool:
        """Insert/replace ``record`` (by key) atomically; see the module docstring. A record
        that is not ``ok`` does not replace an ``ok`` one (returns False, file unchanged)
        unless ``replace_ok``."""
        os.makedirs(os.path.dirname(self.lock_path), exist_ok=True)
        with FileLock(self.lock_path, timeout=600), signals_deferred():
            self._remove_stale_temps()
            old, bad = self._read()
            if record.status != "ok" and not replace_ok and any(
                    r.key == record.key and r.status == "ok" for r in old):
                log.warning("point %s: keeping its ok record; the %s re-run is not recorded "
                            "over it", record.point, record.status)
                return False
            self._rewrite([r for r in old if r.key != record.key] + [record], bad)
        return True

    def _remove_stale_temps(self) -> None:
        """Under the lock: temporary files of writers that were killed mid-write."""
        folder, base = os.path.dirname(self.path), os.path.basename(self.path)
        if not os.path.isdir(folder):
            return
        for name in os.listdir(folder):
            if name.startswith(base + ".") and name.endswith(".tmp"):
                log.info("removing %s, left by a writer that was killed", name)
                try:
                    os.unlink(os.path.join(folder, name))
                except OSError:
                    pass

    def remove(self, keys: Iterable[str]) -> int:
        keys = set(keys)
        os.makedirs(os.path.dirname(self.lock_path), exist_ok=True)
        with FileLock(self.lock_path, timeout=600), signals_deferred():
            self._remove_stale_temps()
            records, bad = self._read()
            kept = [r for r in records if r.key not in keys]
            self._rewrite(kept, bad)
        return len(records) - len(kept)


def _atomic_write_lines(path: str, lines: list[str]) -> None:
    write_atomic(path, "".join(line + "\n" for line in lines))


def write_atomic(path: str, text: str) -> None:
    """``text`` into ``path`` through a temporary file, fsynced and renamed over it (a
    temporary file that could not be written whole is removed)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.replace(tmp, path)
    try:  # make the rename itself durable (POSIX: fsync the directory)
        dfd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def loss_curve(record: Record) -> list[tuple[int, Any]]:
    """(step, loss) of every step a record knows, placed at its true step index: a resumed run's
    ``losses`` start at ``metrics.start_step``; the steps before it (from the checkpoint it
    resumed, ``losses_before_start``) come first when known. Summaries must index losses
    through this, never by list position."""
    m = record.metrics or {}
    start = int(m.get("start_step") or 0)
    before = list(m.get("losses_before_start") or [])
    out = list(enumerate(before)) if len(before) == start else []
    return out + [(start + i, v) for i, v in enumerate(m.get("losses") or [])]


def skipped_steps_of(record: Record) -> set[int]:
    """Step indices whose optimizer step was skipped (fp16 overflow / non-finite gradient),
    including those before a resume."""
    m = record.metrics or {}
    return set(m.get("skipped_at") or []) | set(m.get("skipped_before_start") or [])


def _ident(r: Record) -> str:
    return json.dumps([r.point, _jsonable(r.params), r.mode], sort_keys=True)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(_jsonable(v), sort_keys=True)
    return out


ZERO_R_COMPONENTS = ("activation_checkpointing", "partition_activations", "cpu_checkpointing",
                     "constant_buffers", "contiguous_memory")


def knob_label(config: dict) -> str:
    """A series name from a record's resolved config (never from a label a config pinned):
    model shape, dtype, ZeRO stage and ZeRO-R, world = TP x DP, steps. E.g.
    ``GPT 2x64 (h4, s64) fp32 stage 2 w2=tp1xdp2 8 steps``."""
    m, p = config.get("model") or {}, config.get("parallel") or {}
    z, zr, t = config.get("zero") or {}, config.get("zero_r") or {}, config.get("train") or {}
    world, tp = p.get("world_size", 1), p.get("tp", 1)
    family = "Llama" if m.get("family") == "llama" else "GPT"
    label = (f"{family} {m.get('n_layer')}x{m.get('n_embd')} (h{m.get('n_head')}, "
             f"s{m.get('seq_len')}) {z.get('dtype')} stage {z.get('stage')}")
    name = zero_r_ran(zr)
    if name:
        label += f" + ZeRO-R {name.upper()}"
    return label + f" w{world}=tp{tp}xdp{world // max(1, tp)} {t.get('steps')} steps"


def zero_r_ran(zero_r: dict) -> str:
    """The ZeRO-R configuration a config's components make (never the name alone): its Table
    3 name when the components are that row's, ``custom`` for any other set, '' for none."""
    parts = {k: bool(zero_r.get(k)) for k in ZERO_R_COMPONENTS}
    if not any(parts.values()):
        return ""
    name = str(zero_r.get("name") or "")
    if name in table3.TABLE3:
        row = table3.zero_r_config(name)
        if all(getattr(row, k) == v for k, v in parts.items()):
            return name
    return "custom"


def knob_diff(record: Record, others: Iterable[Record]) -> dict:
    """The identifying config knobs (``config.identity``, dotted) whose value in ``record``
    differs from at least one of ``others``: what tells two records of one point apart.
    The values shown are the record's own (None where its config predates the knob)."""
    mine = _flat(identity.identity(record.config))
    keys: set = set()
    for o in others:
        theirs = _flat(identity.identity(o.config))
        keys |= {k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)}
    said = _flat(record.config or {})
    return {k: json.loads(said[k]) if k in said else None for k in sorted(keys)}


def variants(records: Iterable[Record]) -> list[list[Record]]:
    """Records in layers: layer 0 holds the newest done record of every (point name, params,
    mode),
    layer 1 the next newest of those that have more, and so on. Records of one point that
    differ in a config knob (dtype, steps, model, ...) have different keys and all stay
    visible: each layer is summarized on its own and its series named by the knobs that tell
    it apart (``lab.figures.regenerate.summary_frame``)."""
    by: dict[str, list[Record]] = {}
    for r in records:
        by.setdefault(_ident(r), []).append(r)
    layers: list[list[Record]] = []
    for group in by.values():
        # done (ok/oom) records first: a failed re-run never hides a result
        group = sorted(group, key=lambda r: (r.done, r.timestamp), reverse=True)
        for i, r in enumerate(group):
            if i == len(layers):
                layers.append([])
            layers[i].append(r)
    return layers


def latest(records: Iterable[Record]) -> list[Record]:
    """Newest record per (point name, params, mode), in first-seen order (layer 0 of
    ``variants``)."""
    layers = variants(records)
    return layers[0] if layers else []


def newest_ok(records: Iterable[Record]) -> list[Record]:
    """The newest ``ok`` record of every point name, in first-seen order: for summaries whose
    points changed their identifying params over time (e.g. a dry run's traced steps 1 -> 2):
    the older records stay in points.jsonl as history, the table shows the current method."""
    out: dict[str, Record] = {}
    for r in records:
        if r.status == "ok" and (r.point not in out or r.timestamp >= out[r.point].timestamp):
            out[r.point] = r
    return list(out.values())



def main(argv=None) -> int:
    """``python -m zero_repro.lab.records migrate FILE...``: ``migrate`` each points.jsonl."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("command", choices=["migrate"])
    ap.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    total = 0
    for path in args.files:
        n, changed = migrate(path)
        total += changed
        print(f"{path}: {n} records, {changed} keys rewritten")
    print(f"{total} keys rewritten in {len(args.files)} files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
