"""``python -m experiments.plot NAME``: regenerate ``results/NAME/table.csv`` and its figure from
``results/NAME/points.jsonl`` alone (the command the README names; the work is
done by ``zero_repro.lab.figures.regenerate``)."""
from zero_repro.lab.figures.regenerate import main

if __name__ == "__main__":
    raise SystemExit(main())
