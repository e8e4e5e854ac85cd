"""A deterministic example agent (no model) with a sandbox disk and a tool
that changes the outside world: it works through a plan of orders, one
checkpointed step per order, and charges each through the charge service
(``examples.charge_service``) exactly once, whatever crashes in between.

Each order's step
  1. does sandbox work: writes the order's record into the disk image (at
     ``order * 1 MiB``) and appends a line to a log at the image's start,
     whose line count is read back from the disk itself (so a step that ran
     on a disk not put back after a crash would count twice and show it);
  2. calls the ``charge`` tool, which POSTs the journal's request id with the
     charge, so that the service charges a request id once, and the lease's
     fence (the thread and its fencing token), so that the service refuses
     a host that lost the thread to another and wakes later;
  3. records the charge in ``agent.state`` and a line in ``agent.messages``.

Orders over ``APPROVAL_OVER`` cents wait for a human. The agent is
state-driven: ``state["cursor"]`` is the next order, and
``state["awaiting_approval"]`` says that the run stopped for an approval of
that order, so a resumed run asks again at the same point and gets the
decision. A rejected (or expired) order is skipped, with a log line saying so.

Usage::

    python3 -m examples.charge_service --db charges.sqlite --port 0 --port-file port
    blockdiff init DIR/store        # DIR on XFS (reflink); the image beside the store
    python3 -m examples.agent_example --store DIR/store --disk DIR/disk.img \\
        --service http://127.0.0.1:PORT --thread t1 --orders 4
    # ... exit status 3: waiting for approval; then, in Python,
    #     AgentDB(Store("DIR/store")).decide("t1", "approved")  (or: blockdiff agent approve t1)
    python3 -m examples.agent_example --store DIR/store --disk ... --service ... --thread t1

Exit status: 0 done (or the rewind / failure asked for is done), 3 waiting for
approval, 4 the thread is being run by another process, 5 the run failed (a
payment was declined) and what it charged was refunded, 1 any other error,
2 bad usage.

Fault injection: ``--crash-at POINT:N`` SIGKILLs this process the N-th time
it passes POINT, one of the Agent's ``TRACE_POINTS`` or this example's own
``EXAMPLE_POINTS``; ``--pause-at POINT:N`` sleeps there instead (for
``--pause-seconds``), holding the thread; ``--stop-at POINT:N`` SIGSTOPs it
there, to go on where it stopped when it is sent SIGCONT (a host paused
while its lease lapses). It stops once its uploads under way are done, so
that it holds no transaction of a shared catalog while stopped.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request

from blockdiff.agent.agent import (
    NOT_APPLIED,
    TRACE_POINTS,
    Agent,
    AgentDB,
    ApprovalPending,
    Fence,
    FencedOff,
    NotApplied,
    Tool,
)
from blockdiff.agent.disks import ImageDisk
from blockdiff.errors import (
    AgentError,
    BlockdiffError,
    ThreadBusy,
    ThreadFailed,
    ToolFailed,
    UnknownThread,
)
from blockdiff.store.store import open_store

# This example's own points, passed inside an order's step:
EXAMPLE_POINTS = (
    "sandbox.partial",  # the order's record is written; the log is not updated yet
    "sandbox.written",  # the sandbox work is done; the charge is not asked for yet
)
ALL_POINTS = TRACE_POINTS + EXAMPLE_POINTS

MiB = 1 << 20
BLOCK = 4096
ORDER_STRIDE = MiB           # order n's record lives at n * ORDER_STRIDE
RECORD_SIZE = 64 * 1024
LOG_START = BLOCK            # the log's lines; its header (line count) is at offset 0
LOG_LINE = 128
DEFAULT_DISK_SIZE = 64 * MiB
APPROVAL_OVER = 10_000       # cents: larger orders wait for a human

EXIT_DONE, EXIT_ERROR, EXIT_USAGE, EXIT_APPROVAL, EXIT_BUSY, EXIT_FAILED = 0, 1, 2, 3, 4, 5


# ------------------------------------------------------------------ the plan


def amount_of(order: int) -> int:
    """The deterministic amount (cents) of order ``order``: the 3rd is large."""
    return 50_000 if order == 3 else 1000 + 250 * order


def plan(orders: int) -> list[dict]:
    return [{"order": n, "amount": amount_of(n)} for n in range(1, orders + 1)]


def initial_state(orders: int) -> dict:
    return {"plan": plan(orders), "cursor": 0, "done": [], "skipped": [], "decisions": {},
            "awaiting_approval": None, "total": 0}


def needs_approval(order: dict) -> bool:
    return order["amount"] > APPROVAL_OVER


# ----------------------------------------------------------- sandbox work


def order_record(order: int, amount: int, seq: int, total_before: int) -> bytes:
    """What an order's step writes at ``order * ORDER_STRIDE``: ``seq`` and
    ``total_before`` come from the state, so a step replayed on the wrong
    state writes different bytes."""
    head = (f"order {order}\namount {amount}\nseq {seq}\ntotal_before {total_before}\n"
            .encode())
    fill = hashlib.sha256(f"order {order}".encode()).digest() * (RECORD_SIZE // 32)
    return head + fill[len(head):]


def log_line(index: int, text: str) -> bytes:
    return f"{index:04d} {text}\n".encode().ljust(LOG_LINE, b" ")


def log_header(count: int) -> bytes:
    return f"log {count:08d}\n".encode()


def _append_log(fd: int, text: str) -> int:
    """Append a line to the disk's log; the count is read from the disk."""
    header = os.pread(fd, len(log_header(0)), 0)
    count = int(header[4:12]) if header.startswith(b"log ") else 0
    os.pwrite(fd, log_line(count, text), LOG_START + count * LOG_LINE)
    os.pwrite(fd, log_header(count + 1), 0)
    return count


def sandbox_work(disk: str, order: dict, state: dict, trace) -> None:
    fd = os.open(disk, os.O_RDWR | os.O_CLOEXEC)
    try:
        n, amount = order["order"], order["amount"]
        os.pwrite(fd, order_record(n, amount, len(state["done"]), state["total"]),
                  n * ORDER_STRIDE)
        os.fsync(fd)
        trace("sandbox.partial")
        _append_log(fd, f"order {n} amount {amount}")
        os.fsync(fd)
    finally:
        os.close(fd)
    trace("sandbox.written")


def sandbox_skip(disk: str, order: dict, decision: str) -> None:
    fd = os.open(disk, os.O_RDWR | os.O_CLOEXEC)
    try:
        _append_log(fd, f"skip order {order['order']} ({decision})")
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------ the tool


class Declined(NotApplied):
    """The service refused the payment for good (HTTP 402): nothing charged."""


class ServiceError(Exception):
    pass


def _http(method: str, url: str, body: dict | None, timeout: float) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            answer = json.loads(raw or b"{}")
        except ValueError:
            answer = {"error": raw.decode(errors="replace")}
        return e.code, answer


def charge_tool(service: str, timeout: float = 10.0) -> Tool:
    """The ``charge`` tool: args ``{"amount", "order"}``. The journal's request
    id is the service's idempotency key, so running it twice charges once;
    every request carries the lease's fence, so the service refuses one from
    a process whose lease was taken over (:class:`FencedOff`), and a lookup
    that finds nothing is final."""
    service = service.rstrip("/")

    def fenced(body: dict, fence: Fence) -> dict:
        return body | {"fence": {"scope": fence.scope, "token": fence.token}}

    def refused(status: int, answer: dict) -> None:
        if status == 409 and answer.get("fenced"):
            raise FencedOff(answer.get("error", "stale fencing token"))

    def check(request_id: str, fence: Fence):
        status, answer = _http("POST", f"{service}/lookup",
                               fenced({"request_id": request_id}, fence), timeout)
        refused(status, answer)
        if status == 404:
            return NOT_APPLIED
        if status != 200:
            raise ServiceError(f"charge service answered {status} to a check: "
                               f"{answer.get('error', answer)}")
        return answer

    def run(args: dict, request_id: str, fence: Fence):
        try:
            status, answer = _http("POST", f"{service}/charge",
                                   fenced({"request_id": request_id, "amount": args["amount"],
                                           "order": args["order"]}, fence), timeout)
        except OSError as e:
            # The request may have reached the service before the answer was
            # lost: a tool raises only when the request did not take effect,
            # so ask. (If the service cannot be asked either, raising is still
            # safe: a retry of the step reuses this request id.)
            try:
                found = check(request_id, fence)
            except OSError:
                found = NOT_APPLIED
            if found is not NOT_APPLIED:
                return found
            raise ServiceError(f"charge service at {service} unreachable: {e}") from e
        refused(status, answer)
        if status == 402:
            raise Declined(answer.get("error", "declined"))
        if status not in (200, 201):
            raise ServiceError(f"charge service answered {status}: {answer.get('error', answer)}")
        return answer

    def compensate(args: dict, result, undo_id: str, fence: Fence):
        charge_id = (result or {}).get("request_id") or undo_id.removesuffix(":undo")
        status, answer = _http("POST", f"{service}/refund",
                               fenced({"request_id": undo_id, "charge_request_id": charge_id},
                                      fence), timeout)
        refused(status, answer)
        if status == 404:
            return None  # never charged: nothing to give back
        if status not in (200, 201):
            raise ServiceError(f"refund of {charge_id} failed ({status}): "
                               f"{answer.get('error', answer)}")
        return answer

    return Tool("charge", run=run, check=check, compensate=compensate, external=True,
                idempotent=True, fenced=True)


# ---------------------------------------------------------------- the agent


def checkpoint_after_order(db: AgentDB, thread: str, order: int) -> str:
    """The checkpoint that ended the step of ``order`` on the thread's current path."""
    for cp in db.history(thread):
        if cp.meta.get("order") == order and cp.meta.get("step"):
            return cp.id
    raise AgentError(f"thread {thread} has no checkpoint after order {order} on its path")


def work(agent: Agent, disk: str, trace, say, approval_ttl: float | None = 3600.0) -> str:
    """Run the plan from ``agent.state`` to its end. Returns a summary; raises
    ApprovalPending to stop for a human."""
    while agent.state["cursor"] < len(agent.state["plan"]):
        order = agent.state["plan"][agent.state["cursor"]]
        n, amount = order["order"], order["amount"]
        if needs_approval(order) and str(n) not in agent.state["decisions"]:
            # Said in the state before asking, so that a resumed run comes back
            # to this point and asks again (getting the decision this time).
            agent.state["awaiting_approval"] = n
            decision = agent.approval({"action": "charge", "order": n, "amount": amount},
                                      ttl=approval_ttl)
            say(f"order {n}: {decision.decision}")
            agent.state["decisions"][str(n)] = decision.decision
            agent.state["awaiting_approval"] = None
            if not decision:
                with agent.step(f"skip order {n}", {"order": n}):
                    sandbox_skip(disk, order, decision.decision)
                    agent.state["skipped"].append(n)
                    agent.state["cursor"] += 1
                    agent.messages.append({"role": "assistant",
                                           "content": f"skipped order {n} ({decision.decision})"})
                continue
        with agent.step(f"order {n}", {"order": n}) as s:
            sandbox_work(disk, order, agent.state, trace)
            charge = s.call("charge", {"amount": amount, "order": n})
            if charge.get("order") != n or charge.get("amount") != amount:
                raise AgentError(f"the service answered the charge of order {n} with "
                                 f"{json.dumps(charge)}")
            agent.state["done"].append({"order": n, "amount": amount,
                                        "request_id": charge["request_id"]})
            agent.state["total"] += amount
            agent.state["cursor"] += 1
            agent.messages.append({"role": "tool", "content": f"charged order {n}: {amount} "
                                                              f"cents ({charge['request_id']})"})
        say(f"order {n}: wrote its record, charged {amount} cents "
            f"(request {charge['request_id']}), checkpoint {agent.head}")
    state = agent.state
    return (f"done: {len(state['done'])} order(s) charged, {len(state['skipped'])} skipped, "
            f"total {state['total']} cents")


class Tracer:
    """The Agent's ``trace``: counts each point and crashes or pauses on cue."""

    def __init__(self, crash=None, pause=None, pause_seconds=3600.0, verbose=False, stop=None):
        self.counts: collections.Counter = collections.Counter()
        self.crash, self.pause, self.stop = crash, pause, stop
        # Called before stopping: what must not be left half done meanwhile.
        self.before_stop = lambda: None
        self.pause_seconds, self.verbose = pause_seconds, verbose

    def __call__(self, point: str) -> None:
        self.counts[point] += 1
        here = (point, self.counts[point])
        if self.verbose:
            print(f"trace {point} #{here[1]}", flush=True)
        if here == self.crash:
            print(f"crash at {point}:{here[1]}: killing myself (pid {os.getpid()})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if here == self.pause:
            print(f"pause at {point}:{here[1]} (pid {os.getpid()}) for {self.pause_seconds} s",
                  flush=True)
            time.sleep(self.pause_seconds)
        if here == self.stop:
            self.before_stop()
            print(f"stop at {point}:{here[1]} (pid {os.getpid()})", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
            print(f"continued at {point}:{here[1]}", flush=True)


def _point(text: str) -> tuple[str, int]:
    point, sep, count = text.rpartition(":")
    if not sep or point not in ALL_POINTS or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: want POINT:N with N >= 1 and POINT one of {', '.join(ALL_POINTS)}")
    return point, int(count)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python3 -m examples.agent_example",
        description="A deterministic agent that charges a plan of orders through a payment "
                    "service, one checkpointed step per order, in a sandbox disk image.")
    p.add_argument("--store", required=True, help="the blockdiff store (blockdiff init STORE)")
    p.add_argument("--disk", required=True,
                   help="the sandbox disk image, on the store's filesystem (made if missing)")
    p.add_argument("--service", required=True, help="the charge service's URL")
    p.add_argument("--thread", required=True, help="the agent thread (created if new)")
    p.add_argument("--orders", type=int, default=4,
                   help="orders in the plan of a new thread (default 4; a resumed thread "
                        "keeps its plan)")
    p.add_argument("--disk-size", type=int, default=DEFAULT_DISK_SIZE,
                   help="size of a disk image made here (bytes)")
    p.add_argument("--approval-ttl", type=float, default=3600.0,
                   help="seconds an approval may wait before it expires (default 3600)")
    p.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout (seconds)")
    p.add_argument("--lease", type=float, default=300.0,
                   help="seconds the thread stays held after the last write (another host "
                        "takes it over once it lapses)")
    p.add_argument("--crash-at", type=_point, metavar="POINT:N",
                   help="SIGKILL this process the N-th time it passes POINT")
    p.add_argument("--pause-at", type=_point, metavar="POINT:N",
                   help="sleep the N-th time this process passes POINT")
    p.add_argument("--pause-seconds", type=float, default=3600.0)
    p.add_argument("--stop-at", type=_point, metavar="POINT:N",
                   help="SIGSTOP this process the N-th time it passes POINT (it goes on when "
                        "sent SIGCONT)")
    p.add_argument("--verbose", action="store_true", help="print every trace point")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--rewind-to", metavar="CHECKPOINT|order:N|head",
                        help="rewind the thread (refunding what was charged since) and stop; "
                             "head: to where it resumes, undoing the calls of a step that "
                             "did not finish")
    action.add_argument("--fail", action="store_true",
                        help="fail the thread: refund everything its run charged")
    return p


def run(args, say) -> int:
    store = open_store(args.store)
    tracer = Tracer(args.crash_at, args.pause_at, args.pause_seconds, args.verbose,
                    args.stop_at)
    db = AgentDB(store)
    try:
        try:
            status = db.thread(args.thread).status
        except UnknownThread:
            status = None
        if status == "failed":
            raise AgentError(f"thread {args.thread} failed and its charges were refunded; "
                             f"start a new thread")
        if args.rewind_to and args.rewind_to.startswith("order:"):
            args.rewind_to = checkpoint_after_order(db, args.thread, int(args.rewind_to[6:]))
    finally:
        db.close()
    if not os.path.exists(args.disk):
        with open(args.disk, "xb") as f:
            f.truncate(args.disk_size)
    try:
        agent = Agent(store, args.thread, disk=ImageDisk(store, args.disk),
                      tools=[charge_tool(args.service, args.timeout)], trace=tracer,
                      lease=args.lease)
    except ThreadFailed:
        # A run that died while failing: opening it finished the refunds.
        if args.fail:
            say(f"thread {args.thread} failed on request: refunds finished")
            return EXIT_DONE
        say(f"run failed: refunds finished for thread {args.thread}")
        return EXIT_FAILED
    # A background upload stopped inside its catalog transaction would hold
    # every host's catalog up; a paused host's agent protocol is what is tested.
    tracer.before_stop = lambda: agent.wait_durable(60)
    closing = None
    try:
        if agent.resumed:
            cursor, orders = agent.state["cursor"], len(agent.state["plan"])
            say(f"thread {args.thread}: resumed at checkpoint {agent.head} ("
                + (f"order {cursor + 1} of {orders} next)" if cursor < orders
                   else f"all {orders} orders done)"))
        elif args.rewind_to or args.fail:
            raise AgentError(f"thread {args.thread} has no checkpoints yet")
        else:
            agent.state = initial_state(args.orders)
            say(f"thread {args.thread}: new, {args.orders} order(s)")
        if args.fail:
            report = agent.fail()
            closing = "done-by-fail"
            say(f"thread {args.thread} failed on request: refunded {len(report.compensated)} "
                f"charge(s)")
            return EXIT_DONE
        if args.rewind_to:
            if args.rewind_to == "head":
                args.rewind_to = agent.head
            report = agent.rewind(args.rewind_to)
            say(f"thread {args.thread} rewound to {args.rewind_to}: refunded "
                f"{len(report.compensated)} charge(s); now at checkpoint {agent.head}, "
                f"{len(agent.state['done'])} order(s) done")
            return EXIT_DONE
        try:
            summary = work(agent, args.disk, tracer, say, args.approval_ttl)
        except ApprovalPending as e:
            closing = "waiting_approval"
            say(f"waiting for approval of order {e.action['order']} ({e.action['amount']} "
                f"cents) on thread {args.thread}")
            return EXIT_APPROVAL
        except ToolFailed as e:
            if not isinstance(e.__cause__, Declined):
                raise
            say(f"order {agent.state['plan'][agent.state['cursor']]['order']}: {e.__cause__}; "
                f"failing the run")
            report = agent.fail()
            closing = "done-by-fail"
            say(f"run failed: refunded {len(report.compensated)} charge(s)")
            return EXIT_FAILED
        closing = "done"
        say(summary)
        return EXIT_DONE
    finally:
        if closing != "done-by-fail":  # fail() closed the agent already
            agent.close(closing)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def main(argv=None) -> int:
    args = parser().parse_args(argv)

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        return run(args, say)
    except ThreadBusy as e:
        print(f"error: {_one_line(e)}", file=sys.stderr, flush=True)
        return EXIT_BUSY
    except (BlockdiffError, OSError, ServiceError, ValueError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr, flush=True)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
