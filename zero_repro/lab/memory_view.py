"""A memory snapshot (a dry run's, ``scale.dryrun.snapshot``, or ``torch.cuda.memory.
_dump_snapshot``'s) rendered to one HTML file by PyTorch's own viewer, ``torch.cuda._memory_viz``
(``trace_plot``: the Active Memory Timeline; ``segment_plot``: the Allocator State History), and
optionally photographed by a headless Chromium.

Offline: the HTML torch writes embeds the snapshot but imports the viewer itself
(``MemoryViz.js``) from jsDelivr (``pytorch@main``), and MemoryViz.js imports d3 from a CDN;
torch's wheel ships neither file (torch 2.13: no ``torch/utils/viz/*.js``). With
``viewer_dir`` -- a folder holding ``MemoryViz.js`` (``torch/utils/viz/MemoryViz.js`` of a
PyTorch checkout) and ``d3.min.js`` (d3's UMD bundle of the major version MemoryViz.js imports,
e.g. d3 v5 for ``d3@5``) -- ``offline`` leaves torch's HTML as it is and adds, before it, d3 as a
classic script and an import map that resolves those URLs to the local files (``data:`` URLs):
MemoryViz.js to itself, every d3 URL it imports to one small module re-exporting the names it
uses from the bundle (``d3.event`` kept a live binding). Nothing is copied into this project;
without ``viewer_dir`` the HTML needs the internet, as torch's does.

``python -m zero_repro.lab.memory_view SNAPSHOT [-o OUT.html] [--view trace|segments]
[--viewer-dir DIR] [--screenshot PNG]`` (``viewer_dir`` defaults to ``$ZERO_REPRO_MEMORY_VIZ``,
else ``~/.cache/zero_repro/memory_viz`` where it exists).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from torch.cuda import _memory_viz as MV

from zero_repro import paths
from zero_repro.scale import estimate as E
from zero_repro.scale.dryrun import snapshot as SN
from zero_repro.scale.dryrun.dryrun import dry_run

VIEWS = {"trace": MV.trace_plot, "segments": MV.segment_plot}
VIEWER_JS, D3_JS = "MemoryViz.js", "d3.min.js"
_IMPORT = re.compile(r'import\s+(?:\*\s*as\s+\w+|\{([^}]*)\})\s+from\s+"(https?://[^"]+)"')


def default_viewer_dir() -> Path | None:
    """``$ZERO_REPRO_MEMORY_VIZ``, else ``~/.cache/zero_repro/memory_viz``, where it holds the
    viewer's files; None otherwise."""
    d = Path(os.environ.get("ZERO_REPRO_MEMORY_VIZ", "~/.cache/zero_repro/memory_viz"))
    d = d.expanduser()
    return d if (d / VIEWER_JS).is_file() and (d / D3_JS).is_file() else None


def _data_url(text: str) -> str:
    return "data:text/javascript;base64," + base64.b64encode(text.encode()).decode()


def d3_shim(names) -> str:
    """An ES module re-exporting ``names`` from the classic-script d3 bundle (``globalThis.d3``);
    ``event`` stays live: d3 v5 assigns ``d3.event`` around each listener, a setter passes it
    on to the exported binding."""
    lines = ["const d3 = globalThis.d3;", "let current = d3.event;", "export let event = current;",
             "Object.defineProperty(d3, 'event', {configurable: true, enumerable: true,",
             "  get() { return current; }, set(v) { current = v; event = v; }});"]
    lines += [f"export const {n} = d3.{n};" for n in sorted(set(names) - {"event"})]
    return "\n".join(lines) + "\n"


def offline(html: str, viewer_dir) -> str:
    """``html`` (from ``torch.cuda._memory_viz``) made to load its viewer from ``viewer_dir``
    (module docstring)."""
    d = Path(viewer_dir)
    missing = [f for f in (VIEWER_JS, D3_JS) if not (d / f).is_file()]
    if missing:
        raise ValueError(f"viewer dir {d} lacks {missing}: put torch/utils/viz/MemoryViz.js of a "
                         "PyTorch checkout and the d3 UMD bundle of the major version it "
                         f"imports there as {VIEWER_JS} and {D3_JS}")
    m = re.search(r'from\s+"(https?://[^"]+/MemoryViz\.js)"', html)
    if m is None:
        raise ValueError("this torch's viewer HTML imports no MemoryViz.js: nothing to map")
    viewer = (d / VIEWER_JS).read_text()
    imports = _IMPORT.findall(viewer)
    names = set(re.findall(r"\bd3\.(\w+)", viewer))
    for group, _url in imports:
        names |= {n.split(" as ")[0].strip() for n in group.split(",") if n.strip()}
    shim = _data_url(d3_shim(names))
    mapping = {m.group(1): _data_url(viewer), **{url: shim for _g, url in imports}}
    head = (f"<script>\n{(d / D3_JS).read_text()}\n</script>\n"
            f'<script type="importmap">{json.dumps({"imports": mapping})}</script>\n')
    if "<head>" not in html:
        raise ValueError("this torch's viewer HTML has no <head> to put the import map in")
    return html.replace("<head>", "<head>\n" + head, 1)


def render(snapshot: dict, view: str = "trace", viewer_dir=None) -> str:
    """The HTML of ``view`` (``VIEWS``) of ``snapshot`` by torch's viewer, made offline where
    ``viewer_dir`` is given."""
    if view not in VIEWS:
        raise ValueError(f"view {view!r}: choose one of {sorted(VIEWS)}")
    html = VIEWS[view](snapshot)
    return offline(html, viewer_dir) if viewer_dir is not None else html


def chromium() -> str | None:
    """A Chromium (Debian's ``chromium``) on the PATH, or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _headless(browser: str, profile: str) -> list[str]:
    return [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={profile}", "--virtual-time-budget=20000"]


def browse(html_path, screenshot=None, size=(1600, 1000), timeout: float = 180.0) -> str:
    """Open ``html_path`` in headless Chromium; returns the DOM after its scripts ran (what it
    drew); ``screenshot``: also a PNG of the window (``size``)."""
    browser = chromium()
    if browser is None:
        raise RuntimeError("no chromium on the PATH (Debian: apt-get install chromium)")
    url = Path(html_path).resolve().as_uri()
    with tempfile.TemporaryDirectory() as profile:
        args = _headless(browser, profile)
        if screenshot is not None:
            subprocess.run(args + [f"--screenshot={Path(screenshot).resolve()}",
                                   f"--window-size={size[0]},{size[1]}", url],
                           check=True, capture_output=True, timeout=timeout)
        out = subprocess.run(args + ["--dump-dom", url], check=True, capture_output=True,
                             text=True, timeout=timeout)
    return out.stdout


def stage_snapshots(cfg, stages, zero_r: str, path, offload: str | None = None) -> list[str]:
    """The estimate's ``--snapshot``: for each ZeRO stage of ``stages``, a dry run of ``cfg`` as
    the estimate configures it (``scale.estimate.stage_config``, at its micro-batch; a
    ``selective`` setting is drawn with every block checkpointed) written as a memory snapshot
    to ``path`` (one stage) or ``path`` with ``_stage{s}`` before the suffix. Returns one line
    per snapshot (``snapshot.report_written``)."""
    path, stages = Path(path), list(stages)
    zr = E.zero_r_name(zero_r, cfg.parallel.tp)
    zr = E.zero_r_name("auto", cfg.parallel.tp) if zr == "selective" else zr
    lines = []
    for s in stages:
        cs = E.stage_config(cfg, s, zr, cfg.train.micro_batch_size, offload)
        out = path if len(stages) == 1 else path.with_name(f"{path.stem}_stage{s}{path.suffix}")
        lines.append(f"stage {s}: " + SN.report_written(dry_run(cs), out))
    return lines


def _snapshot_path(cfg, point_name: str, suffix: str = "") -> Path:
    """``<results_dir>/<experiment>/snapshots/<point><suffix>.pickle`` (folder made; not
    committed: .gitignore)."""
    folder = paths.results_path(cfg.experiment.results_dir) / cfg.experiment.name / "snapshots"
    folder.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", point_name).strip("_")
    return folder / f"{slug}{suffix}.pickle"


def point_snapshot(cfg, point_name: str, result) -> dict:
    """``experiment.params.snapshot=true`` of an experiment that runs dry runs: ``result``'s
    snapshot (a ``DryRunResult`` with its trace) beside the experiment's records
    (``_snapshot_path``). Returns {"snapshot": path, "snapshot_bytes"} for the record's
    metrics, {} when off."""
    if not cfg.experiment.params.get("snapshot", False):
        return {}
    w = SN.write_result(result, _snapshot_path(cfg, point_name))
    return {"snapshot": w["path"], "snapshot_bytes": w["bytes"]}


def proof_snapshots(cfg, point_name: str, measured: dict, result) -> dict:
    """The GPU proof's paper point: the snapshot ``torch.cuda.memory._snapshot()`` took of the
    real rank's steps (``measured``) and the dry run's (``result``, with its trace), side by
    side beside the report (``_snapshot_path``: ``_measured`` / ``_dry_run``), with the live
    peak each says (the measured one read back by ``snapshot.stats``)."""
    real_path = _snapshot_path(cfg, point_name, "_measured")
    SN.write(measured, real_path)
    w = SN.write_result(result, _snapshot_path(cfg, point_name, "_dry_run"))
    return {"snapshot_measured": str(real_path), "snapshot_dry_run": w["path"],
            "snapshot_measured_live_peak": SN.stats(measured)["live_peak"],
            "snapshot_dry_run_live_peak": w["live_peak"]}


def main(argv=None) -> int:
    """Render a memory snapshot pickle to HTML with torch's viewer (module docstring)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("snapshot", help="a snapshot pickle (--snapshot of the dry run, or torch's)")
    ap.add_argument("-o", "--out", help="HTML to write (default: SNAPSHOT with .html)")
    ap.add_argument("--view", default="trace", choices=sorted(VIEWS),
                    help="trace: Active Memory Timeline; segments: Allocator State History")
    ap.add_argument("--viewer-dir", help="MemoryViz.js + d3.min.js, for an offline page "
                                         "(default: $ZERO_REPRO_MEMORY_VIZ or ~/.cache/...)")
    ap.add_argument("--screenshot", help="also a PNG of the page, by headless Chromium")
    args = ap.parse_args(argv)
    viewer = Path(args.viewer_dir) if args.viewer_dir else default_viewer_dir()
    out = Path(args.out or Path(args.snapshot).with_suffix(".html"))
    out.write_text(render(SN.load(args.snapshot), args.view, viewer))
    where = f"offline, viewer from {viewer}" if viewer else "loads torch's viewer from the web"
    print(f"memory view: {out} ({args.view}; {where})")
    if args.screenshot:
        browse(out, args.screenshot)
        print(f"memory view: screenshot {args.screenshot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
