"""Table 9 (Figure 8's setups, paper appendix; captioned "Figure 6") names no configurations: which
of its five 60B rows is C1..C5 is an assumption, made explicit here (``ORDERS[name]``: the
configuration of each CSV row, in CSV order; ``experiment.params.table9_order``).

The reference CSV labels the rows C1..C5 (batch per GPU 2, 4, 32, 32, 8). Table 7 lists its rows
as C1, C2, C4, C5, C3; in that order the batches are C1 2, C2 4, C4 32, C5 32, C3 8. Physical
check (60B = 75 x 8192, MP 16, s = 1024): C3 has no P_a, so its checkpoints b·s·h·2·l =
32·1024·8192·2·75 = 40 GB per GPU at batch 32 exceed a V100, 10 GB at batch 8. ``table7`` is the
only order under which every row can run: the default; ``c1_to_c5`` stays selectable.
"""
from __future__ import annotations

import dataclasses

from zero_repro.scale.paper.setups import PaperSetup

CSV_ORDER = ("C1", "C2", "C3", "C4", "C5")
ORDERS = {"c1_to_c5": CSV_ORDER, "table7": ("C1", "C2", "C4", "C5", "C3")}
# see the module docstring and results/paper/REFERENCE.md for why
DEFAULT_ORDER = "table7"


def remap(rows: list[PaperSetup], order: str = DEFAULT_ORDER) -> list[PaperSetup]:
    """Table 9 setups with each 60B row's ``zero_config`` (and point label) set by ``order``;
    rows not labelled C1..C5 (170B C5) are returned unchanged."""
    if order not in ORDERS:
        raise ValueError(f"table9 row order {order!r} is unknown: use one of {sorted(ORDERS)}")
    to = dict(zip(CSV_ORDER, ORDERS[order]))
    out = []
    for s in rows:
        if s.size_label == "60B" and s.zero_config in to:
            zc = to[s.zero_config]
            s = dataclasses.replace(s, zero_config=zc, point=f"{s.size_label} {zc}")
        out.append(s)
    return out


def batch_by_config(rows: list[PaperSetup], order: str = DEFAULT_ORDER) -> dict[str, int]:
    """{C: batch per GPU} of the 60B rows under ``order``."""
    return {s.zero_config: s.batch_per_gpu for s in remap(rows, order) if s.size_label == "60B"}
