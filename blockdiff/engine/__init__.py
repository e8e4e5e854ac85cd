"""The diff engine: extent maps and their algebra, snapshot identity, the
diff formats, creating and applying diffs, and viewing them. It knows files
and filesystems, nothing of stores, VMs or agents.

The names below are imported from their modules when first asked for: the
diff module loads numpy and the native core, which a caller of a small
module of the package (``units``, ``files``) does without."""

from __future__ import annotations

import importlib

# Each name offered here, and the module of the package that has it.
_HOMES = {"ApplyResult": "diff", "CreateResult": "diff", "apply_diff": "diff",
          "create_diff": "diff", "map_file": "diff", "read_diff": "diff",
          "atomic_output": "files", "copy_file": "files"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
