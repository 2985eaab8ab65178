"""One trace, several judged stacks (scale/dryrun/twin.py): the bracket's least-memory end
judged from paper2020's trace equals its own dry run; the 2020 build traced without polling."""
from __future__ import annotations

import pytest

from zero_repro import config as C
from zero_repro.scale.dryrun import dryrun as D
from zero_repro.scale.dryrun import maxsize, twin
from zero_repro.scale.paper.setups import setups


def fig6_cfg(zc: str, stack: str, n_layer: int, point: str = "mid") -> C.Config:
    s = next(s for s in setups("fig6") if s.zero_config == zc)
    return D.apply_overrides(C.Config(), {**D.setup_overrides(s, "dgx2_v100"),
                                          "simulate.stack": stack,
                                          "simulate.outside_point": point,
                                          "model.n_layer": n_layer})


def test_only_the_stream_switch_makes_a_twin():
    assert twin.twin_stack(twin.S.get("paper2020_least")) == "paper2020"
    for name in ("paper2020", "paper2020_most", "modern"):
        assert twin.twin_stack(twin.S.get(name)) is None  # after_sync, or another program
    least = fig6_cfg("C1", "paper2020_least", 3, "low")
    src = twin.trace_config(least)
    assert (src.simulate.stack, src.simulate.outside_point) == ("paper2020", "mid")
    assert twin.trace_config(fig6_cfg("C1", "paper2020_most", 3)).simulate.stack == \
        "paper2020_most"


@pytest.mark.parametrize("zc", ["C1", "C4"])
def test_least_end_judged_from_paper2020s_trace_equals_its_own_dry_run(zc):
    least = fig6_cfg(zc, "paper2020_least", 3, "low")
    own = D.dry_run(least, details=False)
    src = D.dry_run(twin.trace_config(least), details=False)
    assert any(e[0] == "free_held" for e in src.trace)  # the twin's labels differ
    got = twin.rejudge(src, least)
    assert got.trace == own.trace and got.capacity == own.capacity
    assert got.allocator == own.allocator
    for f in ("live_peak", "live_peak_by_phase", "live_peak_by_iteration", "live_peak_steady",
              "n_events", "stack", "config", "ledger", "psi_padded"):
        assert getattr(got, f) == getattr(own, f), f
    assert got.min_capacity() == own.min_capacity()
    assert twin.rejudge(src, twin.trace_config(least)) is src


def test_the_2020_build_traces_the_same_without_polling(monkeypatch):
    cfg = fig6_cfg("C4", "paper2020", 3)
    fast = D.dry_run(cfg, details=False)
    monkeypatch.setattr(D, "_build_polling", lambda tracer, *a: tracer.polling_all())
    assert D.dry_run(cfg, details=False).trace == fast.trace


def test_a_judge_of_the_least_end_reuses_paper2020s_dry_runs():
    mid = maxsize.DryRunJudge(fig6_cfg("C1", "paper2020", 3), 30e9)
    mid(3)
    least_cfg = fig6_cfg("C1", "paper2020_least", 3, "low")
    least = maxsize.DryRunJudge(least_cfg, maxsize.capacity_of(least_cfg, "low"))
    runs = least.n_runs
    least(3)
    assert least.n_runs == runs  # no dry run of its own
    assert least.run(3).stack == "paper2020_least"
