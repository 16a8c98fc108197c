"""The budget of one leadership session: this manager's slices of its queues' ``max_qps`` and
``max_concurrency``, shared with the other shards' managers through lease rows in the databases.

Every ``rate_interval`` (a sixth of ``rate_lease_ttl``) a round:

1. plans each limited queue's slices from the peers' rows of the last round (``limits.Slice.plan``):
   a lower slice is used at once;
2. publishes this manager's rows into its own shard's database and, at the same time, into every
   other shard's database it can reach (:class:`PeerLink`; the topology names them);
3. reads the other shards' rows from its own shard's database only, and judges which are live
   (``limits.Liveness``);
4. if the publish reached every shard whose manager is live, trusts its slices until the round's
   start plus ``rate_trust``, and takes pending raises (``limits.Slice.adopt``).

A shard whose database cannot be reached is treated as down: its manager cannot fire either (its
fires are statements on that database). Its peers take its share once its rows expire on their
own databases, and they keep working while it is down. The decisions are in ``limits.py``; the
argument is in docs/design.md, "Rate and concurrency limits across shards".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Sequence

import psycopg

from queue_manager.domain.topology import TopologyFile
from queue_manager.errors import TopologyError
from queue_manager.manager import store
from queue_manager.manager.limits import Liveness, Peer
from queue_manager.manager.queues import QueueRuntime, Reason
from queue_manager.manager.runtime import Runtime
from queue_manager.manager.store import AsyncConn, LeaseRow, PeerLease

logger = logging.getLogger(__name__)

#: seconds to connect to another shard's database (in the background: a round never waits for it)
PEER_CONNECT_TIMEOUT = 2
#: a peer database that could not be reached is tried again after this many seconds
PEER_RETRY = 0.5
#: the last publish of a session that ends (its slices given back) waits at most this long
RESIGN_TIMEOUT = 1.0


def limited(q: QueueRuntime) -> bool:
    return q.settings.max_qps is not None or q.settings.max_concurrency is not None


class PeerLink:
    """This manager's connection to another shard's database, to publish its rows there.

    Connects in the background and never makes a round wait for it; a write that fails or takes
    longer than its timeout drops the connection (a fresh one is made for a later round).
    """

    def __init__(self, shard: str, dsn: str, application_name: str) -> None:
        self.shard = shard
        self.dsn = dsn
        self._name = application_name
        self.conn: AsyncConn | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._retry_at = 0.0
        #: the last attempt to connect or write failed: the database is taken to be down (its
        #: manager cannot fire either); False while the first connection is still being made
        self.down = False
        #: start of the first round of the current unbroken run of publishes that reached it
        self.reached_since: float | None = None

    async def publish(
        self,
        me: str,
        holder: str,
        term: int,
        ttl: float,
        rows: Sequence[LeaseRow],
        resigned: bool,
        *,
        timeout: float,
        started: float,
    ) -> bool:
        """True when every row was written into the peer's database."""
        conn = self.conn
        if conn is None or conn.closed:
            self.reached_since = None
            self._connect_soon()
            return False
        try:
            async with asyncio.timeout(timeout):
                written = await store.rate_publish(conn, me, holder, term, ttl, rows, resigned)
        except (psycopg.Error, OSError, TimeoutError) as exc:
            await self._lost(exc)
            return False
        except asyncio.CancelledError:
            await self._drop()  # a statement cut off midway leaves the connection unusable
            raise
        if written != len(rows):  # a newer leader of our shard writes there: we are deposed
            self.reached_since = None
            return False
        self._up()
        if self.reached_since is None:
            self.reached_since = started
        return True

    def _connect_soon(self) -> None:
        loop = asyncio.get_running_loop()
        if self._connecting is None and loop.time() >= self._retry_at:
            self._connecting = loop.create_task(self._connect(), name=f"qm-budget-connect-{self.shard}")

    async def _connect(self) -> None:
        conn: AsyncConn | None = None
        try:
            conn = await store.connect(self.dsn, self._name, durable=False, connect_timeout=PEER_CONNECT_TIMEOUT)
            found = await store.shard_name(conn)
            if found != self.shard:
                logger.error(
                    "the topology's database of a shard is another shard's",
                    extra={"action": "limits_peer", "shard": self.shard, "found": found},
                )
                await conn.close()
                conn = None
                self._retry_at = asyncio.get_running_loop().time() + 30 * PEER_RETRY
                return
            self.conn, conn = conn, None
        except (psycopg.Error, OSError) as exc:
            self._note_down(exc)
            self._retry_at = asyncio.get_running_loop().time() + PEER_RETRY
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
            self._connecting = None

    async def connect_now(self, timeout: float) -> None:
        """Connect at once if not connected (for the last publish of a session)."""
        if self.conn is None or self.conn.closed:
            task = self._connecting
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await (asyncio.shield(task) if task is not None else self._connect())

    async def _lost(self, exc: BaseException) -> None:
        self._note_down(exc)
        await self._drop()

    async def _drop(self) -> None:
        self.reached_since = None
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    def _note_down(self, exc: BaseException) -> None:
        self.reached_since = None
        if not self.down:
            self.down = True
            logger.warning(
                "another shard's database is unreachable: its manager's share is taken once its rows expire",
                extra={"action": "limits_peer_down", "shard": self.shard, "error": str(exc).strip()[:200]},
            )

    def _up(self) -> None:
        if self.down:
            self.down = False
            logger.warning(
                "another shard's database is reachable again", extra={"action": "limits_peer_up", "shard": self.shard}
            )

    async def close(self) -> None:
        task, self._connecting = self._connecting, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()


class Budget:
    """Publishes and renews this manager's slices, reads the peers', for one session."""

    def __init__(self, rt: Runtime, conn: AsyncConn, term: int, shard: str) -> None:
        self.rt = rt
        self.conn = conn
        self.term = term
        self.me = shard
        cfg = rt.config
        topology = cfg.topology
        name = f"qm-manager-limits {cfg.holder}"
        peers = () if topology is None else [s for s in topology.shards if s.name != shard]
        self.links = {s.name: PeerLink(s.name, s.dsn, name) for s in peers}
        self._link_name = name
        #: the topology file, watched for changes (None: not looked at yet)
        self._topology_file: TopologyFile | None = None
        self.liveness = Liveness()
        #: live peer rows by queue, from the last read
        self.view: dict[str, list[PeerLease]] = {}
        #: queues whose rows this session published
        self.published: set[str] = set()

    async def run(self) -> None:
        """Rounds until cancelled; a failure on this shard's own database fails the session."""
        clock = self.rt.clock
        interval = self.rt.config.rate_interval
        while True:
            started = clock.monotonic()
            await self.round(started)
            await asyncio.sleep(max(0.0, started + interval - clock.monotonic()))

    def _peers(self, queue: str) -> tuple[list[Peer], list[Peer]]:
        """The live peers' rows of one queue: for the rate, for the concurrency."""
        rate, conc = [], []
        for p in self.view.get(queue, ()):
            if p.claim_qps is not None and p.want_qps is not None:
                rate.append(Peer(p.shard, p.want_qps, p.claim_qps, p.pending_qps))
            if p.claim_concurrency is not None and p.want_concurrency is not None:
                conc.append(Peer(p.shard, p.want_concurrency, p.claim_concurrency, p.pending_concurrency))
        return rate, conc

    async def _follow_topology(self) -> None:
        """Reload the topology file when it changed (a reshard's switch rewrites it): links to
        shards that joined are opened, links to shards that left (or moved database) closed. A
        shard that left stops counting once its rows expire; one that joined counts as live from
        its first row, and until this manager has reached it, no round is trusted (``_covered``)."""
        path = self.rt.config.topology_file
        if path is None:
            return
        if self._topology_file is None:
            self._topology_file = TopologyFile(path)
        try:
            topology = self._topology_file.changed()
        except TopologyError as exc:
            logger.warning(
                "topology file unreadable, kept the last one", extra={"action": "limits_topology", "error": str(exc)}
            )
            return
        if topology is None:
            return
        wanted = {s.name: s.dsn for s in topology.shards if s.name != self.me}
        for name in [n for n, link in self.links.items() if wanted.get(n) != link.dsn]:
            await self.links.pop(name).close()
        for name, dsn in wanted.items():
            if name not in self.links:
                self.links[name] = PeerLink(name, dsn, self._link_name)
        logger.info("limits peers", extra={"action": "limits_topology", "peers": sorted(self.links)})

    async def round(self, started: float) -> None:
        await self._follow_topology()
        rt = self.rt
        cfg = rt.config
        queues = [q for q in rt.queues.values() if limited(q)]
        if not queues:
            return
        leading = rt.leading()
        db_now = rt.db_clock.now()
        rows = []
        for q in queues:
            s, lim = q.settings, q.limits
            lim.measure(started)
            more_due = q.pick.backlog or q.pick.due_hint or q.cache.has_due(db_now)
            dispatching = leading and not s.paused and bool(q.subscribers)
            want_rate, want_slots = lim.wants(started, more_due, q.in_flight, dispatching)
            peers_rate, peers_conc = self._peers(q.name)
            if s.max_qps is not None:
                lim.rate.plan(s.max_qps, self.me, want_rate, peers_rate)
            else:
                lim.rate.drop()
            if s.max_concurrency is not None:
                lim.concurrency.plan(s.max_concurrency, self.me, want_slots, peers_conc, hold=q.in_flight)
            else:
                lim.concurrency.drop()
            rows.append(
                LeaseRow(
                    q.name,
                    None if s.max_qps is None else want_rate,
                    None if s.max_qps is None else lim.rate.claim,
                    s.max_qps is not None and lim.rate.pending,
                    None if s.max_concurrency is None else want_slots,
                    None if s.max_concurrency is None else lim.concurrency.claim,
                    s.max_concurrency is not None and lim.concurrency.pending,
                )
            )
        reached = await self._publish(rows, resigned=False, started=started)
        self.published.update(r.queue for r in rows)
        read = await store.rate_view(self.conn, self.me, [r.queue for r in rows])
        now = rt.clock.monotonic()
        view: dict[str, list[PeerLease]] = {}
        live: set[str] = set()
        for p in read:
            if self.liveness.live((p.queue, p.shard), (p.term, p.seq), p.live, p.resigned, p.ttl_seconds, now):
                view.setdefault(p.queue, []).append(p)
                live.add(p.shard)
        self.view = view
        reached_all = self.me in reached and all(
            self._covered(name, name in live, name in reached, started) for name in live | self.links.keys()
        )
        for q in queues:
            s, lim = q.settings, q.limits
            raised = False
            if not lim.trusted(now) and lim.trusted_until > -math.inf:
                if not lim.lapsed:
                    rt.metrics.limit_lapses.inc(queue=q.name)
                lim.lapsed = True
            if reached_all:
                raised = not lim.trusted(now)  # trusted again (or for the first time): look at it at once
                lim.trusted_until = started + cfg.rate_trust
                lim.lapsed = False
            peers_rate, peers_conc = self._peers(q.name)
            if s.max_qps is not None:
                raised = lim.rate.adopt(s.max_qps, self.me, peers_rate, reached_all) or raised
                rt.metrics.limit_share.set(lim.rate_now(s.max_qps, now), queue=q.name, limit="qps")
            if s.max_concurrency is not None:
                raised = lim.concurrency.adopt(s.max_concurrency, self.me, peers_conc, reached_all) or raised
                rt.metrics.limit_share.set(
                    lim.concurrency_now(s.max_concurrency, now), queue=q.name, limit="concurrency"
                )
            if raised:
                rt.nudge(q, Reason.CREDIT)
        rt.metrics.limit_peers.set(len(live))

    def _covered(self, shard: str, live: bool, reached: bool, started: float) -> bool:
        """Whether this round's claims bind the manager of ``shard`` (see docs/design.md):

        - a peer whose row is live reads its own database: ours must have reached it this round;
        - a peer whose row is not live may be a manager that started a moment ago and has not
          seen us yet: our rows must have been in its database for a whole lease (by then it has
          either written its own rows to ours, or stopped trusting its slices for want of reaching
          us), or its database must be down (then its manager cannot fire either);
        - a shard we have no link to (not in our topology) must not be live.
        """
        if live:
            return reached
        link = self.links.get(shard)
        if link is None:
            return True
        if reached:
            return link.reached_since is not None and started - link.reached_since >= self.rt.config.rate_lease_ttl
        return link.down

    async def _publish(self, rows: Sequence[LeaseRow], resigned: bool, started: float) -> set[str]:
        """Write ``rows`` into this shard's database and every peer's at once; the shards whose
        databases took every row. A failure on this shard's database is raised, after the
        peers' writes have finished (each is bounded by its own timeout)."""
        cfg = self.rt.config
        args = (self.me, cfg.holder, self.term, cfg.rate_lease_ttl, rows, resigned)
        loop = asyncio.get_running_loop()
        own = loop.create_task(store.rate_publish(self.conn, *args))
        peers = {
            name: loop.create_task(link.publish(*args, timeout=cfg.rate_trust / 2, started=started))
            for name, link in self.links.items()
        }
        tasks: list[asyncio.Task[int] | asyncio.Task[bool]] = [own, *peers.values()]
        try:
            await asyncio.wait(tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        reached = {name for name, t in peers.items() if t.result()}
        for name in self.links.keys() - reached:
            self.rt.metrics.limit_publish_failures.inc(shard=name)
        if own.result() == len(rows):
            reached.add(self.me)
        return reached

    async def resign(self) -> None:
        """The session ended (its dispatcher is gone): give the slices back at once, everywhere
        this manager can still reach, so the peers need not wait for the rows to expire."""
        rows = [LeaseRow(name, 0.0, 0.0, False, 0.0, 0.0, False) for name in sorted(self.published)]
        if rows:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(RESIGN_TIMEOUT):
                    # a round cut off by the session's end may have dropped a link: connect again
                    await asyncio.gather(*(link.connect_now(RESIGN_TIMEOUT) for link in self.links.values()))
                    await self._publish(rows, resigned=True, started=self.rt.clock.monotonic())
        for link in self.links.values():
            await link.close()
