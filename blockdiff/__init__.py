"""blockdiff: block-level copy-on-write diffs of disk images on reflink filesystems.

Imports stay lazy: the command line starts in milliseconds and loads numpy
and the native core only for the commands that need them.
"""

__version__ = "0.1.0"
