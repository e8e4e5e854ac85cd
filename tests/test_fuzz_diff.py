"""Malformed .bdiff files: one clear error, never a traceback or a runaway allocation.

Valid v1 and v2 diffs made by ``create_diff`` on small files are mutated (bit
flips, truncations, header and range-table fields set to extreme values,
unsorted and overlapping ranges, with the v2 checksums recomputed so the
mutation reaches the checks behind them) and fed to ``read_diff``, to
``blockdiff view`` through the CLI in process, and to ``apply_diff``. The only
acceptable outcomes are success or a ``BlockdiffError``/``OSError`` with a
one-line message; apply must leave nothing behind but a complete output.

tests/corpus/diff/*.bdiff holds small crafted files, among them the ones that
used to crash the readers; each is replayed on every run.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
from pathlib import Path

import budget
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockdiff import native
from blockdiff.cli import main
from blockdiff.engine import diff as engine
from blockdiff.engine import formats as fmt
from blockdiff.errors import BlockdiffError, InvalidDiff

BLOCK = 4096
CORPUS = Path(__file__).resolve().parent / "corpus" / "diff"
# The inputs the corpus diffs were made against: a base and a target of a few
# blocks, rebuilt by ``seed_images`` (deterministic content).
BASE_NAME = "base.img"

# (offset, width) of each header field a mutation may set.
V1_FIELDS = {"target_size": (8, 8), "base_size": (16, 8), "range_count": (24, 8)}
V2_FIELDS = {"major": (8, 2), "minor": (10, 2), "header_size": (12, 4), "block_size": (16, 4),
             "flags": (20, 4), "target_size": (24, 8), "base_size": (32, 8),
             "range_count": (40, 8), "table_offset": (48, 8), "data_offset": (56, 8),
             "data_length": (64, 8), "samples": (88, 4)}
# (offset within an entry, width) of each range-table field.
V1_ENTRY = {"offset": (0, 8), "length": (8, 8)}
V2_ENTRY = {"offset": (0, 8), "length": (8, 8), "data_pos": (16, 8), "kind": (24, 4),
            "crc": (28, 4)}
EXTREMES = [0, 1, 2, 191, 192, 511, 512, 4095, 4096, 4097, 2**20, 2**30, 2**31, 2**32 - 1,
            2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**63 + 4096, 2**64 - 4096, 2**64 - 1]


# ------------------------------------------------------------ seed diffs


def seed_images(directory: Path) -> tuple[Path, Path]:
    """A base of 10 blocks and a target that changes, zeroes and grows it."""
    rng = random.Random(7)
    base, target = directory / BASE_NAME, directory / "target.img"
    content = bytearray(rng.randbytes(10 * BLOCK))
    content[3 * BLOCK:4 * BLOCK] = bytes(BLOCK)          # a block of zeros in the base
    base.write_bytes(bytes(content))
    content[1 * BLOCK:3 * BLOCK] = rng.randbytes(2 * BLOCK)    # rewritten
    content[5 * BLOCK:6 * BLOCK] = bytes(BLOCK)                # zeroed
    content[8 * BLOCK + 5] ^= 0xFF                             # one byte changed
    content += rng.randbytes(2 * BLOCK + 100)                  # grown, to an unaligned size
    target.write_bytes(bytes(content))
    return base, target


def make_seeds(directory: Path) -> dict[str, tuple[bytes, bool]]:
    """Valid diffs by name: (bytes, made against the base)."""
    base, target = seed_images(directory)
    seeds = {}
    for fmt_name in ("v1", "v2"):
        for with_base in (True, False):
            out = directory / f"seed-{fmt_name}-{'base' if with_base else 'full'}.bdiff"
            engine.create_diff(out, target, base if with_base else None, format=fmt_name)
            seeds[out.stem] = (out.read_bytes(), with_base)
    return seeds


# -------------------------------------------------------------- mutations


def _put(data: bytearray, offset: int, width: int, value: int) -> None:
    if offset + width <= len(data):
        data[offset:offset + width] = (value % (1 << (8 * width))).to_bytes(width, "little")


def _get(data: bytes, offset: int, width: int) -> int:
    return int.from_bytes(data[offset:offset + width].ljust(width, b"\0"), "little")


def _table(data: bytes) -> tuple[int, int, int, dict]:
    """(table offset, entry size, entry count as the header says, entry fields)."""
    if data[:8] == fmt.V1_MAGIC:
        return 32, 16, _get(data, 24, 8), V1_ENTRY
    return _get(data, 48, 8), 32, _get(data, 40, 8), V2_ENTRY


def mutate(data: bytes, ops: list[tuple], fix_checksums: bool) -> bytes:
    """Apply mutation operations to a diff's bytes.

    Operations: ("field", name, value), ("entry", index, field, value),
    ("swap", i, j), ("overlap", i), ("flip", position, bit), ("truncate", size),
    ("extend", count), ("relayout",). With ``fix_checksums`` a v2 diff's table and header
    checksums are recomputed afterwards, where the table is within the file.
    """
    out = bytearray(data)
    v1 = data[:8] == fmt.V1_MAGIC
    for op in ops:
        kind = op[0]
        if kind == "field":
            fields = V1_FIELDS if v1 else V2_FIELDS
            if op[1] in fields:
                _put(out, *fields[op[1]], op[2])
        elif kind in ("entry", "swap", "overlap"):
            start, size, count, entry = _table(out)
            if start >= len(out) or count == 0:
                continue
            count = min(count, (len(out) - start) // size)
            if count == 0:
                continue
            if kind == "entry":
                _, index, name, value = op
                if name in entry:
                    at = start + (index % count) * size + entry[name][0]
                    _put(out, at, entry[name][1], value)
            elif kind == "swap":
                i, j = (op[1] % count, op[2] % count)
                a, b = start + i * size, start + j * size
                out[a:a + size], out[b:b + size] = out[b:b + size], out[a:a + size]
            else:
                i = op[1] % count
                j = min(i + 1, count - 1)
                a, b = start + i * size, start + j * size
                # The next range starts inside this one (or this one grows into it).
                if i == j:
                    _put(out, a + 8, 8, _get(out, a + 8, 8) + BLOCK)
                else:
                    _put(out, b, 8, _get(out, a, 8) + BLOCK // 2)
        elif kind == "flip":
            if out:
                pos = op[1] % len(out)
                out[pos] ^= 1 << (op[2] % 8)
        elif kind == "truncate":
            del out[op[1] % (len(out) + 1):]
        elif kind == "extend":
            out += bytes(op[1])
        elif kind == "relayout" and not v1:
            # Moves the data offset to just after the table the header now
            # describes, so field mutations get past the layout check.
            block = _get(out, 16, 4) or BLOCK
            end = _get(out, 48, 8) + _get(out, 40, 8) * 32
            _put(out, 56, 8, -(-end // block) * block)
    if fix_checksums and not v1 and out[:8] == fmt.V2_MAGIC and len(out) >= fmt.V2_HEADER_SIZE:
        start, size, count, _ = _table(out)
        if count * size <= len(out) and start + count * size <= len(out):
            _put(out, 184, 4, native.crc32c(bytes(out[start:start + count * size])))
        _put(out, 188, 4, native.crc32c(bytes(out[:188])))
    return bytes(out)


_VALUES = st.one_of(st.sampled_from(EXTREMES), st.integers(0, 2**64 - 1),
                    st.integers(0, 64 * BLOCK))
_FIELD_NAMES = sorted(set(V1_FIELDS) | set(V2_FIELDS))
# The fields whose one value decides how much a reader allocates or reads, or
# where: set to extremes most often, with the layout kept consistent so that
# the value reaches the code behind the layout check.
_SIZE_FIELDS = ["range_count", "table_offset", "data_offset", "data_length", "target_size",
                "base_size", "samples"]
_LARGE = [v for v in EXTREMES if v >= 2**20]
_ATTACK = st.tuples(
    st.lists(st.tuples(st.just("field"), st.sampled_from(_SIZE_FIELDS),
                       st.one_of(st.sampled_from(_LARGE), st.sampled_from(EXTREMES))),
             min_size=1, max_size=2),
    st.sampled_from([True, True, True, False]),
).map(lambda t: t[0] + ([("relayout",)] if t[1] else []))
_OPERATION = st.one_of(
    st.tuples(st.just("field"), st.sampled_from(_FIELD_NAMES), _VALUES),
    st.tuples(st.just("entry"), st.integers(0, 64), st.sampled_from(sorted(V2_ENTRY)), _VALUES),
    st.tuples(st.just("swap"), st.integers(0, 64), st.integers(0, 64)),
    st.tuples(st.just("overlap"), st.integers(0, 64)),
    st.tuples(st.just("flip"), st.integers(0, 2**20), st.integers(0, 7)),
    st.tuples(st.just("flip"), st.integers(0, 4 * BLOCK), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, 2**20)),
    st.tuples(st.just("extend"), st.integers(1, 2 * BLOCK)),
    st.just(("relayout",)),
)


@st.composite
def operations(draw) -> list[tuple]:
    """Mutation operations: a few header fields set to extremes, or a mix of
    everything (fields, table entries, flips, truncation, growth)."""
    if draw(st.booleans()):
        return draw(_ATTACK)
    return draw(st.lists(_OPERATION, min_size=1, max_size=3))


def random_operations(rng: random.Random) -> list[tuple]:
    """The same kind of operations as ``operations``, from a plain RNG."""
    def value():
        pick = rng.random()
        if pick < 0.6:
            return rng.choice(EXTREMES)
        return rng.randrange(2**64) if pick < 0.8 else rng.randrange(64 * BLOCK)

    ops = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(["field", "field", "entry", "entry", "swap", "overlap", "flip",
                           "truncate", "extend", "relayout"])
        if kind == "field":
            ops.append((kind, rng.choice(sorted(set(V1_FIELDS) | set(V2_FIELDS))), value()))
        elif kind == "entry":
            ops.append((kind, rng.randrange(64), rng.choice(sorted(V2_ENTRY)), value()))
        elif kind == "swap":
            ops.append((kind, rng.randrange(64), rng.randrange(64)))
        elif kind == "overlap":
            ops.append((kind, rng.randrange(64)))
        elif kind == "flip":
            ops.append((kind, rng.randrange(4 * BLOCK), rng.randrange(8)))
        elif kind == "truncate":
            ops.append((kind, rng.randrange(2**20)))
        elif kind == "extend":
            ops.append((kind, rng.randint(1, 2 * BLOCK)))
        else:
            ops.append((kind,))
    if rng.random() < 0.5:
        ops.append(("relayout",))
    return ops


# ----------------------------------------------------------------- corpus

_V2_NAMES = ("magic", "major", "minor", "header_size", "block_size", "flags", "target_size",
             "base_size", "range_count", "table_offset", "data_offset", "data_length",
             "fingerprint", "samples", "reserved", "base_id", "target_id", "pad", "table_crc",
             "header_crc")
_V2_ENTRY = struct.Struct("<QQQII")


def _v1(target_size: int, base_size: int, pairs, data: bytes = b"", count: int | None = None,
        keep: int | None = None) -> bytes:
    head = fmt.V1_MAGIC + struct.pack("<QQQ", target_size, base_size,
                                      len(pairs) if count is None else count)
    head += b"".join(struct.pack("<QQ", o, n) for o, n in pairs)
    out = head + bytes(-len(head) % BLOCK) + data
    return out if keep is None else out[:keep]


def _v2(entries, data: bytes = b"", *, keep: int | None = None, bad_header_crc: bool = False,
        bad_table_crc: bool = False, **fields) -> bytes:
    """A v2 diff; ``entries`` are (offset, length, kind, data_pos or None) with the
    data CRC computed from ``data``; ``fields`` override header fields."""
    table = b""
    for offset, length, kind, pos in entries:
        if kind == 0:
            chunk = data[pos:pos + length]
            table += _V2_ENTRY.pack(offset, length, pos, 0, native.crc32c(chunk))
        else:
            table += _V2_ENTRY.pack(offset, length, fmt.NO_DATA if pos is None else pos, kind, 0)
    values = dict(magic=fmt.V2_MAGIC, major=2, minor=0, header_size=192, block_size=BLOCK,
                  flags=0, target_size=0, base_size=0, range_count=len(entries),
                  table_offset=192, data_offset=BLOCK, data_length=len(data),
                  fingerprint=bytes(16), samples=0, reserved=0, base_id=bytes(16),
                  target_id=b"\x5a" * 16, pad=bytes(56), table_crc=native.crc32c(table),
                  header_crc=0)
    values.update(fields)
    if bad_table_crc:
        values["table_crc"] ^= 1
    head = fmt.v2.HEADER.pack(*(values[n] for n in _V2_NAMES))
    crc = native.crc32c(head[:188]) ^ (1 if bad_header_crc else 0)
    head = head[:188] + struct.pack("<I", crc)
    out = head + table
    out += bytes(max(0, BLOCK - len(out))) + data
    return out if keep is None else out[:keep]


def build_corpus(directory: Path) -> dict[str, bytes]:
    """The crafted diffs of tests/corpus/diff, by file name.

    ``valid-*`` apply to seed_images' base (``*-base``) or without one;
    ``huge-*`` are well formed but describe a target of 2^40 bytes with 100
    bytes of data; ``invalid-*`` must each be refused by the reader.
    """
    from blockdiff.engine import identity

    base, _ = seed_images(directory)
    base_size = base.stat().st_size                       # 10 blocks
    with open(base, "rb") as f:
        fingerprint = identity.fingerprint(f.fileno(), base_size, base)
    tail = bytes(range(100))
    with_base = dict(flags=fmt.V2_FLAG_HAS_BASE, base_size=base_size, fingerprint=fingerprint,
                     samples=identity.FINGERPRINT_SAMPLES)
    t = base_size + 100                                   # grown by 100 bytes
    ok = [(BLOCK, BLOCK, 1, None), (base_size, 100, 0, 0)]
    tera = 1 << 40
    c = {
        # Well formed.
        "valid-v1-base.bdiff": _v1(t, base_size, [(base_size, 100)], tail),
        "valid-v1-base-no-ranges.bdiff": _v1(base_size, base_size, []),
        "valid-v2-base.bdiff": _v2(ok, tail, target_size=t, **with_base),
        "valid-v2-full.bdiff": _v2([(0, BLOCK, 1, None), (2 * BLOCK, 100, 0, 0)], tail,
                                   target_size=2 * BLOCK + 100),
        "huge-v1-target-2-40.bdiff": _v1(tera, base_size, [(tera - 100, 100)], tail),
        "huge-v2-target-2-40.bdiff": _v2([(tera - 100, 100, 0, 0)], tail, target_size=tera),
        # v1: sizes and counts no file can hold.
        "invalid-v1-target-2-63.bdiff": _v1(1 << 63, base_size, [(base_size, 100)], tail),
        "invalid-v1-target-2-64-1.bdiff": _v1(2**64 - 1, base_size, [(2**63, 100)], tail),
        "invalid-v1-base-2-64-1.bdiff": _v1(t, 2**64 - 1, [(base_size, 100)], tail),
        "invalid-v1-offset-2-63.bdiff": _v1(2**63 - 1, base_size, [(2**63, 100)], tail),
        "invalid-v1-range-count-2-30.bdiff": _v1(t, base_size, [], count=1 << 30),
        "invalid-v1-range-count-2-64-1.bdiff": _v1(t, base_size, [], count=2**64 - 1),
        "invalid-v1-overflow.bdiff": _v1(t, base_size, [(2**64 - BLOCK, 2 * BLOCK)], tail),
        "invalid-v1-unsorted.bdiff": _v1(t, base_size, [(BLOCK, 50), (0, 50)], tail),
        "invalid-v1-overlap.bdiff": _v1(t, base_size, [(0, BLOCK), (100, 50)], tail),
        "invalid-v1-past-target.bdiff": _v1(t, base_size, [(t, 100)], tail),
        "invalid-v1-truncated-header.bdiff": _v1(t, base_size, [(base_size, 100)], tail,
                                                  keep=20),
        "invalid-v1-truncated-table.bdiff": _v1(t, base_size, [(0, 50), (BLOCK, 50)], keep=40),
        "invalid-v1-truncated-data.bdiff": _v1(t, base_size, [(0, BLOCK), (base_size, 100)],
                                               tail),
        # v2: layout fields.
        "invalid-v2-truncated-header.bdiff": _v2(ok, tail, target_size=t, keep=100),
        "invalid-v2-truncated-data.bdiff": _v2(ok, tail, target_size=t, keep=BLOCK + 50),
        "invalid-v2-header-crc.bdiff": _v2(ok, tail, target_size=t, bad_header_crc=True),
        "invalid-v2-table-crc.bdiff": _v2(ok, tail, target_size=t, bad_table_crc=True),
        "invalid-v2-major-3.bdiff": _v2(ok, tail, target_size=t, major=3),
        "invalid-v2-block-size-0.bdiff": _v2(ok, tail, target_size=t, block_size=0),
        "invalid-v2-block-size-2-31.bdiff": _v2(ok, tail, target_size=t, block_size=1 << 31),
        "invalid-v2-header-size-100.bdiff": _v2(ok, tail, target_size=t, header_size=100),
        "invalid-v2-table-offset-2-63.bdiff": _v2(ok, tail, target_size=t, table_offset=2**63,
                                                  data_offset=2**63 + BLOCK),
        "invalid-v2-range-count-2-30.bdiff": _v2(ok, tail, target_size=t, range_count=1 << 30,
                                                 data_offset=(32 << 30) + BLOCK),
        "invalid-v2-data-offset-2-63.bdiff": _v2(ok, tail, target_size=t, data_offset=2**63),
        "invalid-v2-data-length-2-64-1.bdiff": _v2(ok, tail, target_size=t,
                                                   data_length=2**64 - 1),
        "invalid-v2-target-2-63.bdiff": _v2([(2**63 - 100, 100, 0, 0)], tail,
                                            target_size=2**63),
        "invalid-v2-samples-2-32-1.bdiff": _v2(ok, tail, target_size=t,
                                               **{**with_base, "samples": 2**32 - 1}),
        # v2: range table entries.
        "invalid-v2-unknown-kind.bdiff": _v2([(0, BLOCK, 7, None)], target_size=t),
        "invalid-v2-unsorted.bdiff": _v2([(base_size, 100, 0, 0), (0, BLOCK, 1, None)], tail,
                                         target_size=t),
        "invalid-v2-overlap.bdiff": _v2([(0, 2 * BLOCK, 1, None), (BLOCK, 100, 0, 0)], tail,
                                        target_size=t),
        "invalid-v2-range-overflow.bdiff": _v2([(2**64 - BLOCK, 2 * BLOCK, 1, None)],
                                               target_size=t),
        "invalid-v2-data-pos-unaligned.bdiff": _v2([(base_size, 50, 0, 10)], tail,
                                                   target_size=t),
        "invalid-v2-data-pos-2-64-4096.bdiff": _v2([(base_size, 100, 0, 2**64 - BLOCK)], tail,
                                                   target_size=t),
        "invalid-v2-data-past-region.bdiff": _v2([(base_size, 100, 0, 0)], tail[:50],
                                                 target_size=t),
        "invalid-v2-data-shared.bdiff": _v2([(0, 50, 0, 0), (base_size, 50, 0, 0)], tail,
                                            target_size=t),
        # Not v1 or v2 at all.
        "invalid-empty.bdiff": b"",
        "invalid-magic.bdiff": b"NOTADIFF" + bytes(100),
        "invalid-v3.bdiff": b"BDIFFv3\0" + bytes(200),
    }
    return c


# ---------------------------------------------------------------- checks


def _one_line(error: BaseException) -> None:
    message = str(error)
    assert message and "\n" not in message, repr(message)


def check_read(path: Path) -> None:
    try:
        engine.read_diff(path)
    except (BlockdiffError, OSError) as e:
        _one_line(e)


def check_view(path: Path) -> None:
    runner = CliRunner()
    for args in (["view", str(path)], ["view", str(path), "--json"]):
        result = runner.invoke(main, args)
        output = result.output + (result.stderr if result.stderr_bytes is not None else "")
        assert "Traceback" not in output
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        if result.exit_code != 0:
            errors = [line for line in result.stderr.splitlines() if line]
            assert len(errors) == 1 and errors[0].startswith("blockdiff: error: "), errors


PRECIOUS = b"precious" * 512


def check_apply(path: Path, base: Path | None, out_dir: Path) -> bool:
    """Apply over an existing file: on failure it is left as it was and nothing
    else is left behind. True when the apply succeeded."""
    out_dir.mkdir(exist_ok=True)
    for p in out_dir.iterdir():
        p.unlink()
    target = out_dir / "restored.img"
    target.write_bytes(PRECIOUS)
    try:
        result = engine.apply_diff(path, target, base)
    except (BlockdiffError, OSError) as e:
        _one_line(e)
        assert os.listdir(out_dir) == ["restored.img"], os.listdir(out_dir)
        assert target.read_bytes() == PRECIOUS
        return False
    assert os.listdir(out_dir) == ["restored.img"], os.listdir(out_dir)
    assert os.path.getsize(target) == result.target_size
    return True


# ----------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    directory = tmp_path_factory.mktemp("seeds")
    return directory, make_seeds(directory)


def _write(directory: Path, data: bytes) -> Path:
    path = directory / "fuzz.bdiff"
    path.write_bytes(data)
    return path


_FUZZ = settings(max_examples=budget.examples(300), deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow])


def test_seeds_are_valid(seeds, tmp_path):
    directory, made = seeds
    for name, (data, with_base) in made.items():
        path = _write(tmp_path, data)
        header = engine.read_diff(path)
        assert header.has_base == with_base or header.version == 1
        engine.apply_diff(path, tmp_path / "out.img",
                          directory / BASE_NAME if with_base else None)
        assert (tmp_path / "out.img").read_bytes() == (directory / "target.img").read_bytes()


@pytest.mark.parametrize("reader", ["read_diff", "view", "apply"])
@_FUZZ
@given(seed=st.sampled_from(["seed-v1-base", "seed-v1-full", "seed-v2-base", "seed-v2-full"]),
       ops=operations(), fix=st.sampled_from([True, True, True, False]))
def test_readers_on_mutations(seeds, tmp_path, reader, seed, ops, fix):
    """Each reader of diffs (the library's read_diff, ``view`` through the
    CLI, apply over an existing file) on mutations of valid diffs."""
    directory, made = seeds
    data, with_base = made[seed]
    path = _write(tmp_path, mutate(data, ops, fix))
    if reader == "read_diff":
        check_read(path)
    elif reader == "view":
        check_view(path)
    else:
        check_apply(path, directory / BASE_NAME if with_base else None, tmp_path / "out")


@settings(max_examples=budget.examples(100), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.sampled_from(["seed-v1-base", "seed-v2-full"]),
       offset=st.one_of(st.sampled_from(EXTREMES + [2**64, 2**100]), st.integers(-2**70, 2**70)))
def test_view_at_any_offset(seeds, tmp_path, seed, offset):
    """An OFFSET no file can have is no range's, not an OverflowError."""
    _, made = seeds
    path = _write(tmp_path, made[seed][0])
    text = f"{offset:#x}" if offset >= 0 else f"-{-offset:#x}"
    result = CliRunner().invoke(main, ["view", str(path), "--json", "--", text])
    assert result.exit_code == 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def _corpus():
    return sorted(CORPUS.glob("*.bdiff"))


def test_corpus_is_small_and_present():
    files = _corpus()
    assert len(files) >= 12
    assert all(p.stat().st_size < 8192 for p in files)


@pytest.mark.parametrize("path", _corpus(), ids=lambda p: p.name)
def test_corpus(path, tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    base, target = seed_images(inputs)
    diff = tmp_path / path.name
    shutil.copyfile(path, diff)
    check_read(diff)
    check_view(diff)
    # Applied with seed_images' base and without one: whichever is wrong for
    # the diff must be refused as cleanly as a malformed diff.
    applied = [check_apply(diff, base, tmp_path / "out"), check_apply(diff, None, tmp_path / "out")]
    if path.name.startswith("invalid-"):
        with pytest.raises(InvalidDiff):
            engine.read_diff(diff)
        assert applied == [False, False]
    elif path.name.startswith("valid-v1"):
        assert applied[0]        # v1 has no base flag: without a base it applies to nothing
    elif path.name.startswith("valid-"):
        assert applied == ([True, False] if "-base" in path.name else [False, True])
    else:
        # huge-*: well formed, a 2^40-byte target with 100 bytes of data. Refused
        # where the filesystem is smaller than that, at once.
        header = engine.read_diff(diff)
        assert header.target_size == 1 << 40
        st = os.statvfs(tmp_path)
        if st.f_blocks * st.f_frsize < header.target_size:
            assert applied == [False, False]


if __name__ == "__main__":
    # Regenerate the corpus: python3 tests/test_fuzz_diff.py
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        CORPUS.mkdir(parents=True, exist_ok=True)
        for name, data in build_corpus(Path(scratch)).items():
            (CORPUS / name).write_bytes(data)
            print(f"{CORPUS / name}: {len(data)} bytes")
