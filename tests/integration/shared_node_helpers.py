"""Helpers of the shared-node tests (``test_shared_node.py``, ``test_shared_node_checkpoints.py``):
a second account, a shared sticky directory, a one-process strategy to save and load."""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile

from zero_repro.runtime.comm.topology import Topology

OTHER = "zr-other"  # the second account (created where the tests run as root)


# ----------------------------------------------------------------------------- helpers
def as_other() -> list[str] | None:
    """A command prefix that runs a command as a second account, or None where this machine
    cannot (not root, no setpriv/useradd)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return None
    try:
        pw = pwd.getpwnam(OTHER)
    except KeyError:
        if not shutil.which("useradd"):
            return None
        # exit 9: created meanwhile by a test running beside this one
        p = subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                            "/usr/sbin/nologin", OTHER], capture_output=True, text=True)
        if p.returncode not in (0, 9):
            return None
        pw = pwd.getpwnam(OTHER)
    return ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups"]


def shared_tmp() -> str:
    """A fresh world-writable sticky directory (like /tmp or /dev/shm), removed by the caller."""
    d = tempfile.mkdtemp(prefix="zr-test-shared-")
    os.chmod(d, 0o1777)
    return d


def small_strategy(stage: int = 2):
    """A one-process (world 1) ZeRO strategy of a tiny GPT: enough to save and load."""
    from tests.unit.test_checkpoint import make
    topo = Topology.build(tp=1)
    return make(topo, stage), topo
