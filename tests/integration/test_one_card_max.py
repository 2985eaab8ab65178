"""The one-GPU largest-model search (experiments.one_card_max.search) against judges whose
answer is known, and the committed table against the offload papers' claims it is drawn beside."""
import csv
import math

import pytest

from experiments.one_card_max import search as S
from tests import ROOT

CAP, HOST = 100.0, 1000.0


def judge_of(dev0, dev_slope, host0, host_slope, calls=None, bump=None):
    """An affine judge: need(l) = a + l·s, device and host; ``bump`` {depth: extra device}
    makes a depth fail that the affine crossing says fits (the confirmation must see it)."""
    def judge(d):
        if calls is not None:
            calls.append(d)
        dev = dev0 + d * dev_slope + (bump or {}).get(d, 0.0)
        host = host0 + d * host_slope
        return {"fits": dev <= CAP and host <= HOST, "device_fits": dev <= CAP,
                "host_fits": host <= HOST, "peak_reserved": dev, "capacity": CAP,
                "host_bytes": host, "host_capacity": HOST}
    return judge


def test_device_bound_answer_is_judged_at_the_boundary():
    calls = []
    ans = S.largest_depth(judge_of(10.0, 7.0, 0.0, 1.0, calls), (2, 6), confirm_max=96)
    assert ans.depth == math.floor((CAP - 10.0) / 7.0) == 12
    assert (ans.binds, ans.method) == ("device", "judged")
    assert {12, 13} <= set(calls) and len(calls) == 4  # two probes, l* and l* + 1


def test_host_bound_and_deep_answers_are_extrapolated_and_say_so():
    ans = S.largest_depth(judge_of(10.0, 0.01, 0.0, 3.0), (2, 6), confirm_max=96)
    assert (ans.depth, ans.binds, ans.method) == (333, "host", "extrapolated")
    assert sorted(ans.judged) == [2, 6]  # no dry run above confirm_max


def test_confirmation_walks_down_past_a_depth_the_crossing_missed():
    ans = S.largest_depth(judge_of(10.0, 7.0, 0.0, 1.0, bump={12: 20.0, 11: 20.0}), (2, 6))
    assert ans.depth == 10 and ans.method == "judged"


def test_nothing_fits():
    ans = S.largest_depth(judge_of(150.0, 7.0, 0.0, 1.0), (2, 6))
    assert ans.depth == 0


TABLE = ROOT / "results" / "one_card_max" / "table.csv"


@pytest.mark.skipif(not TABLE.exists(), reason="no committed table")
def test_committed_table_holds_zero_offloads_headline_and_names_what_binds():
    rows = {(r["x_value"], r["series"]): r for r in csv.DictReader(TABLE.open())}
    v100 = {s.split(" ", 1)[1]: float(r["y_value"]) for (c, s), r in rows.items()
            if c == "dgx2_v100"}
    # ZeRO-Offload's claim: > 13B with the optimizer on the host, ~10x the no-offload model
    assert v100["cpu"] > 13.0 and v100["cpu"] > 5 * v100["none"]
    assert v100["cpu+param"] > v100["cpu"] > v100["param"] > v100["none"]
    assert all(r["binds"] in ("device", "host") and r["method"] in ("judged", "extrapolated")
               and r["kind"] == "simulated" for r in rows.values())
