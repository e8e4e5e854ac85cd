"""cffi (API mode) build of blockdiff's native core.

The declarations come from native.h; kernel constants are declared with
``...`` so the compiler supplies their values from the kernel headers.
"""

from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent

KERNEL_CONSTANTS = """
#define FIEMAP_EXTENT_LAST ...
#define FIEMAP_EXTENT_UNKNOWN ...
#define FIEMAP_EXTENT_DELALLOC ...
#define FIEMAP_EXTENT_ENCODED ...
#define FIEMAP_EXTENT_DATA_ENCRYPTED ...
#define FIEMAP_EXTENT_NOT_ALIGNED ...
#define FIEMAP_EXTENT_DATA_INLINE ...
#define FIEMAP_EXTENT_DATA_TAIL ...
#define FIEMAP_EXTENT_UNWRITTEN ...
#define FIEMAP_EXTENT_MERGED ...
#define FIEMAP_EXTENT_SHARED ...
#define XFS_SUPER_MAGIC ...
#define BTRFS_SUPER_MAGIC ...
#define EXT4_SUPER_MAGIC ...
#define TMPFS_MAGIC ...
"""


def _declarations() -> str:
    header = (HERE / "native.h").read_text()
    # cffi's parser takes declarations only; include guards and includes go.
    lines = [ln for ln in header.splitlines() if not ln.lstrip().startswith("#")]
    return "\n".join(lines) + KERNEL_CONSTANTS


ffibuilder = FFI()
ffibuilder.cdef(_declarations())
ffibuilder.set_source(
    "blockdiff._native",
    '#include <linux/fiemap.h>\n#include <linux/magic.h>\n#include "native.h"\n',
    # Paths relative to the repository root, where setup.py runs.
    sources=["csrc/native.c"],
    include_dirs=["csrc"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
