"""The smoke figure says which curves coincide and numbers steps as the log does."""
from experiments.smoke import _distinct, coinciding, summarize
from zero_repro.lab.records import Record


def test_coinciding_groups_only_curves_equal_at_every_common_step():
    curves = {"a": {1: 6.0, 2: 5.5}, "b": {1: 6.0, 2: 5.5 + 5e-7}, "c": {1: 6.0, 2: 5.4}}
    assert coinciding(curves) == [["a", "b"]]
    assert coinciding({"a": {1: 6.0}, "c": {1: 6.1}}) == []


def test_distinct_keeps_the_differing_words_and_their_label():
    assert _distinct(["GPT 2x64 fp32 stage 3 w2 8 steps", "GPT 2x64 fp32 stage 0 w2 8 steps"]) \
        == ["stage 3", "stage 0"]


def test_summary_steps_start_at_one_and_name_the_data():
    r = Record(key="k", experiment="smoke", point="p", params={}, mode="measured", status="ok",
               metrics={"losses": [6.1, 5.9]},
               config={"model": {"n_layer": 2, "n_embd": 64, "n_head": 4, "seq_len": 64},
                       "zero": {"dtype": "fp32", "stage": 0}, "parallel": {"world_size": 2},
                       "train": {"steps": 2, "data": "synthetic"}})
    rows = summarize([r])
    assert [row["x_value"] for row in rows] == [1, 2]
    assert rows[0]["series"].endswith("synthetic data")


def test_a_long_run_gets_a_readable_axis_not_a_tick_per_step(monkeypatch):
    """A tick and a marker per step suit a few steps; 5000 of them made the figure unreadable
    and took matplotlib ~40 s to lay out (the Slurm signal test trains thousands of steps)."""
    import pandas as pd

    import experiments.smoke as smoke

    drawn = {}

    def keep(fig, out_dir, name, dpi):
        drawn["ax"] = fig.axes[0]
        return []

    monkeypatch.setattr(smoke, "save_figure", keep)
    for steps, most_ticks in ((4, 4), (5000, 15)):
        table = pd.DataFrame({"kind": "measured", "series": "GPT", "x_value": range(1, steps + 1),
                              "y_value": [6.0 - s / steps for s in range(steps)]})
        smoke.plot(table, "unused")
        ax = drawn["ax"]
        ticks = [t for t in ax.get_xticks() if 1 <= t <= steps]
        assert 2 <= len(ticks) <= most_ticks, (steps, ticks)
        assert all(float(t).is_integer() for t in ticks)
        assert (ax.lines[0].get_marker() in (None, "None", "")) == (steps > smoke.FEW_STEPS)
