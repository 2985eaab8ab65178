"""``python -m experiments.plot NAME``: regenerate ``results/NAME/table.csv`` and its figure from
``results/NAME/points.jsonl`` alone (the command the README and the issues name; the work is
done by ``zero_repro.harness.regenerate``)."""
from zero_repro.harness.regenerate import main

if __name__ == "__main__":
    raise SystemExit(main())
