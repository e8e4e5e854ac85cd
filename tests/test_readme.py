"""Every example in README.md runs as written, so the README cannot drift;
so do the examples the README hands on to the docs pages (``DOCS_CLAIMED``).

Each ```console block is run command by command (the text after ``$ ``) in
one bash process, in a scratch directory on a real XFS, and each ```python
block with ``exec``. Every README block is claimed by exactly one test below,
by its section, so a new example fails until it is run here too; a docs
page's example is claimed by its page and section (a page's other blocks,
such as its JSON documents, are not examples to run).

What the README writes and what runs instead (the substitution):

- ``/srv/sandboxes/image`` (the VM image) is the VM tests' image cache
  (``BLOCKDIFF_TEST_VM_IMAGE``, default ``~/.cache/blockdiff/test-vm``), so the
  image is built from Debian packages once per machine, not per run;
- any other ``/srv/sandboxes/...`` is ``<scratch>/srv/sandboxes/...`` and
  ``/xfs/...`` is ``<scratch>/...``; relative names (``step0.img``,
  ``disk.img``, ``charges.sqlite``) are in ``<scratch>``, the shell's working
  directory (with the repository on ``PYTHONPATH`` for ``python3 -m
  examples...``);
- port ``8411`` is a free loopback port; a command ending in ``&`` (the
  charge service) is started by the test, in the background, and killed by
  its pid at the end;
- the inputs an example presupposes are made first: ``step0.img`` and
  ``disk.img`` for ``create`` (see ``_make_step_images``), a store for the
  Python sandbox example, a disk image for the library example.

The output shown under a command must be exactly its standard output (the
path substitution undone), line for line, except for what differs from run
to run, which the README writes as it came out once:

- 16- and 32-digit hex ids (snapshots, checkpoints) match any id of that
  length, consistently: an id the README shows once stands for the same
  value everywhere, in later output and in later commands (where the real id
  is put in);
- ``HEX…`` (8 or more hex digits then an ellipsis) is a longer hex id cut
  short, bound the same way; any other ``…`` is elided text;
- timings (``N ms``), sizes (``N MiB``), dates and times, pids, and a VM
  image ``built`` or ``up to date``.

A command's exit status must be 0, or N where its comment says ``exit N``.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
IMAGE_CACHE = Path(os.environ.get("BLOCKDIFF_TEST_VM_IMAGE",
                                  Path.home() / ".cache" / "blockdiff" / "test-vm"))
README_PORT = "8411"
COMMAND_TIMEOUT = 300

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for loop mounts")]


# ------------------------------------------------------------ the README


@dataclass
class Block:
    lang: str
    section: str
    text: str
    line: int


def readme_blocks(document: Path = README) -> list[Block]:
    """The fenced blocks of ``document``, each with its ``## `` section."""
    blocks, section, lang, start, body = [], "", None, 0, []
    for number, line in enumerate(document.read_text().splitlines(), 1):
        if lang is None:
            if line.startswith("## "):
                section = line[3:].strip()
            elif line.startswith("```") and line[3:].strip():
                lang, start, body = line[3:].strip(), number, []
        elif line.startswith("```"):
            blocks.append(Block(lang, section, "\n".join(body) + "\n", start))
            lang = None
        else:
            body.append(line)
    return blocks


def block(lang: str, section: str, document: Path = README) -> Block:
    found = [b for b in readme_blocks(document) if b.lang == lang and b.section == section]
    assert len(found) == 1, (
        f"expected one {lang} block in {document.relative_to(ROOT)} section {section!r}")
    return found[0]


# The README's examples, by section, and the test that runs each.
CLAIMED = {
    ("console", "Command line"): "test_command_line_example",
    ("console", "Snapshot store"): "test_snapshot_store_console_example",
    ("console", "Sandbox VMs"): "test_sandbox_vm_console_example",
    ("python", "Agent checkpoints"): "test_sandbox_and_agent_python_examples",
    ("python", "Library"): "test_library_python_example",
    ("console", "Several hosts"): "test_several_hosts_console_example",
}

# The examples the README leaves to a docs page, by page and section.
VM_PYTHON = (DOCS / "vm.md", "python", "From Python")
AGENT_CONSOLE = (DOCS / "agent.md", "console", "The example agent")
DOCS_CLAIMED = {
    VM_PYTHON: "test_sandbox_and_agent_python_examples",
    AGENT_CONSOLE: "test_agent_example_with_the_charge_service",
}


def test_every_example_in_the_readme_is_run_here():
    found = {(b.lang, b.section) for b in readme_blocks() if b.lang in ("console", "python")}
    assert found == set(CLAIMED), "a README example is not run by tests/test_readme.py"
    names = set(globals())
    assert set(CLAIMED.values()) | set(DOCS_CLAIMED.values()) <= names
    for document, lang, section in DOCS_CLAIMED:
        block(lang, section, document)
    # Nothing else fenced goes unchecked by accident.
    assert {b.lang for b in readme_blocks()} <= {"console", "python"}


@dataclass
class Command:
    text: str
    expected: list[str]
    status: int


def console_commands(text: str) -> list[Command]:
    commands: list[Command] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            status = re.search(r"#.*\bexit (\d+)\b", line)
            commands.append(Command(line[2:], [], int(status.group(1)) if status else 0))
        elif commands:
            commands[-1].expected.append(line)
        else:
            assert not line.strip(), f"README output before any command: {line!r}"
    for command in commands:
        while command.expected and not command.expected[-1].strip():
            command.expected.pop()
    return commands


# ------------------------------------------------------- matching output

_TOKEN = re.compile(
    r"(?P<prefix>[0-9a-f]{8,})…"
    r"|(?P<ellipsis>…)"
    r"|(?P<id>(?<![0-9a-zA-Z])(?:[0-9a-f]{32}|[0-9a-f]{16})(?![0-9a-zA-Z]))"
    r"|(?P<ms>\d+(?:\.\d+)? ms\b)"
    r"|(?P<mib>\d+(?:\.\d+)? MiB\b)"
    r"|(?P<when>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)"
    r"|(?P<pid>\(pid \d+\))"
    r"|(?P<built>: built \()")
_ID = re.compile(r"(?<![0-9a-zA-Z])(?:[0-9a-f]{32}|[0-9a-f]{16})(?![0-9a-zA-Z])")


@dataclass
class Bindings:
    """README ids (and cut-short ids) to the real ones they stand for."""

    ids: dict[str, str] = field(default_factory=dict)

    def pattern(self, line: str) -> tuple[re.Pattern, list[str]]:
        parts, names, pos = [], [], 0
        for m in _TOKEN.finditer(line):
            parts.append(re.escape(line[pos:m.start()]))
            pos = m.end()
            kind = m.lastgroup
            if kind == "prefix":
                parts.append("([0-9a-f]{8,})")
                names.append(m.group("prefix") + "…")
            elif kind == "id":
                parts.append(f"([0-9a-f]{{{len(m.group())}}})")
                names.append(m.group())
            elif kind == "ellipsis":
                parts.append(".*?")
            elif kind == "ms":
                parts.append(r"\d+(?:\.\d+)? ms")
            elif kind == "mib":
                parts.append(r"\d+(?:\.\d+)? MiB")
            elif kind == "when":
                parts.append(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
            elif kind == "pid":
                parts.append(r"\(pid \d+\)")
            else:
                parts.append(r": (?:built|up to date) \(")
        parts.append(re.escape(line[pos:]))
        return re.compile("".join(parts)), names

    def match(self, expected: list[str], actual: list[str], where: str) -> None:
        shown = "\n".join(actual)
        assert len(actual) == len(expected), (
            f"{where}: the README shows {len(expected)} line(s) of output, it printed "
            f"{len(actual)}:\n{shown}")
        for want, got in zip(expected, actual):
            regex, names = self.pattern(want.rstrip())
            m = regex.fullmatch(got.rstrip())
            assert m, f"{where}: output differs from the README\n  README: {want}\n  actual: {got}"
            for name, value in zip(names, m.groups()):
                bound = self.ids.get(name)
                assert bound in (None, value), (
                    f"{where}: {name} stands for {bound} earlier in the README, here for {value}")
                if bound is None:
                    assert value not in self.ids.values(), (
                        f"{where}: {value} is shown under two README ids")
                    self.ids[name] = value

    def substitute(self, command: str, where: str) -> str:
        def real(m):
            assert m.group() in self.ids, (
                f"{where}: the README uses the id {m.group()} before any output shows it")
            return self.ids[m.group()]

        return _ID.sub(real, command)


# --------------------------------------------------------------- running


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BLOCKDIFF_STORE", "BLOCKDIFF_AGENT_KEY"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


class Session:
    """One bash process running a README block's commands in ``scratch``,
    with the README's paths and port substituted and its ids bound."""

    def __init__(self, scratch: Path, port: int | None = None):
        self.scratch, self.port = scratch, port
        self.bindings = Bindings()
        self.logs = scratch / ".readme-commands"
        self.logs.mkdir()
        self.paths = [("/srv/sandboxes/image", str(IMAGE_CACHE)),
                      ("/srv/sandboxes/", f"{scratch}/srv/sandboxes/"),
                      ("/xfs/", f"{scratch}/")]
        (scratch / "srv" / "sandboxes").mkdir(parents=True)
        self.background: list[subprocess.Popen] = []
        with open(self.logs / "shell.err", "wb") as shell_err:
            self.shell = subprocess.Popen(["bash", "--norc", "--noprofile"], cwd=scratch,
                                          env=_env(), stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=shell_err, text=True)
        self.count = 0

    def to_real(self, text: str) -> str:
        for readme, real in self.paths:
            text = text.replace(readme, real)
        if self.port is not None:
            text = re.sub(rf"(?<=[:\s]){README_PORT}\b", str(self.port), text)
        return text

    def to_readme(self, text: str) -> str:
        for readme, real in self.paths:
            text = text.replace(real.rstrip("/"), readme.rstrip("/"))
        return text

    def run(self, command: Command) -> str:
        self.count += 1
        where = f"README command {self.count} `{command.text}`"
        text = self.to_real(self.bindings.substitute(command.text, where))
        if text.rstrip().endswith("&"):
            self._start_background(text.rstrip()[:-1])
            return ""
        out, err = self.logs / f"{self.count}.out", self.logs / f"{self.count}.err"
        self.shell.stdin.write(f"{{ {text}\n}} >{out} 2>{err} </dev/null\n"
                               f"echo \"__status__ $?\"\n")
        self.shell.stdin.flush()
        ready, _, _ = select.select([self.shell.stdout], [], [], COMMAND_TIMEOUT)
        assert ready, f"{where}: still running after {COMMAND_TIMEOUT} s"
        line = self.shell.stdout.readline()
        assert line.startswith("__status__ "), f"{where}: the shell died ({line!r})"
        status, stdout = int(line.split()[1]), out.read_text()
        assert status == command.status, (
            f"{where}: exit status {status}, the README says {command.status}\n"
            f"stdout:\n{stdout}\nstderr:\n{err.read_text()}")
        lines = self.to_readme(stdout).rstrip("\n").split("\n") if stdout.strip() else []
        self.bindings.match(command.expected, lines, where)
        return stdout

    def run_block(self, text: str) -> None:
        for command in console_commands(text):
            self.run(command)

    def _start_background(self, text: str) -> None:
        with open(self.logs / f"{self.count}.background", "wb") as log:
            proc = subprocess.Popen(["bash", "-c", f"exec {text}"], cwd=self.scratch,
                                    env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.background.append(proc)
        deadline = time.monotonic() + 30
        while True:   # until it accepts connections on its port
            assert proc.poll() is None, f"`{text}` exited {proc.returncode}"
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=1):
                return
            assert time.monotonic() < deadline, f"`{text}` did not start listening"
            time.sleep(0.05)

    def close(self) -> None:
        for proc in self.background:
            _stop(proc)
        with contextlib.suppress(OSError):
            self.shell.stdin.close()
        try:
            self.shell.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.shell.kill()
            self.shell.wait()
        self.shell.stdout.close()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM by pid, SIGKILL if it has not gone after a few seconds."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def session(scratch: Path, port: int | None = None):
    s = Session(scratch, port)
    try:
        yield s
    finally:
        s.close()


# ------------------------------------------------------------ the tests

MiB, BLOCK = 1 << 20, 4096
STEP_SIZE = 2 << 30
STEP_STRIDE = 51           # the step rewrites every 51st 4 KiB block: 10267 of them
STEP_BLOCKS = 10267


def _make_step_images(directory: Path) -> None:
    """step0.img: a 2 GiB image with 64 MiB of data; disk.img: a reflinked
    copy of it after an agent step that rewrote 10267 scattered 4 KiB
    blocks. Seeded, so every checksum and fingerprint comes out the same."""
    rng = random.Random(7)
    with open(directory / "step0.img", "wb") as f:
        f.truncate(STEP_SIZE)
        f.write(rng.randbytes(64 * MiB))
        os.fsync(f.fileno())
    subprocess.run(["cp", "--reflink=always", str(directory / "step0.img"),
                    str(directory / "disk.img")], check=True)
    fd = os.open(directory / "disk.img", os.O_RDWR)
    try:
        for i in range(1, STEP_BLOCKS + 1):
            os.pwrite(fd, rng.randbytes(BLOCK), i * STEP_STRIDE * BLOCK)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_command_line_example(xfs):
    _make_step_images(xfs)
    with session(xfs) as s:
        s.run_block(block("console", "Command line").text)
    for name in ("step1.img", "step1-checked.img"):
        assert subprocess.run(["cmp", str(xfs / name), str(xfs / "disk.img")]).returncode == 0


def test_snapshot_store_console_example(xfs):
    with session(xfs) as s:
        s.run_block(block("console", "Snapshot store").text)
    sandboxes = xfs / "srv" / "sandboxes"
    assert (sandboxes / "disk.img").read_bytes()[:4096 * 2] == \
        b"step 1\n".ljust(4096 * 2, b"\0")
    assert (sandboxes / "branch.img").read_bytes()[4096:4096 + 7] == b"step 2\n"


def test_agent_example_with_the_charge_service(xfs):
    document, lang, section = AGENT_CONSOLE
    with session(xfs, _free_port()) as s:
        s.run_block(block(lang, section, document).text)


def _vm_image():
    missing = [t for t in ("qemu-system-x86_64", "apt-get", "dpkg-deb", "gcc", "mkfs.ext4",
                           "debugfs") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"the README's VM examples need {', '.join(missing)} (.ci/setup installs "
                    f"them)")
    from blockdiff.vm.image import build_image

    return build_image(IMAGE_CACHE)


def _kill_vms(store_dir: Path, opened_by_examples: bool = False) -> None:
    """Kill every VM of the store; with ``opened_by_examples``, also close the
    stores the Python examples opened by path (``Sandbox.create`` and
    ``Agent`` given a path leave them open), so that nothing stays open on
    the scratch filesystem."""
    import gc

    from blockdiff.store.store import Store
    from blockdiff.vm.sandbox import Sandbox

    if opened_by_examples:
        # Their background threads use their stores, closed below, and may
        # start QEMUs, killed below.
        gc.collect()
        for obj in gc.get_objects():
            if isinstance(obj, Sandbox) and Path(obj.store.root) == store_dir:
                obj.standby.wait()
    if (store_dir / "vms").is_dir():
        with Store(store_dir) as store:
            for box in Sandbox.list(store):
                box._kill()
    if opened_by_examples:
        for obj in gc.get_objects():
            if isinstance(obj, Store) and Path(obj.root) == store_dir:
                with contextlib.suppress(Exception):
                    obj.close()


def test_sandbox_vm_console_example(xfs):
    _vm_image()
    try:
        with session(xfs) as s:
            s.run_block(block("console", "Sandbox VMs").text)
    finally:
        _kill_vms(xfs / "srv" / "sandboxes" / "store")


def test_several_hosts_console_example(xfs, host_b_dir, postgres_url, s3_env):
    """Two hosts (the README's /srv/sandboxes and /srv/host-b, here two XFS
    filesystems) of one store, its catalog a database of a real PostgreSQL
    server and its objects in a real SeaweedFS bucket, each in the README's
    place."""
    import uuid
    with session(xfs) as s:
        s.paths = [("postgresql://blockdiff@db.internal/sandboxes", postgres_url),
                   ("s3://sandboxes/store", f"s3://{s3_env.bucket}/{uuid.uuid4().hex}"),
                   ("/srv/host-b/", f"{host_b_dir}/")] + s.paths
        s.run_block(block("console", "Several hosts").text)


def _python(source: str, scratch: Path) -> str:
    for readme, real in [("/srv/sandboxes/image", str(IMAGE_CACHE)),
                         ("/srv/sandboxes/", f"{scratch}/srv/sandboxes/")]:
        source = source.replace(readme, real)
    return source


def test_sandbox_and_agent_python_examples(xfs, monkeypatch):
    """The Sandbox example of docs/vm.md as written, on a store made first (as the console
    example's ``blockdiff init`` does); then the Agent example with ``box``
    that sandbox started again, and ``pay``, ``lookup`` and ``refund`` a
    payment client kept in memory. Its run stops for the approval; approved,
    a second run charges three orders, each once."""
    _vm_image()
    from blockdiff.agent.agent import AgentDB, ApprovalPending
    from blockdiff.store.store import Store

    store_dir = xfs / "srv" / "sandboxes" / "store"
    store_dir.parent.mkdir(parents=True)
    Store.init(store_dir).close()
    monkeypatch.chdir(xfs)
    scope: dict = {}
    try:
        document, lang, section = VM_PYTHON
        exec(compile(_python(block(lang, section, document).text, xfs), "docs/vm.md", "exec"),
             scope)
        assert scope["other"].exec("cat /work/notes").stdout == b"hi\n"

        ledger: dict[str, dict] = {}

        def pay(args, idempotency_key):
            return ledger.setdefault(idempotency_key, {"id": idempotency_key, **args})

        def refund(result, key):
            ledger[result["id"]]["refunded"] = key

        scope.update(pay=pay, lookup=ledger.get, refund=refund)
        scope["box"].start()
        agent_example = compile(_python(block("python", "Agent checkpoints").text, xfs),
                                "README.md", "exec")
        with pytest.raises(ApprovalPending):
            exec(agent_example, scope)
        assert ledger == {}
        with Store(store_dir) as store:
            db = AgentDB(store)
            try:
                db.decide("order-7", "approved", by="test")
            finally:
                db.close()
        # Resumed at the approval it asked, the run finds the decision there
        # even though the running guest wrote to its disk since.
        exec(agent_example, scope)
        assert sorted(c["amount"] for c in ledger.values()) == [100, 100, 100]
        assert not any("refunded" in c for c in ledger.values())
    finally:
        _kill_vms(store_dir, opened_by_examples=True)


def test_library_python_example(xfs, monkeypatch):
    """Run in the directory of the command-line example's images, with a
    small disk image at /srv/sandboxes/disk.img."""
    _make_step_images(xfs)
    (xfs / "srv" / "sandboxes").mkdir(parents=True)
    with open(xfs / "srv" / "sandboxes" / "disk.img", "wb") as f:
        f.truncate(64 * MiB)
        f.write(random.Random(8).randbytes(4 * MiB))
    monkeypatch.chdir(xfs)
    source = _python(block("python", "Library").text, xfs)
    exec(compile(source, "README.md", "exec"), {})
    assert subprocess.run(["cmp", "step1.img", "disk.img"]).returncode == 0
    assert (xfs / "srv" / "sandboxes" / "branch.img").read_bytes() == \
        (xfs / "srv" / "sandboxes" / "disk.img").read_bytes()


def test_console_parsing_and_matching():
    """The rules above, on a made-up block."""
    commands = console_commands(textwrap.dedent("""\
        $ make thing        # exit 3: it waits
        thing 0123456789abcdef made in 4.2 ms (request 89abcdef…)
        $ use 0123456789abcdef
    """))
    assert [c.status for c in commands] == [3, 0]
    b = Bindings()
    b.match(commands[0].expected,
            ["thing fedcba9876543210 made in 17 ms (request 0011223344556677deadbeef)"], "t")
    assert b.substitute(commands[1].text, "t") == "use fedcba9876543210"
    with pytest.raises(AssertionError):
        b.match(["again 0123456789abcdef"], ["again 1111111111111111"], "t")
    with pytest.raises(AssertionError):
        b.substitute("use 1111222233334444", "t")
