"""Two nodes for real (marker ``slurm``): ``launcher=slurm`` and the torchrun-under-srun recipe
across the CI cluster's partition ``two`` -- nodes zr-n1 and zr-n2, two slurmd on this machine,
each in its own network, UTS and mount namespace (own address on a bridge the cluster script
made, own hostname, own /dev/shm; ``.ci/slurm_cluster.sh``).

What must hold at 2 nodes x 2 ranks, TP 2 x DP 2 on gloo: rendezvous from the Slurm environment,
each TP group inside one node, DP across the nodes on gloo point-to-point (the shared-memory
transport is refused: the peer's segment is on another host), the record naming both nodes and
the transport, and the losses equal to the same configuration on one node.

Skipped with one line where the cluster has no two-node partition because namespaces cannot be
made here (not root, no ``ip netns``); with ``ZR_SLURM_REQUIRED=1`` (CI) that is a failure.
"""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests import REPO
from tests.integration.test_slurm_real import (START_HINT, _cluster_problem, cli, env, finish,
                                               last_line, records)
from zero_repro import config as C
from zero_repro import schema
from zero_repro import validation

pytestmark = pytest.mark.slurm

NODES = ["zr-n1", "zr-n1", "zr-n2", "zr-n2"]  # rank order: srun's block distribution
POINT = ["+exp=smoke", "train.data=synthetic", "train.progress=false", "train.warmup_steps=1",
         "train.steps=4", "parallel.world_size=4", "parallel.tp=2"]


def _why_no_two_nodes() -> str:
    """'' if partition ``two`` has two usable nodes, else why not (the cluster script's note)."""
    p = subprocess.run(["sinfo", "-h", "-N", "-p", "two", "-o", "%T"], capture_output=True,
                       text=True, timeout=20)
    if len(re.findall(r"^(idle|mixed|allocated)", p.stdout, re.M)) == 2:
        return ""
    note = os.path.join(os.path.dirname(os.path.dirname(os.environ.get("SLURM_CONF", "/x/y"))),
                        "two_nodes")
    why = open(note).read().strip() if os.path.exists(note) else "no partition 'two'"
    seen = " ".join(p.stdout.split()) or last_line(p.stderr)
    return f"no two-node partition ({last_line(why)}; sinfo: {seen!r})"


@pytest.fixture(scope="module")
def two_nodes():
    why = _cluster_problem() or _why_no_two_nodes()
    if why:
        if os.environ.get("ZR_SLURM_REQUIRED") == "1":
            pytest.fail(f"ZR_SLURM_REQUIRED=1 but {why}")
        pytest.skip(f"two nodes unavailable: {why}" if "no two-node" in why
                    else f"{START_HINT} ({why})")
    return True


@pytest.fixture(scope="module")
def runs(two_nodes, tmp_path_factory):
    """The point at 2 nodes (launcher=slurm, partition two) and on 1 node (local launcher)."""
    out = {}
    for name, extra in (("two", ["launcher=slurm", "launcher.partition=two"]),
                        ("one", ["launcher=local"])):
        results = str(tmp_path_factory.mktemp(name))
        log = finish(cli([*POINT, *extra, f"experiment.results_dir={results}",
                          f"hydra.run.dir={results}/hydra"]), 300)
        (rec,) = records(results)
        assert rec.status == "ok", (name, rec.reason, log[-3000:])
        out[name] = rec
    return out


def test_two_nodes_slurm_point(runs):
    rec = runs["two"]
    hw = rec.hardware
    assert rec.topology["nodes"] == 2 and rec.topology["world_size"] == 4
    assert hw["hosts"] == NODES and hw["nodes"] == 2, hw
    assert hw["rendezvous"] == "slurm" and hw["slurm_job_num_nodes"] == "2"
    assert hw["tp_within_node"] is True
    # DP pairs (0, 2) and (1, 3) cross the hosts: the shared-memory transport finds no peer
    # segment there and the buckets go point-to-point on gloo
    assert hw["dp_transport"] == "gloo", hw
    assert len(rec.metrics["losses"]) == 4


def test_two_nodes_equal_one_node(runs):
    one, two = runs["one"], runs["two"]
    assert one.hardware["nodes"] == 1 and one.hardware["dp_transport"] == "shm"
    # DP 2: a gradient element's sum has two terms, the same in either order; only the fp64
    # sum of the ranks' squared norms may round differently (seen: 7e-10 relative)
    for key in ("losses", "grad_norms"):
        a, b = two.metrics[key], one.metrics[key]
        assert len(a) == len(b) == 4
        assert max(abs(x - y) / abs(y) for x, y in zip(a, b)) <= 1e-6, (key, a, b)


def test_torchrun_under_srun_recipe_two_nodes(two_nodes, tmp_path):
    """slurm/README.md's torchrun recipe, as written there, across the two nodes: one torchrun
    agent per node, c10d rendezvous at the first node."""
    readme = open(os.path.join(REPO, "slurm", "README.md")).read()
    recipe = re.search(r"# torchrun-under-srun recipe\n(.*?)\n```", readme, re.S)[1]
    cfg = C.Config()
    cfg.model = C.ModelConfig(name="tiny", n_layer=2, n_embd=64, n_head=4, seq_len=64,
                              vocab_size=512, vocab_pad_multiple=8)
    cfg.parallel.world_size, cfg.parallel.tp = 4, 2
    cfg.train.steps, cfg.train.progress, cfg.train.micro_batch_size = 3, False, 2
    cfg.launcher = C.LauncherConfig(name="torchrun")
    schema.save(validation.validate(cfg), str(tmp_path / "resolved.yaml"))
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nset -euo pipefail\n"
                      f"source {REPO}/slurm/env.sh\ncd {tmp_path}\nGPUS_PER_NODE=2\n{recipe}\n")
    p = subprocess.run(["sbatch", "--wait", "--time=5", "--partition=two", "--nodes=2",
                        "--ntasks-per-node=2", f"--output={tmp_path}/job.out", str(script)],
                       env=env(), capture_output=True, text=True, timeout=300)
    log_text = open(tmp_path / "job.out").read()
    assert p.returncode == 0, log_text[-3000:]
    result = json.load(open(tmp_path / "result.json"))
    hw = result["hardware"]
    assert result["topology"]["world_size"] == 4 and len(result["metrics"]["losses"]) == 3
    # torchrun numbers the nodes in the order their agents joined: either node may be first
    assert sorted(hw["hosts"]) == NODES and hw["rendezvous"] == "torchrun"
    assert hw["tp_within_node"] and hw["nodes"] == 2
    assert hw["dp_transport"] == "gloo"
