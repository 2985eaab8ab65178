"""The shared-memory channel's set-up (``runtime.comm.cpu.shm``) in real spawned ranks: a group on
one host gets it and leaves nothing in ``/dev/shm``; ranks that cannot map each other's
segments (here: one rank reports another host, as a rank on another node would) fall back to
gloo point-to-point under ``auto`` and fail with one clear error under ``shm``; a bad
``ZR_CPU_TRANSPORT`` is refused before any process starts."""
from __future__ import annotations

import os

import pytest
import torch
from hydra import compose, initialize_config_dir

from zero_repro.lab import cli
from zero_repro import schema
from zero_repro.runtime.comm import launch
from zero_repro.runtime.comm.cpu import shm
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.comm.transport import bucket_transport


def _build(rank: int, world: int, seg_dir: str, elsewhere: bool = False) -> dict:
    if seg_dir:
        shm.SHM_DIR = seg_dir  # where the segments are made (nameless: nothing shows there)
    if rank == 1 and elsewhere:  # this rank is on another node
        shm.host_identity = lambda: ("another boot", "another host", 0, 0)
    topo = Topology.build(tp=1)
    try:
        t = bucket_transport(topo.dp_group)
    except ValueError as e:
        return {"error": str(e)}
    left = sorted(f for f in os.listdir(shm.SHM_DIR) if f.startswith("zr-"))
    x = torch.full((8,), float(rank + 1))
    t.all_reduce(x).wait()
    return {"kind": type(t).__name__, "left": left, "sum": x.tolist()}


def _scenarios(rank: int, world: int, scenarios: list[tuple]) -> list[dict]:
    """``_build`` for each (ZR_CPU_TRANSPORT or None for unset, seg_dir, elsewhere) in turn on
    the same ranks, each on groups of its own (``Topology.build``); what ``_build`` patches
    (``shm.SHM_DIR``, ``shm.host_identity``) is put back after each, so every scenario starts
    as a fresh rank would."""
    out = []
    for mode, seg_dir, elsewhere in scenarios:
        if mode is None:
            os.environ.pop("ZR_CPU_TRANSPORT", None)
        else:
            os.environ["ZR_CPU_TRANSPORT"] = mode
        saved = shm.SHM_DIR, shm.host_identity
        try:
            out.append(_build(rank, world, seg_dir, elsewhere))
        finally:
            shm.SHM_DIR, shm.host_identity = saved
    return out


@pytest.fixture(scope="module")
def set_ups(tmp_path_factory) -> dict:
    """The three tests below on one pair of ranks (one spawn, not four). By scenario: the
    ranks' results, and for the one-host scenario the ``zr-`` files in ``/dev/shm`` before;
    the segment directories of the two scenarios with a rank on "another host"."""
    before = {f for f in os.listdir(shm.SHM_DIR) if f.startswith("zr-")}
    auto_dir, shm_dir = tmp_path_factory.mktemp("auto_elsewhere"), tmp_path_factory.mktemp(
        "shm_elsewhere")
    names = ["one_host", "elsewhere_auto", "elsewhere_shm", "pairwise"]
    scenarios = [(None, "", False), ("auto", str(auto_dir), True), ("shm", str(shm_dir), True),
                 ("pairwise", "", False)]
    res = spawn(_scenarios, 2, scenarios)
    return {"before": before, "auto_dir": auto_dir,
            **{name: [r[i] for r in res] for i, name in enumerate(names)}}


def test_one_host_shares_memory_and_leaves_no_files(set_ups):
    before = set_ups["before"]
    for r in set_ups["one_host"]:
        assert r["kind"] == "ShmTransport"
        assert set(r["left"]) <= before  # every segment unlinked once mapped
        assert r["sum"] == [3.0] * 8
    assert {f for f in os.listdir(shm.SHM_DIR) if f.startswith("zr-")} <= before


def test_ranks_that_cannot_see_each_other_fall_back_or_fail(set_ups):
    res = set_ups["elsewhere_auto"]  # ZR_CPU_TRANSPORT=auto
    assert [r["kind"] for r in res] == ["PairwiseTransport"] * 2
    assert all(r["sum"] == [3.0] * 8 for r in res)
    assert not os.listdir(set_ups["auto_dir"])  # no segment of either rank is left
    for r in set_ups["elsewhere_shm"]:  # ZR_CPU_TRANSPORT=shm
        assert r["error"].startswith("ZR_CPU_TRANSPORT=shm but group 'dp' cannot share memory"), r
        assert "another host" in r["error"] and "unset it to use gloo" in r["error"]


def test_pairwise_mode_never_maps_segments(set_ups):
    assert [r["kind"] for r in set_ups["pairwise"]] == ["PairwiseTransport"] * 2


def test_a_bad_mode_is_one_error_before_anything_starts(monkeypatch, tmp_path):
    monkeypatch.setenv("ZR_CPU_TRANSPORT", "nccl")
    with pytest.raises(ValueError,
                       match="ZR_CPU_TRANSPORT='nccl': use one of auto, shm, pairwise, native"):
        shm.mode()

    def refuse(*a, **k):
        raise AssertionError("a process was started for a bad input")

    monkeypatch.setattr(launch, "spawn", refuse)
    schema.register_configs()
    with initialize_config_dir(config_dir=cli.conf_dir(), version_base="1.3"):
        d = compose("config", overrides=["+exp=smoke",
                                          f"experiment.results_dir={tmp_path / 'r'}"])
    with pytest.raises((cli.UserError, ValueError), match="ZR_CPU_TRANSPORT='nccl'"):
        cli.prepare(d)
    assert not (tmp_path / "r").exists()
