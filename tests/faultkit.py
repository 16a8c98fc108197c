"""Fault injection for tests: a TCP proxy that can cut a client off its PostgreSQL server.

``TcpProxy`` listens on a free localhost port and forwards every connection to the target.
``cut()`` drops every open connection and refuses new ones (as a network partition would look to
the client); ``restore()`` lets connections through again.
"""

from __future__ import annotations

import asyncio
import contextlib

from psycopg.conninfo import conninfo_to_dict, make_conninfo


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = 0
        self.blocked = False
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
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
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

    def restore(self) -> None:
        self.blocked = False

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
