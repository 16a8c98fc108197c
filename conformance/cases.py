"""The conformance cases: each starts the client under test against the fleet (or a fake manager),
drives it with events whose payloads say what to do, and checks what docs/protocol.md promises from
the database, the managers' ``/health`` and the client's JSON lines (docs/conformance.md)."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from conformance.fleet import SECRET_ALL, SECRET_OTHER, SECRET_UNKNOWN, SHARD, Fleet
from queue_manager import admin
from queue_manager.producer import enqueue
from queue_manager.wire import frames as f


class CaseFailed(AssertionError):
    """The client did not do what the protocol asks."""


class Skipped(Exception):
    """The case cannot run yet; the message says why."""


class Client:
    """The client under test as a child process; its JSON lines are collected as they come."""

    def __init__(self, command: Sequence[str], argv: Sequence[str], log: Path) -> None:
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [*command, *argv], stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True
        )
        self._lines: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                value = json.loads(line)
            except ValueError:
                value = {"kind": "garbage", "line": line[:200]}
            with self._lock:
                self._lines.append(value)

    def lines(self, kind: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [x for x in self._lines if kind is None or x.get("kind") == kind]

    def started(self, ids: Sequence[int], timeout: float = 5.0) -> set[int]:
        """The ids of the handler starts the client reported, once they include ``ids`` or after
        ``timeout``: a start line written before the handler's ack can still be in the pipe (or in
        the reader thread) when the ack's commit is seen."""
        deadline = time.monotonic() + timeout
        while True:
            seen = {x["id"] for x in self.lines("start")}
            if seen >= set(ids) or time.monotonic() > deadline:
                return seen
            time.sleep(0.02)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            if self.wait(15) is None:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise CaseFailed(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


@dataclass
class Context:
    """What a case needs: the fleet, the client's command, a place for its logs."""

    fleet: Fleet
    client: str
    command: Sequence[str]
    logs: Path
    case: str = ""
    _clients: list[Client] = field(default_factory=list)
    _queues: itertools.count[int] = field(default_factory=itertools.count)

    def queue(self, **settings: Any) -> str:
        """A new queue for this case (1 partition: events fire in the order inserted)."""
        assert self.fleet.topology is not None
        name = f"{self.case}_{self.client}_{next(self._queues)}"[:40]
        base = {"partitions": 1, "shuffle": 1, "ack_timeout_seconds": 30, "backoff_min_seconds": 0.2}
        admin.create_queue(self.fleet.topology, name, {**base, **settings})
        return name

    def start(
        self,
        queue: str,
        *,
        token: str = SECRET_ALL,
        urls: Sequence[str] | None = None,
        concurrency: int = 10,
        extend_after: float | None = None,
        extend_by: float = 30.0,
    ) -> Client:
        argv = [arg for url in (urls or self.fleet.urls) for arg in ("--manager", f"{SHARD}={url}")]
        argv += ["--token", token, "--queue", queue, "--concurrency", str(concurrency), "--drain-timeout", "10"]
        if extend_after is not None:
            argv += ["--extend-after", str(extend_after), "--extend-by", str(extend_by)]
        client = Client(self.command, argv, self.logs / f"{self.client}-{self.case}-{len(self._clients)}.log")
        self._clients.append(client)
        return client

    def subscribed(self, queue: str, count: int = 1, timeout: float = 15.0) -> list[dict[str, Any]]:
        """Wait until the leading manager has ``count`` connections subscribed to ``queue``."""

        def found() -> list[dict[str, Any]]:
            return [c for c in self.fleet.connections() if c.get("queue") == queue]

        wait_until(lambda: len(found()) >= count, timeout, f"{count} subscription(s) to {queue}")
        return found()

    def insert(self, queue: str, payloads: Sequence[Any], tenant: str = "acme") -> list[int]:
        """Enqueue these payloads, each committed on its own (in this order: one partition)."""
        ids = []
        with psycopg.connect(self.fleet.dsn, autocommit=True) as conn:
            for p in payloads:
                ident = enqueue(conn, queue, tenant, p)
                assert ident is not None
                ids.append(ident)
        return ids

    def states(self, queue: str) -> dict[int, tuple[str, int]]:
        with psycopg.connect(self.fleet.dsn) as conn:
            rows = conn.execute(f"SELECT id, state::text, attempts FROM {queue}").fetchall()
        return {int(r[0]): (str(r[1]), int(r[2])) for r in rows}

    def settled(self, queue: str, ids: Sequence[int], timeout: float = 15.0, state: str = "acked") -> None:
        wait_until(
            lambda: all(self.states(queue).get(i, ("?", 0))[0] == state for i in ids),
            timeout,
            f"{len(ids)} event(s) {state}",
        )

    def close(self) -> None:
        for c in self._clients:
            c.stop()


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CaseFailed(message)


# ---------------------------------------------------------------------------------------- the cases


def handshake(ctx: Context) -> str:
    """An unknown token and a token that does not cover the queue end the client with an error;
    the right token subscribes and receives."""
    q = ctx.queue()
    for token, why in ((SECRET_UNKNOWN, "an unknown token (HTTP 401)"), (SECRET_OTHER, "a token without the queue")):
        client = ctx.start(q, token=token)
        code = client.wait(15)
        expect(code is not None and code != 0, f"with {why} the client should exit non-zero, got {code}")
    client = ctx.start(q)
    ctx.subscribed(q)
    ids = ctx.insert(q, [{"n": i} for i in range(10)])
    ctx.settled(q, ids)
    expect(client.started(ids) == set(ids), "every event handled once")
    return "401 and forbidden end the client; the right token receives 10 events"


def credit(ctx: Context) -> str:
    """Never more in hand than granted: with 3 handlers, the client grants at most 3, runs at most 3
    at once, and the manager never holds more than 3 unacked on its connection (plus 3 being acked)."""
    q = ctx.queue()
    client = ctx.start(q, concurrency=3)
    ctx.subscribed(q)
    ids = ctx.insert(q, [{"do": ["sleep:0.25"]} for _ in range(15)])
    most = 0
    deadline = time.monotonic() + 30
    while not all(s == "acked" for s, _ in ctx.states(q).values()):
        for c in ctx.fleet.connections():
            if c.get("queue") == q:
                expect(c["credit"] <= 3, f"credit {c['credit']} granted for 3 handlers")
                # in hand at the manager: at most the credit without an ack sent, and as many whose
                # ack is on its way (docs/protocol.md, "Credit and delivery")
                expect(c["in_hand"] <= 6, f"{c['in_hand']} events in hand for 3 handlers")
                most = max(most, c["in_hand"])
        expect(time.monotonic() < deadline, "15 events acked within 30 s")
        time.sleep(0.02)
    handled = client.started(ids)
    running = 0
    peak = 0
    for line in sorted(client.lines(), key=lambda x: (x["t"], x["kind"] == "start")):
        if line["kind"] in ("start", "end"):
            running += 1 if line["kind"] == "start" else -1
            peak = max(peak, running)
    expect(peak <= 3, f"{peak} handlers ran at once; 3 allowed")
    expect(handled == set(ids), "every event handled")
    return f"at most {most} in hand at the manager, {peak} handlers at once (3 granted)"


def ack_nack_extend(ctx: Context) -> str:
    """Ack; nack with a delay (due again no sooner); a failure (the back-off); a slow handler whose
    deadline is extended (never re-fired); the last attempt dead-lettered."""
    q = ctx.queue(ack_timeout_seconds=1.5, max_attempts=2, backoff_min_seconds=0.2, backoff_max_seconds=0.5)
    client = ctx.start(q, extend_after=0.3, extend_by=20)
    ctx.subscribed(q)
    acked, nacked, failed, slow, dead = ctx.insert(
        q,
        [{"do": ["ack"]}, {"do": ["nack:1.5", "ack"]}, {"do": ["fail", "ack"]}, {"do": ["sleep:3"]}, {"do": ["fail"]}],
    )
    ctx.settled(q, [acked, nacked, failed, slow], timeout=20)
    ctx.settled(q, [dead], state="failed", timeout=10)
    st = ctx.states(q)
    expect(st[acked] == ("acked", 1) and st[slow] == ("acked", 1), f"ack and extend at attempt 1: {st}")
    expect(st[nacked] == ("acked", 2) and st[failed] == ("acked", 2), f"nack and failure re-fired once: {st}")
    expect(st[dead] == ("failed", 2), f"dead-lettered at its last attempt: {st}")
    ends = {(x["id"], x["attempt"]): x["t"] for x in client.lines("end")}
    starts = {(x["id"], x["attempt"]): x["t"] for x in client.lines("start")}
    gap = starts[(nacked, 2)] - ends[(nacked, 1)]
    expect(gap >= 1.2, f"a nack with delay 1.5 s came back after {gap:.2f} s")
    expect((slow, 2) not in starts, "the extended event was re-fired")
    return f"ack, nack (back after {gap:.2f} s for 1.5 s), failure, extend past a 1.5 s deadline, dead letter"


def stale_and_unknown(ctx: Context) -> str:
    """A handler that outlives its ack deadline: the manager takes the event back, so the late ack is
    refused (``unknown_id``, or ``stale`` when the database saw it first) and the client reports the
    code; the attempt re-fired after the back-off is acked, and the client goes on receiving."""
    q = ctx.queue(ack_timeout_seconds=1, backoff_min_seconds=3, backoff_max_seconds=3)
    client = ctx.start(q, concurrency=2)
    ctx.subscribed(q)
    [late] = ctx.insert(q, [{"do": ["sleep:2.5", "ack"]}])
    ctx.settled(q, [late], timeout=15)
    expect(ctx.states(q)[late][1] >= 2, "the event was acked at attempt 1, past its deadline")
    wait_until(
        lambda: any(x["id"] == late and x["attempt"] == 1 for x in client.lines("refused")),
        10,
        "the late ack of attempt 1 reported refused",
    )
    codes = {x["code"] for x in client.lines("refused") if x["id"] == late and x["attempt"] == 1}
    expect(codes <= {f.STALE, f.UNKNOWN_ID}, f"the late ack was refused with {codes}")
    more = ctx.insert(q, [{"n": 1}])
    ctx.settled(q, more)
    expect(client.alive(), "the client is still running")
    return f"late ack refused with {sorted(codes)}; attempt {ctx.states(q)[late][1]} acked; still receiving"


def heartbeat(ctx: Context) -> str:
    """The managers ping every 0.5 s and close a connection whose pong is 1 s late: the client
    answers while idle and while its handler runs 3 s."""
    q = ctx.queue()
    client = ctx.start(q)
    [before] = ctx.subscribed(q)
    time.sleep(3)  # idle, pinged six times
    [busy] = ctx.insert(q, [{"do": ["sleep:3"]}])
    ctx.settled(q, [busy])
    [after] = ctx.subscribed(q)
    expect(after["id"] == before["id"], f"the connection changed (closed for a late pong?): {before} -> {after}")
    expect(ctx.states(q)[busy] == ("acked", 1), "the busy event was re-fired")
    expect(client.alive(), "the client is still running")
    return "one connection through 3 s idle and a 3 s handler, pinged every 0.5 s"


def failover(ctx: Context) -> str:
    """The leader is killed: the client finds the new one, nothing acked is delivered again."""
    q = ctx.queue(ack_timeout_seconds=5)
    client = ctx.start(q)
    ctx.subscribed(q)
    first = ctx.insert(q, [{"n": i} for i in range(30)])
    ctx.settled(q, first)
    leader = ctx.fleet.wait_leader()
    killed_at = time.time()
    ctx.fleet.kill(leader)
    second = ctx.insert(q, [{"n": i} for i in range(30)])
    ctx.settled(q, second, timeout=30)
    taken_over = ctx.fleet.wait_leader()
    expect(taken_over != leader, "another manager leads")
    again = sorted({x["id"] for x in client.lines("start") if x["t"] > killed_at} & set(first))
    expect(not again, f"events acked before the kill were delivered again: {again}")
    ctx.fleet.restart(leader)  # back as a standby for the next cases
    return f"manager {leader} killed, {taken_over} took over; 30 + 30 events acked once"


def drain(ctx: Context) -> str:
    """SIGTERM: the handlers running finish and are acked, nothing new starts, the client exits 0."""
    q = ctx.queue()
    client = ctx.start(q, concurrency=3)
    ctx.subscribed(q)
    slow = ctx.insert(q, [{"do": ["sleep:1.5"]} for _ in range(3)])
    wait_until(lambda: len(client.lines("start")) >= 3, 10, "3 handlers started")
    rest = ctx.insert(q, [{"n": i} for i in range(5)])
    client.signal(signal.SIGTERM)
    code = client.wait(15)
    expect(code == 0, f"the client should exit 0 after its drain, got {code}")
    st = ctx.states(q)
    expect(all(st[i] == ("acked", 1) for i in slow), f"the running handlers' events acked: {[st[i] for i in slow]}")
    started = {x["id"] for x in client.lines("start")}
    expect(started <= set(slow) | set(rest), "only this queue's events")
    late = started & set(rest)
    expect(all(st[i][0] == "acked" for i in late), "an event delivered before the drain is settled")
    return f"3 running handlers finished and acked, exit 0; {len(rest) - len(late)} event(s) left for others"


def malformed_server_frame(ctx: Context) -> str:
    """A manager that sends a frame the client cannot read: the client drops the connection and
    connects again, without exiting."""
    fake = FakeManager()
    with fake.running():
        client = ctx.start("orders", urls=[fake.url])
        wait_until(lambda: fake.connections >= 2, 15, "a new connection after the malformed frame")
        expect(client.alive(), "the client exited on a malformed frame")
        expect(fake.closed_by_client >= 1 or fake.connections >= 2, "the client closed the connection")
    return f"{fake.connections} connections: the malformed frame dropped the first, the client reconnected"


def cancel(ctx: Context) -> str:
    """An operator cancels an event whose handler is running: the event ends ``cancelled`` and is
    never fired again. A client that asked for the feature ``cancel`` stops the handler (its ``end``
    line says ``cancelled``, well before the handler's 4 s); one that did not learns of it when it
    acks (its ack refused with the code ``cancelled``). Either way it goes on receiving."""
    q = ctx.queue(ack_timeout_seconds=2, backoff_min_seconds=0.2, backoff_max_seconds=0.5)
    client = ctx.start(q, concurrency=2)
    ctx.subscribed(q)
    [busy] = ctx.insert(q, [{"do": ["sleep:4"]}])
    wait_until(lambda: any(x["id"] == busy for x in client.lines("start")), 10, "the slow handler started")
    assert ctx.fleet.topology is not None
    cancelled_at = time.time()
    out = admin.run(ctx.fleet.topology, q, admin.ACTIONS["cancel"], None, {SHARD: [busy]})
    expect(out.total == 1, f"the cancel changed {out.total} event(s)")
    stopped = [x for x in client.lines("end") if x["id"] == busy and x.get("outcome") == "cancelled"]
    wait_until(
        lambda: bool([x for x in client.lines("end") if x["id"] == busy and x.get("outcome") == "cancelled"])
        or any(x["id"] == busy and x.get("code") == f.CANCELLED for x in client.lines("refused")),
        10,
        "the handler stopped (end: cancelled) or its ack refused with the code cancelled",
    )
    stopped = [x for x in client.lines("end") if x["id"] == busy and x.get("outcome") == "cancelled"]
    time.sleep(3)  # past the ack deadline and the back-off: nothing may come back
    expect(ctx.states(q)[busy] == ("cancelled", 1), f"the event is {ctx.states(q)[busy]}, not cancelled at attempt 1")
    again = [x for x in client.lines("start") if x["id"] == busy and x["attempt"] > 1]
    expect(not again, f"the cancelled event was fired again: {again}")
    more = ctx.insert(q, [{"n": 1}])
    ctx.settled(q, more)
    expect(client.alive(), "the client is still running")
    if stopped:
        return f"the handler stopped {stopped[0]['t'] - cancelled_at:.3f} s after the cancel (cancel frame)"
    return "the client's ack was refused with the code cancelled (it asked for no cancel frame)"


CASES: dict[str, Callable[[Context], str]] = {
    "handshake": handshake,
    "credit": credit,
    "ack_nack_extend": ack_nack_extend,
    "stale_and_unknown": stale_and_unknown,
    "heartbeat": heartbeat,
    "malformed_server_frame": malformed_server_frame,
    "drain": drain,
    "failover": failover,
    "cancel": cancel,
}


class FakeManager:
    """A manager that answers the handshake, then sends a deliver frame without its events."""

    def __init__(self) -> None:
        self.connections = 0
        self.closed_by_client = 0
        self.port = 0
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"

    def running(self) -> Any:
        import contextlib

        @contextlib.contextmanager
        def run() -> Any:
            thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
            thread.start()
            self._ready.wait(10)
            try:
                yield self
            finally:
                if self._loop is not None and self._stop is not None:
                    self._loop.call_soon_threadsafe(self._stop.set)
                thread.join(10)

        return run()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()

        def health(connection: ServerConnection, request: Request) -> Response | None:
            if request.path.startswith("/health"):
                body = json.dumps({"status": "ok", "role": "leader", "term": 1, "shard": SHARD}).encode()
                return Response(200, "OK", Headers({"Content-Type": "application/json"}), body)
            return None

        async def handler(ws: ServerConnection) -> None:
            self.connections += 1
            limits = f.limits(500)
            await ws.send(f.Welcome(f.PROTOCOL, SHARD, 1, "fake", limits).to_json())
            try:
                sub = f.parse(await ws.recv())
                assert isinstance(sub, f.Subscribe)
                await ws.send(f.Subscribed(sub.queue, None, sub.credit or 0, sub.ref).to_json())
                await ws.send('{"type":"deliver","queue":"orders"}')  # malformed on purpose: no events
                await ws.wait_closed()
                self.closed_by_client += 1
            except Exception:  # the client went away: that is what is measured
                self.closed_by_client += 1

        async with serve(handler, "127.0.0.1", 0, subprotocols=[f.PROTOCOL], process_request=health) as server:  # type: ignore[list-item]
            self.port = next(iter(server.sockets)).getsockname()[1]
            self._ready.set()
            await self._stop.wait()


def run_case(name: str, fleet: Fleet, client: str, command: Sequence[str], logs: Path) -> dict[str, Any]:
    """One case against one client: its JSON result line."""
    ctx = Context(fleet, client, command, logs, case=name)
    started = time.monotonic()
    result: dict[str, Any] = {"client": client, "case": name}
    try:
        detail = CASES[name](ctx)
        result.update(status="pass", detail=detail)
    except Skipped as exc:
        result.update(status="skip", detail=str(exc))
    except CaseFailed as exc:
        result.update(status="fail", detail=str(exc))
    except Exception as exc:  # a case that breaks is a failure, with its reason
        result.update(status="fail", detail=f"{type(exc).__name__}: {exc}")
    finally:
        ctx.close()
    result["seconds"] = round(time.monotonic() - started, 2)
    if result["status"] == "fail":
        result["logs"] = str(logs)
    return result
