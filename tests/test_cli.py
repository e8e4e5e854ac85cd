"""The command line: results, and bad input met with one clear line and nothing lost."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from clirun import cli

from blockdiff.engine import diff as engine
from blockdiff.engine.extents import DATA, ZERO
from scenarios import SCENARIOS, assert_same_bytes, make_base_image

BLOCK = 4096
SIZE = 2 * 1024 * 1024 + 100


def run(*args, ok=True):
    return cli(*args, code=0 if ok else None)


def fails(*args, code, match):
    """Run a command expected to fail: exit ``code``, one line on stderr."""
    proc = run(*args, ok=False)
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("blockdiff: error: ") or lines[0].startswith("Error: ")
    assert match in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def pair(xfs):
    """(dir, base, target, v2 diff, v1 diff) of a mixed scenario on XFS."""
    base, target = xfs / "base.img", xfs / "target.img"
    make_base_image(base, SIZE, 1)
    SCENARIOS["mixed"](base, target, 1)
    run("create", xfs / "d.bdiff", target, "--base", base)
    run("create", xfs / "d1.bdiff", target, "--base", base, "--format", "v1")
    return xfs, base, target, xfs / "d.bdiff", xfs / "d1.bdiff"


@pytest.fixture
def existing_target(xfs):
    """A TARGET that already exists: failures must leave it exactly as it was."""
    path = xfs / "existing.img"
    path.write_bytes(b"precious" * 1000)
    return path


def _unchanged(path):
    assert path.read_bytes() == b"precious" * 1000
    leftovers = [p for p in os.listdir(path.parent) if p.endswith(".partial")]
    assert not leftovers, leftovers


def test_create_apply_view_round_trip(pair):
    directory, base, target, diff, diff_v1 = pair
    out = run("create", directory / "again.bdiff", target, "--base", base).stdout
    assert "v2" in out and "ranges" in out
    run("apply", diff, directory / "restored.img", "--base", base)
    assert_same_bytes(directory / "restored.img", target)
    run("apply", diff_v1, directory / "restored1.img", "--base", base)
    assert_same_bytes(directory / "restored1.img", target)
    text = run("view", diff).stdout
    assert "Format: BDIFFv2" in text and "Ranges:" in text
    report = json.loads(run("view", diff, "--json").stdout)
    assert report["format"] == "BDIFFv2" and report["range_count"] == len(report["ranges"])
    first = report["ranges"][0]
    around = json.loads(run("view", diff, hex(first["offset"]), "--json").stdout)
    assert around["containing"] == 0 and len(around["ranges"]) <= 4
    assert json.loads(run("view", diff_v1, "--json").stdout)["format"] == "BDIFFv1"
    image = json.loads(run("view", target, "--json").stdout)
    assert image["type"] == "extent_map" and image["extent_count"] >= 1
    assert "Extents:" in run("view", target).stdout


def test_create_and_apply_json_say_what_they_did(pair):
    directory, base, target, _, _ = pair
    created = json.loads(run("create", directory / "j.bdiff", target, "--base", base,
                             "--json").stdout)
    expected = engine.read_diff(directory / "j.bdiff")
    assert created["path"] == str(directory / "j.bdiff") and created["version"] == 2
    assert created["ranges"] == len(expected.ranges) and created["method"] == "extents"
    assert created["data_bytes"] == expected.ranges.bytes_of(DATA) > 0
    assert created["zero_bytes"] == expected.ranges.bytes_of(ZERO)
    assert created["target_size"] == os.path.getsize(target)
    assert created["base_size"] == os.path.getsize(base)
    assert 0 < created["reflinked"] <= created["ranges"]
    assert created["target_id"] == expected.target_id.hex()
    applied = json.loads(run("apply", directory / "j.bdiff", directory / "j.img", "--base", base,
                             "--json").stdout)
    assert applied == {"path": str(directory / "j.img"), "version": 2,
                       "target_size": created["target_size"], "ranges": created["ranges"],
                       "data_bytes": created["data_bytes"], "zero_bytes": created["zero_bytes"],
                       "base_reflinked": True, "reflinked": applied["reflinked"]}
    assert_same_bytes(directory / "j.img", target)


def test_quiet_prints_nothing(pair):
    directory, base, target, _, _ = pair
    assert run("create", "-q", directory / "q.bdiff", target, "--base", base).stdout == ""


def _commands():
    import click

    from blockdiff.cli import main

    names = []
    for name, command in sorted(main.commands.items()):
        names.append(name)
        if isinstance(command, click.Group):
            names += [f"{name} {sub}" for sub in sorted(command.commands)]
    return names


@pytest.mark.parametrize("command", _commands())
def test_every_command_has_help_with_an_example(command):
    text = run(*command.split(), "--help").stdout
    assert "Example" in text and len(text.splitlines()) > 5


# ------------------------------------------------------------ bad input


def test_missing_files(pair, existing_target):
    directory, base, target, diff, _ = pair
    fails("create", directory / "x.bdiff", directory / "nope.img", code=1,
          match="No such file or directory")
    fails("create", directory / "x.bdiff", target, "--base", directory / "nope.img", code=1,
          match="nope.img")
    fails("apply", directory / "nope.bdiff", existing_target, "--base", base, code=1,
          match="nope.bdiff")
    fails("apply", diff, existing_target, "--base", directory / "nope.img", code=1,
          match="check the path")
    _unchanged(existing_target)
    assert not (directory / "x.bdiff").exists()


def test_wrong_magic(pair, existing_target):
    directory, base, _, _, _ = pair
    bad = directory / "bad.bdiff"
    bad.write_bytes(b"GARBAGE!" + bytes(5000))
    fails("apply", bad, existing_target, "--base", base, code=3, match="not a blockdiff file")
    fails("view", bad, code=3, match="not a blockdiff file")
    _unchanged(existing_target)


@pytest.mark.parametrize("which", ["v2", "v1"])
@pytest.mark.parametrize("keep", ["header", "table", "data"])
def test_truncated_diff(pair, existing_target, which, keep):
    directory, base, _, diff, diff_v1 = pair
    source = diff if which == "v2" else diff_v1
    cut = directory / "cut.bdiff"
    shutil.copyfile(source, cut)
    size = {"header": 20, "table": 200 if which == "v2" else 40,
            "data": os.path.getsize(source) - 1}[keep]
    os.truncate(cut, size)
    fails("apply", cut, existing_target, "--base", base, code=3, match="truncated")
    _unchanged(existing_target)


def _rewrite_v1_ranges(src, dst, transform):
    data = bytearray(src.read_bytes())
    count = int.from_bytes(data[24:32], "little")
    pairs = [(int.from_bytes(data[32 + 16 * i: 40 + 16 * i], "little"),
              int.from_bytes(data[40 + 16 * i: 48 + 16 * i], "little")) for i in range(count)]
    pairs = transform(pairs)
    for i, (o, n) in enumerate(pairs):
        data[32 + 16 * i: 48 + 16 * i] = o.to_bytes(8, "little") + n.to_bytes(8, "little")
    dst.write_bytes(bytes(data))


@pytest.mark.parametrize("transform, match", [
    (lambda p: [p[1], p[0]] + p[2:], "out of order"),
    (lambda p: [(p[0][0], p[1][0] - p[0][0] + BLOCK)] + p[1:], "overlaps"),
    (lambda p: p[:-1] + [(1 << 40, p[-1][1])], "past the target size"),
])
def test_bad_ranges(pair, existing_target, transform, match):
    directory, base, _, _, diff_v1 = pair
    bad = directory / "bad.bdiff"
    _rewrite_v1_ranges(diff_v1, bad, transform)
    fails("apply", bad, existing_target, "--base", base, code=3, match=match)
    _unchanged(existing_target)


def test_corrupt_data_is_caught_before_writing(pair, existing_target):
    directory, base, _, diff, _ = pair
    header = engine.read_diff(diff)
    bad = directory / "bad.bdiff"
    shutil.copyfile(diff, bad)
    with open(bad, "r+b") as f:
        f.seek(header.data_offset + 10)
        byte = f.read(1)
        f.seek(header.data_offset + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    fails("apply", bad, existing_target, "--base", base, code=3,
          match="does not match its checksum")
    _unchanged(existing_target)


def test_corrupt_header(pair, existing_target):
    directory, base, _, diff, _ = pair
    bad = directory / "bad.bdiff"
    shutil.copyfile(diff, bad)
    with open(bad, "r+b") as f:
        f.seek(30)
        f.write(b"\x7f")
    fails("apply", bad, existing_target, "--base", base, code=3, match="header checksum")
    _unchanged(existing_target)


def test_wrong_base(pair, existing_target):
    directory, base, target, diff, diff_v1 = pair
    other_size = directory / "other-size.img"
    make_base_image(other_size, SIZE + BLOCK, 2)
    fails("apply", diff, existing_target, "--base", other_size, code=4, match="is not the base")
    fails("apply", diff_v1, existing_target, "--base", other_size, code=4, match="is not the base")
    same_size = directory / "same-size.img"
    make_base_image(same_size, SIZE, 3)
    fails("apply", diff, existing_target, "--base", same_size, code=4, match="fingerprint")
    fails("apply", diff, existing_target, code=2, match="pass it with --base")
    run("create", directory / "full.bdiff", target)
    fails("apply", directory / "full.bdiff", existing_target, "--base", base, code=2,
          match="without --base")
    _unchanged(existing_target)


def test_wrong_snapshot_is_refused(pair):
    """Two restores with the same content fingerprint but different snapshot ids."""
    directory, base, target, diff, _ = pair
    run("apply", diff, directory / "s1.img", "--base", base)
    later = directory / "later.img"
    SCENARIOS["random_4k_writes"](directory / "s1.img", later, 4)
    run("create", directory / "d2.bdiff", later, "--base", directory / "s1.img")
    # Same bytes as s1 but restored from a different diff: another snapshot id.
    run("create", directory / "again.bdiff", target, "--base", base)
    run("apply", directory / "again.bdiff", directory / "twin.img", "--base", base)
    assert_same_bytes(directory / "twin.img", directory / "s1.img")
    fails("apply", directory / "d2.bdiff", directory / "s2.img", "--base", directory / "twin.img",
          code=4, match="snapshot")


def test_same_file_arguments(pair):
    directory, base, target, diff, _ = pair
    fails("apply", diff, base, "--base", base, code=2, match="same file as BASE")
    fails("create", target, target, "--base", base, code=2, match="same file as TARGET")
    fails("create", base, target, "--base", base, code=2, match="same file as BASE")
    fails("create", directory / "x.bdiff", base, "--base", base, code=2,
          match=f"TARGET {base} is the same file as BASE")
    assert not (directory / "x.bdiff").exists()


def test_encoded_extents_are_refused(btrfs):
    image = btrfs / "compressed.img"
    image.touch()
    subprocess.run(["btrfs", "property", "set", str(image), "compression", "zstd"], check=True)
    with open(image, "wb") as f:
        f.write(b"compress me " * 200_000)
        f.flush()
        os.fsync(f.fileno())
    line = fails("create", btrfs / "d.bdiff", image, code=5, match="encoded")
    assert "cp --reflink=never" in line
    assert not (btrfs / "d.bdiff").exists()


def test_no_permission(pair):
    directory, base, target, diff, _ = pair
    locked = directory / "locked"
    locked.mkdir()
    subprocess.run(["chattr", "+i", str(locked)], check=True)
    try:
        fails("apply", diff, locked / "restored.img", "--base", base, code=1,
              match="Operation not permitted")
        fails("create", locked / "d.bdiff", target, "--base", base, code=1,
              match="Operation not permitted")
        assert os.listdir(locked) == []
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)


def test_no_space(xfs, fresh_filesystem):
    base, target = xfs / "base.img", xfs / "target.img"
    make_base_image(base, 24 * 1024 * 1024, 5, sparse_fraction=0.0, zero_fraction=0.0)
    SCENARIOS["random_4k_writes"](base, target, 5)
    diff = xfs / "d.bdiff"
    run("create", diff, target, "--base", base)
    small = fresh_filesystem("ext4", size=8 * 1024 * 1024)
    fails("apply", diff, small / "restored.img", "--base", base, code=1,
          match="No space left on device")
    assert not [p for p in os.listdir(small) if "restored" in p]


def test_bad_offset_for_view(pair):
    directory, _, _, diff, _ = pair
    proc = run("view", diff, "zzz", ok=False)
    assert proc.returncode == 2 and "hexadecimal" in proc.stderr
    assert "no range contains" in run("view", diff, "0x7fffffffffff").stdout


def test_unknown_format_choice(pair):
    directory, base, target, _, _ = pair
    proc = run("create", directory / "x.bdiff", target, "--format", "v7", ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


# ------------------------------------------------------------ durations


@pytest.mark.parametrize("option, value", [
    ("--ttl", "-5"), ("--ttl", "-1h"), ("--ttl", "nan"), ("--ttl", "inf"), ("--ttl", "infd"),
    ("--ttl", "soon"), ("--keep-within", "-5d"), ("--keep-within", "-0.5"),
    ("--keep-within", "nanh"), ("--keep-within", "inf"),
])
def test_negative_or_endless_durations_are_refused(xfs, option, value):
    store, image = xfs / "store", xfs / "disk.img"
    run("init", store)
    with open(image, "wb") as f:
        f.write(b"disk" * BLOCK)
    first = run("commit", "--store", store, image, "-m", "one").stdout.split()[-1]
    if option == "--ttl":
        fails("commit", "--store", store, image, "--ttl", value, code=2,
              match=f"--ttl '{value}' is not a duration")
    else:
        fails("gc", "--store", store, "--keep-within", value, code=2,
              match=f"--keep-within '{value}' is not a duration")
    # Nothing was committed or removed.
    log = json.loads(run("log", "--store", store, "--json").stdout)
    assert [s["id"] for s in log] == [first]


def test_durations_that_are_not_negative_are_taken(xfs):
    store, image = xfs / "store", xfs / "disk.img"
    run("init", store)
    with open(image, "wb") as f:
        f.write(b"disk" * BLOCK)
    run("commit", "--store", store, image, "--ttl", "2h")
    (snap,) = json.loads(run("log", "--store", store, "--json").stdout)
    assert snap["expires"] - snap["created"] == pytest.approx(7200, abs=5)
    assert "removed" in run("gc", "--store", store, "--keep-within", "0.5d").stdout
    assert len(json.loads(run("log", "--store", store, "--json").stdout)) == 1


@pytest.mark.parametrize("policy", [{"keep_within": -5 * 86400.0}, {"keep_within": float("nan")},
                                    {"keep_within": float("inf")}, {"keep_last": -1},
                                    {"keep_last": 1.5}])
def test_retention_policy_refuses_negative_and_endless_values(policy):
    from blockdiff.errors import UsageError
    from blockdiff.store.retention import Policy

    with pytest.raises(UsageError):
        Policy(**policy)
    assert Policy(keep_last=0, keep_within=0).keep_within == 0


# ------------------------------------------------------------ sandbox VMs

_RECORD_LAUNCH = """
import json, sys
from blockdiff.vm import qemu
from blockdiff.cli import main

def start(launch):
    argv = launch.argv("qemu-system-x86_64")
    print(json.dumps({"argv": argv, "directory": str(launch.directory)}))
    raise qemu.VMError("recorded instead of started")

qemu.Launch.start = start
main(sys.argv[1:])
"""


def test_vm_start_with_a_relative_store_gives_qemu_absolute_paths(xfs):
    """QEMU runs in the VM's directory and daemonizes: a relative --store must
    not reach its command line as a relative path (the kernel went missing)."""
    from blockdiff.store.store import Store
    from blockdiff.vm.sandbox import Sandbox

    kernel = xfs / "kernel"
    kernel.mkdir()
    (kernel / "vmlinuz").write_bytes(b"not really a kernel")
    (kernel / "initrd.img").write_bytes(b"not really an initramfs")
    image = xfs / "rootfs.img"
    image.write_bytes(b"root" * BLOCK)
    with Store.init(xfs / "store") as store:
        Sandbox.create(store, "box", image=image, kernel=kernel)
    import blockdiff

    # The blockdiff under test, whatever the directory the command runs in.
    env = dict(os.environ, BLOCKDIFF_VM_ACCEL="tcg",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(blockdiff.__file__))))
    env.pop("BLOCKDIFF_STORE", None)
    done = subprocess.run([sys.executable, "-c", _RECORD_LAUNCH, "vm", "start", "box",
                           "--store", "store"], cwd=xfs, env=env, capture_output=True,
                          text=True)
    assert done.returncode == 9 and "recorded instead of started" in done.stderr, done.stderr
    launch = json.loads(done.stdout.splitlines()[0])
    argv = launch["argv"]
    assert launch["directory"] == str(xfs / "store" / "vms" / "box")
    files = [argv[argv.index("-kernel") + 1], argv[argv.index("-initrd") + 1],
             next(a for a in argv if a.startswith("file=")).split(",")[0][len("file="):]]
    for path in files:
        assert os.path.isabs(path) and os.path.isfile(path), argv
    assert files[2] == str(xfs / "store" / "vms" / "box" / "disk.img")
    # The library, given the relative path, holds absolute ones too.
    cwd = os.getcwd()
    os.chdir(xfs)
    try:
        box = Sandbox("store", "box")
        box.store.close()
        assert box.root == xfs / "store" and box.disk.is_absolute()
    finally:
        os.chdir(cwd)
