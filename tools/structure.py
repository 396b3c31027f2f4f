"""The project's shape: import cycles between its modules, and the modules and classes over a size.

    python tools/structure.py [--max-module-lines 600] [--max-class-lines 300]

Every ``import`` counts, also one inside a function or under ``TYPE_CHECKING``: a cycle through a
deferred import is still two modules that each need the other. Exits 1 on a cycle; sizes are
reported, not enforced (a module or class over the limit says why in its docstring).
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("tapesac", "torchtitan_common", "torchtitan_ext", "torchtitan03_ext")


def modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The project modules ``name`` imports (anywhere in the file)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            # the longest project module the name refers to (``from . import x`` may be a module)
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    graph = {}
    for name, path in known.items():
        deps = imports(name, path, known)
        # a package's submodule importing its own package (``from . import x``) is no cycle
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def sizes(root: pathlib.Path = ROOT) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(module, lines) and (module:Class, lines) for every module and class of the project."""
    mods, classes = [], []
    for name, path in modules(root).items():
        text = path.read_text()
        mods.append((name, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                classes.append((f"{name}:{node.name}", node.end_lineno - node.lineno + 1))
    return mods, classes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-module-lines", type=int, default=600)
    parser.add_argument("--max-class-lines", type=int, default=300)
    args = parser.parse_args()
    found = cycles(import_graph())
    for comp in found:
        print("import cycle:", " <-> ".join(comp))
    mods, classes = sizes()
    for name, n in sorted(mods, key=lambda x: -x[1]):
        if n > args.max_module_lines:
            print(f"module over {args.max_module_lines} lines: {name} ({n})")
    for name, n in sorted(classes, key=lambda x: -x[1]):
        if n > args.max_class_lines:
            print(f"class over {args.max_class_lines} lines: {name} ({n})")
    print(f"{len(mods)} modules, {len(classes)} classes, {len(found)} import cycles")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
