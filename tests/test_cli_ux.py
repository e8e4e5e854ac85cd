"""What a new user of the command line meets: ids given by a unique prefix
(as git takes them), one JSON document per command with --json (the shapes
of docs/cli.md), and the wording and exit codes of the small cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from clirun import as_json, cli, error_line, short_prefix

from blockdiff.agent import agent as agent_module
from blockdiff.agent.agent import Agent, AgentDB
from blockdiff.errors import AmbiguousCheckpoint, AmbiguousId, UnknownCheckpoint, UnknownSnapshot
from blockdiff.store.catalog import Snapshot
from blockdiff.store.store import Store
from scenarios import make_base_image

BLOCK = 4096
SIZE = 64 * BLOCK


def write_block(path, index, byte):
    with open(path, "r+b") as f:
        f.seek(index * BLOCK)
        f.write(bytes([byte]) * BLOCK)


SNAPSHOT_KEYS = {"id", "parent", "created", "message", "meta", "size", "changed_bytes",
                 "ranges", "expires"}


@pytest.fixture
def line(xfs):
    """A store with a line of three snapshots of an image: (store, image, ids)."""
    root = xfs / "store"
    cli("init", root)
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 7)
    ids = []
    for step in range(3):
        write_block(image, step, 0x40 + step)
        record = as_json("commit", "--store", root, image, "-m", f"step {step}",
                         "--meta", f"step={step}")
        assert set(record) == SNAPSHOT_KEYS | {"unchanged"} and record["unchanged"] is False
        ids.append(record["id"])
    return root, image, ids


def crafted(root, image, ids):
    """Commit ``image`` once for each of ``ids``, under exactly that id (as an
    import does), so that tests can make prefixes that begin several ids."""
    with Store(root) as store:
        for sid in ids:
            store.commit(image, parent=None, _imported=Snapshot(0, sid, None, time.time(),
                                                                f"crafted {sid}", {}))


# ------------------------------------------------------------- prefixes


def test_a_unique_prefix_names_the_snapshot_in_every_command(line, xfs):
    root, image, ids = line
    first, second, third = (short_prefix(i, ids) for i in ids)
    fork = xfs / "fork.img"
    out = cli("restore", "--store", root, first, fork).stdout
    assert out.startswith(f"{fork}: forked from {ids[0]} (")
    restored = as_json("restore", "--store", root, second, image)
    assert restored["snapshot"] == ids[1] and restored["forked"] is False
    assert [s["id"] for s in as_json("log", "--store", root, third)] == ids[::-1]
    diff = as_json("diff", "--store", root, first, third)
    assert (diff["a"], diff["b"]) == (ids[0], ids[2]) and diff["bytes"] == 2 * BLOCK
    # --parent by prefix: the record names the full id.
    write_block(image, 9, 0x99)
    child = as_json("commit", "--store", root, image, "--parent", first.upper())
    assert child["parent"] == ids[0]
    # An export by prefix, since an ancestor by prefix, names full ids, so
    # another store can import it.
    exported = as_json("export", "--store", root, third, xfs / "e.bdx", "--since", first)
    assert (exported["id"], exported["since"]) == (ids[2], ids[0])
    other = xfs / "other"
    cli("init", other)
    cli("export", "--store", root, first, xfs / "b.bdx")
    cli("import", "--store", other, xfs / "b.bdx")
    assert as_json("import", "--store", other, xfs / "e.bdx")["ids"] == [ids[2]]
    compacted = as_json("compact", "--store", root, second)
    assert compacted["id"] == ids[1]
    assert cli("verify", "--store", root, second).returncode == 0
    removed = cli("rm", "--store", root, third).stdout
    assert removed.startswith(f"removed {ids[2]};")
    with Store(root) as store:
        assert store.resolve(first) == ids[0] and store.get(second.upper()).id == ids[1]


def test_an_ambiguous_prefix_lists_the_candidates(line, xfs):
    root, image, _ = line
    many = [f"3bcd{n:012x}" for n in range(1, 13)]
    crafted(root, image, many + ["3bce0000000000a1", "3bce0000000000a2"])
    message = error_line("restore", "--store", root, "3bcd", xfs / "f.img", code=6)
    assert "ambiguous" in message and "12 snapshots" in message
    assert ", ".join(many[:10]) + " and 2 more" in message
    assert not (xfs / "f.img").exists()
    message = error_line("rm", "--store", root, "3bce", code=6)
    assert "(3bce0000000000a1, 3bce0000000000a2);" in message and " more)" not in message
    for command in (["log"], ["compact"], ["verify"], ["export"]):
        args = [*command, "--store", root, "3BCD"] + ([xfs / "x.bdx"] if command == ["export"]
                                                      else [])
        assert "ambiguous" in error_line(*args, code=6)
    with Store(root) as store:
        with pytest.raises(AmbiguousId, match="and 2 more"):
            store.get("3bcd")
        assert store.get("3bcd00000000000c").id == many[-1]
        assert store.resolve("3bcd00000000000C") == many[-1]
        assert len(store.log()) == 3 + 14              # nothing was removed


def test_unknown_short_and_malformed_ids(line):
    root, _, ids = line
    for given in ("ffffffff", "zzzz", "3b%d", "3b_d", ids[0] + "0"):
        assert f"no snapshot {given!r}" in error_line("log", "--store", root, given, code=6)
    assert "at least 4 hex digits" in error_line("rm", "--store", root, ids[0][:3], code=6)
    with Store(root) as store:
        for given in ("", ids[0][:3], "%", ids[0][:4] + "%"):
            with pytest.raises(UnknownSnapshot):
                store.get(given)
        assert len(store.log()) == 3


@pytest.fixture
def agent_store(xfs):
    """A store with thread 't' of three checkpoints, and 'u' of one."""
    root = xfs / "store"
    with Store.init(root) as store:
        with Agent(store, "t") as a:
            for step in range(3):
                a.state["step"] = step
                a.checkpoint(f"step {step}", {"step": step})
            head = a.head
    return root, head


def test_agent_checkpoints_by_prefix(agent_store, monkeypatch):
    root, head = agent_store
    with Store(root) as store, AgentDB(store) as db:
        ids = [c.id for c in db.history("t")]
    prefix = short_prefix(ids[1], ids)
    shown = as_json("agent", "show", "--store", root, prefix)
    assert shown["id"] == ids[1] and shown["meta"] == {"step": 1}
    assert shown["state"] == {"step": 1}
    human = cli("agent", "show", "--store", root, prefix.upper()).stdout
    assert f"id:            {ids[1]}" in human and 'meta:          {"step": 1}' in human
    forked = as_json("agent", "fork", "--store", root, "t", prefix, "u")
    assert forked["forked_from"] == ids[1] and forked["thread"] == "u"
    rewound = as_json("agent", "rewind", "--store", root, "t", short_prefix(ids[2], ids))
    assert rewound["checkpoint"] == ids[2]
    assert set(rewound) == {"thread", "checkpoint", "compensated", "uncompensable", "pending"}
    # Two checkpoints that share a prefix: the agent family's code, with the list.
    crafted_ids = iter(["3bcd000000000001", "3bcd000000000002"])
    monkeypatch.setattr(agent_module, "_new_id", lambda: next(crafted_ids))
    with Store(root) as store, Agent(store, "v") as a:
        for step in range(2):
            a.state["step"] = step
            a.checkpoint(f"step {step}")
    message = error_line("agent", "show", "--store", root, "3bcd", code=10)
    assert "ambiguous" in message and "3bcd000000000001, 3bcd000000000002" in message
    assert "ambiguous" in error_line("agent", "rewind", "--store", root, "v", "3bcd", code=10)
    with Store(root) as store, AgentDB(store) as db:
        with pytest.raises(AmbiguousCheckpoint):
            db.checkpoint("3bcd")
        assert db.resolve_checkpoint("3bcd000000000002") == "3bcd000000000002"
        with pytest.raises(UnknownCheckpoint, match="no checkpoint 'ffff'"):
            db.checkpoint("ffff")


# ----------------------------------------------------------------- JSON


def test_json_of_the_store_commands(line, xfs):
    root, image, ids = line
    write_block(image, 20, 0x77)
    record = as_json("commit", "--store", root, image, "--ttl", "1s")
    assert record["parent"] == ids[2] and record["changed_bytes"] == BLOCK
    assert record["expires"] > record["created"]
    same = as_json("commit", "--store", root, image, "--skip-unchanged")
    assert same["id"] == record["id"] and same["unchanged"] is True
    fork = as_json("restore", "--store", root, ids[0], xfs / "fork.img")
    assert fork == {"snapshot": ids[0], "image": str(xfs / "fork.img"), "forked": True,
                    "ranges": fork["ranges"], "bytes": fork["bytes"], "tracked": False,
                    "checked_bytes": fork["checked_bytes"], "fetched_bytes": 0}
    diff = as_json("diff", "--store", root, ids[0], ids[1])
    assert diff["ranges"] == [{"offset": BLOCK, "length": BLOCK, "kind": "data"}]
    exported = as_json("export", "--store", root, ids[1], xfs / "one.bdx")
    assert set(exported) == {"id", "since", "out", "ranges", "data_bytes", "zero_bytes", "size"}
    assert exported["since"] is None and exported["size"] == SIZE
    skipped = cli("import", "--store", root, xfs / "one.bdx", "--json")
    assert json.loads(skipped.stdout) == {"ids": [ids[1]],
                                          "skipped": f"snapshot {ids[1]} is in the store "
                                                     f"already"}
    assert "skipped" in skipped.stderr
    compacted = as_json("compact", "--store", root, ids[2])
    assert compacted["id"] == ids[2] and compacted["pieces_after"] <= compacted["pieces_before"]
    assert as_json("verify", "--store", root) == {"consistent": True, "problems": {}}
    time.sleep(1.1)
    would = as_json("gc", "--store", root, "--dry-run")
    assert would == {"removed": [record["id"]], "reasons": {record["id"]: would["reasons"][
        record["id"]]}, "bytes_freed": None, "dry_run": True, "evicted": 0}
    gone = as_json("gc", "--store", root)
    assert gone["removed"] == [record["id"]] and gone["dry_run"] is False
    assert isinstance(gone["bytes_freed"], int)
    assert as_json("gc", "--store", root, "--dry-run")["removed"] == []
    removed = as_json("rm", "--store", root, ids[0])
    assert removed["removed"] == [ids[0]] and removed["reasons"] == {ids[0]: "asked"}
    assert removed["bytes_freed"] > 0 and removed["dry_run"] is False
    logged = as_json("log", "--store", root)
    assert [s["id"] for s in logged] == [ids[2], ids[1]]
    assert all(set(s) == SNAPSHOT_KEYS for s in logged)
    assert as_json("view", xfs / "one.bdx")["format"] == "BDIFFv2"


def test_verify_json_names_the_damage_and_keeps_the_exit_code(line):
    root, _, ids = line
    (map_file,) = (root / "objects").glob(f"{ids[1]}.*.map")
    os.chmod(map_file, 0o644)
    done = cli("verify", "--store", root, "--json", code=7)
    report = json.loads(done.stdout)
    assert report["consistent"] is False and list(report["problems"]) == [ids[1]]
    assert ids[1] in done.stderr


def test_json_of_the_vm_commands_on_a_stopped_vm(xfs):
    root = xfs / "store"
    cli("init", root)
    kernel = xfs / "kernel"
    kernel.mkdir()
    for name in ("vmlinuz", "initrd.img"):
        (kernel / name).write_bytes(b"not booted in this test")
    image = xfs / "rootfs.img"
    make_base_image(image, SIZE, 3)
    env = dict(os.environ, BLOCKDIFF_STORE=str(root))
    cli("vm", "create", "box", "--image", image, "--kernel", kernel, env=env)
    (root_snapshot,) = [s["id"] for s in as_json("log", env=env)]
    snap = as_json("vm", "snapshot", "box", "-m", "stopped", env=env)
    assert set(snap) == {"id", "vm", "timing", "memory"} and snap["vm"] == "box"
    assert snap["timing"] is None            # a stopped VM is committed without a pause
    back = as_json("vm", "restore", "box", root_snapshot[:6], env=env)
    assert back["snapshot"] == root_snapshot and back["running"] is False
    assert set(back) == {"vm", "snapshot", "running", "seconds", "rebooted", "tracked", "memory",
                         "standby", "prestarted"}
    human = cli("vm", "restore", "box", snap["id"][:8], env=env).stdout
    assert human.startswith(f"VM box at {snap['id']} (stopped")
    forked = as_json("vm", "fork", "box", snap["id"][:8], "box2", "--no-start", env=env)
    assert forked == {"vm": "box2", "forked_from": snap["id"], "running": False, "memory": False,
                      "memory_from": None, "disk_from": "layers", "prestarted": False}
    cli("vm", "create", "box3", "--from", root_snapshot[:5].upper(), env=env)
    assert {s["name"]: s["snapshot"] for s in as_json("vm", "ls", env=env)} == {
        "box": snap["id"], "box2": snap["id"], "box3": root_snapshot}


def test_json_of_agent_gc(agent_store):
    root, _ = agent_store
    report = as_json("agent", "gc", "--store", root, "--dry-run")
    assert report == {"removed": [], "dry_run": True}
    for command in (["threads"], ["history", "t"], ["journal", "t"], ["pending"]):
        assert isinstance(as_json("agent", *command, "--store", root), list)


# ---------------------------------------------------- the small things


# ``python -c`` with MODULES (JSON) and a command's arguments: runs the
# command, then prints which of MODULES its process imported.
_IMPORTED = ("import json, sys\n"
             "from blockdiff.cli import main\n"
             "try:\n"
             "    main(sys.argv[2:])\n"
             "except SystemExit as e:\n"
             "    assert not e.code, e.code\n"
             "print(json.dumps(sorted(set(sys.modules) & set(json.loads(sys.argv[1])))))")
SHARED_STORE_DRIVERS = ["psycopg", "boto3", "botocore"]


def imported(modules, *args) -> list[str]:
    """Which of ``modules`` the process of ``blockdiff ARGS`` imported."""
    done = subprocess.run([sys.executable, "-c", _IMPORTED, json.dumps(modules),
                           *map(str, args)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_store_of_one_host_starts_without_the_shared_stores_drivers(line):
    """PostgreSQL's driver and the object store's are imported only for a
    shared store (each costs a tenth of a second or more at start-up), and
    numpy and the native core only by what reads maps or layers."""
    root, _, ids = line
    heavy = SHARED_STORE_DRIVERS + ["numpy", "blockdiff._native"]
    assert imported(heavy, "log", "--store", root) == []
    assert imported(heavy, "log", "--store", root, ids[-1], "--json") == []
    assert imported(heavy, "--help") == []
    assert imported(SHARED_STORE_DRIVERS, "diff", "--store", root, ids[0], ids[-1]) == []
    # The probe sees what it should: a command that reads a map loads numpy.
    assert imported(["numpy"], "diff", "--store", root, ids[0], ids[-1]) == ["numpy"]


def test_restore_says_what_it_did(line, xfs):
    root, image, ids = line
    fork = cli("restore", "--store", root, ids[0], xfs / "b.img").stdout
    assert fork.startswith(f"{xfs / 'b.img'}: forked from {ids[0]} (")
    back = cli("restore", "--store", root, ids[0], image).stdout
    assert back == f"{image}: restored in place to {ids[0]} (1 ranges rewritten)\n"


def test_gc_dry_run_says_when_nothing_would_go(line):
    root, _, _ = line
    assert cli("gc", "--store", root, "--dry-run").stdout == "nothing to remove\n"


def test_target_that_is_its_base_is_refused(xfs):
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 1)
    message = error_line("create", xfs / "d.bdiff", image, "--base", image, code=2)
    assert "same file as BASE" in message
    os.link(image, xfs / "alias.img")
    error_line("create", xfs / "d.bdiff", image, "--base", xfs / "alias.img", code=2)
    assert not (xfs / "d.bdiff").exists()


def test_a_missing_image_is_the_same_error_in_create_and_commit(xfs):
    root = xfs / "store"
    cli("init", root)
    missing = xfs / "missing.img"
    for args in (["create", xfs / "d.bdiff", missing], ["commit", "--store", root, missing],
                 ["commit", "--store", root, missing, "--json"]):
        message = error_line(*args, code=1)
        assert f"No such file or directory: {missing}" in message and "check the path" in message
