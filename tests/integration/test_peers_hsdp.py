"""FSDP2's HSDP and this project's stage 3 with ``zero.shard_size`` = G side by side in the peers
harness (world 4, G = 2, fp32, gloo): both train the tiny GPT as the single-process AdamW
reference does (the harness's tolerances, per step), their losses agree with each other per
step, and their per-rank model states are the same sharding (parameters 4Ψ/G bytes each).
Likewise, where DeepSpeed is installed (slow), DeepSpeed's hpZ (zero_hpz_partition_size = 2)
and ``zero.hpz``.
The race's timing and live-peak numbers of the same run are measurements (results/peers/), not
checked here.
"""
from __future__ import annotations

import pytest

from tests.integration.test_peers import LOSS_TOL, PSI, _check_equivalent, _spec
from zero_repro.lab.peers import report
from zero_repro.lab.peers.frameworks import deepspeed_available
from zero_repro.lab.peers.runners import run_peers
from zero_repro.lab.peers.spec import HPZ, HSDP
from zero_repro.runtime.comm.launch import WorkerFailed, spawn

G = 2


GLOO_NO_AVG = "Cannot use ReduceOp.AVG with Gloo"


def test_fsdp2_hsdp_and_ours_match_the_reference_and_each_other():
    try:
        results = spawn(run_peers, 4, _spec(HSDP), timeout_s=300)
    except WorkerFailed as e:
        if GLOO_NO_AVG not in str(e):
            raise
        # FSDP2's HSDP all-reduces fp32 gradients with ReduceOp.AVG; gloo has it from a later
        # torch than the floor (2.7.1 refuses it, 2.13 runs it)
        pytest.skip("this torch's gloo lacks ReduceOp.AVG, which FSDP2's HSDP uses")
    eq = report.equivalence(results, lr=3e-3)
    _check_equivalent(eq, HSDP)
    for r in results:
        fw = r["frameworks"]
        theirs, ours = fw["fsdp2_hsdp"], fw["zero_repro_s3_hsdp"]
        assert max(abs(a - b) for a, b in zip(theirs["losses"], ours["losses"])) <= LOSS_TOL
        # the same sharding: each rank's fp32 parameters are Ψ/G (FSDP2 pads rows, we pad
        # the buckets: within 1%)
        assert abs(theirs["memory"]["params"] / (4 * PSI / G) - 1) <= 0.01, theirs["memory"]
        assert abs(ours["memory"]["params_lp"] / (4 * PSI / G) - 1) <= 0.01, ours["memory"]
        # ours: the replicas' all-reduce of the owned Ψ/G gradient elements once per step
        rep = ours["comm"]["all_reduce/dp_replicate"]
        assert abs(rep["elements"] / (PSI / G) - 1) <= 0.01, rep


@pytest.mark.slow  # DeepSpeed's import and engine set-up at world 4
def test_deepspeed_hpz_and_ours_match_the_reference_and_each_other():
    """ZeRO++'s hpZ, world 4, secondary over 2 ranks: DeepSpeed's zero_hpz_partition_size and
    zero.hpz train as the reference does and as each other, per step."""
    ok, why = deepspeed_available()
    if not ok:
        pytest.skip(why)
    results = spawn(run_peers, 4, _spec(HPZ), timeout_s=600)
    eq = report.equivalence(results, lr=3e-3)
    _check_equivalent(eq, HPZ)
    for r in results:
        theirs, ours = (r["frameworks"][n] for n in HPZ)
        assert max(abs(a - b) for a, b in zip(theirs["losses"], ours["losses"])) <= LOSS_TOL
        # both hold a secondary of the parameters over 2 ranks: 4Ψ/2 bytes in fp32 (DeepSpeed
        # pads each parameter, we pad each bucket: within 1%)
        for held in (theirs["memory"]["params_secondary"], ours["memory"]["params_hpz"]):
            assert abs(held / (4 * PSI / 2) - 1) <= 0.01, (theirs["memory"], ours["memory"])
