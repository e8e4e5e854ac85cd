"""A sandbox VM handed over between two hosts of a shared store (real guests
under TCG): checkpointed on host A with its memory, taken over on host B by
a VM made from that checkpoint alone, whose kernel and snapshots come from
the object store. Its processes carry on with their memory; its disk is the
checkpoint's byte for byte."""

from __future__ import annotations

import filecmp
import uuid

import pytest
from guests import alive, payload_hash, run, running_step

from blockdiff.store.store import Store
from blockdiff.vm.sandbox import Sandbox

pytestmark = [pytest.mark.services]


@pytest.mark.parametrize("catalog", ["postgresql"], indirect=True)
def test_a_vm_checkpointed_on_one_host_resumes_on_another(xfs, second_xfs, catalog,  # noqa: F811
                                                          s3_env, vm_image):
    b_root = second_xfs / f"vm-{uuid.uuid4().hex[:8]}"
    b_root.mkdir()
    a = Store.init(xfs / "store", catalog=catalog, remote=f"s3://{s3_env.bucket}/"
                   f"{uuid.uuid4().hex}")
    b = Store.init(b_root / "store", catalog=catalog)
    moved = None
    try:
        with Sandbox.create(a, "box", image=vm_image.rootfs) as box:
            box.start()
            pid, digest = running_step(box)
            run(box, "echo 'made on A' > /root/note && sync")
            checkpoint = box.checkpoint("handover")
            box.stop()                      # host A goes away
            a_disk = xfs / "a-disk.img"
            a.restore(checkpoint, a_disk)
        assert b.durable(checkpoint)
        moved = Sandbox.from_checkpoint(b, checkpoint, "moved")
        assert moved.running and alive(moved, pid)
        assert payload_hash(moved) == digest
        assert run(moved, "cat /root/note") == "made on A\n"
        assert int(run(moved, "cat /tmp/counter")) > 0
        # And it checkpoints on B, where A can take it back.
        run(moved, "echo 'then on B' >> /root/note && sync")
        again = moved.checkpoint("on B")
        moved.stop()
        b_disk = b_root / "b-disk.img"
        b.restore(again, b_disk)
        back = xfs / "back.img"
        a.restore(again, back)
        assert filecmp.cmp(back, b_disk, shallow=False)
        assert not filecmp.cmp(back, a_disk, shallow=False)
    finally:
        if moved is not None:
            moved._kill()
        a.close()
        b.close()
