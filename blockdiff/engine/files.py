"""Files written whole or not at all, whole-file reflinks with a copy as
the fallback, and small files read within bounds: what every layer that
writes a result or reads a configuration shares. The native core (and numpy
with it) is imported by the functions that write, so that reading a small
file (a store's configuration, at every start-up) does without them."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat

# Errors that mean "these two files cannot share extents": copy instead.
_NO_REFLINK = {errno.EXDEV, errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.ENOSYS}


class UnreadableFile(ValueError):
    """A small file that is not what it should be: not a regular file (a
    symbolic link, a device, a FIFO), too large, not UTF-8, not JSON, or
    nested too deeply. The message says which, without the path."""


# Nesting a small file's JSON may have: far below the parser's recursion limit.
JSON_DEPTH = 32
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def read_small_file(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file ``path``, refused (UnreadableFile) if
    it is a symbolic link (not followed), not a regular file (a FIFO or a
    device is never waited on or read without end) or larger than
    ``limit``; at most ``limit + 1`` bytes are read. A missing file is
    FileNotFoundError; other OSErrors pass."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnreadableFile("it is a symbolic link") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnreadableFile("it is not a regular file")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise UnreadableFile(f"it is larger than {limit} bytes")
    return b"".join(chunks)


def read_json_file(path: str | os.PathLike, limit: int, depth: int = JSON_DEPTH):
    """The JSON value of the small file ``path`` (:func:`read_small_file`),
    refused (UnreadableFile) unless it is UTF-8 JSON nested at most
    ``depth`` deep, with no string a lone surrogate would make unprintable."""
    raw = read_small_file(path, limit)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UnreadableFile("it is not UTF-8 text") from None
    # Bound the nesting before parsing: a deep one would reach Python's
    # recursion limit, in the parser or in whoever walks the value.
    level = deepest = 0
    for c in _BRACKET.findall(_JSON_STRING.sub("", text)):
        level += 1 if c in "[{" else -1
        deepest = max(deepest, level)
    if deepest > depth:
        raise UnreadableFile(f"it is nested more than {depth} deep")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise UnreadableFile(f"it is not JSON ({getattr(e, 'msg', type(e).__name__)})") \
            from None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise UnreadableFile("it holds a string that is not Unicode text") from None
    return value


@contextlib.contextmanager
def open_fd(path: str, flags: int = os.O_RDONLY):
    """A file descriptor of ``path``, closed when the block ends."""
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def clone_or_copy(src_fd: int, dst_fd: int, size: int, path: str) -> bool:
    """Make ``dst_fd`` a whole-file reflink of ``src_fd``, or where reflink
    cannot be had (another filesystem, none at all) a copy keeping holes.
    True when it is a reflink."""
    from blockdiff import native  # here, not at the top: it loads numpy

    try:
        native.clone_file(dst_fd, src_fd, path)
        return True
    except OSError as e:
        if e.errno not in _NO_REFLINK:
            raise
    native.copy_sparse(src_fd, dst_fd, size, path)
    return False


def copy_file(src: str | os.PathLike, dst: str | os.PathLike) -> bool:
    """``src`` to ``dst`` by :func:`clone_or_copy`, replacing ``dst`` atomically."""
    with open_fd(src) as src_fd, atomic_output(os.fspath(dst)) as (out_fd, temp):
        return clone_or_copy(src_fd, out_fd, os.fstat(src_fd).st_size, temp)


def temp_beside(final_path: str) -> str:
    """A new temporary name in the directory of ``final_path``."""
    # A random name opened O_EXCL, like tempfile.mkstemp, without its import cost.
    return os.path.join(os.path.dirname(os.path.abspath(final_path)),
                        f".{os.path.basename(final_path)}.{os.urandom(6).hex()}.partial")


def naming_final(error: OSError, temp: str, final_path: str) -> OSError:
    """``error`` as it should reach the user: naming the file asked for, not
    the temporary one it was being written as."""
    if error.filename is not None and os.fspath(error.filename) == temp:
        return OSError(error.errno, error.strerror, final_path)
    return error


@contextlib.contextmanager
def atomic_output(final_path: str, mode: int = 0o666):
    """A temporary file beside ``final_path`` that replaces it only on success.

    Yields ``(fd, temp_path)``. On success the file is fsynced, renamed over
    the final name and the directory fsynced; on failure it is removed, so a
    half-written result never appears under the final name.

    The file gets ``mode`` less the process's umask, as ``open()`` would give
    a new file (the kernel applies the umask when it creates the file, so
    nothing reads or changes the process-wide umask). A ``final_path`` that
    is a symbolic link is replaced by the new file; what it pointed to is
    left untouched.
    """
    from blockdiff import native

    directory = os.path.dirname(os.path.abspath(final_path))
    temp = temp_beside(final_path)
    try:
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode & 0o7777)
    except OSError as e:
        raise naming_final(e, temp, final_path) from None
    try:
        yield fd, temp
        native.fsync(fd, temp)
        os.rename(temp, final_path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise naming_final(e, temp, final_path) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    finally:
        os.close(fd)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
