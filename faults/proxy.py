"""A TCP proxy that can cut, stall and slow a link: the network faults of the suite and of the tests.

``TcpProxy`` listens on a localhost port and forwards every connection to the target.

* ``cut()`` drops every open connection and refuses new ones (a partition the client notices at
  once, as a reset); ``restore()`` lets connections through again;
* ``stall()`` keeps every connection open and forwards nothing, in either direction, until
  ``restore()`` (a silent partition: the bytes wait, as TCP retransmissions would, and flow again
  when it heals); new connections are accepted but stall too;
* ``slow(delay, jitter)`` delays each chunk by ``delay`` plus up to ``jitter`` seconds, in order (a
  slow, lossy link: a lost segment costs TCP a retransmission delay, not a hole in the stream);
  ``slow(0, 0)`` ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

from psycopg.conninfo import conninfo_to_dict, make_conninfo


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, *, port: int = 0, rng: random.Random | None = None) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = port
        self.blocked = False
        self.delay = 0.0
        self.jitter = 0.0
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

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    await self._flowing.wait()
                    if self.delay or self.jitter:
                        await asyncio.sleep(self.delay + self._rng.random() * self.jitter)
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

    def restore(self) -> None:
        self.blocked = False
        self.delay = self.jitter = 0.0
        self._flowing.set()

    async def close(self) -> None:
        self.restore()
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
