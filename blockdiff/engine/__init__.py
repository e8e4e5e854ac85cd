"""The diff engine: extent maps and their algebra, snapshot identity, the
diff formats, creating and applying diffs, and viewing them. It knows files
and filesystems, nothing of stores, VMs or agents."""

from blockdiff.engine.diff import (
           ApplyResult,
           CreateResult,
           apply_diff,
           create_diff,
           map_file,
           read_diff,
)
from blockdiff.engine.files import atomic_output, copy_file

__all__ = ["ApplyResult", "CreateResult", "apply_diff", "atomic_output", "copy_file",
           "create_diff", "map_file", "read_diff"]
