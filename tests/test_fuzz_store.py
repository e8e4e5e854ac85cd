"""Fuzzing the store's parsers: export files and their records, map files,
a shared store's configuration (shared.json) and the catalog URLs in it.

Bounded budgets (hypothesis), so they run in every test run; the crafted
files in tests/corpus/export/ are replayed each time too. The only outcomes
allowed are success or one of blockdiff's errors (one line, an exit code),
with nothing left in the store's objects or staging.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import budget
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockdiff.db.conninfo import (
    SECRET_KEYWORDS,
    ConninfoError,
    check_url,
    public_url,
    secrets_of,
    url_fields,
)
from blockdiff.errors import BlockdiffError, Damaged
from blockdiff.store.maps import MAP_ERRORS, SnapshotMap, decode_map, encode_map
from blockdiff.store.shared import SharedConfig, read_config
from blockdiff.store.store import Store
from blockdiff.store.transfer import EXPORT_MAGIC, read_export_record

CORPUS = Path(__file__).parent / "corpus" / "export"
FUZZ = settings(max_examples=budget.examples(150), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=20)


def with_record(diff: bytes, body: bytes) -> bytes:
    return diff + body + struct.pack("<Q", len(body)) + EXPORT_MAGIC


@pytest.fixture(scope="module")
def exported(_session_mounts):
    """A real export of a small snapshot on XFS, its diff part and its record."""
    root = Path(tempfile.mkdtemp(prefix="fuzz-store-", dir=_session_mounts("xfs")))
    try:
        yield _export(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _export(root: Path):
    with Store.init(root / "store") as store:
        image = root / "disk.img"
        rng = np.random.default_rng(1)
        image.write_bytes(rng.bytes(64 * 1024))
        snap = store.commit(image, message="m", meta={"k": "v"})
        store.export(snap.id, root / "one.bdx")
    raw = (root / "one.bdx").read_bytes()
    length = struct.unpack("<Q", raw[-16:-8])[0]
    return root, raw, raw[:-16 - length], json.loads(raw[-16 - length:-16])


@FUZZ
@given(record=json_values)
def test_any_json_record_is_checked_or_refused(exported, record):
    root, raw, diff, _ = exported
    path = root / "rec.bdx"
    path.write_bytes(with_record(diff, json.dumps(record).encode()))
    try:
        read_export_record(str(path))
    except BlockdiffError as e:
        assert "\n" not in str(e)


@FUZZ
@given(change=st.dictionaries(st.sampled_from(["id", "created", "expires", "message", "meta"]),
                              json_values, min_size=1, max_size=3))
def test_mutated_snapshot_fields_are_checked_or_refused(exported, change):
    root, raw, diff, record = exported
    mutated = dict(record, snapshot=dict(record["snapshot"], **change))
    path = root / "snap.bdx"
    path.write_bytes(with_record(diff, json.dumps(mutated).encode()))
    try:
        checked = read_export_record(str(path))
    except BlockdiffError:
        return
    info = checked["snapshot"]
    assert isinstance(info["meta"], dict) and isinstance(info["message"], str)
    assert isinstance(info["created"], (int, float)) and 0 <= info["created"] <= 253402300799


@settings(max_examples=budget.examples(60), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_exports_import_or_fail_cleanly(exported, data):
    root, raw, diff, record = exported
    blob = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        how = data.draw(st.sampled_from(["flip", "truncate", "value"]))
        if how == "flip" and blob:
            i = data.draw(st.integers(0, len(blob) - 1))
            blob[i] ^= 1 << data.draw(st.integers(0, 7))
        elif how == "truncate":
            del blob[data.draw(st.integers(0, len(blob))):]
        elif len(blob) >= 8:
            i = data.draw(st.integers(0, len(blob) - 8))
            value = data.draw(st.sampled_from([0, 1, 2**31, 2**32, 2**40, 2**63 - 1, 2**64 - 1]))
            blob[i:i + 8] = struct.pack("<Q", value)
    path = root / "mutated.bdx"
    path.write_bytes(bytes(blob))
    target = root / "target"
    if not (target / "catalog.sqlite").exists():
        Store.init(target).close()
    with Store(target) as store:
        before = sorted(p.name for p in store.objects.iterdir())
        try:
            result = store.import_(path)
        except (BlockdiffError, OSError) as e:
            assert "\n" not in str(e)
            assert sorted(p.name for p in store.objects.iterdir()) == before
        else:
            for sid in result.ids:   # imported: it must be exactly the snapshot
                store.restore(sid, root / "imported.img")
                assert (root / "imported.img").read_bytes() == (root / "disk.img").read_bytes()
                (root / "imported.img").unlink()
                store.rm(sid)
                store.catalog.db.execute("DELETE FROM retired_ids")
        assert list(store.staging.iterdir()) == []


@settings(max_examples=budget.examples(200), deadline=None)
@given(data=st.data())
def test_map_decoder_raises_only_damage(data):
    from blockdiff.engine.extents import ExtentMap, PieceTable

    n = data.draw(st.integers(0, 5))
    u = np.arange(n, dtype=np.uint64) * np.uint64(4096)
    smap = SnapshotMap(PieceTable(u, np.full(n, 4096, np.uint64), np.ones(n, np.int64), u,
                                  n * 4096),
                       ExtentMap.from_arrays(u, u, np.full(n, 4096), np.zeros(n), n * 4096), 1)
    blob = bytearray(encode_map(smap))
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        del blob[data.draw(st.integers(0, len(blob))):]
    try:
        decode_map(bytes(blob))
    except MAP_ERRORS:
        pass


@settings(max_examples=budget.examples(100), deadline=None)
@given(n=st.integers(0, 300), seed=st.integers(0, 2**32 - 1), delta=st.booleans(),
       chain=st.integers(0, 7))
def test_map_files_read_as_numpy_reads_them(n, seed, delta, chain):
    # decode_map parses the .npz itself; every array must come out as
    # np.load gives it: the same values, dtype and shape.
    import io

    from blockdiff.engine.extents import ExtentMap, PieceTable
    from blockdiff.store.maps import MapDelta, _arrays

    rng = np.random.default_rng(seed)
    u = np.sort(rng.choice(1 << 30, n, replace=False)).astype(np.uint64) * np.uint64(4096)
    size = (1 << 42) + 777
    smap = SnapshotMap(PieceTable(u, np.full(n, 4096, np.uint64),
                                  rng.integers(0, 1 << 40, n).astype(np.int64), u * 3, size),
                       ExtentMap.from_arrays(u, u * 7, np.full(n, 4096), rng.integers(0, 8, n),
                                             size), int(rng.integers(0, 1 << 40)), chain)
    extra = MapDelta("0123456789abcdef", u[: n // 2], u[: n // 2] + 4096) if delta else None
    raw = encode_map(smap, extra)
    ours, theirs = _arrays(raw), np.load(io.BytesIO(raw))
    assert sorted(ours) == sorted(theirs.files)
    for key in theirs.files:
        assert ours[key].dtype == theirs[key].dtype and ours[key].shape == theirs[key].shape
        assert np.array_equal(ours[key], theirs[key])
    back, back_delta = decode_map(raw)
    assert back.chain == chain and (back_delta is None) == (extra is None)
    if extra is None:   # a delta holds only its own parts
        assert np.array_equal(back.pieces.offset, smap.pieces.offset)
        assert np.array_equal(back.extents.physical, smap.extents.physical)


@pytest.mark.parametrize("path", sorted(CORPUS.glob("*.bdx")), ids=lambda p: p.name)
def test_export_corpus(path, exported):
    root = exported[0]
    target = root / "corpus-store"
    if not (target / "catalog.sqlite").exists():
        Store.init(target).close()
    proc = subprocess.run([sys.executable, "-m", "blockdiff", "import", "--store", str(target),
                           str(path)], capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert list((target / "objects").iterdir()) == []
    assert os.listdir(target / "staging") == []


# Pieces of PostgreSQL URIs, every character libpq gives a meaning to among them.
_URI_PIECES = st.lists(st.sampled_from(
    ["a", "B", "7", ":", "@", "/", "?", "#", "&", "=", "%", "%41", "%2F", "%3D", "%26", "[",
     "]", "::1", ",", "+", " ", "\\", "'", "password", "pass%77ord", "sslpassword", "host",
     "port", "user", "dbname", "5432", "99999", "%00", "%ff"]), max_size=24).map("".join)
_KEYWORDS = ["host", "port", "dbname", "user", "password", "sslpassword", "sslmode",
             "application_name"]


def _libpq(conninfo: str) -> dict | None:
    """What libpq reads of ``conninfo`` (None if it refuses it)."""
    psycopg = pytest.importorskip("psycopg")
    try:
        return psycopg.conninfo.conninfo_to_dict(conninfo)
    except (psycopg.ProgrammingError, UnicodeDecodeError):   # psycopg: not UTF-8
        return None


def _shown_as_libpq_reads_it(conninfo: str) -> None:
    """The scrubbed form of ``conninfo`` is what libpq reads of it but its
    secrets, and the secrets found are those libpq reads."""
    read = _libpq(conninfo)
    shown = public_url(conninfo)
    if read is None:
        return
    secrets = {k: v for k, v in read.items() if k in SECRET_KEYWORDS}
    assert secrets_of(conninfo) == secrets
    assert _libpq(shown) == {k: v for k, v in read.items() if k not in SECRET_KEYWORDS}


@settings(max_examples=budget.examples(400), deadline=None)
@given(prefix=st.sampled_from(["postgresql://", "postgres://"]), rest=_URI_PIECES)
def test_a_catalog_uri_is_scrubbed_and_checked_as_libpq_reads_it(prefix, rest):
    url = prefix + rest
    try:
        check_url(url)
    except ConninfoError as e:
        assert "\n" not in str(e)
    _shown_as_libpq_reads_it(url)
    read = _libpq(url)
    if read is not None:
        assert url_fields(url) == read


@settings(max_examples=budget.examples(300), deadline=None)
@given(pairs=st.lists(st.tuples(st.sampled_from(_KEYWORDS), st.text(
    st.sampled_from("a7 '\\=:@"), max_size=8), st.booleans()), max_size=5))
def test_a_keyword_value_string_is_scrubbed_as_libpq_reads_it(pairs):
    def value(text, quoted):
        escaped = text.replace("\\", "\\\\").replace("'", "\\'")
        return f"'{escaped}'" if quoted or not text or " " in text else escaped
    _shown_as_libpq_reads_it(" ".join(f"{k}={value(v, q)}" for k, v, q in pairs))


_GOOD_CONFIG = {"version": 1, "catalog": "postgresql://u@db:5432/cat", "host": "0" * 16,
                "name": "h:/srv/store", "cache_size": None}


@FUZZ
@given(content=st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(sorted(_GOOD_CONFIG)), json_values | _URI_PIECES,
                    max_size=3).map(lambda c: json.dumps({**_GOOD_CONFIG, **c}).encode()),
    _URI_PIECES.map(lambda u: json.dumps({**_GOOD_CONFIG,
                                          "catalog": "postgresql://" + u}).encode()),
    st.integers(1, 100_000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 100_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n)))
def test_any_shared_json_is_read_or_refused_as_damaged(content):
    with tempfile.TemporaryDirectory() as root:
        Path(root, "shared.json").write_bytes(content)
        try:
            config = read_config(Path(root))
        except Damaged as e:
            assert "\n" not in str(e) and "shared.json is damaged" in str(e)
        else:
            assert isinstance(config, SharedConfig)
            assert isinstance(config.catalog, str) and config.catalog.encode()
