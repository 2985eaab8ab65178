"""The project's layers only point down, and nothing imports the project from inside a function.

Read from the source with ``ast`` (nothing is imported). Every project module belongs to one
layer (``LAYERS``, bottom first; the longest matching prefix decides). A module-level import of
a project module in a higher layer fails the test, as does any import of a project module inside
a function (they hide cycles and upward imports) and any import cycle among project modules.
Third-party imports inside functions are not checked: optional dependencies (deepspeed, wandb)
are imported where they are used, with a comment saying why. Every ``zero_repro.x.y`` named in
comments, docstrings, the README, Slurm templates and configs must exist (no stale paths).
"""
from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from pathlib import Path

import pytest

from tests import ROOT
PACKAGES = ("zero_repro", "experiments")

# The three wings, bottom first; a module may import its own layer and the layers below it.
# ground: the schema and where files are. runtime: what a ZeRO user imports (torch only; nothing
# of scale or lab). scale: the paper at scale without the hardware (paper facts, closed-form
# models, the dry run). lab: running experiments and keeping their results. experiments: one
# module per conf/exp overlay. Inside the runtime wing the sub-packages keep their own order.
GROUND = ("zero_repro", "zero_repro.config", "zero_repro.gpus", "zero_repro.paths",
          "zero_repro.schema",
          "zero_repro.validation", "zero_repro.identity")
RUNTIME = [
    ("zero_repro.runtime", "zero_repro.runtime.comm"),
    ("zero_repro.runtime.model",),
    ("zero_repro.runtime.zero", "zero_repro.runtime.zero_r"),
    ("zero_repro.runtime.train", "zero_repro.examples"),
]
SCALE = ("zero_repro.scale",)
LAB = ("zero_repro.lab",)
LAYERS: list[tuple[str, ...]] = [GROUND, *RUNTIME, SCALE, LAB, ("experiments",), ("run",)]
# the CPU-only fast path (shared-memory buckets, tcmalloc) is fenced off: these may import it
CPU_FAST_PATH = "zero_repro.runtime.comm.cpu"
CPU_FAST_PATH_USERS = ("zero_repro.runtime.comm.cpu", "zero_repro.runtime.comm.transport",
                       "zero_repro.runtime.comm.launch", "zero_repro.lab")


def layer_of(module: str) -> int:
    best, layer = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, layer = len(p), i
    if layer is None:
        raise AssertionError(f"module {module} is in no layer: add it to LAYERS")
    return layer


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_files() -> list[Path]:
    files = [ROOT / "run.py"]
    for pkg in PACKAGES:
        files += sorted((ROOT / pkg).rglob("*.py"))
    return files


def _resolve(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_pkg else base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _is_project(name: str) -> bool:
    return name.split(".")[0] in PACKAGES or name == "run"


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


@functools.lru_cache(maxsize=None)  # read once per session: several rules walk every file
def imports_of(path: Path) -> tuple[tuple[str, int, bool], ...]:
    """(imported project module, line, inside a function) for every project import."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module, is_pkg = module_name(path), path.name == "__init__.py"
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node, module, is_pkg)
            # `from pkg import sub` imports the submodule pkg.sub when there is one
            names = [f"{target}.{a.name}" if _is_module(f"{target}.{a.name}") else target
                     for a in node.names]
        else:
            continue
        if _type_checking_only(node, parents):
            continue
        in_func, p = False, node
        while p in parents:
            p = parents[p]
            if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                in_func = True
                break
        out += [(n, node.lineno, in_func) for n in names if _is_project(n)]
    return tuple(out)


def _is_module(name: str) -> bool:
    p = ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def test_every_module_has_a_layer():
    for f in project_files():
        layer_of(module_name(f))


def test_imports_point_down():
    upward = []
    for f in project_files():
        src = module_name(f)
        for target, line, _ in imports_of(f):
            if layer_of(target) > layer_of(src):
                upward.append(f"{f.relative_to(ROOT)}:{line}: {src} (layer {layer_of(src)}) "
                              f"imports {target} (layer {layer_of(target)})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_project_import_inside_a_function():
    hidden = [f"{f.relative_to(ROOT)}:{line}: imports {target} inside a function"
              for f in project_files() for target, line, in_func in imports_of(f) if in_func]
    assert not hidden, "\n".join(hidden)


def test_no_import_cycle():
    graph: dict[str, set[str]] = {}
    for f in project_files():
        graph[module_name(f)] = {t for t, _, in_func in imports_of(f) if not in_func}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(m: str, stack: list[str]) -> list[str] | None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if t == m or t not in graph:
                continue
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t] if t in stack else [m, t]
            if state.get(t) is None:
                cyc = visit(t, stack + [t])
                if cyc:
                    return cyc
        state[m] = 2
        return None

    for m in sorted(graph):
        if state.get(m) is None:
            cyc = visit(m, [m])
            assert cyc is None, "import cycle: " + " -> ".join(cyc)


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_cpu_fast_path_is_fenced_off():
    """Only the transport, the launcher and the lab import the CPU-only fast path."""
    reach = [f"{f.relative_to(ROOT)}:{line}: {module_name(f)} imports {target}"
             for f in project_files() for target, line, _ in imports_of(f)
             if _under(target, (CPU_FAST_PATH,))
             and not _under(module_name(f), CPU_FAST_PATH_USERS)]
    assert not reach, "the CPU fast path reaches:\n" + "\n".join(reach)


# lab/figures and each experiment's own figure modules (``experiments/NAME/figure.py``,
# ``panel.py``) turn records into tables and pictures: they plan, search, calibrate and run
# nothing. The throughput figures' vocabulary (names, units, paper setups), the peers report and
# the 2020 stack's switch and outside-byte facts are allowed.
FIGURES = ("zero_repro.lab.figures",)
EXPERIMENT_FIGURES = ("figure", "panel")  # module names inside an experiment's package
NOT_FOR_FIGURES = ("zero_repro.lab.launcher", "zero_repro.lab.rank", "zero_repro.lab.sweep",
                   "zero_repro.lab.cli", "zero_repro.lab.jobs", "zero_repro.lab.checks",
                   "zero_repro.lab.throughput", "zero_repro.lab.preflight",
                   "zero_repro.lab.estimate", "zero_repro.lab.bench", "zero_repro.lab.live_peak",
                   "zero_repro.lab.cuda_memory", "zero_repro.lab.host_adam",
                   "zero_repro.lab.judged", "zero_repro.lab.memory_view",
                   "zero_repro.lab.peers.race", "zero_repro.lab.peers.runners",
                   "zero_repro.lab.peers.frameworks", "zero_repro.lab.peers.memory",
                   "zero_repro.scale.dryrun", "zero_repro.scale.calibrate",
                   "zero_repro.scale.perf_model", "zero_repro.scale.estimate",
                   "zero_repro.scale.estimate_time", "zero_repro.scale.kernels",
                   "zero_repro.scale.modern_step", "zero_repro.scale.offload_time",
                   "zero_repro.runtime", "experiments")
FIGURES_MAY = ("zero_repro.lab.throughput.setups", "zero_repro.scale.dryrun.stack.switches",
               "zero_repro.scale.dryrun.stack.outside")
# what no figure module reaches even through another module: the planners and runners proper
RUNNERS = ("zero_repro.lab.launcher", "zero_repro.lab.rank", "zero_repro.lab.sweep",
           "zero_repro.lab.cli", "zero_repro.lab.jobs", "zero_repro.lab.checks",
           "zero_repro.lab.throughput.plan", "zero_repro.lab.throughput.run",
           "zero_repro.lab.throughput.simulate", "zero_repro.lab.throughput.batch",
           "zero_repro.lab.peers.race", "zero_repro.lab.peers.runners",
           "zero_repro.scale.dryrun.dryrun", "zero_repro.scale.dryrun.maxsize",
           "zero_repro.scale.calibrate", "zero_repro.scale.perf_model",
           "zero_repro.runtime.train", "zero_repro.runtime.zero")


def is_figure_module(module: str) -> bool:
    """``lab.figures.*``, or a figure module of an experiment package
    (``experiments.NAME.figure``, ``experiments.NAME.panel``)."""
    parts = module.split(".")
    return _under(module, FIGURES) or (
        parts[0] == "experiments" and len(parts) == 3 and parts[2] in EXPERIMENT_FIGURES)


def figures_reach(src: str, target: str) -> bool:
    """Whether ``src`` is a figure module importing a planner or runner (the rule above); an
    experiment's figure module may import its own package's other figure modules."""
    own = src.split(".")[:2] == target.split(".")[:2] and is_figure_module(target)
    return (is_figure_module(src) and _under(target, NOT_FOR_FIGURES)
            and not _under(target, FIGURES_MAY) and not own)


def _import_graph() -> dict[str, set[str]]:
    return {module_name(f): {t for t, _, _ in imports_of(f)} for f in project_files()}


def runners_reached(src: str, graph: dict[str, set[str]]) -> list[list[str]]:
    """The import chains from ``src`` that end in a planner or runner (``RUNNERS``)."""
    chains, seen, todo = [], {src}, [[src]]
    while todo:
        chain = todo.pop()
        for t in sorted(graph.get(chain[-1], ())):
            if t in seen:
                continue
            seen.add(t)
            if _under(t, RUNNERS):
                chains.append(chain + [t])
            else:
                todo.append(chain + [t])
    return chains


def test_figures_import_no_planner_or_runner():
    modules = [module_name(f) for f in project_files()]
    figures = [m for m in modules if is_figure_module(m)]
    assert "zero_repro.lab.figures.regenerate" in figures
    assert any(m.startswith("experiments.") for m in figures), figures  # the rule sees them
    bad = [f"{f.relative_to(ROOT)}:{line}: {module_name(f)} imports {target}"
           for f in project_files() for target, line, _ in imports_of(f)
           if figures_reach(module_name(f), target)]
    assert not bad, "figures reach a planner or runner:\n" + "\n".join(bad)


def test_figures_reach_no_runner_through_another_module():
    """Indirectly neither: no chain of imports leads from a figure module to a planner or runner
    (importing a figure module starts no launcher, sweep, dry run or calibration)."""
    graph = _import_graph()
    bad = [" -> ".join(c) for m in sorted(graph) if is_figure_module(m)
           for c in runners_reached(m, graph)]
    assert not bad, "figures reach a planner or runner through:\n" + "\n".join(bad)


@pytest.mark.parametrize("src,target,bad", [
    ("zero_repro.lab.figures.scaling", "zero_repro.lab.throughput.plan", True),
    ("zero_repro.lab.figures.regenerate", "zero_repro.lab.sweep", True),
    ("zero_repro.lab.figures.scaling", "zero_repro.lab.checks.equivalence", True),
    ("zero_repro.lab.figures.peers", "zero_repro.scale.calibrate", True),
    ("zero_repro.lab.figures.throughput_plots", "zero_repro.lab.throughput.setups", False),
    ("zero_repro.lab.figures.regenerate", "zero_repro.lab.records", False),
    ("zero_repro.lab.throughput.plan", "zero_repro.lab.sweep", False),
    ("zero_repro.lab.figures.throughput", "zero_repro.lab.throughput.plan", True),
    ("experiments.fig3_scaling.figure", "zero_repro.lab.throughput.plan", True),
    ("experiments.fig7_cached_memory.figure", "zero_repro.scale.dryrun.dryrun", True),
    ("experiments.fig7_cached_memory.figure", "zero_repro.scale.dryrun.stack.switches", False),
    ("experiments.memory_breakdown.figure", "zero_repro.lab.estimate", True),
    ("experiments.peers.figure", "zero_repro.lab.peers.race", True),
    ("experiments.peers.figure", "zero_repro.lab.peers.report", False),
    ("experiments.fig3_scaling.figure", "experiments.fig3_scaling.panel", False),
    ("experiments.fig3_scaling.figure", "experiments.fig3_scaling", True),
    ("experiments.fig3_scaling.panel", "experiments.fig2_throughput", True),
    ("experiments.fig3_scaling", "zero_repro.lab.throughput.plan", False),  # plans: not a figure
])
def test_figures_rule_catches_a_planner_import(src, target, bad):
    assert figures_reach(src, target) is bad


def test_indirect_rule_catches_a_chain():
    """The rule itself: a figure module reaching a runner through a module it may import."""
    graph = {"experiments.x.figure": {"zero_repro.lab.records"},
             "zero_repro.lab.records": {"zero_repro.lab.sweep"}}
    assert runners_reached("experiments.x.figure", graph) == [
        ["experiments.x.figure", "zero_repro.lab.records", "zero_repro.lab.sweep"]]
    assert runners_reached("experiments.x.figure", {"experiments.x.figure": {"pandas"}}) == []


def test_runtime_imports_nothing_of_scale_or_lab():
    runtime = tuple(p for layer in RUNTIME for p in layer)
    bad = [f"{f.relative_to(ROOT)}:{line}: {module_name(f)} imports {target}"
           for f in project_files() if _under(module_name(f), runtime)
           for target, line, _ in imports_of(f) if _under(target, SCALE + LAB)]
    assert not bad, "\n".join(bad)


def test_no_private_hydra_import():
    """The lab uses Hydra's public API only (compose, ``HydraConfig``, ``core.utils``, the
    override parser): ``hydra._internal`` changes without notice between releases."""
    bad = []
    for f in project_files():
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{f.relative_to(ROOT)}:{node.lineno}: imports {n}" for n in names
                    if n.split(".")[:2] == ["hydra", "_internal"]]
    assert not bad, "\n".join(bad)


def test_runtime_imports_no_hydra_or_omegaconf():
    """What a ZeRO user imports is torch only: the runtime's configs are plain dataclasses
    (``zero_repro.config``); Hydra and OmegaConf are the lab's (``zero_repro.schema``). Checked
    in a fresh interpreter by the modules it ends up holding, indirect imports included."""
    import subprocess
    import sys
    code = ("import sys, zero_repro.runtime.zero, zero_repro.runtime.train.build, "
            "zero_repro.runtime.train.loop, zero_repro.runtime.zero_r; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("src,target,bad", [
    ("zero_repro.runtime.zero.stage2_g", "zero_repro.lab.records", True),
    ("zero_repro.lab.sweep", "zero_repro.runtime.zero.strategy", False),
    ("zero_repro.scale.dryrun.dryrun", "zero_repro.lab.rank", True),
    ("zero_repro.runtime.train.build", "zero_repro.scale.dryrun.dryrun", True),
    ("zero_repro.scale.analytic", "zero_repro.runtime.zero.partition", False),
    ("zero_repro.runtime.comm.comm", "zero_repro.runtime.zero.strategy", True),
    ("experiments.fig6_max_model", "zero_repro.lab.cli", False),
    ("zero_repro.lab.cli", "experiments.fig6_max_model", True),
])
def test_layer_order_catches_upward_imports(src, target, bad):
    """The rule itself: a planted upward import is caught, a downward one is not."""
    assert (layer_of(target) > layer_of(src)) is bad


# --------------------------------------------------------------------- names in prose exist
DOTTED = re.compile(r"\bzero_repro(?:\.[A-Za-z_]\w*)+")
PROSE_FILES = ("README.md", "docs", "results/README.md", "slurm", "conf")  # a file or a folder


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal of a Python file; every line of any
    other text file."""
    src = path.read_text()
    if path.suffix != ".py":
        return list(enumerate(src.splitlines(), 1))
    tokens = tokenize.generate_tokens(io.StringIO(src).readline)
    return [(t.start[0], t.string) for t in tokens if t.type in (tokenize.COMMENT, tokenize.STRING)]


def _class_members(node: ast.ClassDef) -> set[str]:
    """Methods and attributes (class-level, and ``self.x`` assigned in methods) of a class."""
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            out |= {t.id if isinstance(t, ast.Name) else t.attr for t in targets
                    if isinstance(t, (ast.Name, ast.Attribute))}
    return out


def _top_level_names(path: Path) -> dict[str, set[str]]:
    """Names a module defines or imports at module level (inside ``if``/``try`` too), each with
    its members when it is a class (empty otherwise)."""
    names: dict[str, set[str]] = {}
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.If, ast.Try)):
            body += node.body + node.orelse + getattr(node, "finalbody", [])
            body += [n for h in getattr(node, "handlers", []) for n in h.body]
        elif isinstance(node, ast.ClassDef):
            names[node.name] = _class_members(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = set()
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update({n.id: set() for t in targets for n in ast.walk(t)
                          if isinstance(n, ast.Name)})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: set() for a in node.names})
    return names


def resolves(dotted: str) -> bool:
    """Whether ``zero_repro.a.b.c`` names a module, or a name defined in the longest module
    prefix of it (and, one level further, a member of a class defined there)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if not _is_module(".".join(parts[:i])):
            continue
        rest = parts[i:]
        if not rest:
            return True
        base = ROOT.joinpath(*parts[:i])
        path = base / "__init__.py" if (base / "__init__.py").is_file() else base.with_suffix(".py")
        names = _top_level_names(path)
        if rest[0] not in names:
            return False
        return len(rest) == 1 or not names[rest[0]] or rest[1] in names[rest[0]]
    return False


def test_module_paths_named_in_prose_exist():
    """Every ``zero_repro.x.y`` named in a comment, docstring or string of the code, tests,
    README or Slurm templates is a module or a name in one: moves leave no stale references."""
    # this file is left out: it plants stale names to test the rule
    tests = set((ROOT / "tests").rglob("*.py")) - {Path(__file__).resolve()}
    files = project_files() + sorted(tests)
    files += [p for name in PROSE_FILES for p in ([ROOT / name] if (ROOT / name).is_file()
                                                  else sorted((ROOT / name).rglob("*")))
              if p.is_file()]
    stale = [f"{f.relative_to(ROOT)}:{line}: {name}"
             for f in files for line, text in _prose(f)
             for name in DOTTED.findall(text) if not resolves(name)]
    assert not stale, "names that do not resolve:\n" + "\n".join(sorted(set(stale)))


@pytest.mark.parametrize("name,ok", [
    ("zero_repro.scale.dryrun.dryrun.dry_run", True),
    ("zero_repro.runtime.zero.strategy.Strategy.step", True),
    ("zero_repro.lab.records.point_key", True),
    ("zero_repro.simulate.dryrun", False),
    ("zero_repro.measure.records.point_key", False),
    ("zero_repro.lab.records.no_such_function", False),
    ("zero_repro.runtime.zero.strategy.Strategy.no_such_method", False),
])
def test_stale_module_paths_are_caught(name, ok):
    """The rule itself: a planted stale path is caught, a real one is not."""
    assert resolves(name) is ok
