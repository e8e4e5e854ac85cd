"""The engine on real filesystems: every scenario, both formats, compared byte for byte."""

from __future__ import annotations

import errno
import hashlib
import os
import resource
import shutil
import struct
import subprocess
import sys

import budget
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scenarios
from blockdiff import native
from blockdiff.engine import diff as engine
from blockdiff.engine import files
from blockdiff.engine import formats as fmt
from blockdiff.engine.extents import DATA, ZERO
from blockdiff.errors import UsageError, WrongBase
from scenarios import SCENARIOS, assert_same_bytes, make_base_image

BLOCK = 4096
BASE_SIZE = 6 * 1024 * 1024 + 1234   # not a block multiple
FORMATS = ["v1", "v2"]


def _digest(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _clear(directory):
    for p in directory.iterdir():
        p.unlink()


def _round_trip(directory, scenario, fmt_name, seed=1, restore_dir=None):
    """Build a scenario, diff it, apply it; return (create, apply) results."""
    base, target = directory / "base.img", directory / "target.img"
    make_base_image(base, BASE_SIZE, seed)
    SCENARIOS[scenario](base, target, seed)
    base_digest = _digest(base)
    diff = directory / "step.bdiff"
    created = engine.create_diff(diff, target, base, format=fmt_name)
    restored = (restore_dir or directory) / "restored.img"
    applied = engine.apply_diff(diff, restored, base)
    assert_same_bytes(restored, target)
    assert _digest(base) == base_digest, "apply modified the base"
    assert not [p for p in os.listdir(restore_dir or directory) if p.endswith(".partial")]
    return created, applied


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenarios_on_reflink_filesystems(reflink_fs, scenario, fmt_name):
    created, applied = _round_trip(reflink_fs, scenario, fmt_name)
    assert created.method == "extents"
    assert applied.base_reflinked
    # Same filesystem: every data range travels by reflink both ways, an
    # unaligned last one included.
    header = engine.read_diff(reflink_fs / "step.bdiff")
    data_ranges = int((header.ranges.kind == DATA).sum())
    assert not created.notes, created.notes      # nothing had to be copied
    assert applied.reflinked == data_ranges
    if fmt_name == "v2":
        assert created.reflinked == data_ranges


def test_random_writes_diff_holds_only_changed_blocks(xfs):
    base, target = xfs / "base.img", xfs / "target.img"
    make_base_image(base, BASE_SIZE, 3, sparse_fraction=0.0, zero_fraction=0.0)
    scenarios.clone_file(base, target)
    scenarios.random_block_writes(target, count=40, seed=5)
    created = engine.create_diff(xfs / "d.bdiff", target, base)
    # At most the 40 rewritten blocks (fewer if two writes hit one block).
    assert 0 < created.data_bytes <= 40 * BLOCK
    assert created.zero_bytes == 0


def test_punched_holes_restore_as_zeros_not_old_data(xfs):
    """The upstream tool restores the base's old data over a discarded range."""
    base, target = xfs / "base.img", xfs / "target.img"
    make_base_image(base, BASE_SIZE, 4, sparse_fraction=0.0, zero_fraction=0.0)
    scenarios.clone_file(base, target)
    scenarios.punch_hole(target, 64 * BLOCK, 32 * BLOCK)
    scenarios.preallocate_unwritten(target, 200 * BLOCK, 16 * BLOCK)
    for fmt_name in FORMATS:
        diff = xfs / f"{fmt_name}.bdiff"
        created = engine.create_diff(diff, target, base, format=fmt_name)
        restored = xfs / f"{fmt_name}.img"
        engine.apply_diff(diff, restored, base)
        assert_same_bytes(restored, target)
        if fmt_name == "v2":
            assert created.zero_bytes == 48 * BLOCK and created.data_bytes == 0
            assert os.path.getsize(diff) == fmt.v2_data_offset(created.ranges)
        else:
            # v1 stores the zero ranges as holes in the diff: no data blocks used.
            assert os.stat(diff).st_blocks * 512 <= 2 * BLOCK


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_no_base_compacts_a_sparse_file(reflink_fs, fmt_name):
    image = reflink_fs / "sparse.img"
    make_base_image(image, BASE_SIZE, 6, sparse_fraction=0.7)
    diff = reflink_fs / "full.bdiff"
    created = engine.create_diff(diff, image, format=fmt_name)
    restored = reflink_fs / "restored.img"
    engine.apply_diff(diff, restored)
    assert_same_bytes(restored, image)
    allocated = os.stat(image).st_blocks * 512
    assert created.data_bytes <= allocated
    assert os.path.getsize(diff) < BASE_SIZE


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("scenario", ["mixed", "punched_holes", "grow", "shrink_unaligned"])
def test_apply_onto_another_filesystem(xfs, ext4, tmpfs, scenario, fmt_name):
    """Target on ext4/tmpfs: the base and the ranges are copied, not reflinked."""
    for other in (ext4, tmpfs):
        created, applied = _round_trip(xfs, scenario, fmt_name, restore_dir=other)
        assert not applied.base_reflinked
        assert applied.reflinked == 0
        assert applied.notes
        _clear(other)
        _clear(xfs)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_diff_moved_to_another_host_filesystem(xfs, btrfs, fmt_name):
    """A diff made on XFS, carried with its base to btrfs and applied there."""
    base, target = xfs / "base.img", xfs / "target.img"
    make_base_image(base, BASE_SIZE, 8)
    SCENARIOS["mixed"](base, target, 8)
    engine.create_diff(xfs / "d.bdiff", target, base, format=fmt_name)
    for name in ("base.img", "d.bdiff"):
        shutil.copyfile(xfs / name, btrfs / name)
    engine.apply_diff(btrfs / "d.bdiff", btrfs / "restored.img", btrfs / "base.img")
    assert_same_bytes(btrfs / "restored.img", target)


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("scenario", ["random_4k_writes", "punched_holes", "zero_ranges",
                                      "grow", "shrink_unaligned", "mixed", "empty_base"])
def test_content_fallback_without_reflink(ext4, tmpfs, scenario, fmt_name):
    for directory in (ext4, tmpfs):
        created, _ = _round_trip(directory, scenario, fmt_name)
        assert created.method == "content"
        assert any("comparing contents" in n for n in created.notes)
        _clear(directory)


def test_content_fallback_finds_only_changed_blocks(ext4):
    base, target = ext4 / "base.img", ext4 / "target.img"
    make_base_image(base, BASE_SIZE, 9, sparse_fraction=0.0, zero_fraction=0.0)
    shutil.copyfile(base, target)
    scenarios.random_block_writes(target, count=10, seed=2)
    scenarios.punch_hole(target, 100 * BLOCK, 4 * BLOCK)
    created = engine.create_diff(ext4 / "d.bdiff", target, base)
    assert created.data_bytes <= 10 * BLOCK
    assert created.zero_bytes == 4 * BLOCK


def test_base_on_another_filesystem_falls_back_to_content(xfs, btrfs):
    base = btrfs / "base.img"
    make_base_image(base, BASE_SIZE, 10)
    target = xfs / "target.img"
    shutil.copyfile(base, target)
    scenarios.random_block_writes(target, count=5, seed=3)
    created = engine.create_diff(xfs / "d.bdiff", target, base)
    assert created.method == "content"
    engine.apply_diff(xfs / "d.bdiff", xfs / "restored.img", base)
    assert_same_bytes(xfs / "restored.img", target)


def test_chain_of_agent_steps_restores_every_step(xfs):
    """Ten steps, each diffed against the previous step's restored image."""
    disk = xfs / "disk.img"
    make_base_image(disk, BASE_SIZE, 11)
    previous = xfs / "step0.img"
    scenarios.clone_file(disk, previous)
    ops = ["random_4k_writes", "punched_holes", "grow", "unwritten_extents", "zero_ranges",
           "sequential_writes", "shrink_unaligned", "mixed", "random_4k_writes", "mixed"]
    snapshots = [previous]
    for step, op in enumerate(ops, 1):
        nxt = xfs / f"live{step}.img"
        SCENARIOS[op](snapshots[-1], nxt, step)
        diff = xfs / f"step{step}.bdiff"
        engine.create_diff(diff, nxt, snapshots[-1])
        restored = xfs / f"step{step}.img"
        engine.apply_diff(diff, restored, snapshots[-1])
        assert_same_bytes(restored, nxt)
        snapshots.append(restored)
    # Each restored step still holds exactly what it held when it was made.
    for step in range(1, len(ops) + 1):
        assert_same_bytes(xfs / f"step{step}.img", xfs / f"live{step}.img")


def test_snapshot_ids_chain_through_apply(xfs):
    base, target = xfs / "base.img", xfs / "target.img"
    make_base_image(base, BASE_SIZE, 12)
    SCENARIOS["mixed"](base, target, 12)
    first = engine.create_diff(xfs / "1.bdiff", target, base)
    engine.apply_diff(xfs / "1.bdiff", xfs / "s1.img", base)
    # The restored file carries the id of the snapshot it is.
    later = xfs / "later.img"
    SCENARIOS["random_4k_writes"](xfs / "s1.img", later, 13)
    engine.create_diff(xfs / "2.bdiff", later, xfs / "s1.img")
    assert engine.read_diff(xfs / "2.bdiff").base_id == first.target_id
    engine.apply_diff(xfs / "2.bdiff", xfs / "s2.img", xfs / "s1.img")
    assert_same_bytes(xfs / "s2.img", later)



def _unsampled_block(size: int) -> int:
    """A block the base fingerprint does not read (see docs/format.md)."""
    blocks = -(-size // BLOCK)
    k = min(256, blocks)
    sampled = {i * blocks // k for i in range(k)} | {blocks - 1}
    return next(b for b in range(blocks // 2, blocks) if b not in sampled)


def _base_one_block_off(base, path) -> None:
    """A copy of ``base`` (same size) with one unsampled block rewritten."""
    shutil.copyfile(base, path)
    offset = _unsampled_block(os.path.getsize(base)) * BLOCK
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(BLOCK)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in old))


def test_verify_base_refuses_a_base_differing_in_one_block(xfs):
    base, target = xfs / "base.img", xfs / "target.img"
    make_base_image(base, BASE_SIZE, 21)
    SCENARIOS["random_4k_writes"](base, target, 21)
    engine.create_diff(xfs / "d.bdiff", target, base, base_digest=True)
    wrong = xfs / "wrong.img"
    _base_one_block_off(base, wrong)
    # Documented: without --verify-base only 256 sampled blocks are compared,
    # so a base that differs only in an unsampled block is applied.
    engine.apply_diff(xfs / "d.bdiff", xfs / "sampled.img", wrong)
    assert _digest(xfs / "sampled.img") != _digest(target)
    with pytest.raises(WrongBase, match="read in full"):
        engine.apply_diff(xfs / "d.bdiff", xfs / "out.img", wrong, verify_base=True)
    assert not (xfs / "out.img").exists()
    engine.apply_diff(xfs / "d.bdiff", xfs / "out.img", base, verify_base=True)
    assert_same_bytes(xfs / "out.img", target)


def test_base_digest_is_format_v2_1_and_optional(xfs):
    base, target = xfs / "base.img", xfs / "target.img"
    make_base_image(base, BASE_SIZE, 22)
    SCENARIOS["mixed"](base, target, 22)
    engine.create_diff(xfs / "plain.bdiff", target, base)
    engine.create_diff(xfs / "digest.bdiff", target, base, base_digest=True)
    raw_plain = (xfs / "plain.bdiff").read_bytes()[:192]
    raw = (xfs / "digest.bdiff").read_bytes()[:192]
    # Without the digest the header is the v2.0 one, reserved bytes zero.
    assert struct.unpack_from("<HHII", raw_plain, 8) == (2, 0, 192, 4096)
    assert struct.unpack_from("<I", raw_plain, 20)[0] == fmt.V2_FLAG_HAS_BASE
    assert raw_plain[128:184] == bytes(56)
    # With it: minor 1, flag bit 1, the digest at 128-159, the rest still zero.
    assert struct.unpack_from("<HH", raw, 8) == (2, 1)
    assert struct.unpack_from("<I", raw, 20)[0] == fmt.V2_FLAG_HAS_BASE | fmt.V2_FLAG_BASE_DIGEST
    expected = hashlib.blake2b(BASE_SIZE.to_bytes(8, "little") + base.read_bytes(),
                               digest_size=32, person=b"blockdiff-whole").digest()
    assert raw[128:160] == expected and raw[160:184] == bytes(24)
    assert engine.read_diff(xfs / "digest.bdiff").base_digest == expected
    assert engine.read_diff(xfs / "plain.bdiff").base_digest is None
    # A reader that knows nothing of the digest (v2.0) sees the same diff.
    old = bytearray((xfs / "digest.bdiff").read_bytes())
    old[10:12] = b"\0\0"
    old[20:24] = struct.pack("<I", fmt.V2_FLAG_HAS_BASE)
    old[128:160] = bytes(32)
    old[188:192] = struct.pack("<I", native.crc32c(bytes(old[:188])))
    (xfs / "old.bdiff").write_bytes(bytes(old))
    engine.apply_diff(xfs / "old.bdiff", xfs / "out.img", base)
    assert_same_bytes(xfs / "out.img", target)
    # --verify-base with a diff that records no digest (or a v1 diff) is refused.
    with pytest.raises(UsageError, match="--base-digest"):
        engine.apply_diff(xfs / "plain.bdiff", xfs / "x.img", base, verify_base=True)
    engine.create_diff(xfs / "v1.bdiff", target, base, format="v1")
    with pytest.raises(UsageError, match="v1"):
        engine.apply_diff(xfs / "v1.bdiff", xfs / "x.img", base, verify_base=True)
    assert not (xfs / "x.img").exists()


def test_verify_base_on_the_command_line(xfs):
    base, target = xfs / "base.img", xfs / "target.img"
    make_base_image(base, BASE_SIZE, 23)
    SCENARIOS["random_4k_writes"](base, target, 23)
    _base_one_block_off(base, xfs / "wrong.img")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "blockdiff", *map(str, args)],
                              capture_output=True, text=True, cwd=xfs)

    assert cli("create", "-q", "d.bdiff", target, "--base", base, "--base-digest").returncode == 0
    assert cli("create", "-q", "plain.bdiff", target, "--base", base).returncode == 0
    assert cli("apply", "-q", "d.bdiff", "a.img", "--base", "wrong.img").returncode == 0
    refused = cli("apply", "d.bdiff", "b.img", "--base", "wrong.img", "--verify-base")
    assert refused.returncode == 4 and "read in full" in refused.stderr
    assert cli("apply", "plain.bdiff", "b.img", "--base", base,
               "--verify-base").returncode == 2
    assert not (xfs / "b.img").exists()
    assert cli("apply", "-q", "d.bdiff", "b.img", "--base", base,
               "--verify-base").returncode == 0
    assert_same_bytes(xfs / "b.img", target)


# ------------------------------------------------- interoperability with v1


def _upstream_style_apply(diff, target, base):
    """CognitionAI's apply, step for step: copy the base, set the target size
    if it differs from the base size, then write each range's bytes, read
    back to back after the 4 KiB-aligned header."""
    with open(diff, "rb") as f:
        magic, target_size, base_size, count = struct.unpack("<8sQQQ", f.read(32))
        assert magic == b"BDIFFv1\0"
        ranges = [struct.unpack("<QQ", f.read(16)) for _ in range(count)]
        f.seek(-(32 + 16 * count) % 4096, os.SEEK_CUR)
        shutil.copyfile(base, target)
        with open(target, "r+b") as out:
            if target_size != base_size:
                out.truncate(target_size)
            for offset, length in ranges:
                out.seek(offset)
                data = f.read(length)
                assert len(data) == length, "unexpected EOF in diff data"
                out.write(data)


def _upstream_style_create(diff, target, base):
    """CognitionAI's create: every target extent that is not at the same
    physical address as the base's, written with the bincode layout."""
    from blockdiff.engine.extents import ExtentMap

    def extents(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            m = ExtentMap.of_file(fd, path)
        finally:
            os.close(fd)
        return list(zip(m.logical.tolist(), m.physical.tolist(), m.length.tolist()))

    base_map = extents(base)
    ranges = []
    for logical, physical, length in extents(target):
        for block in range(logical, logical + length, BLOCK):
            phys = physical + block - logical
            shared = any(bl <= block < bl + bn and bp + block - bl == phys
                         for bl, bp, bn in base_map)
            if not shared:
                if ranges and ranges[-1][0] + ranges[-1][1] == block:
                    ranges[-1][1] += BLOCK
                else:
                    ranges.append([block, BLOCK])
    target_size, base_size = os.path.getsize(target), os.path.getsize(base)
    head = b"BDIFFv1\0" + struct.pack("<QQQ", target_size, base_size, len(ranges))
    head += b"".join(struct.pack("<QQ", o, n) for o, n in ranges)
    head += bytes(-len(head) % 4096)
    with open(target, "rb") as t, open(diff, "wb") as out:
        out.write(head)
        for offset, length in ranges:
            t.seek(offset)
            out.write(t.read(length))


@pytest.mark.parametrize("scenario", ["random_4k_writes", "sequential_writes", "punched_holes",
                                      "grow", "shrink_unaligned", "mixed"])
def test_our_v1_applies_with_upstream_semantics(xfs, scenario):
    base, target = xfs / "base.img", xfs / "target.img"
    make_base_image(base, BASE_SIZE, 14)
    SCENARIOS[scenario](base, target, 14)
    engine.create_diff(xfs / "d.bdiff", target, base, format="v1")
    _upstream_style_apply(xfs / "d.bdiff", xfs / "theirs.img", base)
    assert_same_bytes(xfs / "theirs.img", target)


@pytest.mark.parametrize("scenario", ["random_4k_writes", "sequential_writes", "grow"])
def test_upstream_v1_applies_with_ours(xfs, scenario):
    base, target = xfs / "base.img", xfs / "target.img"
    # Block-multiple sizes and no holes: the cases the upstream tool handles.
    make_base_image(base, 2 * 1024 * 1024, 15, sparse_fraction=0.0)
    SCENARIOS[scenario](base, target, 15)
    if os.path.getsize(target) % BLOCK:
        scenarios.grow(target, -(-os.path.getsize(target) // BLOCK) * BLOCK)
    _upstream_style_create(xfs / "theirs.bdiff", target, base)
    engine.apply_diff(xfs / "theirs.bdiff", xfs / "ours.img", base)
    assert_same_bytes(xfs / "ours.img", target)


# ------------------------------------------------ random operation sequences

_OPS = st.lists(st.tuples(
    st.sampled_from(["write", "punch", "unwritten", "zero", "truncate"]),
    st.integers(0, 2 * 1024 * 1024), st.integers(1, 300 * 1024)), min_size=1, max_size=8)


@settings(max_examples=budget.examples(60), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS, base_size=st.integers(0, 2 * 1024 * 1024), seed=st.integers(0, 2**16))
def test_random_operation_sequences(xfs, ops, base_size, seed):
    directory = xfs / f"case{seed}-{len(ops)}-{base_size}"
    directory.mkdir()
    try:
        base, target = directory / "base.img", directory / "target.img"
        make_base_image(base, base_size, seed)
        scenarios.clone_file(base, target)
        for op, offset, length in ops:
            if op == "write":
                scenarios.sequential_write(target, offset, length, seed)
            elif op == "punch":
                scenarios.punch_hole(target, offset, length)
            elif op == "unwritten":
                scenarios.preallocate_unwritten(target, offset, length)
            elif op == "zero":
                scenarios.zero_range(target, offset, length)
            else:
                os.truncate(target, offset)
        for fmt_name in FORMATS:
            diff = directory / f"{fmt_name}.bdiff"
            engine.create_diff(diff, target, base, format=fmt_name)
            engine.apply_diff(diff, directory / f"{fmt_name}.img", base)
            assert_same_bytes(directory / f"{fmt_name}.img", target)
    finally:
        shutil.rmtree(directory)


def test_v2_ranges_are_aligned_in_the_file(xfs):
    base, target = xfs / "base.img", xfs / "target.img"
    make_base_image(base, BASE_SIZE, 16)
    SCENARIOS["mixed"](base, target, 16)
    engine.create_diff(xfs / "d.bdiff", target, base)
    header = engine.read_diff(xfs / "d.bdiff")
    data = header.ranges.kind == DATA
    assert header.data_offset % BLOCK == 0
    assert np.all(header.data_pos[data] % np.uint64(BLOCK) == 0)
    assert np.all(header.ranges.offset % np.uint64(BLOCK) == 0)
    assert set(np.unique(header.ranges.kind)) <= {DATA, ZERO}


def test_v1_zero_ranges_stay_holes_when_copied(xfs, ext4):
    """Written to another filesystem (copied, not reflinked), a v1 diff still
    stores its zero ranges as holes rather than as written zeros."""
    base, target = xfs / "base.img", xfs / "target.img"
    make_base_image(base, BASE_SIZE, 17, sparse_fraction=0.0, zero_fraction=0.0)
    scenarios.clone_file(base, target)
    scenarios.punch_hole(target, 0, 256 * BLOCK)
    scenarios.random_block_writes(target, count=3, seed=17)
    created = engine.create_diff(ext4 / "d.bdiff", target, base, format="v1")
    assert created.reflinked == 0 and created.notes
    assert os.stat(ext4 / "d.bdiff").st_blocks * 512 <= (3 + 1) * BLOCK + 64 * 1024
    engine.apply_diff(ext4 / "d.bdiff", xfs / "restored.img", base)
    assert_same_bytes(xfs / "restored.img", target)


# ------------------------------------------ output files: mode, links, sizes


def _small_pair(directory):
    base, target = directory / "base.img", directory / "target.img"
    make_base_image(base, 256 * 1024 + 100, 21)
    SCENARIOS["mixed"](base, target, 21)
    return base, target


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002, 0o000])
def test_outputs_honour_the_umask(xfs, umask):
    base, target = _small_pair(xfs)
    os.chmod(base, 0o664)
    old = os.umask(umask)
    try:
        engine.create_diff(xfs / "d.bdiff", target, base)
        engine.create_diff(xfs / "full.bdiff", target)
        engine.apply_diff(xfs / "d.bdiff", xfs / "from-base.img", base)
        engine.apply_diff(xfs / "full.bdiff", xfs / "no-base.img")
        files.copy_file(target, xfs / "copy.img")
        with files.atomic_output(str(xfs / "explicit")) as (fd, _):
            os.write(fd, b"x")
        with files.atomic_output(str(xfs / "explicit-0640"), 0o640) as (fd, _):
            os.write(fd, b"x")
    finally:
        os.umask(old)

    def mode(name):
        return os.stat(xfs / name).st_mode & 0o7777

    for name in ("d.bdiff", "full.bdiff", "no-base.img", "copy.img", "explicit"):
        assert mode(name) == 0o666 & ~umask, (name, oct(mode(name)))
    assert mode("from-base.img") == 0o664 & ~umask          # the base's mode, masked
    assert mode("explicit-0640") == 0o640 & ~umask


def test_output_that_is_a_symlink_is_replaced_and_its_target_untouched(xfs):
    base, target = _small_pair(xfs)
    diff = xfs / "d.bdiff"
    engine.create_diff(diff, target, base)
    for name in ("victim-apply", "victim-create"):
        (xfs / name).write_bytes(b"do not touch" * 100)
    before = {name: os.stat(xfs / name) for name in ("victim-apply", "victim-create")}
    os.symlink(xfs / "victim-apply", xfs / "restored.img")
    os.symlink("victim-create", xfs / "out.bdiff")          # relative, too
    os.symlink(xfs / "nowhere", xfs / "dangling.img")

    engine.apply_diff(diff, xfs / "restored.img", base)
    engine.create_diff(xfs / "out.bdiff", target, base)
    engine.apply_diff(diff, xfs / "dangling.img", base)

    for link in ("restored.img", "out.bdiff", "dangling.img"):
        assert not os.path.islink(xfs / link) and os.path.isfile(xfs / link)
    assert_same_bytes(xfs / "restored.img", target)
    assert_same_bytes(xfs / "dangling.img", target)
    assert engine.read_diff(xfs / "out.bdiff").target_size == os.path.getsize(target)
    assert not os.path.lexists(xfs / "nowhere")
    for name, then in before.items():
        now = os.stat(xfs / name)
        assert (xfs / name).read_bytes() == b"do not touch" * 100
        assert (now.st_ino, now.st_size, now.st_mtime_ns) == (then.st_ino, then.st_size,
                                                              then.st_mtime_ns)
    # A link to the base is the base: refused, the base unchanged.
    base_digest = _digest(base)
    os.symlink(base, xfs / "to-base.img")
    with pytest.raises(UsageError, match="same file as BASE"):
        engine.apply_diff(diff, xfs / "to-base.img", base)
    assert os.path.islink(xfs / "to-base.img") and _digest(base) == base_digest


def _sparse_image(path, size, tail=b"end of a sparse image"):
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(size - len(tail))
        f.write(tail)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_target_larger_than_the_filesystem_is_refused_at_once(xfs, fmt_name):
    """A diff of a few KiB describing a 2^40-byte (sparse) target, applied on
    a 4 GiB filesystem: refused before anything is read or written."""
    image = xfs / "huge.img"
    _sparse_image(image, 1 << 40)
    diff = xfs / "huge.bdiff"
    engine.create_diff(diff, image, format=fmt_name)
    image.unlink()
    assert os.path.getsize(diff) < 64 * 1024
    (xfs / "restored.img").write_bytes(b"precious")
    with pytest.raises(OSError, match="larger than the whole filesystem") as raised:
        engine.apply_diff(diff, xfs / "restored.img")
    assert raised.value.errno == errno.ENOSPC
    assert sorted(os.listdir(xfs)) == ["huge.bdiff", "restored.img"]
    assert (xfs / "restored.img").read_bytes() == b"precious"


def test_sparse_target_larger_than_the_free_space_is_applied(fresh_filesystem, xfs):
    """Only the data has to fit: a 48 MiB sparse target on a 64 MiB tmpfs
    with 8 MiB free."""
    small = fresh_filesystem("tmpfs", size=64 * 1024 * 1024)
    with open(small / "filler", "wb") as f:
        f.write(bytes(56 * 1024 * 1024))
    image = xfs / "sparse.img"
    _sparse_image(image, 48 * 1024 * 1024)
    engine.create_diff(xfs / "d.bdiff", image)
    engine.apply_diff(xfs / "d.bdiff", small / "restored.img")
    assert_same_bytes(small / "restored.img", image)


def test_data_beyond_the_free_space_fails_cleanly(fresh_filesystem, xfs):
    small = fresh_filesystem("tmpfs", size=16 * 1024 * 1024)
    with open(small / "filler", "wb") as f:
        f.write(bytes(10 * 1024 * 1024))
    (small / "restored.img").write_bytes(b"precious")
    image = xfs / "full.img"
    make_base_image(image, 8 * 1024 * 1024, 22, sparse_fraction=0.0, zero_fraction=0.0)
    engine.create_diff(xfs / "d.bdiff", image)
    with pytest.raises(OSError) as raised:
        engine.apply_diff(xfs / "d.bdiff", small / "restored.img")
    assert raised.value.errno == errno.ENOSPC
    assert sorted(os.listdir(small)) == ["filler", "restored.img"]
    assert (small / "restored.img").read_bytes() == b"precious"


def test_target_beyond_the_largest_file_is_refused(xfs):
    """The largest file the kernel allows here (RLIMIT_FSIZE in this case)
    is asked before anything is written: EFBIG, one line, nothing left."""
    image = xfs / "sparse.img"
    _sparse_image(image, 64 * 1024 * 1024)
    engine.create_diff(xfs / "d.bdiff", image)
    out = xfs / "out"
    out.mkdir()
    limit = 16 * 1024 * 1024

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([sys.executable, "-m", "blockdiff", "apply", str(xfs / "d.bdiff"),
                           str(out / "restored.img")], capture_output=True, text=True,
                          preexec_fn=cap)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "File too large" in proc.stderr and "67108864 bytes" in proc.stderr
    assert os.listdir(out) == []


def test_a_format_without_base_digests_is_not_asked_for_one(tmp_path):
    """Refused before anything is read or written, not made without the digest."""
    target, base = tmp_path / "target.img", tmp_path / "base.img"
    target.write_bytes(b"t" * BLOCK)
    base.write_bytes(b"b" * BLOCK)
    with pytest.raises(UsageError, match="v1 diff cannot record a digest"):
        engine.create_diff(tmp_path / "d.bdiff", target, base, format="v1", base_digest=True)
    assert not (tmp_path / "d.bdiff").exists()
