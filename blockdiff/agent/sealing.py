"""What agent checkpoints write at rest: JSON, with named secrets redacted,
optionally sealed with AES-GCM.

A sealed value is ``b"E1" | 12-byte nonce | ciphertext+tag``, bound by the
associated data to the record and field it belongs to, so a value copied
into another record does not decrypt. A plain value is ``b"J" | JSON``.

A checkpoint's content hash, which tells an unchanged state from a changed
one, is taken over what is written (after redaction, before sealing). With a
key it is ``hmac-sha256:`` an HMAC under a key derived from the sealing key
(HKDF-SHA256, its own label), so that it confirms no guess at a sealed value;
without one, ``sha256:`` a plain hash of values stored in the clear anyway.

The key is 32 bytes, from the ``key`` argument, ``$BLOCKDIFF_AGENT_KEY`` (64
hex digits or URL-safe base64) or the file named by
``$BLOCKDIFF_AGENT_KEY_FILE`` (32 raw bytes, or the same text forms).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
from collections.abc import Callable, Iterable

from blockdiff.errors import SealingError

KEY_ENV = "BLOCKDIFF_AGENT_KEY"
KEY_FILE_ENV = "BLOCKDIFF_AGENT_KEY_FILE"
REDACTED = "[redacted]"
PLAIN, SEALED = b"J", b"E1"
# What content hashes begin with; a hash with neither (plain SHA-256 of the
# state before redaction, as blockdiff wrote before) is rehashed when read.
KEYED_HASH, PLAIN_HASH = "hmac-sha256:", "sha256:"
_HASH_KEY_LABEL = b"blockdiff agent checkpoint content hash v1"


def parse_key(text: str | bytes) -> bytes:
    """32 key bytes from raw bytes, 64 hex digits or base64."""
    if isinstance(text, bytes) and len(text) == 32:
        return text
    value = text.decode().strip() if isinstance(text, bytes) else text.strip()
    try:
        if len(value) == 64:
            return bytes.fromhex(value)
        key = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
    except (ValueError, binascii.Error):
        key = b""
    if len(key) != 32:
        raise SealingError("an agent key is 32 bytes: 64 hex digits or base64; make one with: "
                           "blockdiff agent keygen")
    return key


def key_from_environment() -> bytes | None:
    if os.environ.get(KEY_ENV):
        return parse_key(os.environ[KEY_ENV])
    if os.environ.get(KEY_FILE_ENV):
        path = os.environ[KEY_FILE_ENV]
        try:
            with open(path, "rb") as f:
                return parse_key(f.read())
        except OSError as e:
            raise SealingError(f"cannot read the agent key file {path}: {e.strerror}") from None
    return None


def new_key() -> str:
    return os.urandom(32).hex()


def content_hash(parts: Iterable[bytes], hash_key: bytes | None = None) -> str:
    """See :meth:`Codec.content_hash`; ``hash_key`` is the key derived for it."""
    data = b"\0".join(parts)
    if hash_key is None:
        return PLAIN_HASH + hashlib.sha256(data).hexdigest()
    return KEYED_HASH + hmac.new(hash_key, data, hashlib.sha256).hexdigest()


def redact(value, secrets: frozenset[str]):
    """``value`` with every dict entry whose key is in ``secrets`` replaced."""
    if isinstance(value, dict):
        return {k: REDACTED if k in secrets else redact(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, secrets) for v in value]
    return value


class Codec:
    """Encodes values for the agent database: redact, serialise, seal."""

    def __init__(self, key: bytes | str | None = None, *, secrets: Iterable[str] = (),
                 redactor: Callable | None = None):
        self.key = parse_key(key) if key is not None else key_from_environment()
        self.secrets = frozenset(secrets)
        self.redactor = redactor
        if self.key is not None:
            try:
                from cryptography.hazmat.primitives.ciphers.aead import AESGCM
            except ImportError:
                raise SealingError("encrypting agent state needs the cryptography package: "
                                   "pip install 'blockdiff[crypto]'") from None
            from cryptography.hazmat.primitives import hashes
            from cryptography.hazmat.primitives.kdf.hkdf import HKDF

            self._aead = AESGCM(self.key)
            self._hash_key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                                  info=_HASH_KEY_LABEL).derive(self.key)

    @property
    def sealing(self) -> bool:
        return self.key is not None

    def serialise(self, value) -> bytes:
        """``value`` as written: secrets redacted, the redactor applied,
        canonical JSON (the same value gives the same bytes)."""
        if self.secrets:
            value = redact(value, self.secrets)
        if self.redactor is not None:
            value = self.redactor(value)
        return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()

    def seal(self, data: bytes, context: str) -> bytes:
        """Serialised ``data`` as stored: sealed for ``context`` with a key."""
        if self.key is None:
            return PLAIN + data
        nonce = os.urandom(12)
        return SEALED + nonce + self._aead.encrypt(nonce, data, context.encode())

    def encode(self, value, context: str) -> bytes:
        return self.seal(self.serialise(value), context)

    def content_hash(self, *parts: bytes) -> str:
        """The hash of serialised ``parts`` that a checkpoint records: keyed
        when sealing, so that nobody without the key can test a guess at the
        sealed values against it."""
        return content_hash(parts, self._hash_key if self.key is not None else None)

    def decode(self, blob: bytes, context: str):
        return json.loads(self.data(blob, context))

    def data(self, blob: bytes, context: str) -> bytes:
        """The serialised value a stored ``blob`` holds (decrypted)."""
        if blob[:1] == PLAIN:
            return bytes(blob[1:])
        if blob[:2] != SEALED:
            raise SealingError(f"{context}: not a value blockdiff wrote")
        if self.key is None:
            raise SealingError(f"{context} is encrypted; set {KEY_ENV} or {KEY_FILE_ENV} to "
                               f"its key")
        from cryptography.exceptions import InvalidTag

        try:
            return self._aead.decrypt(blob[2:14], blob[14:], context.encode())
        except InvalidTag:
            raise SealingError(f"{context} does not decrypt with this key: the key is wrong "
                               f"(or the record was altered)") from None
