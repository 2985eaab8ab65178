"""The README is a front door and the docs it links hold the rest: every relative link of the
README, docs/, results/README.md and slurm/README.md names a file or folder that exists, and
every path in the README's map of the code exists."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import ROOT
DOCS = [ROOT / "README.md", ROOT / "results" / "README.md", ROOT / "slurm" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def broken_links(path: Path) -> list[str]:
    """Relative link targets of a markdown file that do not exist (web links are not read)."""
    return [t for t in LINK.findall(path.read_text())
            if "://" not in t and not (path.parent / t).exists()]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    assert doc.is_file()
    assert not broken_links(doc)


def test_the_rule_catches_a_broken_link(tmp_path):
    (tmp_path / "here.md").write_text("x")
    doc = tmp_path / "d.md"
    doc.write_text("[a](here.md) [b](gone.md#x) [c](https://example.org/x)")
    assert broken_links(doc) == ["gone.md"]


def test_the_code_map_names_existing_paths():
    text = (ROOT / "README.md").read_text()
    block = text.split("## The code in ten lines", 1)[1].split("```")[1]
    paths = re.findall(r"\b((?:zero_repro|experiments|conf|tests)/[\w/.]*|[\w]+\.py)\b", block)
    assert len(block.strip().splitlines()) <= 10 and paths
    for p in paths:
        where = ROOT / p if "/" in p else ROOT / "zero_repro" / p
        assert where.exists(), p
