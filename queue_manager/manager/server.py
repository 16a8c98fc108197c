"""The manager process of one shard: it wires the rooms together and serves until stopped.

- :mod:`.config` the validated configuration; :mod:`.runtime` what the parts share;
- :mod:`.leadership` the lease and the loop that runs one :mod:`.term` session per term;
- :mod:`.dispatch` (with the pure :mod:`.plan`) fires and pushes; :mod:`.wakeups` hears producers;
- :mod:`.writer` batches every write; :mod:`.maintenance` runs the leader's periodic jobs, and
  :mod:`.slices` the maintenance slices any manager takes (idle moments, standbys, the floors);
- :mod:`.connection` adapts one websocket to the sans-I/O session of :mod:`queue_manager.wire`;
- :mod:`.http` answers health, metrics and the handshake's checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers

from queue_manager.clock import Clock, SystemClock
from queue_manager.manager.config import ManagerConfig
from queue_manager.manager.connection import ReceiverConnection
from queue_manager.manager.fairness import over_fair_share
from queue_manager.manager.http import HttpFront
from queue_manager.manager.keys import top_keys
from queue_manager.manager.leadership import Leadership
from queue_manager.manager.metrics import ManagerMetrics
from queue_manager.manager.queues import QueueRuntime
from queue_manager.manager.runtime import Runtime
from queue_manager.manager.signals import ManagerSignals
from queue_manager.manager.slices import Slicer
from queue_manager.manager.term import TermSession
from queue_manager.wire import frames

logger = logging.getLogger(__name__)
#: connections listed one by one on /health (the count covers them all)
MAX_LISTED = 200


class Manager:
    """The manager of one shard; ``await Manager(config).run()`` serves until :meth:`request_stop`."""

    def __init__(self, config: ManagerConfig, clock: Clock | None = None) -> None:
        self.config = config
        self.metrics = ManagerMetrics()
        self.signals = ManagerSignals()
        self.rt = Runtime(config, clock or SystemClock(), self.metrics, self.signals)
        #: maintenance slices (slices.py): in the dispatcher's idle moments, on the standby loop,
        #: and the leader's floors
        self.slicer = Slicer(self.rt)
        self.rt.idle_listeners.append(self.slicer.on_idle)
        self.connections: set[ReceiverConnection] = set()
        self.port: int | None = None
        self.ready = asyncio.Event()
        #: starting | running | draining | stopped; while running the role comes from the lease
        self._phase = "starting"
        self._stop = asyncio.Event()
        self._server: Server | None = None
        self.leadership = Leadership(self.rt, self._open_session, self._not_leader_anymore)
        self.http = HttpFront(
            config.tokens,
            config.allowed_origins,
            lambda: self.role,
            self.health,
            self.metrics.render,
            self.rt.role_change,
        )
        self.metrics.bind_gauges(
            queues=lambda: [(q.name, float(q.in_flight), float(len(q.cache))) for q in self.queues.values()],
            leader=lambda: 1.0 if self.role == "leader" else 0.0,
            term=lambda: float(self.term or 0),
            receivers=lambda: float(len(self.connections)),
            over_share=lambda: [
                (q.name, float(over_fair_share(q.ledger.by_tenant(), q.policy))) for q in self.queues.values()
            ],
            clock=self.rt.clock.monotonic,
            keys=lambda: [
                (q.name, *top_keys(q.ledger.by_key(), q.keys)) for q in self.queues.values() if q.ledger.by_key()
            ],
        )

    # ------------------------------------------------------------------ what others read

    @property
    def queues(self) -> dict[str, QueueRuntime]:
        return self.rt.queues

    @property
    def term(self) -> int | None:
        return self.rt.lease.term

    @property
    def shard_name(self) -> str | None:
        return self.rt.shard_name

    @property
    def role(self) -> str:
        """starting | standby | leader | degraded | draining | stopped.

        ``leader`` only while the lease is trusted by time (so a manager woken after a pause is
        not one until a renewal has checked its term) and its database session works.
        """
        if self._phase != "running":
            return self._phase
        if self.rt.lease.term is None:
            return "standby"
        return "leader" if self.rt.leading() else "degraded"

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "role": self.role,
            "term": self.term,
            "shard": self.shard_name,
            "holder": self.config.holder,
            "receivers": len(self.connections),
            #: the first MAX_LISTED connections by id, each with its credit (the dashboard shows them)
            "connections": [c.describe() for c in sorted(self.connections, key=lambda c: c.id)[:MAX_LISTED]],
            "queues": {
                q.name: {
                    "cache": len(q.cache),
                    "in_flight": q.in_flight,
                    "subscribers": len(q.subscribers),
                    **self._limits(q),
                    **self._keys(q),
                }
                for q in self.queues.values()
            },
        }

    def _limits(self, q: QueueRuntime) -> dict[str, Any]:
        """This shard's slices of the queue's limits across shards (only for a limited queue)."""
        s, lim = q.settings, q.limits
        now = self.rt.clock.monotonic()
        out: dict[str, Any] = {}
        if s.max_qps is not None:
            out["qps_share"] = round(lim.rate_now(s.max_qps, now), 3)
        if s.max_concurrency is not None:
            out["concurrency_share"] = lim.concurrency_now(s.max_concurrency, now)
        return out

    @staticmethod
    def _keys(q: QueueRuntime) -> dict[str, Any]:
        """The concurrency keys with the most events in hand, and how many are at their limit
        (only when some key has events in hand)."""
        held = q.ledger.by_key()
        if not held:
            return {}
        top, at_limit = top_keys(held, q.keys)
        return {
            "top_keys": [{"tenant": t, "key": k, "in_hand": n, "max_in_flight": cap} for t, k, n, cap in top],
            "keys_at_limit": at_limit,
        }

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self) -> None:
        """Drain and stop (what SIGTERM does)."""
        self._stop.set()

    async def run(self) -> None:
        """Serve until :meth:`request_stop`; then drain, release leadership and return."""
        cfg = self.config
        self._server = await serve(
            self._handle,
            cfg.host,
            cfg.port,
            process_request=self.http.process_request,
            subprotocols=[frames.PROTOCOL],  # type: ignore[list-item]
            max_size=frames.MAX_FRAME_BYTES,
            max_queue=64,
            ping_interval=cfg.ping_interval,
            ping_timeout=cfg.ping_timeout,
            compression=None,
            server_header=None,
        )
        sock = next(iter(self._server.sockets))
        self.port = int(sock.getsockname()[1])
        self._phase = "running"
        self.ready.set()
        logger.info("manager listening", extra={"action": "listen", "port": self.port, "holder": cfg.holder})
        lead = asyncio.create_task(self.leadership.run(), name="qm-lead")
        standby = asyncio.create_task(self.slicer.run_standby(), name="qm-standby-maintenance")
        try:
            await self._stop.wait()
        finally:
            standby.cancel()
            await asyncio.wait({standby}, timeout=5)
            await self._shutdown(lead)
            await self.slicer.close()

    async def _open_session(self, term: int) -> TermSession:
        return await TermSession.open(self.rt, term, self.slicer)

    async def _not_leader_anymore(self) -> None:
        await self._close_all(frames.CLOSE_NOT_LEADER, "this manager is no longer the shard's active manager")

    async def _close_all(self, code: int, reason: str) -> None:
        for c in list(self.connections):
            await c.close(code, reason)

    async def _shutdown(self, lead: asyncio.Task[None]) -> None:
        rt = self.rt
        role = self.role
        was_leader = role == "leader"
        self._phase = "draining"
        rt.draining = True
        rt.role_changed()  # held /health/leader probes answer 503 now
        for c in self.connections:
            c.session.draining = True
        rt.wake.set()
        if was_leader:
            await self._drain()
        else:
            logger.info("stopping: nothing to drain", extra={"action": "stop", "role": role})
        lead.cancel()
        # bounded: the shutdown must not hang on a task that will not end
        await asyncio.wait({lead}, timeout=5)
        await self.leadership.release()
        await self._close_all(frames.CLOSE_GOING_AWAY, "manager stopping")
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await self._server.wait_closed()
        self._phase = "stopped"

    async def _drain(self) -> None:
        """Wait for the acks of events in hand (up to the drain timeout), then put the rest back."""
        rt = self.rt
        in_hand = sum(q.in_flight for q in self.queues.values())
        logger.info(
            "stopping: draining",
            extra={
                "action": "drain",
                "term": self.term,
                "in_flight": in_hand,
                "receivers": len(self.connections),
                "timeout": self.config.drain_timeout,
            },
        )
        started = rt.clock.monotonic()
        deadline = started + self.config.drain_timeout
        while any(q.in_flight for q in self.queues.values()):
            remaining = deadline - rt.clock.monotonic()
            if remaining <= 0 or not await rt.wait_changed(remaining):
                break
        put_back = 0
        for q in list(self.queues.values()):
            items = [(d.id, d.attempt, 0.0, "manager stopped before the ack") for d in q.ledger.unsettled()]
            if items:
                put_back += len(items)
                await rt.release(q, items, "drain")
        seconds = round(rt.clock.monotonic() - started, 3)
        if put_back:
            logger.warning(
                "drain timeout: events without an ack go back to the queue",
                extra={"action": "drained", "term": self.term, "put_back": put_back, "seconds": seconds},
            )
        else:
            logger.info(
                "drained: every event in hand was settled",
                extra={"action": "drained", "term": self.term, "seconds": seconds},
            )

    async def _handle(self, ws: ServerConnection) -> None:
        headers: Headers = ws.request.headers if ws.request is not None else Headers()
        grant = self.config.tokens.from_authorization(headers.get("Authorization"))
        if grant is None:  # process_request already refused it; belt and braces
            await ws.close(1008, "unauthorized")
            return
        c = ReceiverConnection(ws, grant, self.rt)
        c.session.draining = self._phase == "draining"
        self.connections.add(c)
        who = c.describe()
        logger.info("receiver connected", extra={"action": "connect", "token": who["token"], "peer": who["peer"]})
        try:
            await c.serve(self._welcome())
        finally:
            self.connections.discard(c)
            logger.info(
                "receiver disconnected",
                extra={"action": "disconnect", "token": who["token"], "peer": who["peer"], "code": ws.close_code},
            )

    def _welcome(self) -> str:
        limits = frames.limits(self.config.max_events_per_frame)
        return frames.Welcome(frames.PROTOCOL, self.shard_name, self.term, self.config.holder, limits).to_json()
