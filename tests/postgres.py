"""A real PostgreSQL server for tests: one throwaway cluster on loopback.

The cluster is Debian's (``/usr/lib/postgresql/VERSION/bin``), made by
``initdb`` as the unprivileged user ``nobody`` (PostgreSQL refuses to run as
root) in a temporary directory that user owns, and started directly (no
``pg_ctl``, no system service): ``postgres`` listens on 127.0.0.1 on a free
port, with its unix socket in that directory. The superuser ``postgres`` is
trusted; the role :data:`PASSWORD_ROLE` logs in with a password (SCRAM), for
the tests of credentials. The server is stopped by its pid (SIGINT, PostgreSQL's
fast shutdown, then SIGKILL after :data:`STOP_SECONDS`) however the tests
end, the kernel kills it if the test process dies first, and the directory
is removed.

Fixtures: ``postgres_server`` (one server for the session) and
``postgres_url`` (a fresh database on it for each test, dropped afterwards:
the URL of the superuser on it). ``running_postgres()`` starts a private
one; :meth:`PostgresServer.restart` stops and starts a server on its port,
for the tests of reconnecting.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from services import log_tail, stop_by_pid

SUPERUSER = "postgres"
PASSWORD_ROLE = "blockdiff_password"
# PostgreSQL will not run as root: the cluster belongs to this user.
RUN_AS = "nobody"
START_SECONDS = 30
STOP_SECONDS = 10
_PR_SET_PDEATHSIG = 1

# Trust for the superuser (tests make databases with it), a password for
# everyone else, over TCP and the socket alike.
_HBA = f"""\
local all {SUPERUSER} trust
host all {SUPERUSER} 127.0.0.1/32 trust
local all all scram-sha-256
host all all 127.0.0.1/32 scram-sha-256
"""


def binaries() -> Path | None:
    """The newest Debian PostgreSQL bin directory with initdb and postgres."""
    found = [Path(d) for d in glob.glob("/usr/lib/postgresql/*/bin")
             if os.access(Path(d) / "initdb", os.X_OK) and os.access(Path(d) / "postgres",
                                                                   os.X_OK)]
    return max(found, key=lambda d: int(d.parent.name), default=None)


def unavailable_reason() -> str | None:
    """Why the PostgreSQL tests cannot run here, or None."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install -e '.[test]')"
    if binaries() is None:
        return ("no PostgreSQL server binaries in /usr/lib/postgresql/*/bin "
                "(apt-get install postgresql)")
    if os.geteuid() != 0:
        return f"not root: the test cluster is made and run as the user {RUN_AS}"
    return None


def free_port() -> int:
    """A port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # Runs in the child after it became RUN_AS (which clears the setting),
    # before exec: a SIGKILLed test run takes its server along.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _die_with_this_thread():
    """``_die_with_parent`` if this is the main thread, else None: the
    signal comes when the thread that started the child ends, which for any
    other thread is long before the test run does."""
    return _die_with_parent if threading.current_thread() is threading.main_thread() else None


@dataclass
class PostgresServer:
    """One PostgreSQL cluster: where it lives and listens, the password
    role's secret, and the postmaster's process."""

    directory: Path
    port: int = 0
    password: str = field(default_factory=lambda: "pw-" + secrets.token_urlsafe(18),
                          repr=False)
    process: subprocess.Popen | None = None

    @property
    def data(self) -> Path:
        return self.directory / "data"

    @property
    def log_path(self) -> Path:
        return self.directory / "postgres.log"

    def url(self, database: str = "postgres", *, user: str = SUPERUSER,
            password: str | None = None) -> str:
        """The URL of ``database`` for ``user`` (with ``password`` in it if given)."""
        secret = f":{password}" if password is not None else ""
        return f"postgresql://{user}{secret}@127.0.0.1:{self.port}/{database}"

    def admin(self):
        """A superuser connection (autocommit) to the ``postgres`` database."""
        import psycopg
        return psycopg.connect(self.url(), autocommit=True, connect_timeout=5)

    def init(self) -> None:
        """Make the cluster (as RUN_AS) and its authentication rules."""
        account = pwd.getpwnam(RUN_AS)
        os.chown(self.directory, account.pw_uid, account.pw_gid)
        os.chmod(self.directory, 0o700)
        self._run_as([str(binaries() / "initdb"), "-D", str(self.data), "-U", SUPERUSER,
                      "--auth=trust", "--encoding=UTF8", "--locale=C.UTF-8", "--no-sync"])
        hba = self.data / "pg_hba.conf"
        hba.write_text(_HBA)
        os.chown(hba, account.pw_uid, account.pw_gid)

    def _run_as(self, command: list[str]) -> None:
        done = subprocess.run(command, user=RUN_AS, group=pwd.getpwnam(RUN_AS).pw_gid,
                              cwd=self.directory, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} exited with status {done.returncode}:\n"
                               f"{done.stdout}{done.stderr}")

    def start(self) -> None:
        """Launch the postmaster (on the port it had, if it ran before) and
        wait until it accepts connections."""
        if not self.port:
            self.port = free_port()
        command = [str(binaries() / "postgres"), "-D", str(self.data), "-p", str(self.port),
                   "-c", "listen_addresses=127.0.0.1",
                   "-c", f"unix_socket_directories={self.directory}",
                   # Scratch data: no fsync (a crash of the machine is not tested).
                   "-c", "fsync=off", "-c", "max_connections=100"]
        account = pwd.getpwnam(RUN_AS)
        log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.fchown(log, account.pw_uid, account.pw_gid)
            self.process = subprocess.Popen(command, user=RUN_AS, group=account.pw_gid,
                                            stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, cwd=self.directory,
                                            start_new_session=True,
                                            preexec_fn=_die_with_this_thread())
        finally:
            os.close(log)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        if not getattr(self, "_roles_made", False):
            with self.admin() as admin:
                admin.execute(f"CREATE ROLE {PASSWORD_ROLE} LOGIN PASSWORD "
                              f"'{self.password}'")
            self._roles_made = True

    def _wait_ready(self) -> None:
        import psycopg
        deadline = time.monotonic() + START_SECONDS
        problem = "it did not answer"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited with status {self.process.returncode} "
                                   f"on start:\n{self._log_tail()}")
            try:
                self.admin().close()
                return
            except psycopg.OperationalError as e:
                problem = str(e).strip()
            time.sleep(0.1)
        raise RuntimeError(f"postgres was not ready in {START_SECONDS} s ({problem}):\n"
                           f"{self._log_tail()}")

    def _log_tail(self) -> str:
        return log_tail(self.log_path)

    def stop(self) -> None:
        """Stop the server by its pid: SIGINT, PostgreSQL's fast shutdown
        (its SIGTERM, the smart one, would wait for every client to leave),
        then SIGKILL if it lingers."""
        if self.process is None:
            return
        process, self.process = self.process, None
        stop_by_pid(process, signal.SIGINT, STOP_SECONDS)

    def restart(self) -> None:
        """Stop the server (fast shutdown: every connection is cut) and start
        it again on the same port."""
        self.stop()
        self.start()

    def create_database(self, name: str) -> str:
        """Make an empty database; its superuser URL."""
        with self.admin() as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop a database, cutting off whoever is still connected to it."""
        with self.admin() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def running_postgres():
    """A started PostgreSQL cluster in a new temporary directory, stopped
    and removed when the block ends however it ends."""
    # Not under pytest's tmp_path: its parents are private to root, and the
    # server runs as RUN_AS.
    directory = Path(tempfile.mkdtemp(prefix="blockdiff-pg-"))
    server = PostgresServer(directory)
    try:
        server.init()
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


def _require_postgres() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def postgres_server():
    """One PostgreSQL server for the session (skips when it cannot run)."""
    _require_postgres()
    with running_postgres() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server):
    """A fresh, empty database on the session's server, dropped after the
    test: the superuser's URL of it."""
    name = "test_" + secrets.token_hex(6)
    if postgres_server.process is None:       # a test's restart failed half-way
        postgres_server.start()
    url = postgres_server.create_database(name)
    yield url
    if postgres_server.process is None:
        postgres_server.start()
    postgres_server.drop_database(name)
