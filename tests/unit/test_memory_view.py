"""A dry run's memory snapshot rendered by torch's own viewer (``lab.memory_view``): the page
made offline maps every URL the viewer imports onto local files; in a real headless Chromium
(``-m slow``) it draws the timeline and the allocator state the replay computed."""
from __future__ import annotations

import base64
import json
import re

import pytest

from tests.unit.test_dryrun import tiny_cfg
from zero_repro.lab import memory_view as MVW
from zero_repro.scale.dryrun import snapshot as SN
from zero_repro.scale.dryrun.dryrun import dry_run

STUB_VIEWER = '''import * as d3 from "https://cdn.example/d3@5";
import {axisLeft} from "https://cdn.example/d3-axis@1";
import {zoom as z, zoomIdentity} from "https://cdn.example/d3-zoom@1";
export function add_local_files(files, view) { d3.select("body"); d3.event; }
'''


def _import_map(html: str) -> dict:
    m = re.search(r'<script type="importmap">(.*?)</script>', html, re.S)
    return json.loads(m.group(1))["imports"]


def _decoded(url: str) -> str:
    return base64.b64decode(url.split(",", 1)[1]).decode()


def test_offline_maps_every_url_the_viewer_imports(tmp_path):
    """torch's HTML is kept; the import map resolves its MemoryViz.js URL to the local file and
    each d3 URL that file imports to one module exporting the names the viewer uses."""
    (tmp_path / "MemoryViz.js").write_text(STUB_VIEWER)
    (tmp_path / "d3.min.js").write_text("var d3 = {};")
    snap = SN.from_events([("alloc", 0, 4096, "forward", 0)], {0: "buckets"})
    torch_html = MVW.render(snap)
    html = MVW.render(snap, viewer_dir=tmp_path)
    assert html.endswith(torch_html.split("<head>", 1)[1])  # torch's page, after our head
    imports = _import_map(html)
    viewer_url = re.search(r'from "(https://[^"]+MemoryViz.js)"', torch_html).group(1)
    assert _decoded(imports[viewer_url]) == STUB_VIEWER
    d3_urls = set(re.findall(r'from "(https://cdn.example/[^"]+)"', STUB_VIEWER))
    assert set(imports) == {viewer_url} | d3_urls
    shim = _decoded(imports["https://cdn.example/d3@5"])
    assert len({imports[u] for u in d3_urls}) == 1  # one module: one d3, one live event
    for name in ("select", "axisLeft", "zoom", "zoomIdentity"):
        assert f"export const {name} = d3.{name};" in shim
    assert "export let event" in shim and "export const event" not in shim
    assert "var d3 = {};" in html.split('<script type="module">')[0]


def test_offline_names_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="MemoryViz.js"):
        MVW.offline("<html><head></head></html>", tmp_path)


def _skip_without_browser():
    if MVW.chromium() is None:
        pytest.skip("no chromium on the PATH (Debian: apt-get install chromium)")
    if MVW.default_viewer_dir() is None:
        pytest.skip("torch's wheel ships no viewer JS: put torch/utils/viz/MemoryViz.js of a "
                    "PyTorch checkout and d3's UMD bundle (d3.min.js, the major version it "
                    "imports) in $ZERO_REPRO_MEMORY_VIZ or ~/.cache/zero_repro/memory_viz")


@pytest.mark.slow
def test_chromium_draws_the_dry_runs_snapshot_offline(tmp_path):
    """Stage 2 TP 2 + C_B/M_D: headless Chromium, offline, draws the Active Memory Timeline (a
    polygon per allocation, the categories' legend, a PNG with many colours) and the Allocator
    State History, whose reserved total at the last event is the replay's reserved bytes."""
    _skip_without_browser()
    from matplotlib import image

    r = dry_run(tiny_cfg(4, 2, 2, "c4"))
    snap = SN.from_result(r)
    page = tmp_path / "trace.html"
    page.write_text(MVW.render(snap, "trace", MVW.default_viewer_dir()))
    dom = MVW.browse(page, tmp_path / "trace.png")
    assert dom.count("<polygon") > 100
    for cat in ("fp16 parameters", "fp32 master + Adam", "working layer", "activation checkpoint"):
        assert f">{cat}</text>" in dom
    png = image.imread(tmp_path / "trace.png")
    assert len({tuple(p) for p in png.reshape(-1, png.shape[-1])[::97]}) > 20
    page = tmp_path / "segments.html"
    page.write_text(MVW.render(snap, "segments", MVW.default_viewer_dir()))
    dom = MVW.browse(page)
    reserved = SN.stats(snap)["segments_total"]
    assert f"({reserved} bytes) reserved)" in dom


def test_an_experiments_point_writes_its_snapshot_beside_its_records(tmp_path):
    """``experiment.params.snapshot=true``: the point's dry run lands in
    ``<results_dir>/<experiment>/snapshots/<point>.pickle``; off, nothing is written."""
    from omegaconf import OmegaConf

    r = dry_run(tiny_cfg(2, 1, 1, "off"))
    cfg = OmegaConf.create({"experiment": {"name": "memory_breakdown", "params": {},
                                           "results_dir": str(tmp_path)}})
    assert MVW.point_snapshot(cfg, "40B C4 modern", r) == {}
    cfg.experiment.params.snapshot = True
    out = MVW.point_snapshot(cfg, "40B C4 modern", r)
    assert out["snapshot"] == str(tmp_path / "memory_breakdown" / "snapshots" /
                                  "40B_C4_modern.pickle")
    assert SN.stats(SN.load(out["snapshot"]))["live_peak"] == r.live_peak


def test_the_gpu_proof_writes_both_snapshots_side_by_side(tmp_path):
    """The GPU proof's paper point (CUDA only: ``torch.cuda.memory._snapshot()`` of the real
    steps): the measured snapshot and the dry run's beside the report, each with its live
    peak. Here a snapshot in torch's format stands in for the measured one."""
    from omegaconf import OmegaConf

    r = dry_run(tiny_cfg(2, 1, 1, "off"))
    measured = SN.from_events([("alloc", 0, 1000, "forward", 0), ("alloc", 1, 24, "forward", 0),
                               ("free", 0, 1000, "backward", 0)], {})
    cfg = OmegaConf.create({"experiment": {"name": "gpu_proof", "params": {},
                                           "results_dir": str(tmp_path)}})
    out = MVW.proof_snapshots(cfg, "40B C4", measured, r)
    assert out["snapshot_measured"].endswith("gpu_proof/snapshots/40B_C4_measured.pickle")
    assert out["snapshot_measured_live_peak"] == 1024
    assert out["snapshot_dry_run_live_peak"] == r.live_peak
    assert SN.load(out["snapshot_dry_run"])["dry_run"]["live_peak"] == r.live_peak
