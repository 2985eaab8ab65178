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
