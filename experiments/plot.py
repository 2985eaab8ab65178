"""``python -m experiments.plot NAME``: regenerate ``results/NAME/table.csv`` and its figure from
``results/NAME/points.jsonl`` alone (the command the README names; the work is
done by ``zero_repro.lab.figures.regenerate``), then print the experiment's result lines (its
``conclude(table)``, as ``run.py`` prints them after a run)."""
from zero_repro.lab.cli import print_result
from zero_repro.lab.figures.regenerate import main

if __name__ == "__main__":
    raise SystemExit(main(report=print_result))
