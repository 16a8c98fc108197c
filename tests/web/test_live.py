"""The overview's live reading against two real shards: its counts come from the load counters
and bounded reads (not a scan), a notification on qm_wake brings a reading within a second (and
no more than one a second), the listener comes back after its connection is killed, the pools'
connections carry the statement timeout, managers that cannot be reached are shown as such, and
the exact counts are there on demand."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import psycopg
import pytest
from starlette.testclient import TestClient

from queue_manager.domain.topology import Topology
from queue_manager.web import shards
from queue_manager.web.monitor import Monitor
from tests.conftest import tenants_of
from tests.web.conftest import READ, static_page
from tests.web.test_http import insert

HTML = {"accept": "text/html", "authorization": f"Bearer {READ}"}


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds it took for ``predicate`` to hold; fails after ``timeout``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.05)
    return time.monotonic() - started


def live_cell(client: TestClient, shard: str) -> str:
    page = client.get("/partials/overview", headers=HTML).text
    row = page.split(f'<tr data-queue="orders" data-shard="{shard}">', 1)[1].split("</tr>", 1)[0]
    return row.split('<td class="n live">', 1)[1].split("<", 1)[0]


def monitor_of(client: TestClient) -> Monitor:
    monitor: Monitor = client.app.state.monitor  # type: ignore[attr-defined]
    return monitor


def settle(monitor: Monitor, quiet: float = 1.5, timeout: float = 15.0) -> None:
    """Wait until both listeners have connected and no reading has come for ``quiet`` seconds."""
    wait_until(lambda: monitor.notices >= 2, timeout, "both listeners connected")
    last = (monitor.version, time.monotonic())

    def quiet_now() -> bool:
        nonlocal last
        if monitor.version != last[0]:
            last = (monitor.version, time.monotonic())
        return time.monotonic() - last[1] >= quiet

    wait_until(quiet_now, timeout, "readings to settle")


def test_live_events_come_from_the_load_counters_not_a_count(
    app_for: Callable[..., TestClient], topology: Topology
) -> None:
    client = app_for(idle_seconds=1.0)
    s1 = topology.shards[1]
    insert(topology, [(t, {"n": i}) for i, t in enumerate(tenants_of(s1, 3))])
    wait_until(lambda: live_cell(client, "s1") == "3", 10, "three live events on s1")
    # a row removed behind the counters' back (no qm.add_done): the counters still say 3, so the
    # overview does (no scan corrects it) until a reconciliation re-anchors them on the table
    with psycopg.connect(s1.dsn, autocommit=True) as c:
        c.execute("DELETE FROM orders WHERE id = (SELECT min(id) FROM orders)")
    time.sleep(2.5)  # at least two readings
    assert live_cell(client, "s1") == "3"
    with psycopg.connect(s1.dsn, autocommit=True) as c:
        c.execute("SELECT qm.reconcile_load('orders')")
    wait_until(lambda: live_cell(client, "s1") == "2", 10, "the reconciled count")


def test_in_hand_dead_letters_and_due_are_counted_up_to_their_caps(
    app_for: Callable[..., TestClient], topology: Topology
) -> None:
    from queue_manager.web.shards import Limits

    client = app_for(idle_seconds=1.0, limits=Limits(count_cap=2, due_cap=4))
    s0 = topology.shards[0]
    insert(topology, [(t, {"n": i}) for i, t in enumerate(tenants_of(s0, 6))])
    with psycopg.connect(s0.dsn, autocommit=True) as c:
        c.execute(
            "UPDATE orders SET state = 'failed', attempts = 2 WHERE id IN (SELECT id FROM orders ORDER BY id LIMIT 3)"
        )
        c.execute("ANALYZE orders")
    monitor = monitor_of(client)
    monitor.get()
    version = monitor.version
    wait_until(lambda: monitor.version > version, 10, "a new reading")
    q = next(q for s in monitor.get()["shards"] if s["shard"] == "s0" for q in s["queues"])
    assert (q["failed"], q["failed_capped"]) == (2, True)  # 3 dead letters, counted up to 2
    assert q["due_now"] == 3 and q["oldest_due_age_seconds"] is not None
    page = client.get("/", headers=HTML).text
    assert "2+</a>" in page  # a capped count says so
    warnings = page.split('id="warnings"', 1)[1].split("</table>", 1)[0]
    assert "<td>s0</td>" in warnings and "<td>s1</td>" in warnings  # the health page's warnings, per shard


def test_a_notice_on_qm_wake_brings_a_reading_within_a_second_and_at_most_one_a_second(
    app_for: Callable[..., TestClient], topology: Topology
) -> None:
    client = app_for(idle_seconds=60.0)  # no reading but the ones notices bring
    monitor = monitor_of(client)
    assert client.get("/", headers=HTML).status_code == 200
    settle(monitor, quiet=2.0)
    s1 = topology.shards[1]
    before = (monitor.version, monitor.notices)
    with psycopg.connect(s1.dsn, autocommit=True) as c:  # due later, and no manager waits: no notification
        c.execute(
            "INSERT INTO orders (tenant, fire_at) VALUES (%s, now() + interval '1 hour')", (tenants_of(s1, 1)[0],)
        )
    time.sleep(1.2)
    assert live_cell(client, "s1") == "0", (before, monitor.version, monitor.notices)
    version = monitor.version
    with psycopg.connect(s1.dsn, autocommit=True) as c:
        c.execute("NOTIFY qm_wake, 'orders'")
    took = wait_until(lambda: monitor.version > version, 5, "a reading after the notice")
    assert live_cell(client, "s1") == "1", took
    # a burst of notices: readings at most once a second
    settle(monitor, quiet=1.2)
    version = monitor.version
    started = time.monotonic()
    with psycopg.connect(s1.dsn, autocommit=True) as c:
        for _ in range(30):
            c.execute("NOTIFY qm_wake, 'orders'")
            time.sleep(0.05)
    elapsed = time.monotonic() - started
    assert monitor.version - version <= elapsed + 2, (monitor.version - version, elapsed)


def test_the_listener_comes_back_after_its_connection_is_killed(
    app_for: Callable[..., TestClient], topology: Topology
) -> None:
    client = app_for(idle_seconds=60.0)
    monitor = monitor_of(client)
    client.get("/", headers=HTML)
    settle(monitor)
    s1 = topology.shards[1]
    with psycopg.connect(s1.dsn, autocommit=True) as c:
        killed = c.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = 'qm-web-listen'"
        ).fetchone()
    assert killed == (1,)
    # the listener reconnects (2 s later) and hears again; its reconnection brings a reading itself
    insert(topology, [(tenants_of(s1, 1)[0], {"n": 1})])
    wait_until(lambda: live_cell(client, "s1") == "1", 15, "a reading after the listener came back")
    settle(monitor)
    with psycopg.connect(s1.dsn, autocommit=True) as c:  # due later: only the NOTIFY announces it
        c.execute(
            "INSERT INTO orders (tenant, fire_at) VALUES (%s, now() + interval '1 hour')", (tenants_of(s1, 2)[1],)
        )
        c.execute("NOTIFY qm_wake, 'orders'")
    wait_until(lambda: live_cell(client, "s1") == "2", 5, "a notice heard on the new connection")


def test_pooled_connections_are_reused_and_carry_the_statement_timeout(topology: Topology) -> None:
    limits = shards.Limits(statement_timeout_ms=1234)
    pools = shards.Shards(shards.guarded(topology, limits), limits)
    try:
        pids = set()
        for _ in range(3):
            with pools.connect(topology.shards[0]) as conn:
                row = conn.execute(
                    "SELECT current_setting('statement_timeout') AS t, pg_backend_pid() AS pid"
                ).fetchone()
                assert row is not None and row["t"] == "1234ms"
                pids.add(row["pid"])
            time.sleep(0.2)  # the pool's first connection may still be on its way at the first call
        assert len(pids) <= 2, pids  # the pool's connection is reused
        with pools.connect(topology.shards[0]) as conn, pytest.raises(psycopg.errors.QueryCanceled):
            conn.execute("SELECT pg_sleep(3)")
    finally:
        pools.close()
    with pools.connect(topology.shards[0]) as conn:  # closed: a connection of its own
        assert conn.execute("SELECT 1 AS one").fetchone() == {"one": 1}


@pytest.fixture
def not_a_manager() -> Iterator[str]:
    with static_page("<html>a web server, not a manager</html>") as url:
        yield url


def test_managers_that_cannot_be_read_are_shown_as_such_never_a_500(
    app_for: Callable[..., TestClient], not_a_manager: str
) -> None:
    client = app_for(managers={"s0": ("ws://127.0.0.1:1/", not_a_manager)})
    page = client.get("/", headers=HTML)
    assert page.status_code == 200
    managers = page.text.split('id="managers"', 1)[1].split("</table>", 1)[0]
    assert "ws://127.0.0.1:1/" in managers and "unreachable" in managers
    assert not_a_manager in managers and "did not answer a manager" in managers


def test_managers_of_unknown_shards_or_bad_urls_are_refused(topology: Topology) -> None:
    from queue_manager.errors import ConfigurationError
    from queue_manager.web.app import WebConfig
    from queue_manager.web.managers import parse_managers
    from tests.web.conftest import web_tokens

    with pytest.raises(ConfigurationError, match="no shard named 's9'"):
        WebConfig(topology=topology, tokens=web_tokens(), managers={"s9": ("ws://h:1/",)})
    with pytest.raises(ConfigurationError, match="use ws://host:port/"):
        WebConfig(topology=topology, tokens=web_tokens(), managers={"s0": ("ftp://h/",)})
    assert parse_managers(["s0=ws://a:1/", "s0=ws://b:1/", "s1=ws://c:1/"], ("s0", "s1")) == {
        "s0": ("ws://a:1/", "ws://b:1/"),
        "s1": ("ws://c:1/",),
    }
    with pytest.raises(ConfigurationError, match="name its shard"):
        parse_managers(["ws://a:1/"], ("s0", "s1"))


def test_the_queue_page_counts_exactly_on_demand_and_draws_its_charts(
    app_for: Callable[..., TestClient], topology: Topology
) -> None:
    client = app_for(idle_seconds=1.0)
    insert(topology, [(t, {"n": i}) for i, t in enumerate(tenants_of(topology.shards[0], 4))])
    page = client.get("/queues/orders", headers=HTML).text
    assert 'id="count-exactly"' in page and 'id="exact"' not in page
    assert page.count('<svg class="spark"') == 8  # four charts per shard
    exact = client.get("/queues/orders?exact=1", headers=HTML).text
    table = exact.split('id="exact"', 1)[1].split("</table>", 1)[0]
    assert '<td>s0</td><td class="n">4</td>' in table and '<td>s1</td><td class="n">0</td>' in table
    # rates appear once the history spans two samples (2 s here)
    monitor = monitor_of(client)
    wait_until(lambda: monitor.history.rates("s0", "orders") is not None, 20, "rates")
    assert (
        "…" not in client.get("/partials/overview", headers=HTML).text.split('data-shard="s0"', 1)[1].split("</tr>")[0]
    )


def test_the_queue_page_streams_its_live_part_too(app_for: Callable[..., TestClient], topology: Topology) -> None:
    client = app_for(stream_seconds=0)  # one event, then the stream ends
    insert(topology, [(tenants_of(topology.shards[0], 1)[0], {"n": 1})])
    r = client.get("/live/queues/orders", headers={"authorization": f"Bearer {READ}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    html = "\n".join(line[len("data: ") :] for line in r.text.split("\n") if line.startswith("data: "))
    assert '<tr data-shard="s0">' in html and '<tr data-shard="s1">' in html
    assert html.split('<tr data-shard="s0">', 1)[1].split('<td class="n live">', 1)[1].startswith("1<")
    page = client.get("/queues/orders", headers=HTML).text
    assert 'data-live="/live/queues/orders"' in page and "live.js" in page
    assert client.get("/live/queues/Bad-Name", headers={"authorization": f"Bearer {READ}"}).status_code == 400
