"""The test suite. ``unit/``: one module or part of the library each, named after it
(``test_partition.py`` tests ``runtime/zero/partition.py``), in process or on gloo ranks.
``integration/``: end to end -- the command line, experiments and their committed results,
Slurm, faults, shared nodes, peers."""
import os
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
ROOT = Path(REPO)
