"""Every figure's result lines (its experiment's ``conclude(table)``) on the committed tables: a
few short lines that hold the numbers the table holds (rounded as printed), say simulated /
measured / paper as the table's ``kind`` does, and still conclude when the paper's rows and
columns are gone. Reads ``results/<name>/table.csv`` only: no training, no dry run."""
from __future__ import annotations

import importlib
import logging
import math

import pandas as pd
import pytest

from zero_repro import paths
from zero_repro.lab import cli
from zero_repro.lab.figures.wording import mean_max, num, pct

NAMES = ("fig2_throughput", "fig4_dp_only", "fig6_max_model", "fig7_cached_memory",
         "fig8_configs", "table2_max_model", "prediction_memory", "memory_breakdown")
PAPER_COLUMNS = ("paper_series", "paper_value", "rel_error_vs_paper", "paper_printed",
                 "paper_B", "rel_error_vs_paper_printed")


def committed(name: str) -> pd.DataFrame:
    return pd.read_csv(paths.RESULTS_DIR / name / "table.csv")


def lines_of(name: str, table: pd.DataFrame | None = None) -> list[str]:
    mod = importlib.import_module(f"experiments.{name}")
    return mod.conclude(committed(name) if table is None else table)


def line_with(lines: list[str], start: str) -> str:
    found = [ln for ln in lines if ln.startswith(start)]
    assert len(found) == 1, (start, lines)
    return found[0]


@pytest.mark.parametrize("name", NAMES)
def test_a_few_short_lines_the_cli_prints_as_they_are(name):
    lines = lines_of(name)
    assert 2 <= len(lines) <= 7, lines
    assert all(isinstance(ln, str) and ln.strip() and len(ln) <= 120 for ln in lines), lines
    assert all("nan" not in ln.lower().split() for ln in lines), lines
    # the CLI prints the experiment's own lines, not the generic fallback
    assert cli.conclusion(importlib.import_module(f"experiments.{name}"), committed(name)) == lines


@pytest.mark.parametrize("name", NAMES)
def test_concludes_without_the_papers_rows_and_columns(name):
    t = committed(name)
    t = t[t["kind"] != "paper"].drop(columns=[c for c in PAPER_COLUMNS if c in t])
    lines = lines_of(name, t)
    assert lines and all(0 < len(ln) <= 120 for ln in lines), lines
    assert not any(ln.startswith(("paper ", "paper(")) for ln in lines), lines


def test_fig6_per_stack_sizes_and_signed_errors_beside_the_papers():
    t = committed("fig6_max_model")
    lines = lines_of("fig6_max_model")
    sizes = t[(t["figure"] == "fig6") & (t["y_name"] == "max_model_size")]
    paper = sizes[sizes["kind"] == "paper"].sort_values("x_value")
    assert list(paper["x_value"]) == ["C1", "C2", "C3", "C4", "C5"]
    assert line_with(lines, "paper (measured").endswith(", ".join(
        f"{c} {v:g}" for c, v in zip(paper["x_value"], paper["y_value"])))
    for stack in ("paper2020", "modern"):
        mine = sizes[sizes["stack"] == stack].sort_values("x_value")
        assert len(mine) == 5
        expected = ", ".join(f"{r.x_value} {r.y_value:g} {100 * r.rel_error_vs_paper:+.0f}%"
                             for r in mine.itertuples())
        assert line_with(lines, f"simulated, {stack} [B]: ") == (
            f"simulated, {stack} [B]: {expected}")
    from experiments.fig6_max_model import paper_order
    order = line_with(lines, f"the paper's ascending order {' < '.join(paper_order())}")
    assert order.count("reproduces it") == int(
        (t.loc[t["figure"] == "fig6_order", "y_value"] == 1.0).sum())
    # a stack that orders the five differently says so, with its order
    flipped = t.copy()
    i = flipped.index[(flipped["figure"] == "fig6_order") & (flipped["stack"] == "modern")]
    flipped.loc[i, ["x_value", "y_value"]] = ["C3 < C1 < C2 < C4 < C5", 0.0]
    assert "modern DIFFERS (C3 < C1 < C2 < C4 < C5)" in lines_of("fig6_max_model", flipped)[-1]


def test_fig2_sizes_speedups_against_the_paper_and_fitted_errors_apart():
    import experiments.fig2_throughput as fig2

    t = committed("fig2_throughput")
    lines = lines_of("fig2_throughput")
    sim = t[t["kind"] == "simulated"]
    zero = sim[sim["series"] == fig2.ZERO].assign(x=lambda d: d["x_value"].astype(float))
    zero = zero.sort_values("x")
    assert lines[0].endswith("model sizes [B]: " + " ".join(num(x) for x in zero["x"]))
    paper = t[(t["kind"] == "paper") & (t["series"] == fig2.ZERO)]
    assert line_with(lines, "ZeRO TFLOPs/GPU ") == (
        "ZeRO TFLOPs/GPU " + " ".join(num(y) for y in zero["y_value"]) + ", paper "
        + " ".join(num(y) for y in paper.sort_values("x_value", key=lambda s: s.astype(float))
                   ["y_value"]))
    up = sim[sim["series"] == fig2.SPEEDUP].assign(x=lambda d: d["x_value"].astype(float))
    speed = line_with(lines, "speed-up ")
    assert speed.startswith("speed-up " + " ".join(num(y) for y in up.sort_values("x")["y_value"]))
    assert speed.endswith(" ".join(num(v) for v in up.sort_values("x")["paper_value"]))
    # the fitted series (ZeRO at the paper's batch, in-sample) apart from the unfitted ones,
    # with the numbers the figure's title prints (error_lines)
    err = line_with(lines, "|error| mean/max: ")
    fitted = sim.loc[sim["series"] == fig2.ZERO + " (paper batch)", "rel_error_vs_paper"]
    assert f"fitted (ZeRO, paper's batch) {mean_max(fitted)};" in err
    title = fig2.error_lines(t)[0]
    e = fitted.abs()
    assert f"mean |err| {100 * e.mean():.0f}%, max {100 * e.max():.0f}%" in title
    assert f"unfitted: ZeRO {mean_max(zero['rel_error_vs_paper'])}," in err
    local = line_with(lines, "measured (local, 2 CPU ranks)")
    meas = t[(t["kind"] == "measured") & (t["y_name"] == "speedup")]
    assert len(meas) == 3 and all(num(y) in local for y in meas["y_value"])


def test_fig4_and_fig8_say_withheld_and_hold_each_value_with_its_batch():
    t4 = committed("fig4_dp_only")
    lines = lines_of("fig4_dp_only")
    assert "paper values withheld" in lines[0] and not any("paper " in ln.split("(")[0]
                                                          for ln in lines)
    zero = t4[t4["series"] == "ZeRO-DP (P_os+g)"].sort_values(
        "x_value", key=lambda x: x.astype(float))
    assert line_with(lines, "ZeRO-DP (P_os+g) TFLOPs/GPU").endswith(
        " ".join(num(y) for y in zero["y_value"]))
    assert f"ZeRO-DP {num(zero['x_value'].astype(float).max())}B vs baseline 1.38B" in lines[0]
    assert "ZeRO-DP " + " ".join(num(b) for b in zero["batch_per_gpu"]) in line_with(
        lines, "their batch per GPU")
    local = line_with(lines, "measured (local gpt_20m shape")
    assert "20.8M" in local and "25.5M" in local  # the deeper model ZeRO-DP fits the budget

    t8 = committed("fig8_configs")
    lines = lines_of("fig8_configs")
    assert lines[0].startswith("simulated,") and "paper values withheld" in lines[0]
    fit = t8[t8["series"] == "60B (128 GPUs, MP 16)"].sort_values("x_value")
    assert line_with(lines, "60B (128 GPUs, MP 16), largest batch that fits: ").endswith(
        ", ".join(f"{c} {num(y)} b{int(b)}"
                  for c, y, b in zip(fit["x_value"], fit["y_value"], fit["batch_per_gpu"])))
    assert sum(ln.count("(in-sample)") for ln in lines) == int(t8["in_sample"].notna().sum()) == 1
    big = t8[t8["in_sample"].notna()]  # Table 9's 170B run at its batch: Fig 2's fitted point
    assert len(big) == 1 and big["series"].iloc[0].startswith("170B")
    assert line_with(lines, "170B (400 GPUs, MP 16), Table 9's batch").endswith(
        f"C5 {num(big['y_value'].iloc[0])} b12 (in-sample)")


def test_fig7_cached_memory_per_config_and_an_out_of_memory_verdict():
    t = committed("fig7_cached_memory")
    lines = lines_of("fig7_cached_memory")
    assert "paper values withheld" in lines[0] and lines[0].startswith("simulated")
    cached = t[(t["figure"] == "fig7") & (t["y_name"] == "max_cached_memory")]
    for series, g in cached.groupby("series", sort=False):
        g = g.sort_values("x_value")
        assert line_with(lines, f"{series}: ").startswith(f"{series}: " + ", ".join(
            f"{c} {num(y, 4)}" for c, y in zip(g["x_value"], g["y_value"])))
    assert all(ln.endswith("all fit)") for ln in lines[1:-1])
    claims = line_with(lines, "C4->C5 [GiB]")
    assert "paper2020 40B 0, 100B 0; modern 40B -0.781, 100B -3.906" in claims
    oom = t.copy()
    oom.loc[(oom["series"] == "40B, modern") & (oom["x_value"] == "C1"), "oom_judged"] = True
    assert line_with(lines_of("fig7_cached_memory", oom), "40B, modern: ").endswith(
        "(capacity 31.748; OUT OF MEMORY: C1)")


def test_table2_per_mp_degree_against_the_papers_measured_and_printed():
    t = committed("table2_max_model")
    lines = lines_of("table2_max_model")
    assert lines[0] == "largest model [B params] at N_d 64, MP 1 2 4 8 16 (GPUs = 64 x MP)"
    sim = t[t["kind"] == "simulated"]
    base = sim[(sim["stack"] == "paper2020") & sim["series"].str.contains("Baseline")]
    pos = sim[(sim["stack"] == "paper2020") & sim["series"].str.contains("Pos")]
    assert line_with(lines, "paper (measured): ") == (
        "paper (measured): Baseline " + " ".join(num(v) for v in base["paper_B"])
        + ", Pos " + " ".join(num(v) for v in pos["paper_B"]))
    e = pos["rel_error_vs_paper_printed"]
    assert line_with(lines, "simulated, paper2020: ").endswith(
        "Pos " + " ".join(num(v) for v in pos["y_value"])
        + f" ({pct(e.min())[:-1]}..{pct(e.max())})")
    th = t[t["kind"] == "analytic"]
    assert line_with(lines, "analytic: ").endswith(
        f"<= {100 * th['rel_error_vs_paper_printed'].abs().max():.1f}%")


def test_prediction_memory_counts_what_fits_and_names_the_tightest():
    t = committed("prediction_memory")
    lines = lines_of("prediction_memory")
    for stack in ("paper2020", "modern"):
        g = t[t["stack"] == stack]
        n = int(g["fits_judged"].sum())
        assert line_with(lines, f"{stack}: ").startswith(f"{stack}: {n} of {len(g)} fit at ")
        tight = g.loc[(g["capacity_GiB"] - g["needs_GiB"]).idxmin()]
        assert line_with(lines, f"{stack}: ").endswith(f"needs {num(tight['needs_GiB'], 4)}")
        for fig, h in g.groupby("paper_figure"):
            assert f"{fig} {num(h['needs_GiB'].min())}..{num(h['needs_GiB'].max())}" in \
                line_with(lines, f"{stack}, needs per figure")
    worse = t.copy()
    worse.loc[worse.index[0], "fits_judged"] = False
    assert line_with(lines_of("prediction_memory", worse), "paper2020: ").startswith(
        "paper2020: 43 of 44 fit")


def test_memory_breakdown_largest_categories_add_up_to_the_peak():
    t = committed("memory_breakdown")
    lines = lines_of("memory_breakdown")
    mod = importlib.import_module("experiments.memory_breakdown")
    peaks = t[(t["x_value"] == "peak_reserved (max cached)")
              & t["series"].str.rpartition(", ")[0].isin(mod.MECHANISM_AT)]
    assert len(peaks) == 2 * len(mod.MECHANISM_AT) == 4  # the paper's runs x both stacks
    for r in peaks.itertuples():
        line = line_with(lines, f"{r.series} {num(r.y_value)}: ")
        parts = [p.rsplit(" ", 1) for p in line.split(": ", 1)[1].split(", ")]
        assert 4 <= len(parts) <= 5
        # 3 significant digits each: off by at most half a unit of the last digit printed
        slack = sum(0.5 * 10 ** (math.floor(math.log10(float(v))) - 2) for _, v in parts)
        assert math.isclose(sum(float(v) for _, v in parts), r.y_value, abs_tol=slack), line
    sw = line_with(lines, "switches, 40B C4, alone [GiB]: ")
    switches = t[t["figure"] == "memory_breakdown_switches"]
    top = switches.loc[switches["y_value"].astype(float).idxmax()]
    assert top["x_value"] == "build_sequence"  # the whole-model build costs the most alone
    assert sw.startswith(f"switches, 40B C4, alone [GiB]: build_sequence {float(top['y_value']):+.3g}, ")
    # the mechanisms line: the two that move the capacity needed most, per paper run
    needs = t[(t["figure"] == "memory_breakdown_mechanisms") & (t["y_name"] == "needs_change")]
    mech = line_with(lines, "mechanisms, needs [GiB]: ")
    for setup in mod.MECHANISM_AT:
        g = needs[needs["setup"] == setup]
        x = g.loc[g["y_value"].astype(float).abs().idxmax()]
        assert f"{setup} {mod.SHORT.get(x['x_value'].split('=')[0], x['x_value'])} " \
               f"{float(x['y_value']):+.2f}" in mech, mech


def test_the_calibration_log_line_is_rounded(monkeypatch, caplog):
    """The fit's log line gives e_max and comm_eff at 4 significant digits, not raw floats."""
    from zero_repro.scale import calibrate as C

    raw = (0.42651112485706427, 0.4155882517192398)
    monkeypatch.setattr(C, "nelder_mead", lambda f, x0, step=0.3: (
        [math.log(v) for v in raw], 0.15151234567))
    with caplog.at_level(logging.INFO, logger=C.__name__):
        cal = C.fit()
    assert (cal.params.e_max, cal.params.comm_eff) == pytest.approx(raw)
    text = caplog.text
    assert "e_max 0.4265" in text and "comm_eff 0.4156" in text and "objective 0.1515" in text
    assert "0.426511" not in text and "PerfParams(" not in text
