"""pytest set-up for the benchmarks in bench/: the `bench` marker and
--run-bench.  Benchmarks are skipped unless --run-bench is given:

    pytest bench --run-bench
"""

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # for `import workloads` under any --import-mode


def pytest_addoption(parser):
    try:
        parser.addoption("--run-bench", action="store_true", default=False,
                         help="run benchmarks (tests marked 'bench'), skipped by default")
    except ValueError:
        pass  # already added by tests/conftest.py when both directories are collected


def pytest_configure(config):
    try:
        import workloads  # noqa: F401  (checks that blockdiff imports)
    except ImportError as e:
        raise pytest.UsageError(str(e)) from None
    config.addinivalue_line("markers", "bench: benchmark; skipped unless --run-bench is given")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-bench"):
        return
    skip = pytest.mark.skip(reason="benchmark: pass --run-bench to run")
    for item in items:
        if "bench" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def scratch_xfs_possible():
    """Skip, with the reason, where no scratch XFS can be made here."""
    from blockdiff.demo import scratch

    reason = scratch.filesystem_unavailable_reason("xfs")
    if reason:
        pytest.skip(f"no scratch XFS filesystem: {reason}")
