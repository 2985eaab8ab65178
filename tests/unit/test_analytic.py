"""Closed-form memory model vs the paper's Tables 1-2 and its stated activation examples."""
import math

import pytest

from zero_repro.scale import analytic as A
from zero_repro.scale.paper.setups import reference_rows
from zero_repro.scale.paper.setups import setups


def _num(text: str) -> float:
    """'7.6B' -> 7.6e9, '0.5T' -> 5e11, 'about 33' -> 33."""
    t = text.replace("about", "").replace("around", "").replace(">=", "").strip()
    mult = {"B": 1e9, "T": 1e12}.get(t[-1], 1.0)
    return float(t.rstrip("BT")) * mult


def test_table1_all_54_cells_match_paper_display():
    paper = {}
    for r in reference_rows("table1"):
        model, scheme = r["series"].replace(" model", "").split(" ")
        paper[(model, scheme, int(r["x_value"]))] = float(r["y_value"])
    cells = A.table1()
    assert len(cells) == 54 and len(paper) == 54
    flagged = []
    for c in cells:
        assert c.paper_display == paper[(c.model, c.scheme, c.n_d)], c
        if c.display != paper[(c.model, c.scheme, c.n_d)]:
            flagged.append(c)
    # exactly the 8 cells the paper truncates differ from correct rounding, and they are flagged
    assert len(flagged) == 8 and all(c.truncated_by_paper for c in flagged)
    assert sum(c.truncated_by_paper for c in cells) == 8
    assert {round(c.gb, 2) for c in flagged} >= {513.5, 257.75, 4187.5, 2218.75}


def test_model_state_formulas():
    psi = 1e9
    assert A.model_state_bytes(psi, 0, 64) == 16 * psi
    assert A.model_state_bytes(psi, 1, 64) == pytest.approx(4 * psi + 12 * psi / 64)
    assert A.model_state_bytes(psi, 2, 64) == pytest.approx(2 * psi + 14 * psi / 64)
    assert A.model_state_bytes(psi, 3, 64) == pytest.approx(16 * psi / 64)
    for stage in range(4):
        parts = A.model_state_breakdown(psi, stage, 8)
        assert sum(parts.values()) == pytest.approx(A.model_state_bytes(psi, stage, 8))


def test_table2_theory_columns():
    cols = {"theoretical Baseline": 0, "theoretical Pos": 1, "theoretical Pos+g": 2,
            "theoretical Pos+g+p": 3}
    n = 0
    for r in reference_rows("table2"):
        if r["series"] not in cols:
            continue
        mp = int(r["x_value"].split()[0])
        stage = cols[r["series"]]
        ours = A.max_params(32e9, stage, 64, mp)
        paper = _num(r["y_value"])
        # the paper rounds the MP=1 value (7.6B, 14.4B) and scales it; T cells have 1 digit
        tol = 0.025 if r["y_value"].endswith("T") or stage == 3 else 0.01
        assert ours == pytest.approx(paper, rel=tol), (r["series"], mp, ours, paper)
        if mp == 1:
            assert round(ours / 1e9, 1) == pytest.approx(paper / 1e9)
        n += 1
    assert n == 20


def test_stated_activation_examples():
    # footnote: ≈12·h·b·s·l elements; GPT-2 1.5B (48 x 1600), s=1K, b=32 -> ≈60 GB in fp16
    el = A.activation_elements_footnote(1600, 32, 1024, 48)
    assert 2 * el / A.GB == pytest.approx(60, rel=0.02)
    # with one checkpoint per layer + one block's recompute working set + logits: "about 8 GB"
    mb = A.memory_breakdown(48, 1600, 16, 1, 1, 32, "C3")
    ckpt_plus_work = mb["activation_checkpoints"] + mb["activation_working"]
    assert 5 * A.GB < mb["activation_checkpoints"] < ckpt_plus_work < 8 * 1.25 * A.GB
    # §6.1 P_a example, Table 5's 100B shape (125 x 8192), b=32, s=1024, MP=16:
    # the paper's "≈33 GB" equals the checkpoint *element count* (33.5e9); in fp16 bytes it is
    # 67 GB, consistent with §3.2's "≈60 GB" for the same model -> we check both readings.
    full = A.checkpoint_bytes(32, 1024, 8192, 125)
    assert full / 2 / A.GB == pytest.approx(33, rel=0.03)
    assert full / A.GB == pytest.approx(60, rel=0.15)
    pa = A.checkpoint_bytes(32, 1024, 8192, 125, tp=16, p_a=True)
    assert pa / 2 / A.GB == pytest.approx(2, rel=0.06)  # "≈2 GB" (same element reading)
    assert pa == full / 16
    assert A.checkpoint_bytes(32, 1024, 8192, 125, tp=16, p_a=True, cpu=True) == 0.0
    # the paper's fused 32-bit buffer without C_B (stage 2: one buffer of Ψ): 6 GB for 1.5B,
    # 12 GB for 3B; the runtime reduces in it (its gradient store, the shard inside): no
    # buffer beside it, with C_B independent of Ψ at every stage
    n = A.param_count_formula(48, 1600, 50257, 1024)  # GPT-2 1.5B
    mb = A.memory_breakdown(48, 1600, 16, 1, 16, 1, A.MemConfig(stage=2, c_b=False),
                            buffer_lp_bytes=4)
    assert mb["lp_grads"] == 4 * n and 4 * n / A.GB == pytest.approx(6, rel=0.05)
    # beside it only the native staging of the one in-place gather bucket's chunk
    assert A.buffer_bytes(3e9, False, lp_bytes=4, stage=2, n_d=16) == 4 * 3e9 / 16
    for stage in range(4):
        assert A.buffer_bytes(1.5e9, True, stage=stage, n_d=16) == \
            A.buffer_bytes(100e9, True, stage=stage, n_d=16)
    # with C_B: stages 2-3 hold two gradient buckets of R elements (+ the native transport's
    # staging of 2 chunks at stages 1-2), stages 0-1 none of their own
    r, a = 5e8, 2e8
    assert A.buffer_bytes(100e9, True, r, a, stage=0, n_d=16) == 0
    assert A.buffer_bytes(100e9, True, r, a, stage=2, n_d=16) == \
        (2 * 4e8 + 2 * 2e8 / 16) * 2  # R rounded down to whole gather buckets of A


def test_per_op_activation_count():
    b, s, h, a = 2, 128, 256, 4
    bsh = b * s * h
    # fp16, dropout: bsh·(10 + 24/t) + 5·a·b·s²/t bytes (op enumeration in the docstring)
    for t in (1, 2, 4):
        want = bsh * (10 + 24 / t) + 5 * a * b * s * s / t
        assert A.activation_bytes_per_layer(b, s, h, a, t) == pytest.approx(want)
    no_drop = A.activation_bytes_per_layer(b, s, h, a, 1, dropout=False)
    assert no_drop == pytest.approx(bsh * 32 + 2 * a * b * s * s)


def test_memory_breakdown_configs_order():
    # Figure 6 ordering of per-GPU memory at a fixed model: C1 > C2, C1 > C3 > C4 > C5
    tot = {c: sum(A.memory_breakdown(62, 8192, 32, 16, 25, 16, c).values())
           for c in ("C1", "C2", "C3", "C4", "C5")}
    assert tot["C1"] > tot["C2"] and tot["C1"] > tot["C3"] > tot["C4"] > tot["C5"]


@pytest.mark.parametrize("cfg", ["C1", "C4", "C5"])
def test_max_model_size_bisection_consistent_with_fits(cfg):
    dev = 32e9
    args = dict(tp=16, n_d=25, batch_per_gpu=16, hidden=8192, heads=64)
    n, params = A.max_model_size(dev, cfg, **args)
    fit = lambda k: A.fits(dev, k, 8192, 64, 16, 25, 16, cfg)  # noqa: E731
    assert n > 0 and fit(n) and not fit(n + 1)
    assert params == A.param_count_formula(n, 8192, 50257, 1024)
    # a pluggable judge (a stand-in for the dry run) overrides the analytic answer
    calls = []
    judge = lambda k: calls.append(k) or k <= 37  # noqa: E731
    assert A.max_model_size(dev, cfg, fits_fn=judge, **args)[0] == 37
    assert len(calls) < 40


def test_fig6_analytic_ordering_matches_paper():
    # the analytic seed reproduces the paper's ranking C1 < C3 < C4 < C5 (absolute sizes are
    # the dry run's job; the closed form ignores fragmentation and allocator overheads)
    from experiments.fig6_max_model import paper_order
    s = {x.zero_config: x for x in setups("fig6")}
    size = {c: A.max_model_size(32e9, c, 16, 25, 16, 8192, 64)[1] for c in s}
    assert size["C1"] < size["C3"] < size["C4"] < size["C5"]
    paper = {r["x_value"]: float(r["y_value"]) for r in reference_rows("fig6")
             if r["y_name"] == "max_model_size"}
    order = [c for c in paper_order() if c != "C2"]  # C2 at its own hidden size (6144)
    assert sorted(order, key=size.get) == order
    assert math.isclose(size["C4"] / size["C3"], paper["C4"] / paper["C3"], rel_tol=0.4)
