"""A small local payment service for the agent example: the "outside world"
an agent's tool changes, which no disk restore can take back.

Charges and refunds live in a SQLite file of the service's own. Both are
idempotent by the caller's request id, which is what makes an agent's
exactly-once calls possible::

    POST /charge  {"request_id", "amount", "order"}   201 new charge, 200 the same
                                                     request seen before (not charged
                                                     again); 402 declined
    GET  /charge/<request_id>                        the charge, or 404
    POST /lookup  {"request_id"}                     the same, as a fenced request
                                                     (a tool's check)
    POST /refund  {"request_id", "charge_request_id"}  201, or 200 for a refund seen
                                                     before; 404 no such charge; 409
                                                     refunded already under another id
    GET  /stats                                      {"charges", "total", "refunded",
                                                     "net", "posts", "refunds"}
    GET  /fences                                     {"fences": {scope: token}, "refused"}
    POST /control {"fail": [...], "decline": [...], "hang": [...]}
                                                     faults by order number, for tests

Every POST but /control may carry ``"fence": {"scope", "token"}``: the agent
thread it is made for and its lease's fencing token. A request whose token
is older than the newest the service has seen for its scope is refused (409,
``"fenced": true``) without effect, in the same transaction that would have
made it: an agent host that lost its lease (paused, cut off) and wakes
cannot charge, look up or refund for a thread another host took over, and a
lookup that finds no charge, made under the newer token, is final.

Faults (also as options): *fail* answers 500 to a charge of that order
without charging; *decline* answers 402 (a permanent refusal); *hang* holds
the request, before charging, for as long as the order is in the hang set
(or until the service is killed).

Run it as a separate process::

    python3 -m examples.charge_service --db charges.sqlite --port 0 --port-file port.txt

``--port 0`` takes a free port; ``--port-file`` receives it once the
service accepts connections.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sqlite3
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SCHEMA = """
CREATE TABLE IF NOT EXISTS charges (
    request_id TEXT PRIMARY KEY,
    order_no INTEGER NOT NULL,
    amount INTEGER NOT NULL,
    created REAL NOT NULL,
    refunded_by TEXT
);
CREATE TABLE IF NOT EXISTS refunds (
    request_id TEXT PRIMARY KEY,
    charge_request_id TEXT NOT NULL REFERENCES charges(request_id),
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS fences (
    scope TEXT PRIMARY KEY,
    token INTEGER NOT NULL
);
"""


class StaleFence(Exception):
    """A request under an older fencing token than one seen for its scope."""


class Ledger:
    """The service's database; one connection, serialised by a lock."""

    def __init__(self, path: str):
        self.lock = threading.Lock()
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)

    def _count(self, name: str) -> None:
        self.db.execute("INSERT INTO counters (name, value) VALUES (?, 1) "
                        "ON CONFLICT(name) DO UPDATE SET value = value + 1", (name,))

    def _charge(self, request_id: str):
        row = self.db.execute("SELECT request_id, order_no, amount, created, refunded_by "
                              "FROM charges WHERE request_id = ?", (request_id,)).fetchone()
        if row is None:
            return None
        return {"request_id": row[0], "order": row[1], "amount": row[2], "created": row[3],
                "refunded": row[4] is not None}

    def _fence(self, fence: tuple[str, int] | None) -> None:
        """Admit a request under ``fence`` (scope, token), raising the scope's
        token to it, or refuse one older than the scope's (``StaleFence``)."""
        if fence is None:
            return
        scope, token = fence
        row = self.db.execute("SELECT token FROM fences WHERE scope = ?", (scope,)).fetchone()
        if row is not None and token < row[0]:
            raise StaleFence(f"fencing token {token} of {scope} is older than {row[0]}, "
                             f"seen already: refused")
        self.db.execute("INSERT INTO fences (scope, token) VALUES (?, ?) ON CONFLICT(scope) "
                        "DO UPDATE SET token = MAX(token, excluded.token)", (scope, token))

    def _transaction(self, fence, work):
        """``work()`` in one write transaction, admitted by ``fence`` first; a
        refused request changes nothing but the count of refusals."""
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self._fence(fence)
                result = work()
            except StaleFence:
                self.db.execute("ROLLBACK")
                self.db.execute("INSERT INTO counters (name, value) VALUES ('refused', 1) "
                                "ON CONFLICT(name) DO UPDATE SET value = value + 1")
                raise
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
            return result

    def charge(self, request_id: str, amount: int, order: int,
               fence: tuple[str, int] | None = None) -> tuple[dict, bool]:
        """The charge for ``request_id``, made now unless it exists: (charge, new)."""
        def work():
            self._count("posts")
            existing = self._charge(request_id)
            if existing is None:
                self.db.execute("INSERT INTO charges (request_id, order_no, amount, created) "
                                "VALUES (?, ?, ?, ?)", (request_id, order, amount, time.time()))
            return (existing or self._charge(request_id)), existing is None

        return self._transaction(fence, work)

    def get(self, request_id: str, fence: tuple[str, int] | None = None):
        """The charge for ``request_id`` or None; under ``fence``, a lookup
        that from now on refuses the older tokens of its scope."""
        if fence is None:
            with self.lock:
                return self._charge(request_id)
        return self._transaction(fence, lambda: self._charge(request_id))

    def refund(self, request_id: str, charge_request_id: str,
               fence: tuple[str, int] | None = None) -> tuple[int, dict]:
        return self._transaction(fence, lambda: self._refund(request_id, charge_request_id))

    def fences(self) -> dict:
        with self.lock:
            refused = self.db.execute("SELECT value FROM counters WHERE name = 'refused'"
                                      ).fetchone()
            return {"fences": dict(self.db.execute("SELECT scope, token FROM fences")),
                    "refused": refused[0] if refused else 0}

    def _refund(self, request_id: str, charge_request_id: str) -> tuple[int, dict]:
        seen = self.db.execute("SELECT charge_request_id FROM refunds WHERE request_id = ?",
                               (request_id,)).fetchone()
        if seen is not None:
            if seen[0] != charge_request_id:
                return 409, {"error": f"refund {request_id} was for charge {seen[0]}"}
            return 200, {"request_id": request_id, "charge": self._charge(seen[0])}
        charge = self._charge(charge_request_id)
        if charge is None:
            return 404, {"error": f"no charge {charge_request_id}"}
        if charge["refunded"]:
            return 409, {"error": f"charge {charge_request_id} was refunded already"}
        self.db.execute("INSERT INTO refunds (request_id, charge_request_id, created) "
                        "VALUES (?, ?, ?)", (request_id, charge_request_id, time.time()))
        self.db.execute("UPDATE charges SET refunded_by = ? WHERE request_id = ?",
                        (request_id, charge_request_id))
        return 201, {"request_id": request_id, "charge": self._charge(charge_request_id)}

    def stats(self) -> dict:
        with self.lock:
            charges, total = self.db.execute(
                "SELECT COUNT(*), COALESCE(SUM(amount), 0) FROM charges").fetchone()
            refunded, refunded_total = self.db.execute(
                "SELECT COUNT(*), COALESCE(SUM(amount), 0) FROM charges "
                "WHERE refunded_by IS NOT NULL").fetchone()
            refunds = self.db.execute("SELECT COUNT(*) FROM refunds").fetchone()[0]
            posts = self.db.execute("SELECT value FROM counters WHERE name = 'posts'").fetchone()
            return {"charges": charges, "total": total, "refunded": refunded,
                    "net": total - refunded_total, "posts": posts[0] if posts else 0,
                    "refunds": refunds}


class Faults:
    def __init__(self, fail=(), decline=(), hang=()):
        self.lock = threading.Lock()
        self.fail, self.decline, self.hang = set(fail), set(decline), set(hang)

    def set(self, spec: dict) -> dict:
        with self.lock:
            for name in ("fail", "decline", "hang"):
                if name in spec:
                    setattr(self, name, {int(n) for n in spec[name]})
            return self.get()

    def get(self) -> dict:
        return {"fail": sorted(self.fail), "decline": sorted(self.decline),
                "hang": sorted(self.hang)}


class Handler(BaseHTTPRequestHandler):
    server: "ChargeServer"
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, status: int, body: dict) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        return body

    def do_GET(self):  # noqa: N802 - http.server's name
        ledger = self.server.ledger
        if self.path == "/stats":
            return self._send(200, ledger.stats())
        if self.path == "/control":
            return self._send(200, self.server.faults.get())
        if self.path == "/fences":
            return self._send(200, ledger.fences())
        m = re.fullmatch(r"/charge/([A-Za-z0-9:_.-]+)", self.path)
        if m:
            charge = ledger.get(m.group(1))
            if charge is None:
                return self._send(404, {"error": f"no charge {m.group(1)}"})
            return self._send(200, charge)
        return self._send(404, {"error": f"no route {self.path}"})

    def do_POST(self):  # noqa: N802 - http.server's name
        try:
            body = self._body()
            ledger = self.server.ledger
            if self.path == "/control":
                return self._send(200, self.server.faults.set(body))
            fence = _fence_of(body)
            if self.path == "/charge":
                return self._post_charge(str(body["request_id"]), int(body["amount"]),
                                         int(body["order"]), fence)
            if self.path == "/lookup":
                charge = ledger.get(str(body["request_id"]), fence)
                if charge is None:
                    return self._send(404, {"error": f"no charge {body['request_id']}"})
                return self._send(200, charge)
            if self.path == "/refund":
                status, answer = ledger.refund(str(body["request_id"]),
                                               str(body["charge_request_id"]), fence)
                return self._send(status, answer)
            return self._send(404, {"error": f"no route {self.path}"})
        except StaleFence as e:
            return self._send(409, {"error": str(e), "fenced": True})
        except (KeyError, ValueError, TypeError) as e:
            return self._send(400, {"error": f"bad request: {e!r}"})

    def _post_charge(self, request_id: str, amount: int, order: int, fence):
        faults = self.server.faults
        while order in faults.hang:
            time.sleep(0.05)
        if order in faults.decline:
            return self._send(402, {"error": f"order {order}: payment declined"})
        if order in faults.fail:
            return self._send(500, {"error": f"order {order}: internal error (injected)"})
        if amount <= 0:
            return self._send(400, {"error": "amount must be positive"})
        charge, new = self.server.ledger.charge(request_id, amount, order, fence)
        return self._send(201 if new else 200, charge)


def _fence_of(body: dict) -> tuple[str, int] | None:
    """A request's fence, (scope, token), or None if it carries none."""
    fence = body.get("fence")
    if fence is None:
        return None
    if not isinstance(fence, dict) or not isinstance(fence.get("token"), int):
        raise ValueError("a fence is {\"scope\": THREAD, \"token\": INTEGER}")
    return str(fence["scope"]), fence["token"]


class ChargeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, ledger: Ledger, faults: Faults, verbose: bool = False):
        super().__init__(address, Handler)
        self.ledger, self.faults, self.verbose = ledger, faults, verbose


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m examples.charge_service",
        description="A local, idempotent payment service (charges and refunds in SQLite).")
    parser.add_argument("--db", required=True, help="the service's SQLite file (made if missing)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (the default)")
    parser.add_argument("--port-file", help="write the port here once listening")
    parser.add_argument("--fail-order", type=int, action="append", default=[],
                        help="answer 500 to charges of this order (repeatable)")
    parser.add_argument("--decline-order", type=int, action="append", default=[],
                        help="decline charges of this order with 402 (repeatable)")
    parser.add_argument("--hang-order", type=int, action="append", default=[],
                        help="hold charges of this order without answering (repeatable)")
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    args = parser.parse_args(argv)

    server = ChargeServer((args.host, args.port), Ledger(args.db),
                          Faults(args.fail_order, args.decline_order, args.hang_order),
                          args.verbose)
    port = server.server_address[1]
    if args.port_file:
        # Renamed into place: a reader never sees a partly written port.
        temp = f"{args.port_file}.{os.getpid()}"
        with open(temp, "w") as f:
            f.write(f"{port}\n")
        os.rename(temp, args.port_file)
    print(f"charge service on http://{args.host}:{port} (db {args.db})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
