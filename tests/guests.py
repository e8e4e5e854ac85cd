"""The guests' pytest plugin (loaded by conftest) and the helpers the VM
tests share: the image every guest boots, a store whose VMs are killed after
the test, a running whole-VM sandbox, and what a test runs inside a guest.

The image is built once per machine into a cache directory
(``BLOCKDIFF_TEST_VM_IMAGE``, default ``~/.cache/blockdiff/test-vm``) and
checked once per session. Tests using ``vm_image`` are marked ``vm``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from blockdiff.store.store import Store
from blockdiff.vm import qemu
from blockdiff.vm.image import build_image
from blockdiff.vm.sandbox import MEMORY_KEY, Sandbox

IMAGE_CACHE = Path(os.environ.get("BLOCKDIFF_TEST_VM_IMAGE",
                                  Path.home() / ".cache" / "blockdiff" / "test-vm"))
# A process of the step: counts into /tmp/counter ten times a second. Each
# count is written beside it and renamed over it: "echo > /tmp/counter"
# truncates first, and a read (or a checkpoint) between the truncation and the
# write would find the file empty.
COUNTER = ("(i=0; while true; do i=$((i+1)); echo $i > /tmp/counter.new; "
           "mv -f /tmp/counter.new /tmp/counter; sleep 0.1; done) >/dev/null 2>&1 & echo $!")
# 16 MiB of random bytes in a tmpfs: they live only in guest RAM.
PAYLOAD = ("mkdir -p /mnt/ram && mount -t tmpfs -o size=32m tmpfs /mnt/ram && "
           "head -c 16777216 /dev/urandom > /mnt/ram/payload && sha256sum /mnt/ram/payload")


@pytest.fixture(scope="session")
def vm_image():
    """The image the guests boot (rootfs, kernel, initramfs)."""
    missing = [t for t in (qemu.QEMU, "apt-get", "dpkg-deb", "gcc", "mkfs.ext4", "debugfs")
               if shutil.which(t) is None]
    if missing:
        pytest.skip(f"sandbox VMs need {', '.join(missing)} (installed by .ci/setup)")
    return build_image(IMAGE_CACHE)


@pytest.fixture
def vm_store(xfs):
    """A store on the test's XFS; every VM left in it is killed at the end."""
    with Store.init(xfs / "store") as store:
        yield store
        for box in Sandbox.list(store):
            box._kill()


@dataclass(frozen=True)
class BootedGuest:
    """A guest booted once per session and checkpointed with its memory,
    as export files a test's store imports (see ``memory_box``)."""

    checkpoint: str
    exports: tuple[Path, ...]      # the memory snapshot's, then the disk's


@pytest.fixture(scope="session")
def booted_guest(vm_image, _session_mounts, tmp_path_factory) -> BootedGuest:
    """The session's one boot of the image: a VM started and checkpointed
    right after its boot, exported. Each ``memory_box`` resumes a copy."""
    directory = tmp_path_factory.mktemp("booted-guest")
    root = Path(tempfile.mkdtemp(prefix="booted-guest-", dir=_session_mounts("xfs")))
    try:
        with Store.init(root / "store") as store:
            with Sandbox.create(store, "box", image=vm_image.rootfs) as sandbox:
                sandbox.start()
                checkpoint = sandbox.checkpoint("booted")
                sandbox._kill()
            memory = store.get(checkpoint).meta[MEMORY_KEY]
            exports = (directory / "memory.bdx", directory / "disk.bdx")
            store.export(memory, exports[0])
            store.export(checkpoint, exports[1])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return BootedGuest(checkpoint, exports)


@pytest.fixture
def memory_box(vm_store, vm_image, booted_guest):
    """A running VM named "box" whose checkpoints hold its RAM and devices:
    the session's booted guest resumed in the test's store (its checkpoint
    imported there), not a boot of its own."""
    for export in booted_guest.exports:
        vm_store.import_(export)
    with Sandbox.from_checkpoint(vm_store, booted_guest.checkpoint, "box",
                                 kernel=vm_image.directory) as sandbox:
        assert sandbox.memory_checkpoints   # the default on a reflink store
        yield sandbox


@pytest.fixture
def booted_memory_box(vm_store, vm_image):
    """A "box" like ``memory_box``'s, booted in the test's store: for tests
    of what a VM's first checkpoints and its store's first snapshots are."""
    with Sandbox.create(vm_store, "box", image=vm_image.rootfs) as sandbox:
        assert sandbox.memory_checkpoints
        sandbox.start()
        yield sandbox


def run(sandbox: Sandbox, command: str) -> str:
    """`command`'s stdout in the guest; it must succeed."""
    result = sandbox.exec(command, timeout=60)
    assert result.status == 0, (command, result.stderr)
    return result.stdout.decode()


def counter(sandbox: Sandbox) -> int:
    return int(run(sandbox, "cat /tmp/counter"))


def alive(sandbox: Sandbox, pid: int) -> bool:
    """Whether process ``pid`` runs in the guest. A killed orphan stays a
    zombie until the guest's PID 1 reaps it, and ``kill -0`` still reaches
    a zombie: one checkpointed before it was reaped is dead, not alive."""
    state = f"sed 's/.*) //;s/ .*//' /proc/{pid}/stat"
    return sandbox.exec(f'kill -0 {pid} && [ "$({state})" != Z ]').status == 0


def payload_hash(sandbox: Sandbox) -> str:
    return run(sandbox, "sha256sum /mnt/ram/payload").split()[0]


def running_step(sandbox: Sandbox) -> tuple[int, str]:
    """A counter process and a tmpfs payload; their pid and hash."""
    pid = int(run(sandbox, COUNTER))
    digest = run(sandbox, PAYLOAD).split()[0]
    deadline = time.monotonic() + 30
    while sandbox.exec("test -s /tmp/counter").status != 0:
        assert time.monotonic() < deadline, "the counter never counted"
        time.sleep(0.05)
    return pid, digest
