"""The dry run written as a PyTorch memory snapshot (``scale.dryrun.snapshot``): torch's own
``_memory_viz`` reads it, and what it says equals the dry run's replay to the byte."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from torch.cuda import _memory_viz as MV

from tests.unit.test_dryrun import PAPER_BUCKETS, _world4_cfg, paper_cfg, tiny_cfg
from zero_repro import config as C
from zero_repro.runtime.comm.launch import spawn
from zero_repro.scale.dryrun import snapshot as SN
from zero_repro.scale.dryrun.dryrun import apply_overrides, dry_run
from zero_repro.scale.dryrun.real_run import real_snapshots
from zero_repro.scale.dryrun.trace import live_peaks
from zero_repro.scale.paper.overrides import paper_overrides


def _viewer_reads(snap: dict) -> None:
    """Every reader of ``torch.cuda._memory_viz`` takes it (the HTML ones embed it)."""
    assert "snapshot.pickle" in MV.trace_plot(snap)
    assert "Allocator State History" in MV.segment_plot(snap)
    assert "Summary of segments" in MV.segsum(snap)
    assert "cudaMalloc" in MV.trace(snap)
    # the flame-graph readers, their lines kept (rendering them fetches flamegraph.pl)
    assert MV.segments(snap, format_flamegraph=lambda lines: lines)
    assert MV.memory(snap, format_flamegraph=lambda lines: lines)


def _blocks_tile_segments(snap: dict) -> None:
    for seg in snap["segments"]:
        addr = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == addr
            addr += b["size"]
        assert addr == seg["address"] + seg["total_size"]


@pytest.mark.parametrize("args", [(4, 2, 2, "c4"), (4, 1, 3, "off")])
def test_snapshot_equals_the_replay_to_the_byte(args, tmp_path):
    """Stage 2 TP 2 with C_B/M_D, stage 3: the snapshot's live peak is the dry run's live peak,
    its segment peak and end-state segments the judged replay's reserved peak; it loads back
    and every viewer of torch's reads it."""
    r = dry_run(tiny_cfg(*args))
    w = SN.write_result(r, tmp_path / "s.pickle")
    snap = SN.load(tmp_path / "s.pickle")
    st = SN.stats(snap)
    assert st == {k: w[k] for k in st}
    assert st["live_peak"] == r.live_peak == max(r.live_peak_by_iteration.values())
    assert st["reserved_peak"] == st["segments_total"] == r.allocator["peak_reserved"]
    assert st["actions"]["alloc"] == st["actions"]["free_requested"] + len(
        [b for s in snap["segments"] for b in s["blocks"] if b["state"] != "inactive"])
    assert st["requested_end"] == st["live_end"]
    _blocks_tile_segments(snap)
    _viewer_reads(snap)


def test_frames_name_module_and_category():
    """A block's frame names the module that made the storage and its category; a stage-3
    unit's flat buffer, gathered again and again, is a gather; recomputed activations name
    their module."""
    r = dry_run(tiny_cfg(4, 1, 3, "c4"))
    snap = SN.from_result(r)
    names = {e["frames"][0]["name"] for e in snap["device_traces"][0] if e["action"] == "alloc"}
    cats = {e["category"] for e in snap["device_traces"][0]}
    assert {"fp16 parameters", "fp32 master + Adam", "activation checkpoint", "working layer",
            "ZeRO stage 3 gather", "unknown"} <= cats
    assert any(n.startswith("blocks.0.") and n.endswith("(working layer)") for n in names)
    recomputed = {e["frames"][0]["name"] for e in snap["device_traces"][0]
                  if e["action"] == "alloc" and "backward" in e["frames"][0]["filename"]}
    assert any(n.startswith("blocks.") for n in recomputed)


def test_a_capacity_shows_the_release_and_the_oom():
    """Under a capacity the replay releases cached segments before it runs out (segment_free)
    and records the OOM; the segment peak is still the replay's, the end state its end."""
    r = dry_run(tiny_cfg(4, 1, 3, "off"), allocator_capacity=60e6)
    assert r.allocator["oom"] and r.allocator["n_releases"]
    snap = SN.from_result(r)
    st = SN.stats(snap)
    assert st["actions"]["oom"] >= 1 and st["actions"]["segment_free"] == r.allocator[
        "n_releases"]
    assert st["reserved_peak"] == r.allocator["peak_reserved"]
    assert st["segments_total"] == r.allocator["reserved_end"]
    assert st["live_peak"] == r.live_peak
    _viewer_reads(snap)


def test_stream_held_blocks_are_pending_free_until_the_sync():
    """A free the stream still holds (PyTorch 1.x recordStream) is free_requested at once and
    free_completed only at the sync; a snapshot taken before the sync shows the block
    active_pending_free."""
    ev = [("alloc", 0, 4096, "forward", 0), ("alloc", 1, 4096, "forward", 0),
          ("free_held", 0, 4096, "backward", 0)]
    snap = SN.from_events(ev, {0: "buckets", 1: "checkpoints"})
    states = [b["state"] for s in snap["segments"] for b in s["blocks"]]
    assert states == ["active_pending_free", "active_allocated", "inactive"]
    assert [e["action"] for e in snap["device_traces"][0]] == [
        "segment_alloc", "alloc", "alloc", "free_requested"]
    snap = SN.from_events(ev + [("sync", -1, 0, "backward", 0)], {0: "buckets"})
    acts = [e["action"] for e in snap["device_traces"][0]]
    assert acts[-2:] == ["free_requested", "free_completed"]
    assert SN.stats(snap)["live_peak"] == 8192
    _viewer_reads(snap)


def test_the_2020_stack_holds_blocks_for_the_collectives_stream():
    """paper2020 (recordStream on the NCCL stream): held blocks appear as free_requested
    whose free_completed comes later; the replay is the one judged, build included."""
    cfg = apply_overrides(paper_cfg(2, "c2", stage=2), {"simulate.stack": "paper2020"})
    r = dry_run(cfg)
    assert r.judged_with_build and r.allocator["peak_held"] > 0
    snap = SN.from_result(r)
    st = SN.stats(snap)
    assert st["live_peak"] == r.live_peak
    assert st["reserved_peak"] == r.allocator["peak_reserved"]
    trace = snap["device_traces"][0]
    late = sum(1 for a, b in zip(trace, trace[1:])
               if a["action"] == "free_requested" and b["action"] != "free_completed")
    assert late > 0


@pytest.mark.slow
def test_1t_stage3_on_1024_gpus_snapshot(tmp_path):
    """1T (128 x 25600, 160 heads), 1024 GPUs (MP 16 x N_d 64), stage 3 + C4: the snapshot is
    exact and under 200 MB (its write time: results/memory_snapshot/notes.md)."""
    ov = paper_overrides(128, 25600, 160, 1024, 16, 1, "c4")
    ov["zero.stage"] = 3
    r = dry_run(apply_overrides(C.Config(), {**ov, **PAPER_BUCKETS}))
    w = SN.write_result(r, tmp_path / "1t.pickle")
    assert w["bytes"] < 200e6
    assert w["live_peak"] == r.live_peak
    assert w["reserved_peak"] == w["segments_total"] == r.allocator["peak_reserved"]
    assert live_peaks(SN.steady_events(r))[0] == w["live_peak"]


@pytest.mark.parametrize("name", ["wide-s3-tp2-c4"])
def test_dry_run_snapshot_agrees_with_a_real_cpu_runs(monkeypatch, name):
    """The same small model (stage 3, a vocabulary read in row slices, TP 2 + P_a/C_B/M_D) at
    world 4: the snapshot of a real gloo run (real tensors, every storage polled, measured)
    and the dry run's agree on the live peak and on the live bytes per category at it, within
    the dry run's stated tolerance (64 B, ``test_dryrun``); the same module names appear."""
    monkeypatch.setenv("ZR_CPU_TRANSPORT", "pairwise")  # gloo: peers' segments are not ours
    cfg = _world4_cfg(name)
    (real,) = spawn(real_snapshots, 4, [OmegaConf.to_container(OmegaConf.structured(cfg))])[0]
    dry = SN.from_result(dry_run(cfg, transport_of=real["dry_run"]["transport"]))
    (peak_d, cats_d), (peak_r, cats_r) = SN.peak_categories(dry), SN.peak_categories(real)
    assert abs(peak_d - peak_r) <= 64
    assert set(cats_d) == set(cats_r)
    for cat, nbytes in cats_r.items():
        assert abs(cats_d[cat] - nbytes) <= 64, (cat, cats_d[cat], nbytes)

    def names(snap):
        return {e["frames"][0]["name"] for e in snap["device_traces"][0] if e["frames"]}
    assert names(dry) == names(real)
    MV.trace_plot(real)
