"""LangGraph's own conformance suite for checkpointers
(``langgraph-checkpoint-conformance``) against BlockdiffSaver on a real XFS
store: every capability, base (put, put_writes, get_tuple, list,
delete_thread) and extended (copy_thread, prune, delete_for_runs), must be
detected and pass, with a disk-less saver and with one that snapshots an
image disk at every top-level checkpoint.

Each capability's suite gets a fresh saver; the suite's threads have random
ids, so the savers of one run share one store.
"""

from __future__ import annotations

import asyncio
import os

from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import (
    ALL_CAPABILITIES,
    DetectedCapabilities,
)

from blockdiff.agent.disks import ImageDisk
from blockdiff.agent.langgraph import BlockdiffSaver
from blockdiff.store.store import Store

BLOCK = 4096


def _run(factory):
    report = asyncio.run(validate(factory))
    failures = {name: result.failures for name, result in report.results.items()
                if result.failures}
    assert not failures, failures
    assert set(report.results) == {c.value for c in ALL_CAPABILITIES}
    for name, result in report.results.items():
        assert result.detected, f"{name} is not implemented"
        assert result.passed is True and result.tests_passed > 0, (name, result)
        assert result.tests_failed == 0 and result.tests_skipped == 0, (name, result)
    assert report.passed_all_base() and report.passed_all()
    assert report.conformance_level() == "FULL"
    return report


def test_every_capability_is_implemented(xfs):
    with Store.init(xfs / "store") as store, BlockdiffSaver(store) as saver:
        detected = DetectedCapabilities.from_instance(saver)
    assert detected.detected == ALL_CAPABILITIES and not detected.missing


def test_conformance_without_a_disk(xfs):
    with Store.init(xfs / "store") as store:
        @checkpointer_test(name="BlockdiffSaver")
        async def saver():
            with BlockdiffSaver(store) as s:
                yield s

        _run(saver)


def test_conformance_with_an_image_disk(xfs):
    image = xfs / "disk.img"
    with open(image, "wb") as f:
        f.truncate(16 * BLOCK)
    with Store.init(xfs / "store") as store:
        steps = 0

        class WritingDisk(ImageDisk):
            """Every other snapshot sees new bytes, as a sandbox's would."""

            def checkpoint(self, *args, **kwargs):
                nonlocal steps
                steps += 1
                if steps % 2:
                    fd = os.open(image, os.O_WRONLY)
                    try:
                        os.pwrite(fd, steps.to_bytes(8, "little") * (BLOCK // 8),
                                  (steps % 16) * BLOCK)
                    finally:
                        os.close(fd)
                return super().checkpoint(*args, **kwargs)

        @checkpointer_test(name="BlockdiffSaver+ImageDisk")
        async def saver():
            with BlockdiffSaver(store, WritingDisk(store, image)) as s:
                yield s

        _run(saver)
        assert steps > 0 and len(store.log()) > 1
        # The suite's prunes and deletions removed snapshots, but none that
        # a remaining checkpoint names.
        with BlockdiffSaver(store) as s:
            named = {t.metadata["disk_snapshot"] for t in s.list(None)
                     if "disk_snapshot" in t.metadata}
        assert named <= {snap.id for snap in store.log()}
