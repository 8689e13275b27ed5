"""The package's shape: imports run one way through its layers, with no circles, and the
command line lives in one place (dhelix/cli/).

Every module under dhelix/ is read with `ast` (nothing is imported): its top-level imports
and the ones inside functions (the code imports lazily a lot) are edges of a module graph.
"""
import ast
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(REPO, "dhelix")

# The layers, lowest first. A module may import from its own layer and the layers before
# it, never from a later one. A module's layer is that of the longest prefix listed.
LAYERS = [
    # plain data and helpers: units, hardware facts, the model config files, the CPU
    # stand-ins for CUDA-only megatron pieces
    ("base", ["dhelix", "dhelix.base", "dhelix.compat", "dhelix.models.config",
              "dhelix.models.params", "dhelix._planner_core"]),
    # pure logic: ops, plans, costs, the DP planner, the layer and pipeline simulators
    ("planner", ["dhelix.planner"]),
    # the emulated cluster links (the paced link times collectives by the planner's model)
    ("links", ["dhelix.links"]),
    # ops on lanes, the executor, and the layers built of them (models/: DHelix's layer
    # spec, ring attention, the GPT)
    ("strand", ["dhelix.strand", "dhelix.models"]),
    ("schedules", ["dhelix.schedules"]),
    ("folding", ["dhelix.folding"]),
    # training and the Megatron-LM hook; dhelix.testing starts local ranks as train does
    ("train", ["dhelix.train", "dhelix.megatron", "dhelix.testing"]),
    # tools that run training or layers: profiler, benchmarks, Helix, the demo; advise
    ("tools", ["dhelix.profiler", "dhelix.bench", "dhelix.helix", "dhelix.demo",
               "dhelix.advise"]),
    ("cli", ["dhelix.cli"]),
]

# Edges allowed for now, each with the reason; the test fails when one is no longer
# needed, so that the entry is removed with the code that needed it.
PENDING: set = set()     # upward edges allowed for now (none)

# the only files below dhelix/ that may import argparse besides dhelix/cli/
ARGPARSE_OK = {
    # Megatron-LM's `extra_args_provider` hook: it is handed an argparse parser
    "dhelix/megatron/args.py",
}

COMMANDS = ["train", "demo", "make-corpus", "profile", "validate-model", "plan", "simulate",
            "plan-sweep", "advise", "bench", "layouts", "published", "helix-bench"]


def _modules():
    """{module name: path relative to the repository}."""
    out = {}
    for d, dirs, files in os.walk(PKG):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(d, f), REPO)
            name = rel[:-3].replace(os.sep, ".")
            if name.endswith(".__init__"):
                name = name[:-len(".__init__")]
            out[name] = rel
    return out


def _imports(path, name, is_pkg):
    """(imported name, line) for every import in the file, at any depth."""
    with open(os.path.join(REPO, path)) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                                  # relative: from . import x
                pkg = name if is_pkg else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = pkg + ("." + base if base else "")
            for a in node.names:
                # `from p import m`: the module p.m if there is one, else p itself
                yield (base + "." + a.name, node.lineno)


def module_graph():
    """{module: [(target module, line)]} for the imports between dhelix's modules."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        edges = []
        for target, line in _imports(path, name, path.endswith("__init__.py")):
            if target.split(".")[0] != "dhelix":
                continue
            while target not in mods and "." in target:
                target = target.rpartition(".")[0]
            if target in mods and target != name and (target, line) not in edges:
                edges.append((target, line))
        graph[name] = edges
    return mods, graph


def layer_of(module):
    best, best_len = None, -1
    for k, (layer, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = k, len(p)
    return best


def upward_edges(mods, graph):
    bad = []
    for m, edges in graph.items():
        for t, line in edges:
            if (m, t) in PENDING:
                continue
            if layer_of(t) > layer_of(m):
                bad.append(f"{mods[m]}:{line}: {m} ({LAYERS[layer_of(m)][0]}) imports {t} "
                           f"({LAYERS[layer_of(t)][0]}), a layer above it")
    return bad


def cycles(graph):
    """The strongly connected components with more than one module, each as one cycle
    through it (Tarjan's algorithm, iterative)."""
    succ = {m: sorted({t for t, _ in e}) for m, e in graph.items()}
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]
    for root in sorted(succ):
        if root in index:
            continue
        work = [(root, iter(succ[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(succ.get(w, []))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        comps.append(_one_cycle(sorted(comp), succ))
    return comps


def _one_cycle(comp, succ):
    """A shortest path from the component's first module back to itself."""
    inside, start = set(comp), comp[0]
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in succ[v]:
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if w in inside and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def test_every_module_has_a_layer():
    mods, _ = module_graph()
    assert not [m for m in mods if layer_of(m) is None], "modules without a layer"


def test_imports_point_down_the_layers():
    """base ← planner ← links ← strand ← schedules ← folding ← train ← tools ← cli."""
    mods, graph = module_graph()
    bad = upward_edges(mods, graph)
    assert not bad, "imports from a higher layer:\n" + "\n".join(bad)
    for m, t in PENDING:
        assert t in {x for x, _ in graph.get(m, [])}, f"PENDING edge {m} -> {t} is gone: " \
                                                      f"remove it from the list"


def test_no_import_circles():
    _, graph = module_graph()
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_argparse_only_in_the_cli():
    mods, _ = module_graph()
    bad = []
    for name, path in mods.items():
        if path.startswith(os.path.join("dhelix", "cli") + os.sep) or path in ARGPARSE_OK:
            continue
        for target, line in _imports(path, name, path.endswith("__init__.py")):
            if target.split(".")[0] == "argparse":
                bad.append(f"{path}:{line}")
    assert not bad, "argparse imported outside dhelix/cli/: " + ", ".join(bad)


def _dhelix(*args):
    return subprocess.run([sys.executable, "-m", "dhelix.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


def test_help_lists_every_command_and_version():
    r = _dhelix("--help")
    assert r.returncode == 0, r.stderr
    listed = r.stdout.split("{", 1)[1].split("}", 1)[0].split(",")
    assert listed == COMMANDS, listed
    for cmd in COMMANDS:                   # and each has a help line of its own
        assert f"    {cmd} " in r.stdout, cmd
    r = _dhelix("--version")
    assert r.returncode == 0, r.stderr
    from importlib.metadata import version
    assert r.stdout.strip() == f"dhelix {version('dhelix')}"
