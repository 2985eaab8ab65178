"""A measurement is never lost: for every way a record used to be lost, the record survives
and the user is told where it is.

* Ctrl-C held down (SIGINT to the whole process group every 50 ms) while a real point trains:
  the point is recorded ``cancelled`` before the process ends, the last line names the file,
  no temporary file is left, no traceback.
* The results directory made read-only mid-sweep: each finished point's record is printed as
  one JSON line (its run directory is read-only too), an ``error:`` line says so, the sweep
  goes on to its last point, exit status 1.
* A full file system (a file-size limit, ``RLIMIT_FSIZE``, that the rewrite of points.jsonl
  exceeds): each record goes to ``<run dir>/record.json`` and the user is told; the sweep
  goes on.
* A damaged line in points.jsonl: reported once as an error line, moved byte for byte to
  ``points.jsonl.unreadable`` by the next write, the other records kept.

The last three run ``cli.main`` in a child process on a registered experiment of simulated
points (nothing trains), so that the limits and mounts stay out of the test process.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import psutil
import pytest

from tests import REPO
from zero_repro.lab import records as R


_SWEEP = '''
import json, os, subprocess, sys
from zero_repro.lab import cli, registry
from zero_repro.lab.points import Point

RESULTS = sys.argv[1]
ACTION = os.environ.get("ZRT_ACTION", "")

class Three:
    def plan(self, cfg):
        return [Point(name=f"p{i}", params={"i": i}, mode="simulated") for i in range(3)]

    def run_point(self, cfg, point):
        if point.params["i"] == 1 and ACTION:
            subprocess.run(ACTION, shell=True, check=True)  # the directory goes read-only
        return {"y": point.params["i"], "losses": [3.0, 2.0, 1.0]}

    def summarize(self, records):
        return [{"figure": "f", "series": "s", "x_name": "i", "x_value": r.params["i"],
                 "y_name": "y", "y_value": r.metrics["y"], "unit": "u", "kind": r.mode}
                for r in records if r.status == "ok"]

registry.register("faulty", Three())
sys.argv = ["run.py", "+exp=smoke", "experiment.name=faulty", "train.progress=false",
            f"experiment.results_dir={RESULTS}", f"hydra.run.dir={RESULTS}/../hydra"]
cli.main()
'''


def _sweep(tmp_path, env=None, preexec=None):
    script = tmp_path / "sweep.py"
    script.write_text(textwrap.dedent(_SWEEP))
    results = tmp_path / "results"
    return subprocess.run([sys.executable, str(script), str(results)], cwd=REPO,
                          capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, **(env or {})), preexec_fn=preexec)


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def _read_only(path) -> tuple[str, str]:
    """(command that makes ``path`` read-only, command that undoes it): a read-only bind
    mount for root (permission bits do not stop root), the permission bits otherwise."""
    if os.geteuid() != 0:
        return f"chmod -R a-w {path}", f"chmod -R u+w {path}"
    probe = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"running as root without mount permission: {probe.stderr!r}")
    subprocess.run(["umount", str(path)], check=True)
    return (f"mount --bind {path} {path} && mount -o remount,bind,ro {path}",
            f"umount {path}")


def test_read_only_results_directory_mid_sweep_loses_no_record(tmp_path):
    results = tmp_path / "results"
    (results / "faulty").mkdir(parents=True)
    make_ro, undo = _read_only(results)
    try:
        p = _sweep(tmp_path, env={"ZRT_ACTION": make_ro})
    finally:
        subprocess.run(undo, shell=True)
    assert p.returncode == 1, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr + p.stdout, p.stderr[-3000:]
    stored = R.RecordStore.for_experiment(str(results), "faulty").load()
    assert [r.point for r in stored] == ["p0"]  # written before the directory went read-only
    printed = _json_lines(p.stdout)
    assert [d["point"] for d in printed] == ["p1", "p2"]  # the sweep went on to its last point
    assert all(d["status"] == "ok" and d["metrics"]["losses"] == [3.0, 2.0, 1.0]
               for d in printed)
    told = [ln for ln in p.stderr.splitlines() if ln.startswith("error: point")]
    assert any("'p1'" in ln and "could not be written" in ln for ln in told), p.stderr
    assert any("'p2'" in ln for ln in told), p.stderr


def test_full_file_system_keeps_each_record_in_its_run_directory(tmp_path):
    results = tmp_path / "results"
    store = R.RecordStore.for_experiment(str(results), "faulty")
    os.makedirs(os.path.dirname(store.path))
    # an old record large enough that rewriting the file passes the size limit below
    old = R.Record(key="old", experiment="faulty", point="old", params={"i": -1},
                   mode="simulated", status="ok", metrics={"y": -1, "pad": "x" * 200_000})
    with open(store.path, "w") as f:
        f.write(old.to_json() + "\n")
    limit = os.path.getsize(store.path) + 1000  # a record is a few KiB: the rewrite fails

    def full():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    p = _sweep(tmp_path, preexec=full)
    assert p.returncode == 1, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr + p.stdout, p.stderr[-3000:]
    assert [r.point for r in store.load()] == ["old"]  # the file is whole
    for i in range(3):
        line = next(ln for ln in p.stderr.splitlines() if f"error: point 'p{i}'" in ln)
        where = line.split("it is kept in ")[1].split(":")[0]
        assert where.startswith(str(results / "faulty" / "runs")), line
        assert where.endswith(os.path.join("", "record.json")), line
        doc = json.loads(open(where).read())
        assert doc["point"] == f"p{i}" and doc["status"] == "ok"
    leftovers = [f for _, _, fs in os.walk(results) for f in fs if f.endswith(".tmp")]
    assert leftovers == []


def test_damaged_line_is_moved_aside_and_reported_once(tmp_path):
    results = tmp_path / "results"
    store = R.RecordStore.for_experiment(str(results), "faulty")
    os.makedirs(os.path.dirname(store.path))
    keep = R.Record(key="kept", experiment="faulty", point="kept", params={"i": -1},
                    mode="simulated", status="ok", metrics={"y": 1})
    torn = keep.to_json()[:70]  # a write cut short
    with open(store.path, "w") as f:
        f.write(keep.to_json() + "\n" + torn + "\n")
    p = _sweep(tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    reported = [ln for ln in out.splitlines() if "unreadable line" in ln]
    assert len(reported) == 1 and "error:" in reported[0], reported
    assert store.aside_path in reported[0]
    assert open(store.aside_path).read() == torn + "\n"  # byte for byte
    assert sorted(r.point for r in store.load()) == ["kept", "p0", "p1", "p2"]
    assert "unreadable" not in open(store.path).read()


def _tagged(tag: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("ZRT_TAG") == tag and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT,
                                 pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_signal_burst_to_the_process_group_keeps_the_record(tmp_path, sig):
    """A signal held down (to the CLI and its ranks, every 50 ms for 3 s) while a point
    trains and checkpoints: the point is recorded as cancelled, the last line says where."""
    tag = uuid.uuid4().hex
    results = tmp_path / "results"
    p = subprocess.Popen([sys.executable, os.path.join(REPO, "run.py"), "+exp=smoke",
                          "parallel.tp=1", "train.steps=100000", "train.progress=false",
                          "checkpoint.save_every=1", f"experiment.results_dir={results}",
                          f"hydra.run.dir={tmp_path / 'hydra'}"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, ZRT_TAG=tag), start_new_session=True)
    deadline = time.monotonic() + 180
    runs = results / "smoke" / "runs"
    while not any(n.startswith("step_") for _, ds, _ in os.walk(runs) for n in ds):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.2)  # training, saving a checkpoint every step
    end = time.monotonic() + 3.0
    while time.monotonic() < end and p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + sig, (p.returncode, err[-3000:])
    assert "Traceback" not in out + err, err[-3000:]
    store = R.RecordStore.for_experiment(str(results), "smoke")
    assert [r.status for r in store.load()] == ["cancelled"], err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted") and store.path in last, last
    assert [f for _, _, fs in os.walk(results) for f in fs if f.endswith(".tmp")] == []
    t0 = time.monotonic()
    while _tagged(tag) and time.monotonic() - t0 < 10:
        time.sleep(0.2)
    assert _tagged(tag) == []
