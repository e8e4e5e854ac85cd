"""Shared pytest fixtures: real XFS/btrfs/ext4/tmpfs mounts, the servers
(plugins below), the shared-store fixtures and the bench marker.

Fixtures `xfs`, `btrfs`, `ext4`, `tmpfs`, `reflink_fs` (xfs, btrfs) and
`any_fs` (all four) each give a test its own fresh, empty directory on a
mounted filesystem of that kind.  Each kind is mounted once per session on
first use.  `fresh_filesystem(kind, size=None)` gives a private mount for
tests that need an exact size (e.g. running out of space).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

# Let tests import the helper modules next to this file under any
# --import-mode (importlib mode does not add test directories to sys.path).
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import filesystems  # noqa: E402
from filesystems import KINDS, REFLINK_KINDS  # noqa: E402

# The servers' fixtures (`postgres_server`, `postgres_url`, `seaweedfs`,
# `s3_env`) and the guests' (`vm_image`, `vm_store`, `memory_box`) are
# plugins, so each server starts and the image is checked once per session:
# a session fixture imported into a test module is a new fixture of that
# module, and starts again there.
pytest_plugins = ["postgres", "objectstore", "guests"]


def pytest_addoption(parser):
    parser.addoption("--run-bench", action="store_true", default=False,
                     help="run benchmarks (tests marked 'bench'), skipped by default")
    parser.addoption("--fast", action="store_true", default=False,
                     help="the fast tier: leave out the tests marked vm, services or slow, "
                          "at BLOCKDIFF_TEST_BUDGET=small")


# The tiers. A test is marked from the fixtures it uses (its whole closure):
# `vm` if it needs a guest image, `services` if it needs the session's
# PostgreSQL or object store; `slow` is set by hand on races, kill matrices
# and whole-program runs. The fast tier (`--fast`) leaves all three out and
# runs the rest at the small budget (tests/budget.py).
VM_FIXTURES = frozenset({"vm_image"})
SERVICE_FIXTURES = frozenset({"postgres_server", "seaweedfs"})
TIERED = frozenset({"vm", "services", "slow"})


def pytest_configure(config):
    if config.getoption("--fast"):
        # Before any test module imports tests/budget.py, which reads it.
        os.environ["BLOCKDIFF_TEST_BUDGET"] = "small"
    config.addinivalue_line("markers", "bench: benchmark; skipped unless --run-bench is given")
    config.addinivalue_line("markers", "vm: boots or restores a real QEMU guest")
    config.addinivalue_line("markers", "services: uses the session's PostgreSQL or object store")
    config.addinivalue_line("markers", "slow: a race, a kill matrix or a whole-program run; "
                                       "left out of the fast tier")


def pytest_sessionstart(session):
    # SIGTERM (CI timeouts, `timeout`) would otherwise kill the interpreter
    # without running fixture teardown and leave mounts and loop devices
    # behind; as KeyboardInterrupt, pytest tears down fixtures and exits.
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    # Mounts from runs that were SIGKILLed can only be cleaned up later.
    if os.geteuid() == 0:
        filesystems.cleanup_stale_mounts()


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"received signal {signum}")


def pytest_report_header(config):
    lines = ["filesystems:"]
    for kind in KINDS:
        reason = filesystems.filesystem_unavailable_reason(kind)
        lines.append(f"  {kind}: " + ("available" if reason is None else f"unavailable - {reason}"))
    return lines


def pytest_collection_modifyitems(config, items):
    run_bench = config.getoption("--run-bench")
    skip_bench = pytest.mark.skip(reason="benchmark; pass --run-bench to run")
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & VM_FIXTURES:
            item.add_marker(pytest.mark.vm)
        if fixtures & SERVICE_FIXTURES:
            item.add_marker(pytest.mark.services)
        if "bench" in item.keywords and not run_bench:
            item.add_marker(skip_bench)
    if config.getoption("--fast"):
        def tiered(item) -> bool:
            return any(mark.name in TIERED for mark in item.iter_markers())

        left_out = [item for item in items if tiered(item)]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if not tiered(item)]


def _require(kind: str) -> None:
    reason = filesystems.filesystem_unavailable_reason(kind)
    if reason is not None:
        pytest.skip(f"{kind} unavailable: {reason}")


@pytest.fixture(scope="session")
def _session_mounts():
    """Mount each kind on first request; unmount everything at session end."""
    with contextlib.ExitStack() as stack:
        mounts: dict[str, Path] = {}

        def get(kind: str) -> Path:
            _require(kind)
            if kind not in mounts:
                mounts[kind] = stack.enter_context(filesystems.mounted_filesystem(kind))
            return mounts[kind]

        yield get


def _test_dir(request, get_mount, kind: str):
    root = get_mount(kind)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)[:60]
    path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
    yield path
    # Files are removed after each test so one long session does not fill the
    # shared filesystem.
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def second_xfs():
    """Another XFS filesystem: the second host's disk
    in the tests of a store several hosts share."""
    reason = filesystems.filesystem_unavailable_reason("xfs")
    if reason is not None:
        pytest.skip(f"xfs unavailable: {reason}")
    with filesystems.mounted_filesystem("xfs") as mount:
        yield mount


@pytest.fixture
def host_b_dir(second_xfs):
    """A fresh directory on the second host's XFS."""
    path = second_xfs / f"b-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["postgresql", "sqlite"])
def catalog(request, tmp_path):
    """Where the hosts' shared catalog is: a database of a real PostgreSQL
    server, or a SQLite file (store directories on one machine)."""
    if request.param == "sqlite":
        return str(tmp_path / "shared-catalog.sqlite")
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def xfs(request, _session_mounts):
    """Fresh empty directory on a reflink-enabled XFS mount."""
    yield from _test_dir(request, _session_mounts, "xfs")


@pytest.fixture
def btrfs(request, _session_mounts):
    """Fresh empty directory on a btrfs mount."""
    yield from _test_dir(request, _session_mounts, "btrfs")


@pytest.fixture
def ext4(request, _session_mounts):
    """Fresh empty directory on an ext4 mount (no reflink support)."""
    yield from _test_dir(request, _session_mounts, "ext4")


@pytest.fixture
def tmpfs(request, _session_mounts):
    """Fresh empty directory on a tmpfs mount (no reflink, no FIEMAP)."""
    yield from _test_dir(request, _session_mounts, "tmpfs")


@pytest.fixture(params=REFLINK_KINDS)
def reflink_fs(request, _session_mounts):
    """Fresh directory on each reflink-capable filesystem (xfs, btrfs).

    The kind is `request.node.callspec.params["reflink_fs"]` or
    `filesystems.filesystem_type(path)`.
    """
    yield from _test_dir(request, _session_mounts, request.param)


@pytest.fixture(params=KINDS)
def any_fs(request, _session_mounts):
    """Fresh directory on each of xfs, btrfs, ext4 and tmpfs."""
    yield from _test_dir(request, _session_mounts, request.param)


@pytest.fixture
def fresh_filesystem():
    """Factory: `fresh_filesystem(kind, size=None)` mounts a private filesystem.

    Returns the mount point; it is torn down when the test finishes.
    """
    with contextlib.ExitStack() as stack:
        def make(kind: str, size: int | None = None) -> Path:
            _require(kind)
            return stack.enter_context(filesystems.mounted_filesystem(kind, size=size))

        yield make
