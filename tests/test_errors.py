"""The one table of errors (blockdiff/errors.py): each exit status one
meaning, the README's table listing exactly the statuses blockdiff exits
with, and one path to import an error class from."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import re
from pathlib import Path

import blockdiff
from blockdiff import errors
from blockdiff.errors import BlockdiffError

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
ERROR_NAMES = {name for name, value in vars(errors).items()
               if isinstance(value, type) and issubclass(value, Exception)}


def _every_error_class() -> list[type]:
    for info in pkgutil.walk_packages(blockdiff.__path__, "blockdiff."):
        if info.name == "blockdiff.__main__":
            continue
        if info.name != "blockdiff.agent.langgraph" or importlib.util.find_spec("langgraph"):
            importlib.import_module(info.name)
    classes, everything = [BlockdiffError], []
    while classes:
        cls = classes.pop()
        everything.append(cls)
        classes.extend(cls.__subclasses__())
    return everything


def _exit_table() -> dict[int, tuple[str, str]]:
    text = README.read_text()
    table = text[text.index("| exit | `blockdiff` | the example agent |"):]
    rows = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        code, ours, example = (c.strip() for c in line.strip("|").split("|"))
        rows[int(code)] = (ours, example)
    return rows


def test_the_exit_table_is_what_the_code_returns():
    """One table of errors, each exit status one meaning, and the README's
    table lists exactly the statuses blockdiff exits with."""
    everything = _every_error_class()
    outside = [c.__module__ + "." + c.__qualname__ for c in everything
               if c.__module__ != errors.__name__ and not c.__module__.startswith("tests")]
    assert not outside, f"error classes outside blockdiff.errors: {outside}"
    # A status belongs to one family: one class sets it, the rest inherit it.
    setters: dict[int, list[str]] = {}
    for cls in everything:
        if "exit_code" in vars(cls) and cls is not BlockdiffError:
            setters.setdefault(cls.exit_code, []).append(cls.__name__)
    assert all(len(names) == 1 for names in setters.values()), setters
    codes = {0} | {cls.exit_code for cls in everything}
    cli = "\n".join(p.read_text() for p in (ROOT / "blockdiff" / "cli").glob("*.py"))
    codes |= {int(c) for c in re.findall(r"\bfail\([^\n]*?, (\d+)\)\n", cli)}
    codes |= {int(c) for c in re.findall(r"sys\.exit\((\d+)\)", cli)}
    rows = _exit_table()
    assert {c for c, (ours, _) in rows.items() if ours} == codes
    example = (ROOT / "examples" / "agent_example.py").read_text()
    _names, values = re.search(r"^(EXIT_\w+(?:, EXIT_\w+)*) = ([\d, ]+)$", example,
                              re.M).groups()
    statuses = {int(v) for v in values.split(", ")}
    assert "signal.SIGKILL" in example          # --crash-at: 128 + 9 in a shell
    assert {c for c, (_, theirs) in rows.items() if theirs} == statuses | {137}


def _python_sources() -> list[Path]:
    return [path for folder in ("blockdiff", "tests", "bench", "examples")
            for path in (ROOT / folder).rglob("*.py")]


def test_error_classes_are_imported_from_blockdiff_errors_only():
    """An error class has one import path: ``from blockdiff.errors import X``.
    A module that uses one imports it from there, and no package re-exports
    one, so a reader finds every error, and what it means, in one file."""
    elsewhere = []
    for path in _python_sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.startswith("blockdiff") and node.module != "blockdiff.errors"):
                elsewhere += [f"{path.relative_to(ROOT)}:{node.lineno}: {a.name} from {node.module}"
                              for a in node.names if a.name in ERROR_NAMES]
    for module in ("blockdiff.store", "blockdiff.store.store"):
        exported = set(getattr(importlib.import_module(module), "__all__", ()))
        elsewhere += [f"{module}.__all__: {name}" for name in sorted(exported & ERROR_NAMES)]
    assert not elsewhere, "\n".join(elsewhere)


def test_the_documentation_imports_errors_from_blockdiff_errors():
    """The examples in the README and docs/ import error classes from the one path too."""
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    wrong = [f"{page.name}: {line.strip()}" for page in pages
             for line in page.read_text().splitlines()
             if re.match(r"\s*from blockdiff\.(?!errors\b)\S+ import .*", line)
             and set(re.findall(r"\w+", line.split(" import ", 1)[1])) & ERROR_NAMES]
    assert not wrong, "\n".join(wrong)
