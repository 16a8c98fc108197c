"""The suite's deployment: two PostgreSQL servers (one per shard), two managers per shard (an
active one and a standby, real ``qm manager`` processes), a TCP proxy on each manager's link to its
database and on each manager's port for receivers, and receiver processes.

One pair of servers serves the whole run; each scenario gets fresh databases cloned from a
migrated template, fresh managers, proxies and receivers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import sys
import time
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psycopg

from faults.history import HistoryWriter
from faults.proxy import TcpProxy
from queue_manager import admin
from queue_manager.db.migrate import set_identity, upgrade
from queue_manager.domain.topology import KeyRange, Shard, Topology
from queue_manager.local import fleet
from queue_manager.local.embedded import LocalServer

QUEUE = "faults"
SECRET_ALL = "faults-suite-all-queues-0001"
SECRET_VIP = "faults-suite-vip-tenants-001"
#: the lease TTL of the suite's managers (seconds): the bound of a manager fault is this plus 1 s
LEASE_TTL = 2.0
#: the receivers' reconnect back-off cap (seconds): the bound of a link fault is this plus 1 s
RECONNECT_MAX = 0.5
#: the queue's ack timeout and back-off (seconds)
ACK_TIMEOUT = 2
BACKOFF_MIN = 0.1
BACKOFF_MAX = 0.5
QUEUE_SETTINGS = {
    "partitions": 8,
    "shuffle": 2,
    "ack_timeout_seconds": ACK_TIMEOUT,
    "backoff_min_seconds": BACKOFF_MIN,
    "backoff_max_seconds": BACKOFF_MAX,
    "max_attempts": 1000,
    "retention_seconds": 3600,
}
SERVER_SETTINGS = {"max_connections": "300", "max_prepared_transactions": "20"}
NAMES = ("s0", "s1")
RANGES = ("-80", "80-")


def tenants_for(key_range: KeyRange, prefix: str, count: int) -> list[str]:
    out: list[str] = []
    i = 0
    while len(out) < count:
        name = f"{prefix}-{i}"
        if key_range.contains(name):
            out.append(name)
        i += 1
    return out


class Servers:
    """The two PostgreSQL servers and a migrated template database on each."""

    TEMPLATE = "faults_tpl"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.servers = [LocalServer(root / f"pg-{n}" / "pgdata", settings=SERVER_SETTINGS) for n in NAMES]

    def start(self) -> None:
        for server in self.servers:
            admin_dsn = server.start()
            with psycopg.connect(admin_dsn, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {self.TEMPLATE} WITH (FORCE)")
                conn.execute(f"CREATE DATABASE {self.TEMPLATE}")
            upgrade(server.dsn(self.TEMPLATE))

    def fresh(self, name: str) -> Topology:
        shards = []
        for server, shard_name, key_range in zip(self.servers, NAMES, RANGES, strict=True):
            with psycopg.connect(server.dsn(), autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
                conn.execute(f"CREATE DATABASE {name} TEMPLATE {self.TEMPLATE}")
            shards.append(Shard(shard_name, server.dsn(name), KeyRange.parse(key_range)))
        topology = Topology(tuple(shards))
        for s in topology.shards:
            set_identity(s.dsn, s, topology)
        admin.create_queue(topology, QUEUE, QUEUE_SETTINGS)
        return topology

    def drop(self, name: str) -> None:
        for server in self.servers:
            with contextlib.suppress(Exception), psycopg.connect(server.dsn(), autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def stop(self) -> None:
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.stop(mode="immediate")


class Failover:
    """A shard's server with a synchronous streaming standby, behind an address that follows the primary.

    The shard's DSN in the topology names ``address``, a TCP proxy of the harness standing for
    what production puts there (a virtual IP, a DNS name, a pooler): every client (managers,
    producers, receivers' SQL acks, the harness) connects through it, so pointing it at the
    promoted standby points them all at the new primary and the topology file does not change.

    :meth:`promote` stops the primary (``-m immediate``), promotes the standby and repoints the
    address; :meth:`rebuild` copies a fresh standby from the new primary into the old primary's
    wiped data directory (the old primary never starts as a primary again) and makes it
    synchronous, for the next round.
    """

    def __init__(self, servers: Servers, index: int) -> None:
        self.servers = servers
        self.index = index
        primary = servers.servers[index]
        # two data directories take turns: pg-s0 and pg-s0-b
        home = primary.data_dir.parent
        other = home.with_name(home.name[:-2] if home.name.endswith("-b") else f"{home.name}-b")
        self.standby = LocalServer(other / "pgdata", settings=SERVER_SETTINGS)
        self.address = TcpProxy("127.0.0.1", primary.port or 0)

    @property
    def primary(self) -> LocalServer:
        return self.servers.servers[self.index]

    async def start(self) -> None:
        await self.address.start()
        await asyncio.to_thread(self._wipe, self.standby)
        await asyncio.to_thread(self.standby.start_standby_of, self.primary)
        await asyncio.to_thread(self._synchronous, True)

    def dsn(self, dsn: str) -> str:
        return self.address.proxied(dsn)

    async def promote(self) -> None:
        """The primary stopped at once, the standby promoted and made the address's target."""
        old, new = self.primary, self.standby
        await asyncio.to_thread(old.stop, "immediate")
        await asyncio.to_thread(new.promote)
        self.servers.servers[self.index], self.standby = new, old
        # alone, the new primary commits without waiting for a standby until rebuild() gives it one
        await asyncio.to_thread(self._synchronous, False)
        self.address.retarget("127.0.0.1", new.port or 0)

    async def rebuild(self) -> None:
        await asyncio.to_thread(self._wipe, self.standby)
        await asyncio.to_thread(self.standby.start_standby_of, self.primary)
        await asyncio.to_thread(self._synchronous, True)

    def _synchronous(self, on: bool) -> None:
        """Make every COMMIT on the primary wait for the standby (``synchronous_standby_names``), and
        wait until the standby streams as synchronous; or stop waiting for one."""
        with psycopg.connect(self.primary.dsn(), autocommit=True) as conn:
            if on:
                conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
            else:
                conn.execute("ALTER SYSTEM RESET synchronous_standby_names")
            conn.execute("SELECT pg_reload_conf()")
            for _ in range(600):
                row = conn.execute(
                    "SELECT current_setting('synchronous_standby_names'), "
                    "(SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync')"
                ).fetchone()
                if row is not None and (row[0] == "*" and row[1] == 1 if on else row[0] == ""):
                    return
                time.sleep(0.05)
        raise RuntimeError(f"the standby of {self.primary.data_dir} did not become synchronous within 30 s")

    @staticmethod
    def _wipe(server: LocalServer) -> None:
        server.stop("immediate")
        shutil.rmtree(server.data_dir, ignore_errors=True)

    async def close(self) -> None:
        """The primary alone again (not synchronous), the standby stopped and its data removed."""
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self._synchronous, False)
        await asyncio.to_thread(self._wipe, self.standby)
        await self.address.close()


@dataclass
class ManagerSlot:
    """One manager of a shard: its fixed port, its two proxies, its current process."""

    shard: str
    index: int
    port: int
    db_proxy: TcpProxy
    front: TcpProxy
    topology_file: Path
    proc: fleet.ManagerProcess | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.front.port}/"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.alive() else None


@dataclass
class ReceiverSlot:
    name: str
    config: dict[str, Any]
    proc: fleet.Child | None = None


@dataclass
class Deployment:
    """One scenario's databases, managers, proxies and receivers."""

    dir: Path
    topology: Topology
    tokens_file: Path
    history: HistoryWriter
    managers: dict[str, list[ManagerSlot]] = field(default_factory=dict)
    receivers: dict[str, ReceiverSlot] = field(default_factory=dict)
    terms: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # shard -> (term, holder pid)
    #: the scenario's seed: the receivers' draws derive from it
    seed: int = 0
    #: shard s0's standby and address, in the scenarios that promote it
    failover: Failover | None = None

    def dsn(self, shard: str) -> str:
        return next(s.dsn for s in self.topology.shards if s.name == shard)

    # ------------------------------------------------------------------ managers

    async def start_managers(self) -> None:
        fleet.write_tokens(
            self.tokens_file,
            [fleet.Token("all", SECRET_ALL), fleet.Token("vip", SECRET_VIP, (QUEUE,), tuple(vip_tenants()))],
        )
        for shard in self.topology.shards:
            slots = []
            for i in range(2):
                db_proxy = TcpProxy.for_dsn(shard.dsn)
                await db_proxy.start()
                port = fleet.free_port()
                front = TcpProxy("127.0.0.1", port)
                await front.start()
                topo = Topology(
                    tuple(
                        replace(s, dsn=db_proxy.proxied(s.dsn)) if s.name == shard.name else s
                        for s in self.topology.shards
                    )
                )
                path = self.dir / f"topology-{shard.name}-{i}.toml"
                path.write_text(topo.to_toml())
                slots.append(ManagerSlot(shard.name, i, port, db_proxy, front, path))
            self.managers[shard.name] = slots
        await asyncio.gather(*(self.start_manager(slot) for slots in self.managers.values() for slot in slots))

    async def start_manager(self, slot: ManagerSlot) -> None:
        def start() -> fleet.ManagerProcess:
            return fleet.ManagerProcess(
                slot.topology_file,
                self.tokens_file,
                slot.shard,
                port=slot.port,
                log=self.dir / f"manager-{slot.shard}-{slot.index}.log",
                lease_ttl=LEASE_TTL,
                drain_timeout=2,
            )

        slot.proc = await asyncio.to_thread(start)

    def active(self, shard: str) -> ManagerSlot | None:
        holder = self.terms.get(shard, (0, None))[1]
        return next((m for m in self.managers[shard] if m.pid is not None and m.pid == holder), None)

    def standby(self, shard: str) -> ManagerSlot | None:
        active = self.active(shard)
        return next((m for m in self.managers[shard] if m is not active and m.pid is not None), None)

    async def watch_terms(self, stop: asyncio.Event) -> None:
        """Record every new term of each shard (read from its lease row every 0.1 s)."""
        while not stop.is_set():
            for shard in self.topology.shards:
                with contextlib.suppress(Exception):
                    async with await psycopg.AsyncConnection.connect(shard.dsn, connect_timeout=2) as conn:
                        cur = await conn.execute("SELECT term, holder, expires_at > clock_timestamp() FROM qm.leader")
                        row = await cur.fetchone()
                    if row is not None:
                        term, holder, live = int(row[0]), row[1], bool(row[2])
                        pid = int(str(holder).split(":")[1]) if live and holder else None
                        if self.terms.get(shard.name, (None,))[0] != term:
                            self.history.write("term", shard=shard.name, term=term)
                        self.terms[shard.name] = (term, pid)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)

    async def wait_leaders(self, timeout: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not all(self.active(s.name) is not None for s in self.topology.shards):
            if loop.time() > deadline:
                raise RuntimeError(f"no leader on every shard within {timeout} s: {self.terms}")
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------------ receivers

    def start_receiver(self, slot: ReceiverSlot) -> None:
        """Start the receiver's process, or start it again after it ended."""
        if slot.proc is None:
            argv = [sys.executable, "-m", "faults.receiver_proc", json.dumps(slot.config)]
            slot.proc = fleet.Child(argv, log=self.dir / f"{slot.name}.log")
        else:
            slot.proc.start()

    def add_receiver(self, name: str, kind: str, *, tenants: list[str], vip: bool = False, **options: Any) -> None:
        config = {
            "name": name,
            "kind": kind,
            "queue": QUEUE,
            "token": SECRET_VIP if vip else SECRET_ALL,
            "tenants": tenants,
            "urls": {shard: [m.url for m in slots] for shard, slots in self.managers.items()},
            "dsns": {s.name: s.dsn for s in self.topology.shards},
            "history": str(self.dir / f"{name}.jsonl"),
            "ack_timeout": ACK_TIMEOUT,
            "backoff_max": RECONNECT_MAX,
            "seed": self.seed * 10_007 + zlib.crc32(name.encode()),
            **options,
        }
        slot = self.receivers[name] = ReceiverSlot(name, config)
        self.start_receiver(slot)

    def signal_receiver(self, name: str, sig: signal.Signals) -> None:
        proc = self.receivers[name].proc
        if proc is not None:
            proc.signal(sig)

    # ------------------------------------------------------------------ teardown

    async def stop(self) -> None:
        receivers = [slot.proc for slot in self.receivers.values() if slot.proc is not None]
        for proc in receivers:  # all at once: they drain side by side
            proc.signal(signal.SIGCONT)
            proc.signal(signal.SIGTERM)
        for proc in receivers:
            await asyncio.to_thread(proc.stop, 10)
        for slots in self.managers.values():
            for m in slots:
                m.db_proxy.restore()
                m.front.restore()
        await asyncio.gather(
            *(asyncio.to_thread(m.proc.stop) for slots in self.managers.values() for m in slots if m.proc is not None)
        )
        for slots in self.managers.values():
            for m in slots:
                await m.db_proxy.close()
                await m.front.close()


def vip_tenants() -> list[str]:
    """Tenants that only the scoped receiver (which acks everything by SQL) may take."""
    return [t for r in RANGES for t in tenants_for(KeyRange.parse(r), "vip", 3)]


def plain_tenants(shard_range: str, count: int = 30) -> list[str]:
    return tenants_for(KeyRange.parse(shard_range), "ten", count)
