"""The store of judged depths shared by the experiments that judge them (paper §10.5: Figure 6,
Table 2's measured column): one dry-run judgement per (configuration at that depth, stack,
capacity, traced iterations), kept beside the records at the code that made it.

``for_experiment(cfg)`` opens ``<results_dir>/judged/<code signature>.jsonl`` (one JSON line per
judgement, appended as each is made; ``lab.provenance.code_signature``: judgements made at other
code are in other files and never read). A run with ``experiment.force=true`` reads nothing
from it -- every judgement is made again -- and writes what it makes; any other run reads what
an earlier one (of this or another experiment) judged. Values are the judge's
(``scale.dryrun.maxsize.DryRunJudge``): a ``Judgement``'s fields, and the capacity a depth
needs where computed.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from zero_repro import paths
from zero_repro.lab import provenance


class JudgedStore:
    """``get(key) -> dict | None`` / ``put(key, value)`` over one JSON-lines file; a key is any
    JSON-serialisable value (hashed), a later line for the same key wins."""

    def __init__(self, path: str | os.PathLike, read: bool = True):
        self.path, self.read = Path(path), read
        self._rows: dict[str, dict] | None = None

    @staticmethod
    def _hash(key) -> str:
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()

    def _load(self) -> dict[str, dict]:
        if self._rows is None:
            self._rows = {}
            if self.read and self.path.exists():
                with open(self.path) as f:
                    for line in f:
                        try:
                            row = json.loads(line)
                        except json.JSONDecodeError:  # a line cut short by a killed run
                            continue
                        self._rows[row["key"]] = row["value"]
        return self._rows

    def get(self, key) -> dict | None:
        return self._load().get(self._hash(key))

    def put(self, key, value: dict) -> None:
        h = self._hash(key)
        self._load()[h] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:  # one line per write: appends from one writer
            f.write(json.dumps({"key": h, "value": value}) + "\n")


def for_experiment(cfg) -> JudgedStore:
    """The store of ``cfg``'s results folder at this code (module docstring)."""
    sig = hashlib.sha256(provenance.code_signature().encode()).hexdigest()[:16]
    folder = paths.results_path(cfg.experiment.results_dir) / "judged"
    return JudgedStore(folder / f"{sig}.jsonl", read=not cfg.experiment.force)
