"""The source's layout holds what docs/development.md promises: no import cycle among the
modules of ``src/scaleopt`` (imports inside functions included), and functions short enough to
read (50 lines, 80 in the command)."""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set

ROOT = pathlib.Path(__file__).resolve().parent.parent / "src"
PACKAGE = ROOT / "scaleopt"


def _modules() -> Dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> Dict[str, Set[str]]:
    """Module -> the modules of the package it imports, anywhere in its code."""
    modules = _modules()
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:  # a submodule, or a name of ``base``
                    sub = f"{base}.{alias.name}"
                    deps.add(sub if sub in modules or not node.module else base)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_sees_imports_and_cycles():
    graph = import_graph()
    assert "scaleopt._layerwise" in graph["scaleopt.lamb"]  # from ._layerwise import ...
    assert "scaleopt._native" in graph["scaleopt.lamb"]  # from . import _native
    assert "scaleopt.cli.train" in graph["scaleopt.cli"]  # from . import ..., train
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_in_the_package():
    assert cycles(import_graph()) == []


def test_no_function_is_too_long_to_read():
    long = []
    for name, path in _modules().items():
        limit = 80 if name.startswith("scaleopt.cli") else 50
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert long == []


def test_no_module_of_the_command_is_too_long_to_read():
    """Each module of ``cli/`` holds one concern: none over 450 lines."""
    long = {str(p.relative_to(ROOT)): n for p in (PACKAGE / "cli").glob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}
    assert long == {}


def test_the_command_reads_no_private_argparse_attribute():
    """Which options were given is known from the values (every default None), not from
    argparse's internals, which change between Python releases."""
    private = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in (
                    "_actions", "_action_groups", "_group_actions", "_option_string_actions",
                    "_subparsers", "_defaults"):
                private.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.attr}")
    assert private == []


def test_each_option_of_the_command_is_defined_once():
    """An option the commands share comes from one builder (cli/options.py, or the run options
    of cli/config.py): no flag is written out in two places."""
    import re

    seen: Dict[str, List[str]] = {}
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        for flag in re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", path.read_text()):
            seen.setdefault(flag, []).append(path.name)
    assert {f: where for f, where in seen.items() if len(where) > 1} == {}
    # and the options the benchmark scripts share with the command come from the same builders
    shared = {"--threads", "--rounds", "--size", "--device", "--world", "--out", "--overwrite",
              "--workers", "--optimizer", "--offload"}
    scripts = [*ROOT.parent.joinpath("benchmarks").glob("*.py"), PACKAGE / "benchmarking.py"]
    written = [(path.name, flag) for path in scripts
               for flag in re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", path.read_text())
               if flag in shared]
    # bench_host.py reads --device before torch and Triton are imported (the Triton
    # interpreter must be set first), so before the command's builders can be
    assert written == [("bench_host.py", "--device")]
