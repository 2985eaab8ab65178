"""Hierarchical sharding on two real nodes (marker ``slurm``; the CI cluster's partition ``two``,
``.ci/slurm_cluster.sh``: nodes zr-n1 and zr-n2, each a slurmd in its own network namespace,
wired to a bridge through the host-side veths zrv1 and zrv2).

Stage 3 at 2 nodes x 2 ranks (TP 1, DP 4, gloo point-to-point across the nodes), three ways:
plain ZeRO (G = N_d = 4), ``zero.shard_size=node`` (HSDP, G = the 2 ranks of a node) and
``zero.hpz=true`` (ZeRO++'s hpZ, its secondary over the node's 2 ranks). What must hold:

* the comm ledger's inter-node bytes of a step (the record's ``comm_inter_node_bytes``, rank 0)
  fall against plain ZeRO's, by the volume each moves inside the node instead (hpZ: the
  backward's all-gathers; HSDP: everything but the replicas' all-reduce);
* an independent count agrees: the bytes the nodes put on the wire between them (the host-side
  veths' ``rx_bytes``, read around each job: everything each node sent to the other, plus its
  few Slurm / rendezvous messages) fall too, and by at least half of what the ledger's per-step
  fall predicts over the job's steps (the wire carries a pairwise exchange's (N-1)/N of the §7
  volume, and headers);
* the losses equal plain ZeRO's (fp32: the same sums in another association, within 1e-5).
"""
from __future__ import annotations

import pytest

from tests.integration.test_slurm_real import cli, finish, records
from tests.integration.test_slurm_two_nodes import two_nodes  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slurm

STEPS = 4
POINT = ["+exp=smoke", "train.data=synthetic", "train.progress=false", "train.warmup_steps=1",
         f"train.steps={STEPS}", "parallel.world_size=4", "parallel.tp=1", "zero.stage=3",
         "launcher=slurm", "launcher.partition=two"]
WAYS = {"plain": [], "hsdp": ["zero.shard_size=node"], "hpz": ["zero.hpz=true"]}
VETHS = ("zrv1", "zrv2")  # the host ends of zr-n1's and zr-n2's links


def wire_bytes() -> int:
    """Bytes the two nodes sent onto the bridge (received by the host ends of their veths)."""
    return sum(int(open(f"/sys/class/net/{v}/statistics/rx_bytes").read()) for v in VETHS)


@pytest.fixture(scope="module")
def runs(two_nodes, tmp_path_factory):  # noqa: F811
    out = {}
    for name, extra in WAYS.items():
        results = str(tmp_path_factory.mktemp(name))
        before = wire_bytes()
        log = finish(cli([*POINT, *extra, f"experiment.results_dir={results}",
                          f"hydra.run.dir={results}/hydra"]), 400)
        wire = wire_bytes() - before
        (rec,) = records(results)
        assert rec.status == "ok", (name, rec.reason, log[-3000:])
        assert rec.hardware["nodes"] == 2, rec.hardware
        out[name] = (rec, wire)
    return out


def test_inter_node_bytes_fall_in_the_ledger_and_on_the_wire(runs):
    plain, plain_wire = runs["plain"]
    inter = plain.metrics["comm_inter_node_bytes"]
    assert inter > 0 and plain.metrics["comm_intra_node_bytes"] == 0, plain.metrics
    for name in ("hsdp", "hpz"):
        rec, wire = runs[name]
        m = rec.metrics
        assert m["comm_inter_node_bytes"] < inter, (name, m["comm_inter_node_bytes"], inter)
        # the same collectives' volume, part of it now inside the node
        fall = inter - m["comm_inter_node_bytes"]
        assert m["comm_intra_node_bytes"] > 0
        if name == "hpz":  # hpZ moves the backward's gathers inside: the same total volume
            assert m["comm_intra_node_bytes"] == fall, (m, inter)
        # the wire, counted by the kernel: the jobs' bytes between the nodes fall too, by
        # at least half the ledger's fall over the steps (module docstring)
        assert plain_wire - wire >= 0.5 * fall * STEPS, (name, plain_wire, wire, fall)
        for a, b in zip(rec.metrics["losses"], plain.metrics["losses"]):
            assert abs(a - b) <= 1e-5, (name, rec.metrics["losses"], plain.metrics["losses"])
