"""A minimal NBD client for reading QEMU dirty bitmaps through block status.

While a VM runs, QEMU tracks the blocks the guest writes in a dirty bitmap
(``block-dirty-bitmap-add``) and can publish it on its built-in NBD server
(``block-export-add`` with ``bitmaps: [NAME]``) as the metadata context
``qemu:dirty-bitmap:NAME``. Reading that bitmap tells a snapshot which blocks
changed since the last one, so it does not have to map the whole image.

Only the part of the protocol needed for that is spoken
(https://github.com/NetworkBlockDevice/nbd/blob/master/doc/proto.md):
fixed-newstyle negotiation with ``NBD_OPT_STRUCTURED_REPLY``,
``NBD_OPT_SET_META_CONTEXT`` and ``NBD_OPT_GO``; then ``NBD_CMD_BLOCK_STATUS``
answered by structured replies, and ``NBD_CMD_DISC``. No TLS, no extended
headers, no reads or writes, one request in flight at a time.
"""

from __future__ import annotations

import errno
import os
import socket
import struct

import numpy as np

from blockdiff.errors import NBDError

NBDMAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
OLDSTYLE_MAGIC = 0x00420281861253
OPTION_REPLY_MAGIC = 0x0003E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698
STRUCTURED_REPLY_MAGIC = 0x668E33EF

FLAG_FIXED_NEWSTYLE = 1 << 0
FLAG_NO_ZEROES = 1 << 1

OPT_ABORT = 2
OPT_GO = 7
OPT_STRUCTURED_REPLY = 8
OPT_SET_META_CONTEXT = 10
OPTION_NAMES = {OPT_GO: "NBD_OPT_GO", OPT_STRUCTURED_REPLY: "NBD_OPT_STRUCTURED_REPLY",
                OPT_SET_META_CONTEXT: "NBD_OPT_SET_META_CONTEXT"}

REP_ACK = 1
REP_INFO = 3
REP_META_CONTEXT = 4
REP_ERROR_BIT = 1 << 31
REP_ERROR_NAMES = {1: "unsupported", 2: "refused by policy", 3: "invalid",
                   4: "unsupported on this platform", 5: "TLS required",
                   6: "unknown export", 7: "server shutting down",
                   8: "block size negotiation required", 9: "too big",
                   10: "extended headers required"}

INFO_EXPORT = 0

CMD_DISC = 2
CMD_BLOCK_STATUS = 7

REPLY_FLAG_DONE = 1 << 0
REPLY_TYPE_NONE = 0
REPLY_TYPE_BLOCK_STATUS = 5
REPLY_TYPE_ERROR_BIT = 1 << 15

STATE_DIRTY = 1  # qemu:dirty-bitmap:NAME, bit 0 of a descriptor's flags

DIRTY_BITMAP_CONTEXT = "qemu:dirty-bitmap:"

# Request lengths are u32; stay a page below 4 GiB so that each request keeps
# the next one's offset aligned for the server.
MAX_REQUEST = 2**32 - 4096
# Far beyond anything a sane server sends (QEMU caps block status at 1 MiB of
# descriptors); bounds what junk on the socket can make us allocate.
MAX_PAYLOAD = 64 << 20

_OPTION = struct.Struct(">QII")
_OPTION_REPLY = struct.Struct(">QIII")
_REQUEST = struct.Struct(">IHHQQI")
_SIMPLE_REPLY_REST = struct.Struct(">IQ")  # after the magic
_STRUCTURED_REPLY_REST = struct.Struct(">HHQI")  # after the magic


def _errno_text(code: int) -> str:
    name = errno.errorcode.get(code)
    return f"{name}: {os.strerror(code)}" if name else f"error {code}"


class NBDClient:
    """One NBD connection, negotiated for block status of ``contexts``.

    Takes ownership of ``sock``, an already connected stream socket: it is
    closed by ``close()`` or when the handshake fails.
    """

    def __init__(self, sock: socket.socket, export: str, contexts: list[str] = (), *,
                 timeout: float = 10.0):
        self._sock = sock
        self._timeout = timeout
        self._closed = False
        self._transmission = False
        # Set while a reply is (partly) unread: after a failure mid-reply the
        # stream cannot be resynchronised, and the connection is only closed.
        self._awaiting_reply = False
        self._next_cookie = 1
        self.export = export
        self.context_ids: dict[str, int] = {}
        self.size = 0
        self.transmission_flags = 0
        try:
            sock.settimeout(timeout)
            self._handshake(export, list(contexts))
        except BaseException:
            self._sock.close()
            self._closed = True
            raise

    # ------------------------------------------------------------ wire

    def _recv(self, size: int, what: str) -> bytearray:
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        try:
            while got < size:
                n = self._sock.recv_into(view[got:])
                if n == 0:
                    raise NBDError(f"the NBD server closed the connection while we waited "
                                   f"for {what}")
                got += n
        except TimeoutError:
            raise NBDError(f"the NBD server did not send {what} within "
                           f"{self._timeout:g} s") from None
        except ConnectionResetError:
            raise NBDError(f"the NBD server closed the connection while we waited "
                           f"for {what}") from None
        except OSError as e:
            raise NBDError(f"the NBD connection failed while we waited for {what}: "
                           f"{e.strerror or e}") from None
        return buf

    def _send(self, data: bytes, what: str) -> None:
        try:
            self._sock.sendall(data)
        except TimeoutError:
            raise NBDError(f"the NBD server did not accept {what} within "
                           f"{self._timeout:g} s") from None
        except (BrokenPipeError, ConnectionResetError):
            raise NBDError(f"the NBD server closed the connection before we sent "
                           f"{what}") from None
        except OSError as e:
            raise NBDError(f"the NBD connection failed while we sent {what}: "
                           f"{e.strerror or e}") from None

    # ------------------------------------------------------------ handshake

    def _handshake(self, export: str, contexts: list[str]) -> None:
        magic, second, server_flags = struct.unpack(">QQH", self._recv(18, "the NBD greeting"))
        if magic != NBDMAGIC:
            raise NBDError("the peer is not an NBD server (no NBD magic in its greeting)")
        if second == OLDSTYLE_MAGIC:
            raise NBDError("the NBD server only speaks the oldstyle protocol; "
                           "newstyle is required")
        if second != IHAVEOPT:
            raise NBDError("the NBD server sent an unknown greeting")
        if not server_flags & FLAG_FIXED_NEWSTYLE:
            raise NBDError("the NBD server does not support fixed newstyle negotiation")
        # NO_ZEROES spares the 124 zero bytes after the export info of the
        # legacy NBD_OPT_EXPORT_NAME; harmless with NBD_OPT_GO.
        self._send(struct.pack(">I", FLAG_FIXED_NEWSTYLE | (server_flags & FLAG_NO_ZEROES)),
                   "the client flags")
        try:
            self._negotiate(export, contexts)
        except NBDError:
            # A refusal leaves the server waiting for the next option: say we
            # are leaving. If the stream broke instead, this is junk it drops.
            try:
                self._sock.sendall(_OPTION.pack(IHAVEOPT, OPT_ABORT, 0))
            except OSError:
                pass
            raise

    def _negotiate(self, export: str, contexts: list[str]) -> None:
        self._option(OPT_STRUCTURED_REPLY, b"")
        reply, _ = self._option_reply(OPT_STRUCTURED_REPLY)
        if reply != REP_ACK:
            raise NBDError(f"the NBD server sent reply type {reply} to "
                           f"NBD_OPT_STRUCTURED_REPLY")

        name = export.encode()
        if contexts:
            queries = [c.encode() for c in contexts]
            self._option(OPT_SET_META_CONTEXT, b"".join(
                [struct.pack(">I", len(name)), name, struct.pack(">I", len(queries))]
                + [struct.pack(">I", len(q)) + q for q in queries]))
            while True:
                reply, data = self._option_reply(OPT_SET_META_CONTEXT)
                if reply == REP_ACK:
                    break
                if reply != REP_META_CONTEXT or len(data) < 4:
                    raise NBDError(f"the NBD server sent reply type {reply} to "
                                   f"NBD_OPT_SET_META_CONTEXT")
                (context_id,) = struct.unpack_from(">I", data)
                self.context_ids[bytes(data[4:]).decode(errors="replace")] = context_id
            missing = [c for c in contexts if c not in self.context_ids]
            if missing:
                raise NBDError(f"the NBD export {export!r} has no metadata context "
                               f"{', '.join(map(repr, missing))}"
                               + (" (no such dirty bitmap exported)"
                                  if any(m.startswith(DIRTY_BITMAP_CONTEXT) for m in missing)
                                  else ""))

        # No info requests: the server sends NBD_INFO_EXPORT regardless.
        self._option(OPT_GO, struct.pack(">I", len(name)) + name + struct.pack(">H", 0))
        have_export_info = False
        while True:
            reply, data = self._option_reply(OPT_GO)
            if reply == REP_ACK:
                break
            if reply != REP_INFO or len(data) < 2:
                raise NBDError(f"the NBD server sent reply type {reply} to NBD_OPT_GO")
            (info,) = struct.unpack_from(">H", data)
            if info == INFO_EXPORT:
                if len(data) != 12:
                    raise NBDError("the NBD server sent a malformed NBD_INFO_EXPORT")
                self.size, self.transmission_flags = struct.unpack_from(">QH", data, 2)
                have_export_info = True
            # Other info types (name, description, block size) are not needed.
        if not have_export_info:
            raise NBDError("the NBD server did not send the export size (NBD_INFO_EXPORT)")
        self._transmission = True

    def _option(self, option: int, data: bytes) -> None:
        self._send(_OPTION.pack(IHAVEOPT, option, len(data)) + data, OPTION_NAMES[option])

    def _option_reply(self, option: int) -> tuple[int, bytearray]:
        what = f"the reply to {OPTION_NAMES[option]}"
        magic, replied_option, reply, length = _OPTION_REPLY.unpack(
            self._recv(_OPTION_REPLY.size, what))
        if magic != OPTION_REPLY_MAGIC:
            raise NBDError(f"the NBD server sent garbage instead of {what}")
        if replied_option != option:
            raise NBDError(f"the NBD server answered option {replied_option} instead of "
                           f"{OPTION_NAMES[option]}")
        if length > MAX_PAYLOAD:
            raise NBDError(f"the NBD server sent an oversized reply ({length} bytes) to "
                           f"{OPTION_NAMES[option]}")
        data = self._recv(length, what)
        if reply & REP_ERROR_BIT:
            kind = REP_ERROR_NAMES.get(reply & ~REP_ERROR_BIT, f"error {reply:#x}")
            message = bytes(data).decode(errors="replace").strip()
            raise NBDError(f"the NBD server refused {OPTION_NAMES[option]} "
                           f"({kind})" + (f": {message}" if message else ""))
        return reply, data

    # ------------------------------------------------------------ transmission

    def block_status(self, context: str, offset: int = 0, length: int | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Descriptors of ``context`` over ``[offset, offset + length)``.

        Returns ``(offsets, lengths, flags)`` (uint64, uint64, uint32):
        contiguous, in order, covering exactly the range. Neighbours may share
        flags where the range took more than one request.
        """
        if self._closed:
            raise NBDError("the NBD connection is closed")
        if self._awaiting_reply:
            raise NBDError("the NBD connection broke during an earlier request; reconnect")
        try:
            context_id = self.context_ids[context]
        except KeyError:
            raise NBDError(f"metadata context {context!r} was not negotiated on this "
                           f"connection") from None
        if length is None:
            length = self.size - offset
        end = offset + length
        if offset < 0 or length < 0 or end > self.size:
            raise NBDError(f"block status range {offset}+{length} is outside the export "
                           f"({self.size} bytes)")

        offset_parts, length_parts, flag_parts = [], [], []
        position = offset
        while position < end:
            # A capped request ends on a 4 KiB boundary, so the next one starts
            # aligned with the server's blocks.
            ask = min(end - position, MAX_REQUEST - position % 4096)
            descriptors = self._block_status_request(context_id, position, ask)
            lengths = descriptors[:, 0].astype(np.uint64)
            ends = np.cumsum(lengths, dtype=np.uint64) + np.uint64(position)
            # Descriptors past the range (older servers round up) are cut off.
            keep = min(int(np.searchsorted(ends, end)) + 1, len(ends))
            lengths, ends = lengths[:keep], ends[:keep]
            if int(ends[-1]) > end:
                lengths[-1] -= ends[-1] - np.uint64(end)
                ends[-1] = end
            offset_parts.append(ends - lengths)
            length_parts.append(lengths)
            flag_parts.append(descriptors[:keep, 1].astype(np.uint32))
            position = int(ends[-1])

        if not offset_parts:
            return (np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.uint32))
        return (np.concatenate(offset_parts), np.concatenate(length_parts),
                np.concatenate(flag_parts))

    def _block_status_request(self, context_id: int, offset: int, length: int) -> np.ndarray:
        """One NBD_CMD_BLOCK_STATUS: the (length, flags) descriptor pairs, as
        big-endian u32 rows, of ``context_id``."""
        cookie = self._next_cookie
        self._next_cookie += 1
        self._awaiting_reply = True
        self._send(_REQUEST.pack(REQUEST_MAGIC, 0, CMD_BLOCK_STATUS, cookie, offset, length),
                   "a block status request")
        what = "a block status reply"
        descriptors = None
        error = None
        while True:
            (magic,) = struct.unpack(">I", self._recv(4, what))
            if magic == SIMPLE_REPLY_MAGIC:
                # Allowed for errors of commands other than reads.
                code, reply_cookie = _SIMPLE_REPLY_REST.unpack(
                    self._recv(_SIMPLE_REPLY_REST.size, what))
                self._check_cookie(reply_cookie, cookie)
                self._awaiting_reply = False
                if code:
                    raise NBDError(f"the NBD server refused block status at {offset}+{length}: "
                                   f"{_errno_text(code)}")
                raise NBDError("the NBD server answered block status without any status")
            if magic != STRUCTURED_REPLY_MAGIC:
                raise NBDError(f"the NBD server sent garbage instead of {what}")
            flags, chunk_type, reply_cookie, chunk_length = _STRUCTURED_REPLY_REST.unpack(
                self._recv(_STRUCTURED_REPLY_REST.size, what))
            self._check_cookie(reply_cookie, cookie)
            if chunk_length > MAX_PAYLOAD:
                raise NBDError(f"the NBD server sent an oversized reply chunk "
                               f"({chunk_length} bytes)")
            payload = self._recv(chunk_length, what)

            if chunk_type & REPLY_TYPE_ERROR_BIT:
                # Keep reading to DONE so the connection stays usable.
                if error is None:
                    error = self._chunk_error(payload, offset, length)
            elif chunk_type == REPLY_TYPE_BLOCK_STATUS:
                if chunk_length < 12 or (chunk_length - 4) % 8:
                    raise NBDError(f"the NBD server sent a malformed block status chunk "
                                   f"({chunk_length} bytes)")
                (chunk_context,) = struct.unpack_from(">I", payload)
                if chunk_context == context_id:
                    descriptors = np.frombuffer(payload, ">u4", offset=4).reshape(-1, 2)
            elif chunk_type != REPLY_TYPE_NONE:
                raise NBDError(f"the NBD server sent reply chunk type {chunk_type} to "
                               f"block status")
            if flags & REPLY_FLAG_DONE:
                break
        self._awaiting_reply = False

        if error is not None:
            raise error
        if descriptors is None:
            raise NBDError("the NBD server's block status reply lacks the requested context")
        if not descriptors[:, 0].all():
            # A zero-length extent would also stall our loop forever.
            raise NBDError("the NBD server sent a zero-length block status descriptor")
        return descriptors

    @staticmethod
    def _check_cookie(got: int, expected: int) -> None:
        if got != expected:
            raise NBDError(f"the NBD server replied to request {got:#x} while request "
                           f"{expected:#x} was the only one in flight")

    @staticmethod
    def _chunk_error(payload: bytearray, offset: int, length: int) -> NBDError:
        if len(payload) < 6:
            return NBDError("the NBD server sent a malformed error chunk")
        code, message_length = struct.unpack_from(">IH", payload)
        message = bytes(payload[6:6 + message_length]).decode(errors="replace").strip()
        return NBDError(f"the NBD server failed block status at {offset}+{length}: "
                        + (f"{message} ({_errno_text(code)})" if message else _errno_text(code)))

    # ------------------------------------------------------------ lifetime

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._transmission and not self._awaiting_reply:
                self._sock.sendall(_REQUEST.pack(REQUEST_MAGIC, 0, CMD_DISC,
                                                 self._next_cookie, 0, 0))
        except OSError:
            pass  # the server is gone already; closing is all that is left
        finally:
            self._sock.close()

    def __enter__(self) -> "NBDClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def dirty_ranges(sock: socket.socket, export: str, bitmap: str, *, timeout: float = 10.0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and lengths (uint64, sorted, touching runs merged) of the dirty
    runs of ``bitmap`` over the whole of ``export``. Closes ``sock``."""
    context = DIRTY_BITMAP_CONTEXT + bitmap
    with NBDClient(sock, export, [context], timeout=timeout) as client:
        offsets, lengths, flags = client.block_status(context)
    dirty = (flags & STATE_DIRTY).astype(bool)
    starts, ends = offsets[dirty], offsets[dirty] + lengths[dirty]
    if len(starts) == 0:
        return starts, ends - starts
    # Descriptors are contiguous, so dirty runs touch only where one request's
    # answer ended inside a run; join those.
    run_begins = np.flatnonzero(np.r_[True, starts[1:] != ends[:-1]])
    run_ends = np.r_[run_begins[1:], len(starts)] - 1
    merged_starts = starts[run_begins]
    return merged_starts, ends[run_ends] - merged_starts
