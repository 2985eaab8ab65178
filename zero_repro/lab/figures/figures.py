"""Figure output shared by every experiment: PNG + PDF side by side."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

# marker and line style of each row ``kind`` (measured | simulated | analytic | paper), every plot
MARKERS = {"measured": "o", "simulated": "s", "analytic": "^", "paper": "X"}
LINESTYLES = {"measured": "-", "simulated": "--", "analytic": ":", "paper": "none"}


def save_figure(fig, out_dir: str, name: str, dpi: int = 150) -> list[str]:
    """Write ``fig`` as ``out_dir/name.png`` and ``.pdf`` (every experiment plots both), close it,
    and return the two paths. Byte-deterministic: no creation date in the PDF, no software
    version in either file, so re-plotting the same table leaves committed files untouched."""
    paths = [os.path.join(out_dir, f"{name}.{ext}") for ext in ("png", "pdf")]
    meta = {"png": {"Software": None}, "pdf": {"CreationDate": None, "Producer": None,
                                                "Creator": None}}
    for p, ext in zip(paths, ("png", "pdf")):
        fig.savefig(p, dpi=dpi, metadata=meta[ext])
    plt.close(fig)
    return paths
