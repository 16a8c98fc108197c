"""The demo behind ``make demo``: the whole system, live, until Ctrl-C or ``--duration``.

1. two embedded PostgreSQL shards start (or are reused) in ``DIR`` and are migrated; the queue
   ``demo_events`` exists on both (16 partitions, 4 per tenant, 5 s ack timeout, 3 attempts);
2. per shard an active manager and a standby run as child processes (``qm manager``, with a
   token file generated in ``DIR``);
3. several receiver processes (``qm receive ... queue_manager.demo_handlers:handle``) get the
   events of both shards: most succeed at once, the ``tenant-bad-*`` tenants fail every time
   (retried, then dead-lettered), the ``tenant-slow-*`` tenants take a little longer;
4. a producer thread commits events for many tenants, each tenant's events in one transaction
   with an order row of its own; some are scheduled a few seconds ahead; ``tenant-noisy`` sends
   much more than the rest;
5. a live view (``rich``; plain lines without a terminal): events per state and shard,
   throughput, pickup delay (commit or ``fire_at`` to the fire), the top tenants, and each
   shard's leader from its managers' ``/health``; the web dashboard (``qm web``) shows the same
   run in a browser, at the URL printed with its login token;
6. at a third of the run the active manager of the first shard is killed (SIGKILL): its standby
   takes over once the lease runs out, and the killed one comes back as the new standby;
7. at the end a summary checked against the database: every event committed by the producer is
   acked, dead-lettered, or still live (lost = 0). Every child process stops, and so do the
   shards unless ``keep``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import psycopg

import queue_manager
from queue_manager import admin
from queue_manager.domain.stats import percentile
from queue_manager.domain.topology import Topology
from queue_manager.errors import QueueManagerError
from queue_manager.local import fleet
from queue_manager.producer import Router, enqueue

QUEUE = "demo_events"
#: the queue's settings: a short ack timeout and few attempts, so that retries and dead letters show
QUEUE_SETTINGS: dict[str, Any] = {
    "ack_timeout_seconds": 5.0,
    "max_attempts": 3,
    "backoff_min_seconds": 0.5,
    "backoff_max_seconds": 2.0,
}
NOISY = "tenant-noisy"
BAD = ("tenant-bad-1", "tenant-bad-2")
SLOW = ("tenant-slow-1", "tenant-slow-2")
HANDLER = "queue_manager.demo_handlers:handle"
LEASE_TTL = 2.0
_ROOT = Path(queue_manager.__file__).resolve().parents[1]
_PORT_LINE = re.compile(r"ws://127\.0\.0\.1:(\d+)/")


# --------------------------------------------------------------------------- child processes


def _answers(url: str, timeout: float) -> bool:
    """True once ``url`` answers 200 (within ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return True
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    return False


class _Child(fleet.Child):
    """One ``qm`` command in a child process (its own session: Ctrl-C reaches only the demo), its
    output in ``log_dir/NAME.log``."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.log_path.write_bytes(b"")  # this run's log only
        super().__init__(fleet.qm(*argv), log=self.log_path, env=env, new_session=True)

    def start(self) -> None:
        # a restart appends to the killed process's log (its last lines tell why it was replaced)
        if self.proc is not None:
            with self.log_path.open("a") as log:
                log.write(f"==== restarted by the demo at {datetime.now().astimezone():%H:%M:%S}\n")
        super().start()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


class _Manager(_Child):
    def __init__(self, shard: str, letter: str, topo: Path, tokens: Path, log_dir: Path, env: dict[str, str]) -> None:
        self.shard = shard
        self.port = fleet.free_port()
        self.url = f"ws://127.0.0.1:{self.port}/"
        argv = fleet.manager_argv(
            topo, shard, tokens, port=self.port, lease_ttl=LEASE_TTL, drain_timeout=2, sweep_interval=0.5
        )
        super().__init__(f"manager-{shard}-{letter}", argv, log_dir, env)

    def health(self) -> tuple[str, int | None]:
        """(role, term) from ``/health``; role ``down`` when the process does not answer."""
        if not self.alive():
            return "down", None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=0.5) as resp:
                body = json.loads(resp.read())
        except (OSError, ValueError):
            return "starting", None
        term = body.get("term")
        return str(body.get("role", "?")), int(term) if isinstance(term, int) else None


# --------------------------------------------------------------------------- producer


@dataclass
class _Produced:
    lock: threading.Lock = field(default_factory=threading.Lock)
    by_shard: Counter[str] = field(default_factory=Counter)
    by_tenant: Counter[str] = field(default_factory=Counter)
    scheduled: int = 0
    errors: int = 0
    last_error: str = ""

    def total(self) -> int:
        with self.lock:
            return sum(self.by_shard.values())


class _Producer(threading.Thread):
    """Commits about `rate` events a second: each tenant's events of a tick in one transaction."""

    TICK = 0.1

    def __init__(self, topology: Topology, rate: float, run_id: str) -> None:
        super().__init__(name="demo-producer", daemon=True)
        self.topology = topology
        self.rate = rate
        self.run_id = run_id
        self.out = _Produced()
        #: when it started and stopped committing (monotonic): the summary's rate
        self.started_at: float | None = None
        self.stopped_at: float | None = None
        self._stop_event = threading.Event()
        self._rng = random.Random()
        self._seq = 0

    def stop(self) -> None:
        self._stop_event.set()

    def _tenant(self) -> str:
        x = self._rng.random()
        if x < 0.30:
            return NOISY
        if x < 0.33:
            return self._rng.choice(BAD)
        if x < 0.37:
            return self._rng.choice(SLOW)
        return f"tenant-{self._rng.randrange(200)}"

    def _tick(self, router: Router) -> None:
        count = int(self.rate * self.TICK) + (1 if self._rng.random() < (self.rate * self.TICK) % 1 else 0)
        groups: dict[str, int] = Counter(self._tenant() for _ in range(count))
        for tenant, n in groups.items():
            scheduled = 0
            try:
                with router.transaction(tenant) as conn:
                    conn.execute("INSERT INTO demo_orders (tenant, total) VALUES (%s, %s)", (tenant, n))
                    for _ in range(n):
                        self._seq += 1
                        fire_at = None
                        if tenant != NOISY and self._rng.random() < 0.1:
                            fire_at = datetime.now(UTC) + timedelta(seconds=self._rng.uniform(2, 8))
                            scheduled += 1
                        payload = {"run": self.run_id, "seq": self._seq, "tenant": tenant}
                        enqueue(conn, QUEUE, tenant, payload, fire_at=fire_at)
            except (psycopg.Error, QueueManagerError) as exc:
                with self.out.lock:
                    self.out.errors += 1
                    self.out.last_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                continue
            with self.out.lock:
                self.out.by_shard[router.shard_for(tenant).name] += n
                self.out.by_tenant[tenant] += n
                self.out.scheduled += scheduled

    def run(self) -> None:
        self.started_at = time.monotonic()
        try:
            self._run()
        finally:
            self.stopped_at = time.monotonic()

    def _run(self) -> None:
        with Router(self.topology, max_size=2) as router:
            next_tick = time.monotonic()
            while not self._stop_event.is_set():
                self._tick(router)
                next_tick += self.TICK
                delay = next_tick - time.monotonic()
                if delay > 0:
                    self._stop_event.wait(delay)
                else:
                    next_tick = time.monotonic()


# --------------------------------------------------------------------------- what the database says


@dataclass
class _Counts:
    due: int = 0
    scheduled: int = 0
    fired: int = 0
    acked: int = 0
    failed: int = 0
    deliveries: int = 0

    @property
    def total(self) -> int:
        return self.due + self.scheduled + self.fired + self.acked + self.failed

    @property
    def pending(self) -> int:
        return self.due + self.scheduled + self.fired

    def add(self, other: _Counts) -> _Counts:
        return _Counts(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def as_tuple(self) -> tuple[int, ...]:
        return (self.due, self.scheduled, self.fired, self.acked, self.failed, self.deliveries)


_COUNTS_SQL = f"""
SELECT count(*) FILTER (WHERE state = 'to_be_fired' AND fire_at <= now()),
       count(*) FILTER (WHERE state = 'to_be_fired' AND fire_at > now()),
       count(*) FILTER (WHERE state = 'fired'),
       count(*) FILTER (WHERE state = 'acked'),
       count(*) FILTER (WHERE state = 'failed'),
       coalesce(sum(attempts), 0)
  FROM {QUEUE} WHERE id > %s
"""
_DELAYS_SQL = f"""
SELECT extract(epoch FROM fired_at - greatest(created_at, fire_at))
  FROM {QUEUE} WHERE id > %s AND fired_at > now() - interval '5 seconds'
"""
_TENANTS_SQL = f"""
SELECT tenant, count(*), count(*) FILTER (WHERE state = 'acked'), count(*) FILTER (WHERE state = 'failed')
  FROM {QUEUE} WHERE id > %s GROUP BY tenant ORDER BY count(*) DESC LIMIT 6
"""


class _Database:
    """One autocommit connection per shard; every query looks only at this run's events (id > the run's floor)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.conns = {s.name: psycopg.connect(s.dsn, autocommit=True) for s in topology.shards}
        self.floor: dict[str, int] = {}
        for name, conn in self.conns.items():
            row = conn.execute(f"SELECT coalesce(max(id), 0) FROM {QUEUE}").fetchone()
            self.floor[name] = int(row[0]) if row else 0

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()

    def counts(self) -> dict[str, _Counts]:
        out = {}
        for name, conn in self.conns.items():
            row = conn.execute(_COUNTS_SQL, (self.floor[name],)).fetchone()
            out[name] = _Counts(*(int(v) for v in row)) if row else _Counts()
        return out

    def delays(self) -> list[float]:
        values: list[float] = []
        for name, conn in self.conns.items():
            values.extend(float(r[0]) for r in conn.execute(_DELAYS_SQL, (self.floor[name],)) if r[0] is not None)
        return sorted(values)

    def tenants(self) -> list[tuple[str, int, int, int]]:
        rows: list[tuple[str, int, int, int]] = []
        for name, conn in self.conns.items():
            rows.extend(
                (str(r[0]), int(r[1]), int(r[2]), int(r[3])) for r in conn.execute(_TENANTS_SQL, (self.floor[name],))
            )
        return sorted(rows, key=lambda r: -r[1])[:6]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


#: the producer is "behind" when its rate over the last RATE_WINDOW seconds is below this share of its target
BEHIND = 0.9
RATE_WINDOW = 5.0


def producer_behind(rate: float | None, target: float) -> str | None:
    """``producer behind: 60 of 150/s`` when the producer commits clearly less than asked (the machine
    cannot keep up); None while it keeps up, or before there is a rate to judge."""
    if rate is None or rate >= BEHIND * target:
        return None
    return f"producer behind: {rate:.0f} of {target:.0f}/s"


# --------------------------------------------------------------------------- the view


@dataclass
class _Snapshot:
    elapsed: float
    counts: dict[str, _Counts]
    enqueued: int
    enqueued_rate: float
    acked_rate: float
    p50: float | None
    p99: float | None
    tenants: list[tuple[str, int, int, int]]
    leaders: dict[str, list[tuple[str, str, int | None]]]
    #: the producer's target rate (--rate), and its rate over the last RATE_WINDOW seconds
    target_rate: float = 0.0
    producer_rate: float | None = None

    @property
    def behind(self) -> str | None:
        return producer_behind(self.producer_rate, self.target_rate)

    def leader_text(self, shard: str) -> str:
        parts = []
        for name, role, term in self.leaders.get(shard, []):
            short = name.rsplit("-", 1)[-1]
            parts.append(f"{short}:{role}" + (f"(term {term})" if role == "leader" and term is not None else ""))
        return " ".join(parts)

    def line(self) -> str:
        total = _Counts()
        for c in self.counts.values():
            total = total.add(c)
        leaders = "  ".join(f"{s}[{self.leader_text(s)}]" for s in self.counts)
        behind = f"  !! {self.behind}" if self.behind else ""
        return (
            f"t={self.elapsed:5.1f}s  enqueued {self.enqueued} ({self.enqueued_rate:.0f}/s of "
            f"{self.target_rate:.0f}/s)  "
            f"acked {total.acked} ({self.acked_rate:.0f}/s)  due {total.due}  scheduled {total.scheduled}  "
            f"fired {total.fired}  dead {total.failed}  pickup p50 {_ms(self.p50)} p99 {_ms(self.p99)}  {leaders}"
            f"{behind}"
        )

    def renderable(self) -> Any:
        from rich.console import Group
        from rich.table import Table

        states = Table(title=f"queue {QUEUE} - {self.elapsed:.0f} s", expand=False)
        for col in ("shard", "due", "scheduled", "fired", "acked", "dead-lettered", "deliveries", "managers"):
            states.add_column(col, justify="left" if col in ("shard", "managers") else "right")
        total = _Counts()
        for shard, c in self.counts.items():
            total = total.add(c)
            states.add_row(shard, *(str(v) for v in c.as_tuple()[:5]), str(c.deliveries), self.leader_text(shard))
        states.add_row("all", *(str(v) for v in total.as_tuple()), "", style="bold")

        caption = "pickup: commit (or fire_at) to fire, events fired in the last 5 s"
        if self.behind:
            caption = f"[bold red]{self.behind} (this machine cannot keep up)[/]\n{caption}"
        rates = Table(title="flow", caption=caption, expand=False)
        for col in ("enqueued", "enqueued/s", "target/s", "acked/s", "pickup p50", "pickup p99"):
            rates.add_column(col, justify="right")
        rates.add_row(
            str(self.enqueued),
            f"{self.enqueued_rate:.0f}",
            f"{self.target_rate:.0f}",
            f"{self.acked_rate:.0f}",
            _ms(self.p50),
            _ms(self.p99),
            style="red" if self.behind else None,
        )

        tenants = Table(title="top tenants", expand=False)
        for col in ("tenant", "events", "acked", "dead-lettered"):
            tenants.add_column(col, justify="left" if col == "tenant" else "right")
        for name, n, acked, failed in self.tenants:
            tenants.add_row(name, str(n), str(acked), str(failed), style="yellow" if name == NOISY else None)
        return Group(states, rates, tenants)


class _Output:
    """The live view on a terminal; plain lines every `plain_every` seconds otherwise."""

    def __init__(self, live: bool, plain_every: float = 2.0) -> None:
        self._live: Any = None
        self._plain_every = plain_every
        self._last_plain = 0.0
        if live:
            from rich.live import Live

            self._live = Live(refresh_per_second=4, transient=False)
            self._live.start()

    def say(self, msg: str) -> None:
        if self._live is not None:
            self._live.console.print(msg, highlight=False, markup=False)
        else:
            print(msg, flush=True)

    def show(self, snap: _Snapshot) -> None:
        if self._live is not None:
            self._live.update(snap.renderable())
        elif time.monotonic() - self._last_plain >= self._plain_every:
            self._last_plain = time.monotonic()
            print("   " + snap.line(), flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


# --------------------------------------------------------------------------- the run


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """SIGTERM and SIGINT stop the demo as Ctrl-C does, even when started with SIGINT ignored (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    previous_int = signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _start_shards(directory: Path, shards: int, say: Callable[[str], None]) -> Topology:
    from queue_manager.local.fleet import start_shards

    say(f"== starting {shards} embedded PostgreSQL shard(s) in {directory}")
    topology = start_shards(directory, shards)
    for s in topology.shards:
        say(f"   shard {s.name} owns keyspace {s.key_range}: {s.dsn}")
    admin.create_queue(topology, QUEUE, {"partitions": 16, "shuffle": 4, **QUEUE_SETTINGS}, if_not_exists=True)
    admin.alter_queue(topology, QUEUE, QUEUE_SETTINGS)
    for s in topology.shards:
        with psycopg.connect(s.dsn, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS demo_orders (id bigserial PRIMARY KEY, tenant text, total numeric)"
            )
    say(
        f"   queue {QUEUE}: 16 partitions, 4 per tenant, ack timeout {QUEUE_SETTINGS['ack_timeout_seconds']:g} s, "
        f"max attempts {QUEUE_SETTINGS['max_attempts']}"
    )
    return topology


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _wait_for_leaders(managers: dict[str, list[_Manager]], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(any(m.health()[0] == "leader" for m in pair) for pair in managers.values()):
            return True
        for pair in managers.values():
            for m in pair:
                if not m.alive():
                    return False
        time.sleep(0.2)
    return False


def run_demo(
    directory: Path,
    *,
    shards: int = 2,
    duration: float | None = None,
    rate: float = 150.0,
    receivers: int = 3,
    keep: bool = False,
    live: bool | None = None,
) -> int:
    """Run the live demo until Ctrl-C (or SIGTERM) or `duration` seconds; returns a process exit code.

    `live`: the ``rich`` live view (default: when stdout is a terminal), else plain lines.
    """
    from queue_manager.local.embedded import LocalCluster

    directory = directory.resolve()
    out = _Output(sys.stdout.isatty() if live is None else live)
    say = out.say
    children: list[_Child] = []
    managers: dict[str, list[_Manager]] = {}
    producer: _Producer | None = None
    db: _Database | None = None
    started_shards = False
    ok = True
    summary: list[str] = []
    try:
        with _interruptible():
            directory.mkdir(parents=True, exist_ok=True)
            topology = _start_shards(directory, shards, say)
            started_shards = True
            db = _Database(topology)

            secret = secrets.token_urlsafe(24)
            web_secret = secrets.token_urlsafe(24)
            tokens = fleet.write_tokens(
                directory / "demo-tokens.toml",
                [fleet.Token("demo", secret, (QUEUE,))],
                [fleet.WebToken("demo-admin", web_secret)],
            )
            topo = directory / "topology.toml"
            log_dir = directory / "demo-logs"
            log_dir.mkdir(exist_ok=True)
            env = _child_env()
            env["QM_TOKEN"] = secret

            say(f"== per shard an active manager and a standby (qm manager, lease {LEASE_TTL:g} s); logs in {log_dir}")
            for s in topology.shards:
                pair = [_Manager(s.name, letter, topo, tokens, log_dir, env) for letter in ("a", "b")]
                managers[s.name] = pair
                children.extend(pair)
            if not _wait_for_leaders(managers, 60):
                say("   the managers did not come up; see the logs in " + str(log_dir))
                return 1
            for name, pair in managers.items():
                say(
                    f"   {name}: " + ", ".join(f"{m.name} on port {m.port} pid {m.pid} ({m.health()[0]})" for m in pair)
                )

            say(f"== {receivers} receiver process(es): qm receive ... {HANDLER}")
            urls = {s: [m.url for m in pair] for s, pair in managers.items()}
            for i in range(receivers):
                argv = fleet.receiver_argv(
                    QUEUE,
                    HANDLER,
                    topology=topo,
                    managers=urls,
                    concurrency=8,
                    handler_timeout=3,
                    drain_timeout=3,
                    log_level="INFO",
                )
                children.append(_Child(f"receiver-{i + 1}", argv, log_dir, env))

            web_port = fleet.free_port()
            web_argv = ["web", "--topology", str(topo), "--tokens", str(tokens), "--port", str(web_port)]
            web_argv += fleet.manager_flags(urls)
            children.append(_Child("web", web_argv, log_dir, env))
            if _answers(f"http://127.0.0.1:{web_port}/health", 20):
                say(f"== dashboard: http://127.0.0.1:{web_port}/  (qm web; log in with the token {web_secret})")
            else:
                say(f"== the dashboard (qm web) did not start: see {log_dir / 'web.log'}")

            run_id = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
            say(
                f"== producer: ~{rate:.0f} events/s from 200 tenants + {NOISY} (30 %) + failing {', '.join(BAD)} "
                f"+ slow {', '.join(SLOW)}; 10 % scheduled 2-8 s ahead"
            )
            producer = _Producer(topology, rate, run_id)
            producer.start()
            ok = _watch(db, producer, managers, duration, out)
    except KeyboardInterrupt:
        say("== interrupted: stopping")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip the clean-up
        try:
            if producer is not None:
                producer.stop()
                producer.join(10)
                if db is not None:
                    _settle(db, say)
            receivers_ = [c for c in children if not isinstance(c, _Manager)]
            for c in receivers_:
                c.signal(signal.SIGTERM)
            for c in receivers_:
                c.stop(8)
            for pair in managers.values():
                for m in pair:
                    m.signal(signal.SIGTERM)
            for pair in managers.values():
                for m in pair:
                    m.stop(8)
            left = [c.name for c in children if c.alive()]
            out.close()
            if children:
                print(
                    f"== stopped {len(children)} child process(es)" + (f"; STILL RUNNING: {left}" if left else ""),
                    flush=True,
                )
            if db is not None and producer is not None:
                lost, summary = _summary(db, producer)
                ok = ok and lost == 0
            if db is not None:
                db.close()
            for line in summary:
                print(line, flush=True)
            if started_shards and not keep:
                LocalCluster.from_directory(directory).stop()
                print(f"== stopped the shards in {directory}", flush=True)
            elif started_shards:
                print(
                    f"== the shards keep running (--keep); stop them with: qm local stop --dir {directory}", flush=True
                )
        finally:
            out.close()
            signal.signal(signal.SIGINT, signal.default_int_handler)
    return 0 if ok else 1


def _watch(
    db: _Database,
    producer: _Producer,
    managers: dict[str, list[_Manager]],
    duration: float | None,
    out: _Output,
) -> bool:
    """Sample and show until `duration` (or Ctrl-C); kill shard 0's leader at a third of the run."""
    start = time.monotonic()
    failover_at = duration / 3 if duration else 20.0
    first = next(iter(managers))
    killed: _Manager | None = None
    killed_term: int | None = None
    killed_at = 0.0
    took_over = False
    restarted = False
    last_sample = 0.0
    prev_enq, prev_acked, prev_t = 0, 0, start
    #: (time, enqueued) of the samples of the last RATE_WINDOW seconds: the producer's recent rate
    recent: deque[tuple[float, int]] = deque()

    def note(msg: str) -> None:
        out.say(msg)

    while duration is None or time.monotonic() - start < duration:
        now = time.monotonic()
        elapsed = now - start
        leaders = {s: [(m.name, *m.health()) for m in pair] for s, pair in managers.items()}

        if killed is None and elapsed >= failover_at:
            victim = next(
                (m for m, (_, role, _t) in zip(managers[first], leaders[first], strict=True) if role == "leader"), None
            )
            if victim is not None:
                killed_term = victim.health()[1]
                victim.signal(signal.SIGKILL)
                victim.wait(5)
                killed, killed_at = victim, time.monotonic()
                note(
                    f"== failover: SIGKILL the active manager of shard {first} ({victim.name}, pid {victim.pid}, "
                    f"term {killed_term}) at t={elapsed:.1f}s"
                )
        if killed is not None and not took_over:
            for name, role, term in leaders[first]:
                if role == "leader" and name != killed.name:
                    took_over = True
                    note(
                        f"== failover: {name} now leads shard {first} (term {term}), "
                        f"{time.monotonic() - killed_at:.1f} s after the kill (lease {LEASE_TTL:g} s)"
                    )
        if killed is not None and took_over and not restarted:
            killed.start()
            restarted = True
            note(f"== failover: {killed.name} restarted (pid {killed.pid}) as the new standby of shard {first}")

        if now - last_sample >= 1.0:
            last_sample = now
            counts = db.counts()
            delays = db.delays()
            enq = producer.out.total()
            acked = sum(c.acked for c in counts.values())
            dt = max(now - prev_t, 1e-6)
            recent.append((now, enq))
            while now - recent[0][0] > RATE_WINDOW:
                recent.popleft()
            span = now - recent[0][0]
            snap = _Snapshot(
                elapsed=elapsed,
                counts=counts,
                enqueued=enq,
                enqueued_rate=(enq - prev_enq) / dt,
                acked_rate=(acked - prev_acked) / dt,
                p50=percentile(delays, 50),
                p99=percentile(delays, 99),
                tenants=db.tenants(),
                leaders=leaders,
                target_rate=producer.rate,
                # judged once the window is mostly full (the first seconds include the start-up)
                producer_rate=(enq - recent[0][1]) / span if span >= RATE_WINDOW * 0.6 else None,
            )
            prev_enq, prev_acked, prev_t = enq, acked, now
            out.show(snap)
        time.sleep(0.25)
    if killed is None:
        out.say("== failover: not reached (the run was shorter than a third of its duration)")
    elif not took_over:
        out.say(f"== failover: no standby took over shard {first} before the end")
        return False
    return True


def _settle(db: _Database, say: Callable[[str], None], timeout: float = 6.0) -> None:
    """After the producer stopped: wait a little for the due and in-flight events to settle."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = db.counts()
        if all(c.due == 0 and c.fired == 0 for c in counts.values()):
            return
        time.sleep(0.25)
    say("   (some events were still due or in flight when the demo stopped; they stay live in the queue)")


def _summary(db: _Database, producer: _Producer) -> tuple[int, list[str]]:
    counts = db.counts()
    total = _Counts()
    for c in counts.values():
        total = total.add(c)
    with producer.out.lock:
        enqueued = dict(producer.out.by_shard)
        errors, last_error = producer.out.errors, producer.out.last_error
        noisy = producer.out.by_tenant[NOISY]
    lost = 0
    lines = ["== summary (checked against the database)"]
    for shard, c in counts.items():
        committed = enqueued.get(shard, 0)
        missing = committed - c.total
        lost += max(missing, 0)
        lines.append(
            f"   {shard}: enqueued {committed}, found {c.total}: acked {c.acked}, dead-lettered {c.failed}, "
            f"still pending {c.pending} (due {c.due}, scheduled {c.scheduled}, fired {c.fired})"
            + (f", {-missing} MORE THAN ENQUEUED" if missing < 0 else "")
        )
    lines += [
        f"   enqueued {sum(enqueued.values())} (of them {noisy} by {NOISY}), delivered {total.deliveries} times",
        f"   acked {total.acked}, dead-lettered {total.failed}, still pending {total.pending}",
        f"   lost = {lost}" + ("  (every enqueued event is acked, dead-lettered or still live)" if lost == 0 else ""),
    ]
    if producer.started_at is not None and producer.stopped_at is not None:
        seconds = max(producer.stopped_at - producer.started_at, 1e-6)
        rate = sum(enqueued.values()) / seconds
        behind = producer_behind(rate, producer.rate)
        lines.append(
            f"   producer: {rate:.0f} events/s over {seconds:.0f} s, of the {producer.rate:.0f}/s asked"
            + (f" ({behind}: this machine could not keep up)" if behind else "")
        )
    if errors:
        lines.append(f"   producer transactions that failed (rolled back, not counted): {errors}; last: {last_error}")
    return lost, lines
