"""A TCP proxy that can cut, stall and slow a link: the network faults of the suite and of the tests.

``TcpProxy`` listens on a localhost port and forwards every connection to the target.

* ``cut()`` drops every open connection and refuses new ones (a partition the client notices at
  once, as a reset); ``restore()`` lets connections through again;
* ``stall()`` keeps every connection open and forwards nothing, in either direction, until
  ``restore()`` (a silent partition: the bytes wait, as TCP retransmissions would, and flow again
  when it heals); new connections are accepted but stall too;
* ``slow(delay, jitter)`` delays each chunk by ``delay`` plus up to ``jitter`` seconds, in order (a
  slow link); ``slow(0, 0)`` ends it;
* ``lossy(loss, reset)`` loses packets as TCP shows it to the application: TCP cannot drop bytes
  inside a stream without breaking it, so a lost segment costs a retransmission delay. Each chunk
  is lost with probability ``loss`` and then held back for Linux's minimum retransmission timeout
  (200 ms), its retransmission lost again with the same probability (the timeout doubling: 400 ms,
  800 ms, ...); the chunks behind it wait (in order, head-of-line). With probability ``reset`` a
  chunk instead resets the connection (both sides see it broken), as a link bad enough for TCP to
  give up does; ``lossy(0, 0)`` ends it;
* ``retarget(host, port)`` points the proxy at another server and resets every open connection
  (what a virtual IP, a DNS name or a pooler does when a replica is promoted).
"""

from __future__ import annotations

import asyncio
import contextlib
import random

from psycopg.conninfo import conninfo_to_dict, make_conninfo

#: Linux's minimum TCP retransmission timeout (seconds): the first wait of a lost segment
RTO_MIN = 0.2


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, *, port: int = 0, rng: random.Random | None = None) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = port
        self.blocked = False
        self.delay = 0.0
        self.jitter = 0.0
        self.loss = 0.0
        self.reset = 0.0
        #: chunks forwarded, lost (held for retransmission) and connections reset while lossy
        self.counts = {"chunks": 0, "lost": 0, "resets": 0}
        #: when set, (event loop time, connection number, first bytes) of every chunk a client sent, as it arrived
        self.sends: list[tuple[float, int, bytes]] | None = None
        self._accepted = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._rng = rng or random.Random()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @classmethod
    def for_dsn(cls, dsn: str) -> TcpProxy:
        params = conninfo_to_dict(dsn)
        return cls(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))

    def proxied(self, dsn: str) -> str:
        """``dsn`` with its host and port replaced by the proxy's."""
        return make_conninfo(dsn, host="127.0.0.1", port=str(self.port))

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.blocked:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        self._accepted += 1
        number = self._accepted

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    if self.sends is not None and src is reader:
                        self.sends.append((asyncio.get_running_loop().time(), number, data[:200]))
                    await self._flowing.wait()
                    if self.delay or self.jitter:
                        await asyncio.sleep(self.delay + self._rng.random() * self.jitter)
                        await self._flowing.wait()
                    if self.loss or self.reset:
                        self.counts["chunks"] += 1
                        if self._rng.random() < self.reset:
                            self.counts["resets"] += 1
                            writer.transport.abort()
                            up_writer.transport.abort()
                            break
                        if held := self.retransmission_delay():
                            self.counts["lost"] += 1
                            await asyncio.sleep(held)
                            await self._flowing.wait()
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.discard(writer)
        self._writers.discard(up_writer)

    def cut(self) -> None:
        self.blocked = True
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    def stall(self) -> None:
        self._flowing.clear()

    def slow(self, delay: float, jitter: float = 0.0) -> None:
        self.delay, self.jitter = delay, jitter

    def lossy(self, loss: float, reset: float = 0.0) -> None:
        if not (0 <= loss < 1 and 0 <= reset < 1):
            raise ValueError(f"loss and reset are probabilities below 1, not {loss} and {reset}")
        self.loss, self.reset = loss, reset

    def retransmission_delay(self) -> float:
        """How long the next chunk is held back: 0, or the sum of the doubling retransmission
        timeouts of each time it (then its retransmission) was lost."""
        held, rto = 0.0, RTO_MIN
        while self._rng.random() < self.loss:
            held += rto
            rto *= 2
        return held

    def retarget(self, host: str, port: int) -> None:
        self.target_host, self.target_port = host, port
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    def restore(self) -> None:
        self.blocked = False
        self.delay = self.jitter = self.loss = self.reset = 0.0
        self._flowing.set()

    async def close(self) -> None:
        self.restore()
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
