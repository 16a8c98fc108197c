"""The processes a one-shard benchmark runs, started from the parent: a manager, receivers and an
open-loop producer, each in its own ``multiprocessing`` spawn process (entry points in
:mod:`benchmarks.lib.procs`), with the handles the parent uses to start, watch and stop them."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.lib import procs
from queue_manager.producer import Event

logger = logging.getLogger("bench")

CTX = mp.get_context("spawn")

#: wall-clock times at which a manager did not stop within procs.STOP_TIMEOUT of request_stop()
#: (a report gives their count; the process is ended so the run goes on)
stop_hangs: list[float] = []


# --------------------------------------------------------------------------- manager


@dataclass
class ManagerHandle:
    proc: Any
    port: int
    status_q: Any
    stop_ev: Any
    reset_ev: Any
    #: what the manager reported when it stopped: counters, slow calls, role, stop_hung
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"

    def counters(self) -> dict[str, Any]:
        """The manager's timed database calls (after it stopped): see :func:`db_calls`."""
        return db_calls(self.info.get("counters", {}))


@contextlib.contextmanager
def manager_process(
    dsn: str, overrides: Mapping[str, Any] | None = None, profile_path: str | None = None
) -> Iterator[ManagerHandle]:
    """A manager in its own process, leading the shard; drained and stopped on exit.

    ``overrides``: ManagerConfig fields for this manager; ``profile_path``: cProfile output.
    Setting ``reset_ev`` clears its call counters (the parent's "go")."""
    status_q, stop_ev, reset_ev = CTX.Queue(), CTX.Event(), CTX.Event()
    proc = CTX.Process(
        target=procs.manager_main,
        args=(dsn, dict(overrides or {}), status_q, stop_ev, reset_ev, profile_path),
        name="bench-manager",
        daemon=True,
    )
    proc.start()
    handle: ManagerHandle | None = None
    try:
        kind, value = status_q.get(timeout=90)
        if kind != "ready":
            raise RuntimeError(f"the manager process failed to start: {value}")
        handle = ManagerHandle(proc, int(value), status_q, stop_ev, reset_ev)
        yield handle
    finally:
        stop_ev.set()
        with contextlib.suppress(Exception):
            while True:
                kind, value = status_q.get(timeout=procs.STOP_TIMEOUT + 30)
                if kind == "done":
                    if handle is not None:
                        handle.info = value
                    if value.get("stop_hung"):
                        stop_hangs.append(time.time())
                    break
                if kind == "error":
                    logger.warning("manager process: %s", value)
                    break
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=10)


def db_calls(raw: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """{name: {calls, seconds, items, ms_per_call, items_per_call}} of the manager's timed calls."""
    out = {}
    for name, (calls, seconds, items) in sorted(raw.items()):
        entry: dict[str, Any] = {"calls": int(calls), "items": int(items)}
        if name != "deliver_frames":
            entry["seconds"] = round(seconds, 3)
            entry["ms_per_call"] = round(1000 * seconds / calls, 3) if calls else None
        entry["items_per_call"] = round(items / calls, 1) if calls else None
        out[name] = entry
    return out


# --------------------------------------------------------------------------- receivers


@dataclass
class Receivers:
    procs: list[Any]
    ready: list[Any]
    go: Any
    stop: Any
    handled: list[Any]
    acked: list[Any]
    last_ack: list[Any]
    out_q: Any
    results: list[dict[str, Any]] = field(default_factory=list)

    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.procs]

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        for r in self.ready:
            if not r.wait(max(0.1, deadline - time.monotonic())):
                raise RuntimeError("a receiver process did not become ready in time")

    def handled_total(self) -> int:
        return sum(int(h.value) for h in self.handled)

    def acked_total(self) -> int:
        return sum(int(a.value) for a in self.acked)

    def finish(self, timeout: float = 60) -> list[dict[str, Any]]:
        """Stop every receiver and return their reports (see :func:`procs.receiver`)."""
        self.stop.set()
        deadline = time.monotonic() + timeout
        while len(self.results) < len(self.procs) and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                self.results.append(self.out_q.get(timeout=0.5))
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        errors = [r["error"] for r in self.results if r.get("error")]
        if errors:
            logger.warning("receiver errors: %s", errors)
        if len(self.results) < len(self.procs):
            raise RuntimeError(f"only {len(self.results)} of {len(self.procs)} receivers reported")
        return self.results


def start_receivers(
    count: int,
    url: str,
    mode: str,
    credit: int,
    concurrency: int,
    profile_dir: str | None = None,
    library: bool = False,
    service: float = 0.0,
    tracing: bool = False,
) -> Receivers:
    """``count`` receiver processes on ``url`` (``mode`` and the rest: see :func:`procs.receiver`);
    they start receiving when ``go`` is set."""
    go, stop, out_q = CTX.Event(), CTX.Event(), CTX.Queue()
    ready = [CTX.Event() for _ in range(count)]
    handled = [CTX.Value("q", 0, lock=False) for _ in range(count)]
    acked = [CTX.Value("q", 0, lock=False) for _ in range(count)]
    last_ack = [CTX.Value("d", 0.0, lock=False) for _ in range(count)]
    ps = []
    for i in range(count):
        prof = str(Path(profile_dir) / f"receiver-{i}.prof") if profile_dir else None
        ps.append(
            CTX.Process(
                target=procs.spawned,
                args=(
                    procs.receiver,
                    out_q,
                    {"idx": i},
                    i,
                    url,
                    mode,
                    credit,
                    concurrency,
                    ready[i],
                    go,
                    stop,
                    handled[i],
                    acked[i],
                    last_ack[i],
                    out_q,
                    prof,
                    library,
                    service,
                    tracing,
                ),
                name=f"bench-receiver-{i}",
                daemon=True,
            )
        )
    for p in ps:
        p.start()
    return Receivers(ps, ready, go, stop, handled, acked, last_ack, out_q)


# --------------------------------------------------------------------------- producer


@dataclass
class Producer:
    proc: Any
    ready: Any
    go: Any
    out_q: Any

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    def wait_ready(self, timeout: float = 60) -> None:
        if not self.ready.wait(timeout):
            raise RuntimeError("the producer did not become ready")

    def result(self, timeout: float) -> dict[str, Any]:
        """The producer's report once it has sent every event: ``sent`` (seq -> (call start,
        commit returned), time.time()), ``elapsed``; raises what stopped it."""
        res: dict[str, Any] = self.out_q.get(timeout=timeout)  # before the join: it exits once read
        self.proc.join(timeout=10)
        if "error" in res:
            raise RuntimeError(f"producer failed: {res['error']}")
        return res


def start_producer(
    dsn: str,
    n: int,
    rate: float,
    go: Any | None = None,
    *,
    warmup: int = 0,
    conns: int = 1,
    seed: int = 0,
    tenant: str | None = None,
    name: str = "bench-producer",
    priority: int | None = None,
) -> Producer:
    """An open-loop producer process (see :func:`procs.produce`): ``warmup`` + ``n`` events at
    ``rate``/s over ``conns`` connections, one transaction each, from when ``go`` is set (an
    event of the caller's, e.g. the receivers' go, or the producer's own)."""
    ready, out_q = CTX.Event(), CTX.Queue()
    go = CTX.Event() if go is None else go
    proc = CTX.Process(
        target=procs.spawned,
        args=(procs.produce, out_q, {}, dsn, n, warmup, float(rate), conns, seed, ready, go, out_q, tenant, priority),
        name=name,
        daemon=True,
    )
    proc.start()
    return Producer(proc, ready, go, out_q)


def make_events(n: int, seed: int, fire_at: Sequence[datetime] | None = None) -> list[Event]:
    """``n`` events of random tenants (procs.TENANTS), payload ``{"n": i}``, fire_at when given."""
    rng = random.Random(seed)
    return [
        Event(rng.choice(procs.TENANTS), {"n": i, "kind": "bench"}, fire_at[i] if fire_at is not None else None)
        for i in range(n)
    ]
