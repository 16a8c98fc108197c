"""Run a reshard against the databases: prepare the targets, copy, keep in sync, cut over, reverse,
clean up or cancel. The decisions are ``plan``'s; this module moves rows and records each step in the
state file next to the topology (``<topology>.reshard.json``, replaced by rename), so that a rerun
after a crash resumes where the last recorded step left off.

The copy is by change capture (docs/operations.md, "Resharding"): the serving side's queue tables
get statement triggers that record (queue, id, tenant) of every changed row in qm.reshard_capture;
a snapshot copy pages through each queue by id; applying a captured entry re-reads the current row
by id and upserts it on the other side (or deletes it there when it is gone), so the order and
repeats of entries do not matter. The lag is the number of entries not yet applied.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

import psycopg
from psycopg import errors as pg
from psycopg import sql
from psycopg.types.json import Jsonb

from queue_manager.db.migrate import topology_json, upgrade
from queue_manager.db.sqlfiles import query
from queue_manager.domain.names import check_queue_name
from queue_manager.domain.topology import Shard, Topology
from queue_manager.domain.topology_file import write_file_atomically, write_topology_file
from queue_manager.errors import ConfigurationError, QueueManagerError
from queue_manager.reshard.plan import (
    FREEZE_ATTEMPTS,
    LOCK_TIMEOUT,
    ReshardPlan,
    ReshardState,
    Side,
    begin_cutover,
    check_allowed,
    intersection,
    make_plan,
    next_step,
    other,
    overlaps,
    rolled_back,
    step_done,
)

logger = logging.getLogger(__name__)

Conn = psycopg.Connection[Any]

#: rows per page of the snapshot copy and per round of applying captured changes
BATCH = 2000
#: a fault-injection point for the crash tests: the process kills itself (SIGKILL) right after it
#: has recorded the step named here (a cut-over step, or 'prepared', 'capturing', 'copied'), or
#: right after one shard's freeze committed ('freeze:<shard>', before the step is recorded)
CRASH_AFTER_ENV = "QM_RESHARD_CRASH_AFTER"


#: the captured changes a cut-over may leave for its frozen catch-up: it catches up while the
#: range takes writes until no more are left (what arrives until the freeze commits comes on top)
CATCH_UP_LEFT = 30
#: libpq's words for a connection the server refused for good: retrying cannot mend these
PERMANENT_CONNECT_FAILURES = (
    "does not exist",
    "authentication failed",
    "no pg_hba.conf entry",
    "permission denied",
    "could not translate host name",
)


class ReshardError(QueueManagerError):
    """The reshard stopped; the message says what happened and what to do."""


class ReshardLockError(ReshardError):
    """A lock of the reshard was not granted: a lock timeout, or a deadlock that PostgreSQL broke by
    ending the reshard's statement. Nothing is half done (the cut-over rolled back): run it again."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        #: "lock timeout" or "deadlock"
        self.kind = kind


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _heals(exc: psycopg.OperationalError) -> bool:
    """Whether a retry may mend this failure: a lost connection or a server going down or starting
    up may; a database or role that does not exist, or a refused login, may not."""
    if exc.sqlstate is not None:
        return exc.sqlstate.startswith(("57P", "08"))
    return not any(words in str(exc) for words in PERMANENT_CONNECT_FAILURES)


def _q(name: str, queue: str | None = None) -> sql.SQL | sql.Composed:
    text = query(name, "reshard.sql")
    if queue is None:
        return sql.SQL(text)
    return sql.SQL(text).format(queue=sql.Identifier(check_queue_name(queue)))


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _shards_json(topology: Topology) -> Jsonb:
    return Jsonb(json.loads(topology_json(topology)))


#: host names a DSN may give the local server by (no host: its Unix socket)
LOCAL_HOSTS = frozenset({"", "localhost", "127.0.0.1", "::1"})


def database_of(dsn: str) -> tuple[str, str, str]:
    """(host, port, database) of a DSN, normalised, so that two DSNs written differently (a URL and
    key=value, the default port written out or not, localhost or 127.0.0.1 or the local socket)
    compare equal when they name the same database."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(f"a DSN cannot be parsed ({_first_line(exc)})") from None
    host = str(info.get("host") or info.get("hostaddr") or "").lower()
    if host in LOCAL_HOSTS or host.startswith("/"):
        host = "localhost"
    return host, str(info.get("port") or "5432"), str(info.get("dbname") or info.get("user") or "")


def state_path(topology_path: Path) -> Path:
    """Where the state of a reshard of this topology is recorded."""
    return topology_path.with_name(topology_path.name + ".reshard.json")


def load_state(topology_path: Path) -> ReshardState | None:
    """The recorded reshard of this topology, None if there is none."""
    path = state_path(topology_path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, KeyError, ValueError) as exc:
        raise ReshardError(f"the reshard state {path} is unreadable ({exc}); restore it or move it aside") from None
    return ReshardState.from_dict(data)


def _crash_point(what: str) -> None:
    if os.environ.get(CRASH_AFTER_ENV) == what:
        logger.warning("crash point", extra={"action": "reshard_crash_point", "step": what})
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class Progress:
    """What a copy or apply round did: rows written and seconds spent."""

    rows: int = 0
    seconds: float = 0.0
    #: every change captured when the round started is applied (it did not stop at its deadline)
    drained: bool = True

    @property
    def rate(self) -> float | None:
        return self.rows / self.seconds if self.seconds > 0 and self.rows else None


class Reshard:
    """One reshard of the topology at ``topology_path``; holds connections to every shard involved
    and the reshard lock on each (one process at a time). Use as a context manager."""

    def __init__(self, topology_path: str | Path, *, say: Callable[[str], None] | None = None) -> None:
        self.topology_path = Path(topology_path)
        self.say = say or (lambda line: logger.info(line, extra={"action": "reshard"}))
        self._conns: dict[str, Conn] = {}
        #: connections that only read (status, lag), without the reshard lock
        self._readers: dict[str, Conn] = {}
        #: tenant overrides this process wrote: (from shard, to shard, queue) -> overrides
        self._synced: dict[tuple[str, str, str], Any] = {}

    # ------------------------------------------------------------------ plumbing

    def __enter__(self) -> Reshard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for conns in (self._conns, self._readers):
            for c in conns.values():
                c.close()
            conns.clear()

    def conn(self, shard: Shard) -> Conn:
        """An autocommit connection to the shard, holding the reshard lock there."""
        c = self._conns.get(shard.name)
        if c is None or c.closed or c.broken:
            if c is not None:
                c.close()
            c = psycopg.connect(shard.dsn, autocommit=True)
            row = c.execute(_q("reshard_lock")).fetchone()
            if not row or not row[0]:
                c.close()
                raise ReshardError(
                    f"another reshard process holds the reshard lock on shard {shard.name!r}: "
                    "wait for it to end (or end it) and run the command again"
                )
            self._conns[shard.name] = c
        return c

    def reader(self, shard: Shard) -> Conn:
        """An autocommit connection to the shard for reading only, without the reshard lock (so
        that ``status`` works while another process runs the reshard)."""
        c = self._readers.get(shard.name)
        if c is None or c.closed or c.broken:
            if c is not None:
                c.close()
            c = psycopg.connect(shard.dsn, autocommit=True)
            self._readers[shard.name] = c
        return c

    def _retrying(
        self, shard: Shard, fn: Callable[[Conn], Any], what: str, attempts: int = 30, *, read_only: bool = False
    ) -> Any:
        """Run ``fn`` on the shard's connection (``reader``'s when ``read_only``), reconnecting on a
        lost connection (a restarted server) for up to ``attempts`` tries a second apart. A failure
        no retry can mend (a database that does not exist, a refused login) raises ReshardError at
        once; a lock timeout or a deadlock raises ReshardLockError."""
        conns = self._readers if read_only else self._conns
        for i in range(attempts):
            try:
                return fn(self.reader(shard) if read_only else self.conn(shard))
            except (pg.DeadlockDetected, pg.LockNotAvailable) as exc:
                kind = "deadlock" if isinstance(exc, pg.DeadlockDetected) else "lock timeout"
                raise ReshardLockError(
                    f"shard {shard.name!r}: {kind} while {what} ({_first_line(exc)})", kind=kind
                ) from exc
            except psycopg.OperationalError as exc:
                if not _heals(exc):
                    raise ReshardError(
                        f"shard {shard.name!r} refused while {what}: {_first_line(exc)}; "
                        "check the shard's DSN (database, role, password), then run the command again"
                    ) from exc
                if i + 1 == attempts:
                    raise ReshardError(f"shard {shard.name!r} unreachable while {what}: {exc}") from exc
                logger.warning(
                    "shard unreachable, retrying",
                    extra={"action": "reshard_retry", "shard": shard.name, "what": what, "error": str(exc)},
                )
                old = conns.pop(shard.name, None)
                if old is not None:
                    old.close()
                time.sleep(1)
        raise AssertionError("unreachable")  # pragma: no cover

    def fetchall(
        self, shard: Shard, stmt: sql.SQL | sql.Composed, params: dict[str, Any] | None = None, what: str = "reading"
    ) -> list[Any]:
        """Run a query on the shard (reconnecting as ``_retrying`` does) and return its rows."""

        def run(c: Conn) -> list[Any]:
            return c.execute(stmt, params).fetchall()

        rows: list[Any] = self._retrying(shard, run, what)
        return rows

    def save(self, state: ReshardState) -> ReshardState:
        write_file_atomically(state_path(self.topology_path), json.dumps(state.to_dict(), indent=2) + "\n")
        return state

    def state(self) -> ReshardState:
        state = load_state(self.topology_path)
        if state is None:
            raise ConfigurationError(
                f"no reshard of {self.topology_path} is recorded ({state_path(self.topology_path)}): start one with "
                "'qm reshard start'"
            )
        return state

    # ------------------------------------------------------------------ plan and start

    def plan(self, targets: Sequence[Shard]) -> ReshardPlan:
        """The plan for moving the targets' ranges to them (nothing changes)."""
        return make_plan(Topology.load(self.topology_path), targets, database_of)

    def start(self, targets: Sequence[Shard], *, batch: int = BATCH) -> ReshardState:
        """Prepare the targets, turn the capture on, copy every event, apply what changed meanwhile.

        A rerun with the same targets resumes (the copy from its cursors); another reshard of the
        same topology must be finished or cancelled first. Nothing is recorded until the sources'
        queues are read and every target's database is reachable (created if missing): a target
        that cannot be used fails the command at once and leaves no reshard behind."""
        state = load_state(self.topology_path)
        if state is not None and state.active:
            if [t for t in state.plan.targets] != list(targets) and targets:
                raise ConfigurationError(
                    f"a reshard to {', '.join(t.name for t in state.plan.targets)} is {state.phase} "
                    f"({state_path(self.topology_path)}): finish or cancel it first"
                )
            if state.copied:
                self.say("the copy is complete already; the capture keeps it in sync: run 'qm reshard switch'")
                return state
            plan = state.plan
            queues = self._source_queues(plan)
            for t in plan.targets:
                _ensure_database(t)
        else:
            plan = self.plan(targets)
            queues = self._source_queues(plan)
            for t in plan.targets:
                try:
                    _ensure_database(t)
                except ReshardError as exc:
                    raise ReshardError(f"{exc} (nothing was started or recorded)") from exc
            state = self.save(ReshardState(plan))
        for line in plan.describe():
            self.say(line)
        for t in plan.targets:
            self._prepare_target(plan, t, queues)
        _crash_point("prepared")
        for s in plan.sources:
            self._retrying(s, lambda c: c.execute(_q("reshard_set_capturing"), {"on": True}), "turning the capture on")
        self.say(f"capturing changes on {', '.join(s.name for s in plan.sources)}")
        _crash_point("capturing")
        state = self._snapshot(state, list(queues), batch)
        state = self.save(replace(state, copied=True, history=[*state.history, {"step": "copied", "at": _now()}]))
        _crash_point("copied")
        progress = self._apply_captured(plan, "sources", batch=batch)
        self._sync_tenants(plan, "sources")
        state = self.save(replace(state, apply_rate=progress.rate or state.apply_rate))
        self.say(f"copied; {progress.rows} changes applied since. Next: qm reshard status, then qm reshard switch")
        return state

    def _source_queues(self, plan: ReshardPlan) -> dict[str, dict[str, Any]]:
        """Every queue of the sources with its settings; the sources must agree."""
        found: dict[str, tuple[str, dict[str, Any]]] = {}
        for s in plan.sources:
            rows = self._retrying(s, lambda c: c.execute(_q("reshard_queues")).fetchall(), "reading the queues")
            for name, settings, resizing in rows:
                if resizing:
                    raise ReshardError(
                        f"queue {name!r} on shard {s.name!r} is still shrinking (partitions_physical > partitions): "
                        "wait until the dropped partitions drain, then start the reshard"
                    )
                if name in found and found[name][1] != settings:
                    raise ReshardError(
                        f"queue {name!r} has different settings on shards {found[name][0]!r} and {s.name!r}: "
                        "make them equal (qm queue alter) before merging"
                    )
                found.setdefault(name, (s.name, settings))
        return {name: settings for name, (_, settings) in found.items()}

    def _prepare_target(self, plan: ReshardPlan, target: Shard, queues: dict[str, dict[str, Any]]) -> None:
        upgrade(target.dsn)
        c = self.conn(target)
        c.execute(
            _q("reshard_prepare_target"),
            {
                "name": target.name,
                "range_start": target.key_range.start,
                "range_end": target.key_range.end,
                "shards": _shards_json(plan.old),
            },
        )
        existing = {r[0]: r[1] for r in c.execute(_q("reshard_queues")).fetchall()}
        for name, settings in queues.items():
            if name not in existing:
                c.execute(_q("reshard_create_queue"), {"name": name, "settings": Jsonb(settings)})
            elif existing[name] != settings:
                c.execute(_q("reshard_alter_queue"), {"name": name, "settings": Jsonb(settings)})
        self.say(f"target {target.name} ({target.key_range}) migrated, {len(queues)} queue(s), not serving yet")

    # ------------------------------------------------------------------ the copy

    def _dest_for(self, plan: ReshardPlan, to: Side) -> Callable[[str], Shard]:
        topology = plan.topology_of(to)
        side = {s.name for s in plan.side(to)}

        def dest(tenant: str) -> Shard:
            shard = topology.shard_for(tenant)
            if shard.name not in side:
                raise ReshardError(f"tenant {tenant!r} belongs to shard {shard.name!r}, outside the reshard")
            return shard

        return dest

    def _snapshot(self, state: ReshardState, queues: list[str], batch: int) -> ReshardState:
        plan = state.plan
        dest_for = self._dest_for(plan, "targets")
        started = time.monotonic()
        total = 0
        for s in plan.sources:
            for queue in queues:
                key = f"{s.name}/{queue}"
                after = state.cursors.get(key, 0)
                while True:
                    rows = self.fetchall(
                        s, _q("reshard_snapshot", queue), {"queue": queue, "after": after, "limit": batch}, "copying"
                    )
                    if not rows:
                        break
                    by_dest: dict[str, list[str]] = defaultdict(list)
                    for _id, tenant, row in rows:
                        by_dest[dest_for(tenant).name].append(row)
                    for name, part in by_dest.items():
                        self._apply(plan.new.by_name(name), queue, s.name, part, [])
                    after = int(rows[-1][0])
                    total += len(rows)
                    state = self.save(replace(state, cursors={**state.cursors, key: after}))
                self.say(f"copied {queue} from {s.name} (up to id {after})")
        elapsed = time.monotonic() - started
        if total:
            self.say(f"snapshot: {total} events in {elapsed:.1f}s ({total / max(elapsed, 1e-6):.0f}/s)")
        return state

    def _apply(self, dest: Shard, queue: str, origin: str, upserts: list[str], gone: list[str]) -> int:
        params = {
            "queue": queue,
            "origin": origin,
            "upserts": "[" + ",".join(upserts) + "]",
            "gone": "[" + ",".join(gone) + "]",
        }

        def run(c: Conn) -> int:
            row = c.execute(_q("reshard_apply"), params).fetchone()
            return int(row[0]) if row else 0

        result: int = self._retrying(dest, run, f"applying to {dest.name}")
        return result

    def _apply_captured(
        self, plan: ReshardPlan, side: Side, *, batch: int = BATCH, once: bool = False, until: float | None = None
    ) -> Progress:
        """Apply the captured changes of ``side`` to the other side until none is left (or one
        round, ``once``; or until the monotonic time ``until``). Returns what was applied."""
        to = other(side)
        dest_for = self._dest_for(plan, to)
        dest_topology = plan.topology_of(to)
        progress = Progress()
        started = time.monotonic()
        for s in plan.side(side):
            while True:
                entries = self._retrying(
                    s, lambda c: c.execute(_q("reshard_captured"), {"limit": batch}).fetchall(), "reading the capture"
                )
                if not entries:
                    break
                by_queue: dict[str, dict[int, str]] = defaultdict(dict)
                for _seq, queue, eid, tenant in entries:
                    by_queue[queue][int(eid)] = tenant
                for queue, tenants in by_queue.items():
                    ids = sorted(tenants)
                    rows = self.fetchall(s, _q("reshard_rows_by_id", queue), {"queue": queue, "ids": ids})
                    upserts: dict[str, list[str]] = defaultdict(list)
                    gone: dict[str, list[str]] = defaultdict(list)
                    for eid, present, row in rows:
                        name = dest_for(tenants[int(eid)]).name
                        (upserts if present else gone)[name].append(row)
                    for name in set(upserts) | set(gone):
                        progress.rows += self._apply(
                            dest_topology.by_name(name), queue, s.name, upserts.get(name, []), gone.get(name, [])
                        )
                seqs = [int(e[0]) for e in entries]
                self.fetchall(
                    s, _q("reshard_forget_captured") + sql.SQL(" RETURNING seq"), {"seqs": seqs}, "forgetting"
                )
                if until is not None and time.monotonic() > until and len(entries) == batch:
                    progress.drained = False
                    break
                if once or len(entries) < batch:
                    break
        progress.seconds = time.monotonic() - started
        return progress

    def _sync_tenants(self, plan: ReshardPlan, side: Side) -> None:
        """Make the other side's tenant overrides equal to ``side``'s: each shard of the other side
        gets, from each shard of ``side`` whose range meets its own, the overrides of the tenants
        of both ranges. What this process wrote already is not written again (the frozen catch-up
        then reads the overrides and writes nothing, unless they changed)."""
        to_side = plan.side(other(side))
        for s in plan.side(side):
            rows = self._retrying(s, lambda c: c.execute(_q("reshard_tenants")).fetchall(), "reading tenant overrides")
            for t in to_side:
                if not overlaps(s.key_range, t.key_range):
                    continue
                shared = intersection(s.key_range, t.key_range)
                for queue, overrides in rows:
                    key = (s.name, t.name, queue)
                    if self._synced.get(key) == overrides:
                        continue
                    params = {"queue": queue, "range_start": shared.start, "range_end": shared.end}
                    self.fetchall(
                        t, _q("reshard_sync_tenants"), {**params, "rows": Jsonb(overrides)}, "syncing tenants"
                    )
                    self._synced[key] = overrides

    def lag(self, shards: Sequence[Shard], *, attempts: int = 30) -> dict[str, int]:
        """Captured changes not yet applied, per shard (read without the reshard lock)."""
        out = {}
        for s in shards:
            row = self._retrying(
                s, lambda c: c.execute(_q("reshard_lag")).fetchone(), "reading the lag", attempts, read_only=True
            )
            out[s.name] = int(row[0]) if row else 0
        return out

    def sync(self, *, batch: int = BATCH) -> Progress:
        """Apply the captured changes now (and sync tenant overrides)."""
        state = self.state()
        check_allowed(state, "sync")
        progress = self._apply_captured(state.plan, state.serving, batch=batch)
        self._sync_tenants(state.plan, state.serving)
        self.save(replace(state, apply_rate=progress.rate or state.apply_rate))
        return progress

    # ------------------------------------------------------------------ the cut-over

    def switch(self, *, timeout: float = 10.0, lock_timeout: float = LOCK_TIMEOUT) -> ReshardState:
        """Cut over to the targets (or resume an interrupted switch)."""
        return self._cutover("targets", timeout=timeout, lock_timeout=lock_timeout)

    def reverse(self, *, timeout: float = 10.0, lock_timeout: float = LOCK_TIMEOUT) -> ReshardState:
        """Cut back over to the sources (allowed until cleanup)."""
        return self._cutover("sources", timeout=timeout, lock_timeout=lock_timeout)

    def _cutover(self, to: Side, *, timeout: float, lock_timeout: float) -> ReshardState:
        state = self.state()
        fresh = state.phase != "cutover"
        state = begin_cutover(state, to)
        plan = state.plan
        frm = other(to)
        if not fresh and state.step is None:
            # stopped in its freeze (or before it): no step is recorded, but a source may be frozen;
            # it serves again, and the cut-over starts over with its catch-up while serving
            self.say(f"the cut-over to the {to} stopped before its freeze was recorded: starting it over")
            self._unfreeze(plan, frm)
            fresh = True
        if fresh:
            state = self.save(state)
            # the receiving side captures from before the freeze: it takes no writes until it
            # serves but the copy's, which are not captured (session_replication_role), so this
            # records nothing until then and keeps the DDL out of the frozen window
            self._set_capturing(plan.side(to), True)
            self._catch_up_serving(plan, frm)
        else:
            self.say(f"resuming the cut-over to the {to} after step {state.step!r}")
        started = time.monotonic()
        while (step := next_step(state)) is not None:
            t0 = time.monotonic()
            if step == "freeze":
                try:
                    self._freeze(plan, frm, lock_timeout)
                except ReshardLockError as exc:
                    self._roll_back(state, f"the freeze could not take its locks ({exc})", kind=exc.kind)
                except Exception as exc:
                    self._roll_back(state, f"the freeze failed ({_first_line(exc)})")
            elif step == "catch_up":
                if not self._final_catch_up(plan, frm, timeout):
                    self._roll_back(state, f"the catch-up did not finish within {timeout:g}s")
            elif step == "serve":
                self._serve(plan, to)
            elif step == "topology":
                self._publish_topology(plan, to)
            state = self.save(step_done(state, step, _now()))
            self.say(f"{step}: done in {time.monotonic() - t0:.3f}s")
            _crash_point(step)
        for s in plan.side(to):
            # the copy wrote rows without counting them; approximate loads by design, so this is
            # done outside the cut-over (and a crash before it is made good by the managers'
            # reconciliation slices)
            self.fetchall(s, _q("reshard_reconcile"), None, "reconciling the load counters")
        names = ", ".join(s.name for s in plan.side(to))
        self.say(f"the {to} serve ({names}); cut-over took {time.monotonic() - started:.3f}s")
        return state

    def _catch_up_serving(self, plan: ReshardPlan, frm: Side) -> None:
        """Apply the captured changes while the range still takes writes, until few are left, so
        that the frozen catch-up is short."""
        self._sync_tenants(plan, frm)
        applied = Progress()
        lag = 0
        for _ in range(40):
            p = self._apply_captured(plan, frm, until=time.monotonic() + 30)
            applied.rows += p.rows
            applied.seconds += p.seconds
            lag = sum(self.lag(plan.side(frm)).values())
            if lag <= CATCH_UP_LEFT:
                break
        self.say(
            f"caught up while the {frm} serve: {applied.rows} changes applied in {applied.seconds:.3f}s, {lag} left"
        )

    def _freeze(self, plan: ReshardPlan, frm: Side, lock_timeout: float) -> None:
        """Stop writes on the serving side and depose its managers, every shard at once, each tried
        FREEZE_ATTEMPTS times; raises ReshardLockError when a shard's locks were still not granted
        (a lock timeout, or a deadlock with an application's transaction)."""
        params = {"shards": _shards_json(plan.topology_of(other(frm))), "timeout": f"{int(lock_timeout * 1000)}ms"}

        def freeze(c: Conn) -> None:
            c.execute(_q("reshard_freeze"), params)

        def freeze_one(s: Shard) -> None:
            for attempt in range(1, FREEZE_ATTEMPTS + 1):
                try:
                    self._retrying(s, freeze, "freezing")
                    break
                except ReshardLockError as exc:
                    self.say(f"freezing {s.name}: {exc} (attempt {attempt} of {FREEZE_ATTEMPTS})")
                    if attempt == FREEZE_ATTEMPTS:
                        raise
                    time.sleep(lock_timeout)
            _crash_point(f"freeze:{s.name}")

        self._each(plan.side(frm), freeze_one)

    def _final_catch_up(self, plan: ReshardPlan, frm: Side, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            # the frozen side takes no writes: a round that was not cut short leaves nothing behind
            if self._apply_captured(plan, frm, until=deadline).drained:
                break
            if sum(self.lag(plan.side(frm)).values()) == 0:
                break
            if time.monotonic() > deadline:
                return False
        self._sync_tenants(plan, frm)
        marks: list[tuple[int, dict[str, int | None] | None]] = []
        self._each(
            plan.side(frm),
            lambda s: marks.extend(self.fetchall(s, _q("reshard_origin_marks"), None, "reading the term and ids")),
        )
        term = max(int(t) for t, _ in marks)
        min_ids: dict[str, int] = {}
        for _, last_ids in marks:
            for name, last in (last_ids or {}).items():
                if last is not None:
                    min_ids[name] = max(min_ids.get(name, 0), int(last))
        finish = {"min_term": term, "min_ids": Jsonb(min_ids)}
        self._each(
            plan.side(other(frm)), lambda s: self.fetchall(s, _q("reshard_finish_copy"), finish, "finishing the copy")
        )
        return True

    def _unfreeze(self, plan: ReshardPlan, frm: Side) -> None:
        """The frozen side serves again (a no-op on a shard that serves)."""
        for s in plan.side(frm):
            self._retrying(
                s,
                lambda c: c.execute(
                    _q("reshard_set_serving"), {"state": "serving", "shards": _shards_json(plan.topology_of(frm))}
                ),
                "unfreezing",
            )

    def _undo_cutover(self, state: ReshardState, why: str) -> ReshardState:
        """Undo a cut-over stopped before its 'serve' step: the frozen side serves again, and the
        state recorded says so."""
        self._unfreeze(state.plan, state.serving)
        return self.save(rolled_back(state, _now(), why))

    def _roll_back(self, state: ReshardState, why: str, *, kind: str | None = None) -> NoReturn:
        """``_undo_cutover``, then raise (ReshardLockError when a lock stopped it, of that ``kind``)."""
        frm = state.serving
        self._undo_cutover(state, why)
        message = f"cut-over rolled back: {why}; the {frm} serve again. Run the command again"
        if kind is not None:
            raise ReshardLockError(message + " (at a quieter moment, or with a longer --lock-timeout)", kind=kind)
        raise ReshardError(message)

    def _publish_topology(self, plan: ReshardPlan, to: Side) -> None:
        """Write the topology file (what producers wait for), then retire the frozen side (its
        capture off, marked moved) and rewrite every shard's stored map: after the file, nothing
        here holds a write back."""
        topology = plan.topology_of(to)
        # under the file's lock, keeping the managers recorded since the plan (a manager that started then)
        write_topology_file(self.topology_path, topology, keep_managers=True)
        frm = plan.side(other(to))
        self._set_capturing(frm, False)
        for s in frm:
            self._retrying(
                s,
                lambda c: c.execute(_q("reshard_set_serving"), {"state": "moved", "shards": _shards_json(topology)}),
                "marking moved",
            )
        shards = {s.name: s for s in (*plan.old.shards, *plan.new.shards)}
        for s in shards.values():
            self._retrying(
                s, lambda c: c.execute(_q("reshard_set_shard_map"), {"shards": _shards_json(topology)}), "map"
            )

    def _serve(self, plan: ReshardPlan, to: Side) -> None:
        """The ``to`` side serves (every shard at once)."""
        params = {"state": "serving", "shards": _shards_json(plan.topology_of(to))}

        def serve(c: Conn) -> None:
            c.execute(_q("reshard_set_serving"), params)

        self._each(plan.side(to), lambda s: self._retrying(s, serve, "serving"))

    def _each(self, shards: Sequence[Shard], fn: Callable[[Shard], Any]) -> None:
        """``fn(shard)`` for every shard at once, each on its own connection: the cut-over's
        statements to different shards wait for their round trips together. Raises the first
        error (in the order of ``shards``) once every call has ended."""
        if len(shards) < 2:
            for s in shards:
                fn(s)
            return
        with ThreadPoolExecutor(max_workers=len(shards), thread_name_prefix="reshard") as pool:
            futures = [pool.submit(fn, s) for s in shards]
        for f in futures:
            if (exc := f.exception()) is not None:
                raise exc

    def _set_capturing(self, shards: Sequence[Shard], on: bool) -> None:
        for s in shards:
            self._retrying(s, lambda c: c.execute(_q("reshard_set_capturing"), {"on": on}), "setting the capture")

    # ------------------------------------------------------------------ the end

    def cleanup(self) -> ReshardState:
        """After the switch: end the reverse capture and drop the sources' events and overrides."""
        state = self.state()
        check_allowed(state, "cleanup")
        plan = state.plan
        for t in plan.targets:
            self._retrying(
                t,
                lambda c: (
                    c.execute(_q("reshard_set_capturing"), {"on": False}),
                    c.execute(_q("reshard_clear_capture")),
                    c.execute(_q("reshard_clear_rows")),
                ),
                "ending the reverse capture",
            )
        for s in plan.sources:
            self._clear_events(s)
            self.say(f"source {s.name}: events and tenant overrides dropped (it serves nothing; retire it)")
        return self.save(replace(state, phase="done", history=[*state.history, {"step": "cleanup", "at": _now()}]))

    def cancel(self) -> ReshardState:
        """Before the switch: end the capture and drop what was copied to the targets."""
        state = self.state()
        check_allowed(state, "cancel")
        plan = state.plan
        if state.phase == "cutover":
            if next_step(state) == "serve":
                # the serve step is recorded once it ran: a process stopped in between left no trace
                # of it but the targets' own state
                served = [t.name for t in plan.targets if self._serving(t)]
                if served:
                    raise ConfigurationError(
                        f"the cut-over's serve step ran ({', '.join(served)} serve already): "
                        "finish it with 'qm reshard switch'"
                    )
            state = self._undo_cutover(state, "cancelled")
        for s in plan.sources:
            self._retrying(
                s,
                lambda c: (
                    c.execute(_q("reshard_set_capturing"), {"on": False}),
                    c.execute(_q("reshard_clear_capture")),
                ),
                "ending the capture",
            )
        for t in plan.targets:
            try:
                self._set_capturing([t], False)
                self._clear_events(t)
            except ReshardError as exc:
                self.say(f"target {t.name}: not cleared ({exc})")
        return self.save(replace(state, phase="cancelled", history=[*state.history, {"step": "cancel", "at": _now()}]))

    def _serving(self, shard: Shard) -> bool:
        row = self._retrying(shard, lambda c: c.execute(_q("reshard_shard")).fetchone(), "reading its state")
        return bool(row) and row[3] == "serving"

    def _clear_events(self, shard: Shard) -> None:
        def clear(c: Conn) -> None:
            with c.transaction():
                for (name,) in c.execute(_q("reshard_queue_names")).fetchall():
                    c.execute(_q("reshard_truncate_queue", name))
                c.execute(_q("reshard_clear_tenants"))
                c.execute(_q("reshard_clear_rows"))
                c.execute(_q("reshard_clear_capture"))

        self._retrying(shard, clear, "clearing")

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """Phase, rows copied and left, lag, and an estimate of the cut-over's catch-up. Reads
        without the reshard lock, so it answers while another process runs the reshard."""
        state = self.state()
        plan = state.plan
        out: dict[str, Any] = {
            "kind": plan.kind,
            "phase": state.phase,
            "serving": state.serving,
            "sources": [f"{s.name} ({s.key_range})" for s in plan.sources],
            "targets": [f"{t.name} ({t.key_range})" for t in plan.targets],
            "copied": state.copied,
        }
        if state.phase == "cutover":
            out["cutover"] = {"to": state.cutover_to, "last_step": state.step, "next_step": next_step(state)}
        if state.phase in ("copying", "switched", "cutover"):
            capturing = state.serving
            copy = {}
            if not state.copied:
                for s in plan.sources:

                    def left(c: Conn, origin: str = s.name) -> dict[str, dict[str, int]]:
                        rows = {}
                        for (name,) in c.execute(_q("reshard_queue_names")).fetchall():
                            after = state.cursors.get(f"{origin}/{name}", 0)
                            row = c.execute(_q("reshard_left", name), {"after": after}).fetchone()
                            rows[f"{origin}/{name}"] = {"copied_up_to_id": after, "left": int(row[0]) if row else 0}
                        return rows

                    copy.update(self._retrying(s, left, "reading the copy's progress", 2, read_only=True))
                out["snapshot"] = copy
            lag = self.lag(plan.side(capturing), attempts=2)
            out["lag"] = lag
            rate = state.apply_rate
            out["apply_rate"] = rate
            out["estimated_catch_up_seconds"] = round(sum(lag.values()) / rate, 3) if rate else None
        out["history"] = state.history[-10:]
        return out


def _ensure_database(target: Shard) -> None:
    """Create the target's database if its server has none of that name. Raises ReshardError at
    once (no retry) when the target cannot be reached or its database cannot be created."""
    try:
        psycopg.connect(target.dsn, connect_timeout=10).close()
        return
    except psycopg.OperationalError as exc:
        if not ('database "' in str(exc) and "does not exist" in str(exc)):
            raise ReshardError(
                f"target {target.name!r} cannot be reached: {_first_line(exc)}; "
                "check its DSN and that its server runs, then run 'qm reshard start' again"
            ) from exc
    name = str(psycopg.conninfo.conninfo_to_dict(target.dsn).get("dbname") or "")
    admin = psycopg.conninfo.make_conninfo(target.dsn, dbname="postgres")
    try:
        with psycopg.connect(admin, autocommit=True, connect_timeout=10) as c:
            c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    except psycopg.Error as exc:
        raise ReshardError(
            f"target {target.name!r}: database {name!r} does not exist and could not be created "
            f"({_first_line(exc)}); create it (CREATE DATABASE) or give the DSN's role CREATEDB, "
            "then run 'qm reshard start' again"
        ) from exc
    logger.info("created database", extra={"action": "reshard_create_database", "database": name})


@contextmanager
def opened(topology_path: str | Path, say: Callable[[str], None] | None = None) -> Iterator[Reshard]:
    r = Reshard(topology_path, say=say)
    try:
        yield r
    finally:
        r.close()
