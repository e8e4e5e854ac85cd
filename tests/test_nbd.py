"""The NBD dirty-bitmap client against a real qemu-storage-daemon.

Each test gets its own daemon over a sparse raw image, with a dirty bitmap on
the raw node and an NBD export publishing it. Writes go through that export
with qemu-io, so QEMU sees them exactly as it would a guest's; the expected
dirty set is computed by a plain model: each written byte range widened to
the bitmap's 4 KiB granularity.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from blockdiff.errors import NBDError
from blockdiff.vm.guestlink import connect_unix
from blockdiff.vm.nbd import NBDClient, dirty_ranges

GRANULARITY = 4096
BITMAP = "snap"
EXPORT = "disk"
CONTEXT = "qemu:dirty-bitmap:" + BITMAP
GiB = 1 << 30
MiB = 1 << 20


class QMPError(Exception):
    pass


class QMP:
    """Just enough QMP for the tests: one command at a time, events skipped."""

    def __init__(self, path: str, dir_fd: int):
        self.sock = connect_unix(path, dir_fd)
        self.sock.settimeout(10)
        self.file = self.sock.makefile("rwb")
        self.events: list[str] = []
        self._read()  # greeting
        self.command("qmp_capabilities")

    def _read(self) -> dict:
        line = self.file.readline()
        assert line, "qemu-storage-daemon closed its QMP socket"
        return json.loads(line)

    def command(self, command: str, /, **arguments) -> dict:
        self.file.write(json.dumps({"execute": command, "arguments": arguments}).encode()
                        + b"\n")
        self.file.flush()
        while "event" in (reply := self._read()):
            self.events.append(reply["event"])
        if "error" in reply:
            raise QMPError(f"{command}: {reply['error']['desc']}")
        return reply["return"]

    def wait_event(self, event: str) -> None:
        while event not in self.events:
            self.events.append(self._read().get("event"))
        self.events.remove(event)

    def close(self) -> None:
        self.file.close()
        self.sock.close()


class Daemon:
    """A qemu-storage-daemon exporting ``disk.raw`` as ``EXPORT`` with ``BITMAP``."""

    def __init__(self, directory: Path, size: int, discard: str = "ignore"):
        self.directory = directory
        self.size = size
        with open(directory / "disk.raw", "wb") as image:
            image.truncate(size)
        self.dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        self.qmp = None
        # Relative socket paths (cwd is the directory) and /proc/self/fd for
        # our side keep deep tmp paths clear of the 108-byte sun_path limit.
        with open(directory / "qsd.log", "wb") as log:
            self.process = subprocess.Popen(
                ["qemu-storage-daemon",
                 "--blockdev", f"file,node-name=file0,filename=disk.raw,discard={discard}",
                 "--blockdev", f"raw,node-name=disk0,file=file0,discard={discard}",
                 "--chardev", "socket,id=m,path=qmp.sock,server=on,wait=off",
                 "--monitor", "chardev=m",
                 "--nbd-server", "addr.type=unix,addr.path=nbd.sock"],
                cwd=directory, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 10
            while not ((directory / "qmp.sock").exists()
                       and (directory / "nbd.sock").exists()):
                assert self.process.poll() is None, (
                    "qemu-storage-daemon exited: " + (directory / "qsd.log").read_text())
                assert time.monotonic() < deadline, "qemu-storage-daemon did not start"
                time.sleep(0.01)
            self.qmp = QMP("qmp.sock", self.dir_fd)
            self.qmp.command("block-dirty-bitmap-add", node="disk0", name=BITMAP,
                             granularity=GRANULARITY)
            self.export()
        except BaseException:
            self.stop()
            raise

    def export(self) -> None:
        self.qmp.command("block-export-add", type="nbd", id="export0", **{"node-name": "disk0"},
                         name=EXPORT, writable=True, bitmaps=[BITMAP])

    def unexport(self) -> None:
        # Deletion completes asynchronously, once the export's clients are gone.
        self.qmp.command("block-export-del", id="export0")
        self.qmp.wait_event("BLOCK_EXPORT_DELETED")

    def connect(self) -> socket.socket:
        return connect_unix("nbd.sock", self.dir_fd)

    def write(self, *ranges: tuple[int, int], zeroes: bool = False) -> None:
        """Write each (offset, length) through the NBD export, as a guest would."""
        op = "write -z" if zeroes else "write -P 0x5a"
        commands = [f"{op} {offset} {length}" for offset, length in ranges]
        for start in range(0, len(commands), 2000):
            argv = ["qemu-io", "-f", "raw", f"nbd+unix:///{EXPORT}?socket=nbd.sock"]
            for command in commands[start:start + 2000]:
                argv += ["-c", command]
            done = subprocess.run(argv, cwd=self.directory, capture_output=True, text=True,
                                  timeout=120)
            assert done.returncode == 0 and "failed" not in done.stdout + done.stderr, (
                done.stdout + done.stderr)

    def write_zeroes_pipelined(self, ranges: list[tuple[int, int]]) -> None:
        """NBD_CMD_WRITE_ZEROES for each range, many in flight: qemu-io spends
        about 0.3 ms a command, too slow for the 100,000 runs some tests need.
        With discard=unmap QEMU punches holes, so nothing gets allocated."""
        with NBDClient(self.connect(), EXPORT) as client:
            sock = client._sock  # the client reads only; borrow its negotiated socket
            batch = 1024  # requests and replies of a batch fit in the socket buffers
            for start in range(0, len(ranges), batch):
                chunk = ranges[start:start + batch]
                sock.sendall(b"".join(
                    struct.pack(">IHHQQI", 0x25609513, 0, 6, start + i, offset, length)
                    for i, (offset, length) in enumerate(chunk)))
                replies = bytearray()
                while len(replies) < 16 * len(chunk):
                    received = sock.recv(16 * len(chunk) - len(replies))
                    assert received, "qemu-storage-daemon closed the NBD connection"
                    replies += received
                # Success is a simple reply (magic, error 0, cookie).
                words = np.frombuffer(replies, ">u4").reshape(-1, 4)
                assert (words[:, 0] == 0x67446698).all() and (words[:, 1] == 0).all()

    def dirty(self) -> tuple[np.ndarray, np.ndarray]:
        return dirty_ranges(self.connect(), EXPORT, BITMAP)

    def client(self, contexts=(CONTEXT,), **kwargs) -> NBDClient:
        return NBDClient(self.connect(), EXPORT, list(contexts), **kwargs)

    def stop(self) -> None:
        if self.qmp is not None:
            self.qmp.close()
        self.process.kill()
        self.process.wait()
        os.close(self.dir_fd)


@pytest.fixture
def qsd(tmp_path):
    """Start a daemon: ``qsd(size)``; every one is killed at teardown."""
    for tool in ("qemu-storage-daemon", "qemu-io"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (Debian: apt-get install qemu-utils "
                        f"qemu-system-common)")
    daemons = []

    def start(size: int, **options) -> Daemon:
        directory = tmp_path / f"qsd{len(daemons)}"
        directory.mkdir()
        daemons.append(Daemon(directory, size, **options))
        return daemons[-1]

    yield start
    for daemon in daemons:
        daemon.stop()


# ------------------------------------------------------------ the model


def expected_runs(size: int, writes) -> tuple[np.ndarray, np.ndarray]:
    """Dirty runs QEMU should report: writes widened to the granularity,
    touching ones joined, the last clipped to the export's end."""
    blocks = np.zeros(-(-size // GRANULARITY), dtype=bool)
    for offset, length in writes:
        blocks[offset // GRANULARITY:-(-(offset + length) // GRANULARITY)] = True
    edges = np.flatnonzero(np.diff(np.r_[0, blocks.astype(np.int8), 0]))
    starts = edges[0::2].astype(np.uint64) * GRANULARITY
    ends = np.minimum(edges[1::2].astype(np.uint64) * GRANULARITY, size)
    return starts, ends - starts


def assert_runs(actual, expected):
    (offsets, lengths), (want_offsets, want_lengths) = actual, expected
    assert offsets.dtype == lengths.dtype == np.uint64
    assert list(zip(offsets.tolist(), lengths.tolist())) == list(
        zip(want_offsets.tolist(), want_lengths.tolist()))


def assert_covers(offsets, lengths, flags, start, end):
    assert offsets.dtype == lengths.dtype == np.uint64 and flags.dtype == np.uint32
    assert len(offsets) == len(lengths) == len(flags) >= 1
    assert offsets[0] == start and int(offsets[-1] + lengths[-1]) == end
    assert (offsets[1:] == offsets[:-1] + lengths[:-1]).all()
    assert (lengths > 0).all()


def clip_runs(runs, start, end):
    offsets, lengths = runs
    lo = np.maximum(offsets, start)
    hi = np.minimum(offsets + lengths, end)
    keep = hi > lo
    return lo[keep], hi[keep] - lo[keep]


def dirty_of(offsets, lengths, flags):
    """Merged dirty runs from raw descriptors."""
    model = list(zip(offsets[flags & 1 == 1].tolist(), lengths[flags & 1 == 1].tolist()))
    merged = []
    for offset, length in model:
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1][1] += length
        else:
            merged.append([offset, length])
    return (np.array([m[0] for m in merged], np.uint64),
            np.array([m[1] for m in merged], np.uint64))


def random_writes(rng: random.Random, size: int, count: int) -> list[tuple[int, int]]:
    writes = []
    for _ in range(count):
        length = rng.choice([1, 17, 511, 512, 4095, 4096, 4097, 8192, 12345, 65536,
                             rng.randrange(1, 2 * MiB)])
        offset = rng.randrange(0, size - length + 1)
        if rng.random() < 0.3:
            offset -= offset % GRANULARITY
        writes.append((offset, length))
    return writes


# ------------------------------------------------------------ tests


def test_fresh_bitmap_is_clean(qsd):
    daemon = qsd(64 * MiB)
    offsets, lengths = daemon.dirty()
    assert len(offsets) == len(lengths) == 0
    assert offsets.dtype == lengths.dtype == np.uint64
    with daemon.client() as client:
        assert client.size == 64 * MiB
        assert_covers(*client.block_status(CONTEXT), 0, 64 * MiB)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_writes_match_model(qsd, seed):
    size = 96 * MiB
    daemon = qsd(size)
    rng = random.Random(seed)
    writes = random_writes(rng, size, 150)
    zero_writes = random_writes(rng, size, 20)
    daemon.write(*writes)
    daemon.write(*zero_writes, zeroes=True)
    assert_runs(daemon.dirty(), expected_runs(size, writes + zero_writes))


def test_clear_then_only_new_writes(qsd):
    size = 32 * MiB
    daemon = qsd(size)
    daemon.write((0, 1), (5 * MiB + 3, 70000), (size - 4096, 4096))
    assert len(daemon.dirty()[0]) == 3
    # QEMU marks an exported bitmap busy: clearing it means unexporting first.
    with pytest.raises(QMPError, match="in use"):
        daemon.qmp.command("block-dirty-bitmap-clear", node="disk0", name=BITMAP)
    daemon.unexport()
    daemon.qmp.command("block-dirty-bitmap-clear", node="disk0", name=BITMAP)
    daemon.export()
    offsets, lengths = daemon.dirty()
    assert len(offsets) == len(lengths) == 0
    later = [(8192, 100), (20 * MiB - 1, 2)]
    daemon.write(*later)
    assert_runs(daemon.dirty(), expected_runs(size, later))


def test_export_larger_than_4_gib(qsd):
    size = 9 * GiB
    daemon = qsd(size)
    first_request_end = 2**32 - 4096  # where the client's first request stops
    writes = [(0, 4096), (1 * MiB + 5, 1),
              (first_request_end - 8192, 3 * 4096 + 1),  # straddles two requests
              (2**32, 4096), (2**32 + 12 * MiB, 1 * MiB),
              (size - 4096 * 3 - 7, 7), (size - 1, 1)]
    daemon.write(*writes)
    expected = expected_runs(size, writes)
    assert_runs(daemon.dirty(), expected)

    with daemon.client() as client:
        assert client.size == size
        offsets, lengths, flags = client.block_status(CONTEXT)
        assert_covers(offsets, lengths, flags, 0, size)
        # The straddling run comes back split at the request boundary, and
        # dirty_ranges joined it above.
        assert first_request_end in offsets.tolist()
        assert_runs(dirty_of(offsets, lengths, flags), expected)


@pytest.mark.parametrize("file_size", [10 * MiB + 3 * 512, 10 * MiB + 1000])
def test_size_not_a_multiple_of_the_granularity(qsd, file_size):
    daemon = qsd(file_size)
    # QEMU 7.2 sizes block nodes in 512-byte sectors: it rounds the file up.
    size = -(-file_size // 512) * 512
    writes = [(0, 1), (file_size - 100, 100), (size - 4096 - 1, 2)]
    daemon.write(*writes)
    with daemon.client() as client:
        assert client.size == size
        assert_covers(*client.block_status(CONTEXT), 0, size)
    offsets, lengths = daemon.dirty()
    assert int(offsets[-1] + lengths[-1]) == size
    assert_runs((offsets, lengths), expected_runs(size, writes))


def test_server_answering_short_is_continued(qsd):
    # QEMU 7.2 puts at most 131,072 descriptors (1 MiB) in one reply; 100,000
    # separate dirty runs need 200,000, so the first request comes back short.
    size = 2 * GiB
    daemon = qsd(size, discard="unmap")
    writes = [(block * 2 * GRANULARITY, GRANULARITY) for block in range(100_000)]
    daemon.write_zeroes_pipelined(writes)
    expected = expected_runs(size, writes)
    with daemon.client() as client:
        asked = []
        ask_server = client._block_status_request

        def counting(context_id, offset, length):
            asked.append((offset, length))
            return ask_server(context_id, offset, length)

        client._block_status_request = counting
        offsets, lengths, flags = client.block_status(CONTEXT)
    assert len(asked) > 1 and asked[0] == (0, size)
    assert_covers(offsets, lengths, flags, 0, size)
    assert len(offsets) == 200_000  # dirty, clean, ..., dirty, clean to the end
    assert_runs(dirty_of(offsets, lengths, flags), expected)
    assert_runs(daemon.dirty(), expected)


def test_block_status_of_a_sub_range(qsd):
    size = 64 * MiB
    daemon = qsd(size)
    writes = random_writes(random.Random(7), size, 60)
    daemon.write(*writes)
    model = expected_runs(size, writes)
    rng = random.Random(8)
    with daemon.client() as client:
        for start, length in [(0, 1), (1, 4095), (4095, 2), (12345, 6 * MiB + 77),
                              (size - 10, 10), (size // 2, size // 2)] + [
                (s, rng.randrange(1, size - s + 1))
                for s in (rng.randrange(size) for _ in range(20))]:
            offsets, lengths, flags = client.block_status(CONTEXT, start, length)
            assert_covers(offsets, lengths, flags, start, start + length)
            assert_runs(dirty_of(offsets, lengths, flags),
                        clip_runs(model, start, start + length))
        empty = client.block_status(CONTEXT, 1000, 0)
        assert [len(a) for a in empty] == [0, 0, 0]
        with pytest.raises(NBDError, match="outside the export"):
            client.block_status(CONTEXT, size - 10, 11)
        with pytest.raises(NBDError, match="not negotiated"):
            client.block_status("base:allocation")


def test_server_errors_keep_the_connection_usable(qsd):
    daemon = qsd(16 * MiB)
    daemon.write((4096, 1))
    with daemon.client(["base:allocation", CONTEXT]) as client:
        # Past the end: QEMU answers with an error chunk, not a hang-up.
        with pytest.raises(NBDError, match="past EOF|EINVAL"):
            client._block_status_request(client.context_ids[CONTEXT], client.size - 4096, 8192)
        offsets, lengths, flags = client.block_status(CONTEXT)
        assert_runs(dirty_of(offsets, lengths, flags), expected_runs(client.size, [(4096, 1)]))
        assert_covers(*client.block_status("base:allocation"), 0, client.size)
    client.close()  # idempotent


def test_server_dying_mid_session(qsd):
    daemon = qsd(16 * MiB)
    client = daemon.client()
    daemon.process.kill()
    daemon.process.wait()
    with pytest.raises(NBDError, match="closed the connection"):
        client.block_status(CONTEXT)
    with pytest.raises(NBDError, match="reconnect"):
        client.block_status(CONTEXT)
    client.close()
    client.close()


def test_stalled_server_times_out(qsd):
    daemon = qsd(16 * MiB)
    with daemon.client(timeout=0.3) as client:
        daemon.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(NBDError, match="did not send a block status reply within 0.3 s"):
                client.block_status(CONTEXT)
            assert time.monotonic() - started < 3
        finally:
            daemon.process.send_signal(signal.SIGCONT)


def test_unknown_bitmap_is_named(qsd):
    daemon = qsd(16 * MiB)
    with pytest.raises(NBDError, match="qemu:dirty-bitmap:no-such-bitmap"):
        dirty_ranges(daemon.connect(), EXPORT, "no-such-bitmap")
    # A bitmap that exists but is not exported is just as unknown to NBD.
    daemon.qmp.command("block-dirty-bitmap-add", node="disk0", name="private")
    with pytest.raises(NBDError, match="qemu:dirty-bitmap:private"):
        dirty_ranges(daemon.connect(), EXPORT, "private")
    assert len(daemon.dirty()[0]) == 0  # the server is still fine


def test_unknown_export(qsd):
    daemon = qsd(16 * MiB)
    with pytest.raises(NBDError, match="no-such-export"):
        dirty_ranges(daemon.connect(), "no-such-export", BITMAP)
    with pytest.raises(NBDError, match="no-such-export"):  # refused at NBD_OPT_GO
        NBDClient(daemon.connect(), "no-such-export")


def _fake_peer(data: bytes | None, *, close: bool = True):
    ours, theirs = socket.socketpair()
    if data is not None:
        theirs.sendall(data)
    if close:
        theirs.close()
    return ours, theirs


@pytest.mark.parametrize("junk, message", [
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", "not an NBD server"),
    (b"SSH-2.0-Open", "closed the connection"),
    (b"", "closed the connection"),
    # NBD magic, then an oldstyle server: we only speak newstyle.
    (bytes.fromhex("4e42444d41474943" "0000420281861253") + bytes(130), "oldstyle"),
    # Newstyle greeting, then the peer hangs up instead of answering options.
    (bytes.fromhex("4e42444d41474943" "49484156454f5054" "0003"), "closed the connection"),
])
def test_peer_that_is_not_nbd(junk, message):
    sock, _ = _fake_peer(junk)
    started = time.monotonic()
    with pytest.raises(NBDError, match=message):
        NBDClient(sock, EXPORT, [CONTEXT], timeout=5)
    assert time.monotonic() - started < 4
    assert sock.fileno() == -1  # the client closed the socket it was given


def test_silent_peer_times_out():
    sock, theirs = _fake_peer(None, close=False)
    try:
        with pytest.raises(NBDError, match="did not send .* within 0.2 s"):
            dirty_ranges(sock, EXPORT, BITMAP, timeout=0.2)
    finally:
        theirs.close()


@pytest.mark.slow
def test_timing_4_gib_with_5000_runs(qsd):
    size = 4 * GiB
    daemon = qsd(size)
    rng = random.Random(5000)
    # Even block numbers only: no two runs touch, so there are exactly 5000.
    blocks = sorted(rng.sample(range(0, size // GRANULARITY, 2), 5000))
    writes = [(b * GRANULARITY + rng.randrange(GRANULARITY), 1) for b in blocks]
    daemon.write(*writes)
    assert_runs(daemon.dirty(), expected_runs(size, writes))
    timings = []
    for _ in range(20):
        started = time.perf_counter()
        offsets, _ = daemon.dirty()
        timings.append(time.perf_counter() - started)
    assert len(offsets) == 5000
    print(f"\ndirty_ranges, 4 GiB export, 5000 runs: median {np.median(timings) * 1e3:.2f} ms, "
          f"best {min(timings) * 1e3:.2f} ms (connect + handshake + block status)")
