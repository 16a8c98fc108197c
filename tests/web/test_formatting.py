"""How the pages write numbers (issue 38): durations in units, sizes in kB/MB, booleans as words,
pickup delays in milliseconds below a second; pure, then on the real pages."""

from __future__ import annotations

import json

import psycopg
import pytest
from starlette.testclient import TestClient

from queue_manager.domain.topology import Topology
from queue_manager.web.formatting import duration, setting, size
from tests.conftest import tenants_of
from tests.web.conftest import ADMIN, READ, login

HTML = {"accept": "text/html"}


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "-"),
        (0.0004, "0.4 ms"),
        (0.0032, "3.2 ms"),
        (0.25, "250 ms"),
        (0.9996, "1 s"),
        (1.5, "1.5 s"),
        (30, "30 s"),
        (90, "1.5 min"),
        (7200, "2 h"),
        (86400, "1 day"),
        (604800, "7 days"),
        (2592000, "30 days"),
        (315576000, "10 years"),
    ],
)
def test_durations_read_in_their_unit(seconds: float | None, text: str) -> None:
    assert duration(seconds) == text


@pytest.mark.parametrize(
    ("n", "text"), [(None, "-"), (0, "0 B"), (512, "512 B"), (65536, "64 kB"), (1572864, "1.5 MB"), (3 << 30, "3 GB")]
)
def test_sizes_read_as_postgresql_writes_them(n: int | None, text: str) -> None:
    assert size(n) == text


def test_settings_read_by_their_kind() -> None:
    assert setting("paused", False) == "no" and setting("paused", True) == "yes"
    assert setting("retention_seconds", 604800.0) == "7 days" and setting("ack_timeout_seconds", 0.25) == "250 ms"
    assert setting("payload_limit_bytes", 65536) == "64 kB" and setting("max_qps", None) == "none"
    assert setting("max_qps", 12.5) == "12.5" and setting("partitions", 4) == "4"


def test_the_pages_write_durations_sizes_booleans_and_pickup_delays_in_their_units(
    client: TestClient, topology: Topology
) -> None:
    s0 = topology.shards[0]
    tenant = tenants_of(s0, 1)[0]
    with psycopg.connect(s0.dsn, autocommit=True) as c:  # acked events picked up 12 ms after they were due
        for i in range(3):
            c.execute("INSERT INTO orders (tenant, payload) VALUES (%s, %s)", (tenant, json.dumps({"n": i})))
        c.execute(
            "UPDATE orders SET state = 'acked', attempts = 1, fired_at = fire_at + interval '12 ms', acked_at = now()"
        )
    for secret in (READ, ADMIN):
        login(client, secret)
        page = client.get("/queues/orders", headers=HTML).text
        settings = page.split('id="settings"', 1)[1].split("</table>", 1)[0]
        for key, text in (
            ("retention_seconds", "7 days"),
            ("failed_retention_seconds", "30 days"),
            ("max_delay_seconds", "10 years"),
            ("ack_timeout_seconds", "30 s"),
            ("payload_limit_bytes", "64 kB"),
            ("paused", "no"),
        ):
            row = settings.split(f"<th>{key}</th>", 1)[1].split("</tr>", 1)[0]
            assert f'<td class="value">{text}</td>' in row, (secret, key, row)
        assert "12 ms / 12 ms" in page, "the pickup delay below a second, in ms"
    overview = client.get("/", headers=HTML).text
    assert "12 ms / 12 ms" in overview
    database = client.get("/database", headers=HTML).text
    assert " kB</td>" in database and "table bytes" not in database
