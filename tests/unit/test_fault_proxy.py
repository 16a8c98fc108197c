"""The fault suite's lossy link (faults/proxy.py): loss shows as retransmission delays of 200 ms
doubling, the stream arrives whole and in order, and a reset breaks the connection."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import pytest

from faults.proxy import RTO_MIN, TcpProxy


def test_a_lost_chunk_waits_the_doubling_retransmission_timeouts() -> None:
    proxy = TcpProxy("127.0.0.1", 1, rng=random.Random(3))
    proxy.lossy(0.5)
    waits = [proxy.retransmission_delay() for _ in range(2000)]
    allowed = {round(RTO_MIN * (2**n - 1), 6) for n in range(30)}
    assert {round(w, 6) for w in waits} <= allowed
    assert 0.4 < sum(w == 0 for w in waits) / len(waits) < 0.6  # half the chunks pass at once
    assert 0.2 < sum(w == pytest.approx(RTO_MIN) for w in waits) / len(waits) < 0.3  # a quarter lost once
    proxy.restore()
    assert proxy.retransmission_delay() == 0.0
    with pytest.raises(ValueError, match="probabilities"):
        proxy.lossy(1.0)


#: a seed whose draws lose a few chunks and keep the test under a second
SEED = 2


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def test_a_lossy_link_delivers_the_stream_in_order_and_a_reset_breaks_it() -> None:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    proxy = TcpProxy("127.0.0.1", server.sockets[0].getsockname()[1], rng=random.Random(SEED))
    await proxy.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        proxy.lossy(0.3)
        started = time.monotonic()
        for i in range(6):
            line = f"{i:04d}\n".encode()
            writer.write(line)
            await writer.drain()
            assert await asyncio.wait_for(reader.readexactly(len(line)), 10) == line
        assert proxy.counts["lost"] > 0 and proxy.counts["resets"] == 0
        assert time.monotonic() - started >= RTO_MIN * proxy.counts["lost"] / 2  # each loss held (either way)
        proxy.lossy(0.0, reset=0.99)
        writer.write(b"x\n")
        await writer.drain()
        with contextlib.suppress(ConnectionResetError):  # reset: the connection is gone
            assert await asyncio.wait_for(reader.read(10), 5) == b""
        assert proxy.counts["resets"] == 1
        writer.close()
    finally:
        await proxy.close()
        server.close()
        await server.wait_closed()
