"""A shared cluster node, its checkpoints (docs/running.md, "Shared nodes"; the processes and ports:
``test_shared_node.py``):

* Checkpoints are private (0700 / 0600); a checkpoint another account owns or may write is
  refused unless ``checkpoint.allow_untrusted=true``; nothing in one is unpickled beyond the
  checkpoint format's own data types.
* No fixed name under the temporary directory; a planted symlink is never followed.
* Two runs sharing a checkpoint directory never delete each other's saves.

Tests that need a second account (``setpriv``, root) say so where they skip; CI runs as root,
where they run.
"""
from __future__ import annotations

import json
import os
import pickle
import pwd
import socket
import stat
import subprocess
import sys

import pytest

from zero_repro import config as C
from zero_repro.runtime.train import checkpoint as ck
from tests import REPO
from tests.integration.shared_node_helpers import OTHER, as_other, small_strategy


# ------------------------------------------------------------------------ checkpoints
def _modes(root: str) -> set[tuple[str, str]]:
    out = set()
    for d, dirs, files in os.walk(root):
        out |= {("dir", oct(stat.S_IMODE(os.stat(os.path.join(d, x)).st_mode))) for x in dirs}
        out |= {("file", oct(stat.S_IMODE(os.stat(os.path.join(d, x)).st_mode))) for x in files}
    return out


def test_checkpoints_are_private(tmp_path):
    strategy, topo = small_strategy()
    root = str(tmp_path / "ck")
    ck.save(root, strategy, topo, 1)
    assert oct(stat.S_IMODE(os.stat(root).st_mode)) == "0o700"
    assert _modes(root) <= {("dir", "0o700"), ("file", "0o600")}, _modes(root)


def test_resume_refuses_a_checkpoint_others_can_write(tmp_path):
    strategy, topo = small_strategy()
    path = ck.save(str(tmp_path / "ck"), strategy, topo, 1)
    os.chmod(path, 0o777)
    with pytest.raises(ck.CheckpointError, match="writable by others"):
        ck.load(path, strategy, topo)
    assert ck.load(path, strategy, topo, trust=True)["step"] == 1  # the user said so


def test_resume_refuses_a_checkpoint_of_another_account(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a checkpoint to another account needs root")
    other = as_other()
    if other is None:
        pytest.skip("no second account can be made here (useradd/setpriv)")
    strategy, topo = small_strategy()
    path = ck.save(str(tmp_path / "ck"), strategy, topo, 1)
    uid = pwd.getpwnam(OTHER).pw_uid
    for d, _, files in os.walk(path):
        for f in [d] + [os.path.join(d, x) for x in files]:
            os.chown(f, uid, -1)
    with pytest.raises(ck.CheckpointError, match=f"owned by uid {uid}"):
        ck.load(path, strategy, topo)


def test_resume_check_before_any_process_starts(tmp_path, monkeypatch):
    """The CLI's pre-flight refuses an untrusted checkpoint with the knob that allows it."""
    from zero_repro.lab import launcher
    strategy, topo = small_strategy()
    path = ck.save(str(tmp_path / "ck"), strategy, topo, 1)
    os.chmod(path, 0o775)
    cfg = C.Config()
    cfg.train.steps = 4
    cfg.checkpoint.resume = path
    with pytest.raises(ValueError, match="checkpoint.allow_untrusted=true"):
        launcher._check_resume(cfg, path)
    cfg.checkpoint.allow_untrusted = True
    launcher._check_resume(cfg, path)


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rehash(path: str) -> None:
    """What anyone who can write the directory can do: the manifest's hashes made to match."""
    with open(os.path.join(path, ck.MANIFEST)) as f:
        manifest = json.load(f)
    manifest["files"] = {n: ck._sha256(os.path.join(path, n)) for n in manifest["files"]}
    with open(os.path.join(path, ck.MANIFEST), "w") as f:
        f.write(ck.files.sealed(manifest))  # the manifest's own digest is no secret either


def test_a_planted_metadata_pickle_is_not_run(tmp_path):
    strategy, topo = small_strategy()
    path = ck.save(str(tmp_path / "ck"), strategy, topo, 1)
    marker = tmp_path / "pwned"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Payload(str(marker)), f)
    _rehash(path)
    _load_refused(path, strategy, topo, marker)


def _load_refused(path, strategy, topo, marker) -> None:
    """Loading ``path`` (this account's, private) raises CheckpointError, the payload unrun."""
    try:
        ck.load(path, strategy, topo)
        err = None
    except BaseException as e:  # noqa: BLE001 - DCP's own exception is a BaseException
        err = e
    assert not marker.exists(), "the planted payload ran"
    assert isinstance(err, ck.CheckpointError), repr(err)


def test_a_planted_byte_entry_is_not_unpickled(tmp_path):
    """The metadata names an entry as pickled bytes (DCP then ``torch.load``s it with
    weights_only=False): refused, the payload not run."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    strategy, topo = small_strategy()
    path = ck.save(str(tmp_path / "ck"), strategy, topo, 1)
    marker = tmp_path / "pwned"
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    key = "rng/rank0"
    payload = pickle.dumps(_Payload(str(marker)))
    with open(os.path.join(path, "__0_0.distcp"), "ab") as f:
        offset = f.tell()
        f.write(payload)
    md.state_dict_metadata[key] = BytesStorageMetadata()
    for idx in [i for i in md.storage_data if i.fqn == key]:
        info = md.storage_data.pop(idx)
        md.storage_data[type(idx)(key)] = type(info)(info.relative_path, offset, len(payload))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    _rehash(path)
    _load_refused(path, strategy, topo, marker)


def test_latest_never_follows_a_planted_symlink(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    os.symlink(victim, root / "latest.tmp")
    ck._write_latest(str(root), "step_00000001")
    assert victim.read_text() == "mine\n"
    assert (root / "latest").read_text().strip() == "step_00000001"


def test_the_example_has_no_fixed_checkpoint_directory(tmp_path):
    """``examples/minimal.py`` with no ``--ckpt-dir``: a fresh private directory, not a fixed
    name in the temporary directory (there a planted ``latest.tmp`` symlink overwrote a file
    of the user's)."""
    tmp = tmp_path / "tmp"
    fixed = tmp / "zr_minimal_ckpt"
    fixed.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    os.symlink(victim, fixed / "latest.tmp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, TMPDIR=str(tmp), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "-m", "zero_repro.examples.minimal", "--steps", "1"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    assert victim.read_text() == "mine\n"
    saved = [ln for ln in p.stderr.splitlines() if "checkpoint " in ln][-1].rsplit(" ", 1)[1]
    assert os.path.dirname(saved) != str(fixed)
    assert oct(stat.S_IMODE(os.stat(os.path.dirname(saved)).st_mode)) == "0o700"


SAVER = r"""
import os, sys, time
import torch.distributed.checkpoint as dcp
from tests.integration.shared_node_helpers import small_strategy
from zero_repro.runtime.train import checkpoint as ck
root, flag = sys.argv[1], sys.argv[2]
real = dcp.save
def paused(*a, **k):  # this run's save is written, not yet committed, while another saves
    out = real(*a, **k)
    print("writing", flush=True)
    while not os.path.exists(flag):
        time.sleep(0.05)
    return out
dcp.save = paused
strategy, topo = small_strategy()
print(ck.save(root, strategy, topo, 5), flush=True)
"""


def test_a_save_never_deletes_another_runs_save_in_progress(tmp_path):
    """Two runs sharing a checkpoint directory (runs that differ only in ``train.steps``): one
    saves while the other's save is being written (before: every save removed every unfinished
    save: FileNotFoundError in the other run)."""
    root, flag = str(tmp_path / "ck"), str(tmp_path / "go")
    other = subprocess.Popen([sys.executable, "-c", SAVER, root, flag], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=REPO))
    try:
        line = other.stdout.readline()
        assert line.strip() == "writing", other.stderr.read()[-2000:]
        strategy, topo = small_strategy()
        ck.save(root, strategy, topo, 7)
    finally:
        open(flag, "w").close()
        out, err = other.communicate(timeout=120)
    assert other.returncode == 0, err[-2000:]
    assert [os.path.basename(p) for p in ck.committed(root)] == ["step_00000007",
                                                                 "step_00000005"]


@pytest.mark.slow
def test_two_runs_of_different_length_share_a_checkpoint_directory(tmp_path):
    """Two sweeps started together in one results directory, 60 and 64 steps, saving every
    step into their shared checkpoint directory: both end ``ok`` (before: the 64-step run
    failed with FileNotFoundError on its own .partial directory)."""
    from zero_repro.lab import records as R
    runs = [subprocess.Popen([sys.executable, os.path.join(REPO, "run.py"), "+exp=smoke",
                              f"train.steps={n}", "checkpoint.save_every=1",
                              "train.progress=false", "train.data=synthetic",
                              f"experiment.results_dir={tmp_path / 'results'}",
                              f"hydra.run.dir={tmp_path / str(n)}"],
                             cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for n in (60, 64)]
    outs = [p.communicate(timeout=900) for p in runs]
    for p, (out, _) in zip(runs, outs):
        assert p.returncode == 0, out[-2000:]
    recs = R.RecordStore.for_experiment(str(tmp_path / "results"), "smoke").load()
    assert sorted((r.config["train"]["steps"], r.status) for r in recs) == [(60, "ok"),
                                                                            (64, "ok")]


def test_an_interrupted_save_of_a_dead_run_is_removed(tmp_path):
    """What a killed run left (its lock is free) goes at the next save, as before."""
    root = tmp_path / "ck"
    (root / "step_00000003.partial").mkdir(parents=True)
    strategy, topo = small_strategy()
    ck.save(str(root), strategy, topo, 4)
    assert sorted(os.listdir(root)) == ["latest", "step_00000004"]
