"""The package's architecture, checked: each concern is one package, and a
module imports only from its own package or from the packages below it.

    cli        the command line: one module per command group
    demo       the main job and the scratch filesystems (no runtime package imports it)
    agent      agent checkpoints, sealing, disks, the LangGraph saver
    vm         sandbox VMs: image builder, QEMU, NBD, the guest daemon's link
    store      the snapshot store over layers, maps and a catalog
    db         the one database layer under the catalog, agent records and saver
    engine     extents, identity, the diff formats, create/apply, view
    native     the one module over the C core
    progress   how a long operation reports its progress (no imports)
    errors     the error table

Imports inside functions count as much as those at the top: a lazy import
upward is still an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "blockdiff"
FLOORS = ["errors", "progress", "native", "engine", "db", "store", "vm", "agent", "demo", "cli",
          "__main__"]
RANK = {name: i for i, name in enumerate(FLOORS)}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every blockdiff module ``path`` imports, at any depth of its code
    (``from blockdiff.engine import formats`` is an import of the module
    blockdiff.engine.formats, not of the package's face)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "blockdiff"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "blockdiff":
                found |= {f"blockdiff.{a.name}" for a in node.names if a.name != "__version__"}
            elif node.module.split(".")[0] == "blockdiff":
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
    return found


def _floor(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "blockdiff"


def _graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def test_every_module_sits_on_a_floor():
    unplaced = sorted(m for m in _graph() if _floor(m) not in RANK and m != "blockdiff")
    assert not unplaced, f"modules outside the packages of the layout: {unplaced}"


def test_no_module_imports_from_a_floor_above_it():
    upward = []
    for module, imported in _graph().items():
        floor = _floor(module)
        for target in imported:
            there = _floor(target)
            if there == "_native":
                continue
            if floor != "blockdiff" and there != floor and RANK.get(there, 0) >= RANK[floor]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that run upward or sideways:\n" + "\n".join(sorted(upward))


def test_only_native_imports_the_c_core():
    users = sorted(m for m, imported in _graph().items()
                   if any(t.startswith("blockdiff._native") for t in imported))
    assert users == ["blockdiff.native"]


def test_the_error_table_imports_nothing_of_blockdiff():
    assert _graph()["blockdiff.errors"] == set()


def test_no_import_cycles():
    """Between modules, not only packages: a cycle is two modules that can
    only be understood together."""
    graph = _graph()
    packages = {m for m in graph if (PACKAGE / Path(*m.split(".")[1:]) / "__init__.py").exists()}

    def edges(module):
        # A package's face re-exports its modules; importing a name from it is
        # importing the module that defines it, which the face names.
        return {t for t in graph.get(module, ()) if t in graph and t not in packages}

    state: dict[str, int] = {}
    cycles = []

    def visit(module, path):
        state[module] = 1
        for target in sorted(edges(module)):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state and module not in packages:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_layout_page_names_every_module():
    section = (ROOT / "docs" / "layout.md").read_text()
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 3 and cells[1].startswith("`"):
            rows[cells[1].strip("`")] = cells[2]
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if path.name in ("__init__.py", "__main__.py"):
            continue
        row = rows.get("blockdiff/" if len(relative.parts) == 1 else f"{relative.parts[0]}/", "")
        if f"`{path.name}`" not in row:
            missing.append(str(relative))
    assert not missing, f"modules docs/layout.md leaves out: {missing}"
