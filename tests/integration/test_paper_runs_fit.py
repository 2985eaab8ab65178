"""The gate from the paper's own runs: every setup the paper reports running (Figures 2 and 3,
Figure 4's Table 10, Figure 6's C1-C5 at Table 7's depths, Figure 8's Table 9 in Table 7's row
order) must fit a V100-32GB under the paper2020 stack at its paper batch.

What is judged: the allocator capacity each run needs (``DryRunResult.min_capacity``: the judged
replay, to the allocator's steady state, does not run out of memory), as committed in
results/prediction_memory/table.csv by ``python run.py +exp=prediction_memory``, against the
capacity the code gives today: the device as it reports itself (``scale.hardware``) less the
sourced bracket of bytes outside the allocator (``dryrun.stack.outside``) at its stated point and
at its high end (the whole bracket). A change to the capacity model, or a re-run whose needs
grow, fails here; the slow test re-runs the tightest runs' dry runs and checks the committed
needs. A run that cannot fit with no modelling error found goes to ``KNOWN`` with the reason.
"""
from __future__ import annotations

import csv

import pytest

from zero_repro.paths import RESULTS_DIR
from zero_repro.scale.dryrun.stack import switches as S
from zero_repro.scale.hardware import device_bytes, load_cluster
from zero_repro.scale.paper import table9
from zero_repro.scale.paper.setups import setups

GIB = 2**30
TABLE = RESULTS_DIR / "prediction_memory" / "table.csv"
# (figure, setup label as the table writes it) -> why it cannot fit; none today
KNOWN: dict[tuple[str, str], str] = {}


def _reported_runs() -> list[tuple[str, str, int]]:
    runs = []
    for fig in ("fig2", "fig3", "fig4", "fig6"):
        runs += [(fig, f"{s.point} {s.series}", s.batch_per_gpu) for s in setups(fig)]
    runs += [("fig8", f"{s.point} {s.series}", s.batch_per_gpu)
             for s in table9.remap(setups("fig8"), table9.DEFAULT_ORDER)]
    return runs


RUNS = _reported_runs()


def _table() -> dict[tuple[str, str, int], dict]:
    with open(TABLE, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["stack"] == "paper2020"]
    return {(r["paper_figure"], r["x_value"], int(r["batch_per_gpu"])): r for r in rows}


def _capacity(point: str) -> float:
    return S.paper2020().capacity_bytes(device_bytes(load_cluster("dgx2_v100")), point)


def test_the_device_is_what_it_reports():
    c = load_cluster("dgx2_v100")
    assert device_bytes(c) == 32510 * 2**20  # nvidia-smi total of a V100-SXM3-32GB
    assert c.device_memory_gb * 1e9 == 32e9  # the datasheet figure, closed-form tables only
    lo, hi = S.paper2020().outside_bracket()
    assert 0.3 * GIB < lo < hi < 2.5 * GIB


def test_every_reported_run_is_judged():
    table = _table()
    assert len(RUNS) == 44  # 18 + 4 + 11 + 5 + 6
    missing = [r for r in RUNS if r not in table]
    assert not missing, f"not in {TABLE.name}: {missing} (re-run +exp=prediction_memory)"


@pytest.mark.parametrize("run", RUNS, ids=[f"{f} {p} b{b}" for f, p, b in RUNS])
def test_reported_run_fits_paper2020_at_the_real_capacity(run):
    row = _table()[run]
    if run[:2] in KNOWN:
        pytest.xfail(KNOWN[run[:2]])
    needs = float(row["needs_GiB"]) * GIB
    for point in (S.DEFAULT_POINT, "high"):
        cap = _capacity(point)
        assert needs <= cap, (f"{run}: needs {needs / GIB:.2f} GiB, the paper2020 allocator has "
                              f"{cap / GIB:.2f} GiB with the outside bytes at the {point} end")


@pytest.mark.slow
@pytest.mark.parametrize("fig,label", [("fig8", "60B C2 ZeRO"), ("fig8", "170B C5 ZeRO"),
                                       ("fig4", "12B ZeRO"), ("fig4", "13B ZeRO"),
                                       ("fig8", "60B C1 ZeRO")])
def test_committed_needs_are_what_the_dry_run_says(fig, label):
    """The five runs the 29.8 GiB judge called OOM, re-run: the committed needs hold."""
    from zero_repro import config as C
    from zero_repro.lab.throughput import batch as TB
    from zero_repro.lab.throughput import setups as TN
    from zero_repro.lab.throughput import simulate as TSim
    from zero_repro.scale.dryrun.dryrun import apply_overrides, dry_run
    from zero_repro.scale.hardware import Hardware
    from zero_repro.scale.paper.clusters import DRYRUN_FIELDS, cluster_overrides

    s = next(s for s in TN.figure_setups(fig, {}) if f"{s.point} {s.series}" == label)
    zc = TSim.zero_config_of(s, Hardware.from_config(load_cluster("dgx2_v100")))
    ov = {**TB.paper_point_overrides(s, zc, s.batch_per_gpu, dict(TN.DEFAULTS), "fp16"),
          **cluster_overrides("dgx2_v100", DRYRUN_FIELDS), "simulate.stack": "paper2020"}
    r = dry_run(apply_overrides(C.Config(), ov))
    row = _table()[(fig, label, s.batch_per_gpu)]
    assert abs(r.min_capacity() / GIB - float(row["needs_GiB"])) < 0.01


def test_outside_bracket_is_its_sourced_parts():
    from zero_repro.scale.dryrun.stack import outside as O

    assert O.NCCL_CONNECTION_BYTES == 4 * 2**20 + 256 * 2**10 + 4096  # NCCL 2.4.8 ncclRecvMem
    parts = {p.name: p for p in O.PAPER2020}
    assert set(parts) == {"cuda_context", "nccl_buffers"}
    assert (parts["cuda_context"].low, parts["cuda_context"].high) == (300 * 2**20, 1005 * 2**20)
    assert (O.NCCL_LOW, O.NCCL_HIGH) == (18, 300)
    lo, hi = O.bracket("paper2020")
    assert (lo, hi) == (sum(p.low for p in O.PAPER2020), sum(p.high for p in O.PAPER2020))
    assert O.at("paper2020", "mid") == (lo + hi) // 2 and O.bracket("none") == (0, 0)
    for bad in (lambda: O.at("paper2020", "middle"), lambda: O.bracket("paper2019")):
        with pytest.raises(ValueError):
            bad()


def test_fig6_flip_band_reads_the_judged_depths():
    from experiments.fig6_max_model import flip_band

    j = [{"n_layer": n, "fits": f} for n, f in ((50, True), (54, False), (55, True),
                                                 (59, True), (60, False), (61, False))]
    # the increasing sweep stops at 54 (answer 53); 55-59 fit again
    assert flip_band(j, 53, 59) == (54, 59)
    assert flip_band(j, 53) == (54, 59)  # the largest fit read from the judgements
    assert flip_band(j[:1] + j[-2:], 50) == (50, 50)  # monotone: no band
