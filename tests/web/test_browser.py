"""The dashboard in a real browser: Debian's Chromium, headless, driven by Playwright, against a
dashboard served by uvicorn over two real shards, with a real manager and receiver on shard s0.

One browser, one server and one manager for the module (they cost seconds of CPU). Skipped with
the reason when Chromium or Playwright is missing (`make setup` installs both, as root). With
``QM_WEB_SCREENSHOTS=DIR`` each page is saved there as a PNG (docs/dashboard/ holds those of the
docs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queue_manager import admin
from queue_manager.db.migrate import set_identity
from queue_manager.domain.topology import KeyRange, Shard, Topology
from tests import pgtest
from tests.conftest import tenants_of
from tests.web.conftest import ADMIN, READ, serving, static_page, web_tokens

CHROMIUM = os.environ.get("QM_TEST_CHROMIUM", "/usr/bin/chromium")


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: run `make setup`"
    if not Path(CHROMIUM).is_file() and shutil.which("chromium") is None:
        return "no Chromium: as root, `make setup` installs it (apt-get install chromium)"
    return None


pytestmark = [
    pytest.mark.skipif(_missing() is not None, reason=str(_missing())),
    pytest.mark.timeout(120),
    pytest.mark.slow,
]


@contextlib.contextmanager
def _two_shards(pg_admin_dsn: str, template_db: str, prefix: str, settings: dict[str, Any]) -> Iterator[Topology]:
    """Two shards (``s0``: ``-80``, ``s1``: ``80-``) with the queue ``orders``, dropped at the end."""
    names = [f"{prefix}_{os.getpid()}_{i}" for i in range(2)]
    topo = Topology(
        (
            Shard("s0", pgtest.fresh_database(pg_admin_dsn, template_db, names[0]), KeyRange.parse("-80")),
            Shard("s1", pgtest.fresh_database(pg_admin_dsn, template_db, names[1]), KeyRange.parse("80-")),
        )
    )
    for s in topo.shards:
        set_identity(s.dsn, s, topo)
    admin.create_queue(topo, "orders", settings)
    try:
        yield topo
    finally:
        for name in names:
            pgtest.drop_database(pg_admin_dsn, name)


@pytest.fixture(scope="module")
def topology(pg_admin_dsn: str, template_db: str) -> Iterator[Topology]:
    with _two_shards(pg_admin_dsn, template_db, "qm_web", {"partitions": 4, "shuffle": 2, "max_attempts": 2}) as topo:
        yield topo


class Live:
    """A manager and a recording receiver of shard s0, in an event loop of their own thread."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.ready = threading.Event()
        self.received: list[dict[str, Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.error: BaseException | None = None
        #: the manager's URL (the dashboard reads its /health)
        self.url = ""

    async def _main(self) -> None:
        from tests.managerkit import leading_manager, running_receiver, url

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            # maintenance at a relaxed pace: these tests watch dispatch, not the sweeps
            async with leading_manager(self.dsn, purge_interval=5.0, reconcile_interval=5.0) as manager:
                self.url = url(manager)
                async with running_receiver(url(manager)) as (_, recorder):
                    recorder_events = recorder.events
                    self.ready.set()
                    while not self._stop.is_set():
                        self.received = [e.payload for e in recorder_events]
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._stop.wait(), 0.05)
        except BaseException as exc:  # surfaced by the tests
            self.error = exc
            self.ready.set()

    def start(self) -> None:
        self._thread.start()
        assert self.ready.wait(30) and self.error is None, self.error

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(40)
        assert not self._thread.is_alive(), "the manager of the browser tests did not stop"

    def wait_for(self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(list(self.received)):
            assert self.error is None, self.error
            if time.monotonic() > deadline:
                raise AssertionError(f"not delivered within {timeout}s; received {self.received[-10:]}")
            time.sleep(0.05)


@pytest.fixture(scope="module")
def live(topology: Topology) -> Iterator[Live]:
    running = Live(topology.shards[0].dsn)
    running.start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def server(topology: Topology, live: Live) -> Iterator[str]:
    from queue_manager.web.app import WebConfig

    # a reading every 2 s even without a notice (s1 has no manager to send one): the tests wait for live changes
    config = WebConfig(
        topology=topology,
        tokens=web_tokens(),
        root_path="/qm",
        db_share=0.5,
        idle_seconds=2.0,
        managers={"s0": (live.url,)},
        manager_timeout=5.0,  # a loaded machine
    )
    with serving(config) as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    executable = CHROMIUM if Path(CHROMIUM).is_file() else shutil.which("chromium")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def _page(browser: Any, server: str, secret: str) -> Any:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.set_default_timeout(15_000)
    page.goto(f"{server}/")
    assert page.url.startswith(f"{server}/login")
    page.fill("input[name=token]", secret)
    page.click("button[type=submit]")
    page.wait_for_url(f"{server}/")
    return page


def _shot(page: Any, name: str) -> None:
    directory = os.environ.get("QM_WEB_SCREENSHOTS")
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(directory) / f"{name}.png"))


def _insert(dsn: str, rows: list[tuple[str, dict[str, Any]]]) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as c:
        return [
            int(
                c.execute(
                    "INSERT INTO orders (tenant, payload) VALUES (%s, %s) RETURNING id", (t, json.dumps(p))
                ).fetchone()[0]
            )  # type: ignore[index]
            for t, p in rows
        ]


def test_every_page_loads_and_the_payload_filter_finds_events(
    topology: Topology, server: str, browser: Any, live: Live
) -> None:
    s1 = topology.shards[1]
    t1 = tenants_of(s1, 1, "browse")[0]
    # scheduled a day ahead: the manager of s0 leaves them be while the test looks at them
    with psycopg.connect(s1.dsn, autocommit=True) as c:
        for i in range(6):
            c.execute(
                "INSERT INTO orders (tenant, payload, fire_at) VALUES (%s, %s, now() + interval '1 day')",
                (t1, json.dumps({"order": {"id": 40 + i}, "kind": "browse"})),
            )
    page = _page(browser, server, ADMIN)
    assert page.locator("#queues tr[data-queue=orders]").count() == 2
    # live: a new event shows up in the overview without a reload, pushed by the server
    live_row = page.locator("#queues tr[data-queue=orders][data-shard=s1] td:nth-child(3)")
    before = int(live_row.inner_text())
    with psycopg.connect(s1.dsn, autocommit=True) as c:
        c.execute("INSERT INTO orders (tenant, payload, fire_at) VALUES (%s, '{}', now() + interval '1 day')", (t1,))
    page.wait_for_function(
        "n => Number(document.querySelector('#queues tr[data-shard=s1] td:nth-child(3)').textContent) === n",
        arg=before + 1,
    )
    # a hidden tab closes its stream, and opens it again when it shows
    assert page.get_attribute("#live", "data-stream") == "open"
    page.evaluate(
        "hidden => { Object.defineProperty(document, 'hidden', {value: hidden, configurable: true});"
        " document.dispatchEvent(new Event('visibilitychange')); }",
        True,
    )
    assert page.get_attribute("#live", "data-stream") == "closed"
    page.evaluate(
        "hidden => { Object.defineProperty(document, 'hidden', {value: hidden, configurable: true});"
        " document.dispatchEvent(new Event('visibilitychange')); }",
        False,
    )
    assert page.get_attribute("#live", "data-stream") == "open"
    assert page.locator("#shards").inner_text().count("s1") == 1
    s0_row, s1_row = page.locator("#shards tbody tr").all_inner_texts()
    assert "no live leader" not in s0_row and "no live leader" in s1_row  # a manager runs on s0 only
    # the manager of s0, read from its /health: leader, with the test's receiver and its credit
    page.wait_for_selector("#managers tr[data-manager] td.role-leader")  # live: a reading may still come
    manager = page.locator("#managers tr[data-manager]")
    assert manager.count() == 1 and "leader" in manager.inner_text()
    page.wait_for_selector("#receivers tr[data-receiver]")
    receiver = page.locator("#receivers tr[data-receiver]")
    assert receiver.count() == 1 and "orders" in receiver.inner_text()
    assert int(receiver.locator("td.credit").inner_text()) > 0
    # rates once the history spans two samples (4 s here), and each row's chart of the last hour
    page.wait_for_function(
        "() => /^[0-9.]+$/.test(document.querySelector('#queues tr[data-shard=s0] td.rate-enq').textContent)",
        timeout=30_000,
    )
    assert page.locator("#queues td.chart svg.spark").count() == 2
    _shot(page, "overview")
    page.click("text=orders >> nth=0")
    page.wait_for_url(f"{server}/queues/orders")
    assert page.locator("#partitions tbody tr").count() == 2 and page.locator("#pause").is_visible()
    assert t1 in page.locator("#tenants").inner_text()
    assert page.locator("#charts svg.spark").count() == 8
    _shot(page, "queue")
    page.click("text=Browse events")
    page.fill("input[name=payload]", "payload.order.id = 42")
    page.click("#filters button[type=submit]")
    page.wait_for_url("**payload=payload.order.id**")
    rows = page.locator("#events tbody tr[data-id]")
    assert rows.count() == 1 and "s1:" in rows.first.get_attribute("data-id")
    _shot(page, "events")
    page.fill("input[name=payload]", "payload.order.id >")
    page.click("#filters button[type=submit]")
    assert "expected = or !=" in page.locator(".error").inner_text()
    page.go_back()
    page.click("#events tbody tr[data-id] td a")
    assert '"id": 42' in page.locator("pre.payload").inner_text() and t1 in page.content()
    _shot(page, "event")
    page.click("text=Database health")
    page.wait_for_url(f"{server}/database")  # loaded: a locator's count does not wait for the page
    assert page.locator("h2").count() == 2
    _shot(page, "database")
    page.context.close()


def test_bulk_retry_of_dead_letters_is_confirmed_and_delivered(
    topology: Topology, server: str, browser: Any, live: Live
) -> None:
    s0 = topology.shards[0]
    tenant = tenants_of(s0, 1, "dead")[0]
    ids = _insert(s0.dsn, [(tenant, {"dead": i}) for i in range(5)])
    with psycopg.connect(s0.dsn, autocommit=True) as c:  # as the manager leaves them after the last attempt
        live.wait_for(lambda got: sum("dead" in p for p in got) >= 5)
        c.execute("UPDATE orders SET state = 'failed', last_error = 'handler failed' WHERE id = ANY(%s)", (ids,))
    before = sum("dead" in p for p in live.received)
    page = _page(browser, server, ADMIN)
    page.goto(f"{server}/queues/orders/events?state=failed&tenant={tenant}")
    assert page.locator("#events tbody tr[data-id]").count() == 5
    page.click("#retry-all")
    assert "5" in page.locator("#count strong").inner_text()
    _shot(page, "confirm")
    page.click("#confirm")
    page.wait_for_url("**/queues/orders?done=**")
    assert "Retry: 5 dead letters of orders changed, of 5 bound" in page.locator(".notice").inner_text()
    live.wait_for(lambda got: sum("dead" in p for p in got) >= before + 5)
    with psycopg.connect(s0.dsn) as c:
        assert c.execute("SELECT count(*) FROM orders WHERE id = ANY(%s) AND state = 'failed'", (ids,)).fetchone() == (
            0,
        )
        row = c.execute(
            "SELECT actor, action, requested, affected FROM qm.audit WHERE action = 'retry_dead'"
        ).fetchone()
    assert row == ("alice", "retry_dead", 5, 5)
    page.context.close()


def test_pause_stops_dispatch_and_resume_starts_it(topology: Topology, server: str, browser: Any, live: Live) -> None:
    s0 = topology.shards[0]
    tenant = tenants_of(s0, 1, "pause")[0]
    page = _page(browser, server, ADMIN)
    page.goto(f"{server}/queues/orders")
    page.click("#pause")
    assert "paused" in page.locator(".notice").inner_text() and page.locator("#resume").is_visible()
    (held,) = _insert(s0.dsn, [(tenant, {"held": 1})])
    time.sleep(1.5)  # a negative: nothing may arrive while paused (dispatch reacts within milliseconds)
    assert not any("held" in p for p in live.received)
    with psycopg.connect(s0.dsn) as c:
        assert c.execute("SELECT state::text FROM orders WHERE id = %s", (held,)).fetchone() == ("to_be_fired",)
    page.click("#resume")
    assert page.locator("#pause").is_visible()
    live.wait_for(lambda got: any("held" in p for p in got))
    page.context.close()


def test_a_read_only_token_finds_every_action_refused(topology: Topology, server: str, browser: Any) -> None:
    page = _page(browser, server, READ)
    assert "read-only" in page.locator("header").inner_text()
    page.goto(f"{server}/queues/orders")
    assert page.locator("#pause, #resume").count() == 0 and "Read-only token" in page.content()
    page.goto(f"{server}/queues/orders/events?state=failed")
    assert page.locator("#retry-all, #fire-all, #reschedule-all").count() == 0
    assert page.locator("input[name=sel]").count() == 0
    csrf = page.locator("input[name=csrf]").first.get_attribute("value")
    statuses = page.evaluate(
        """async ([base, csrf]) => {
            const out = {};
            for (const path of ['pause', 'resume', 'limits', 'bulk', 'bulk/confirm']) {
                const body = new URLSearchParams({csrf, do: 'retry_dead/all', confirm: '1'});
                const r = await fetch(`${base}/queues/orders/${path}`, {method: 'POST', body});
                out[path] = [r.status, await r.text()];
            }
            return out;
        }""",
        [server, csrf],
    )
    assert {k: v[0] for k, v in statuses.items()} == dict.fromkeys(statuses, 403)
    assert all("read-only" in v[1] for v in statuses.values())
    assert [r["paused"] for r in admin.list_queues(topology)["s0"]] == [False]
    page.context.close()


#: the event browser at a million rows: s0's rows of its own tenants, s1's with one tenant's events spread among them
MILLION = {"s0": 600_000, "s1": 400_000}
#: every this many rows of s1 is an event of the browsed tenant (100 of them)
SPREAD = 4_000


@pytest.fixture(scope="module")
def million(pg_admin_dsn: str, template_db: str) -> Iterator[tuple[Topology, str, list[int]]]:
    """Two shards holding a million events between them, and a tenant of s1 with 100 events spread
    evenly over s1's 400 000 (s0's 600 000 are other tenants'), all newer on s0 as on s1 as time goes:
    the rows are inserted by generate_series with the queue's triggers off (session_replication_role
    = replica: these rows are only browsed, no manager runs on them), about 3 s instead of a minute.
    Returns the topology, the tenant and its event ids, newest first."""
    with _two_shards(pg_admin_dsn, template_db, "qm_webm", {"partitions": 4, "shuffle": 2}) as topo:
        yield (topo, *_fill_a_million(topo))


def _fill_a_million(topo: Topology) -> tuple[str, list[int]]:
    tenant = tenants_of(topo.shards[1], 1, "needle")[0]
    for shard in topo.shards:
        others = tenants_of(shard, 50, "hay")
        rows = MILLION[shard.name]
        with psycopg.connect(shard.dsn, autocommit=True) as c:
            c.execute("SET session_replication_role = replica")
            c.execute(
                "INSERT INTO orders (tenant, partition, payload, fire_at, created_at) "
                "SELECT CASE WHEN n.needle THEN %(needle)s::text ELSE (%(others)s::text[])[1 + i %% 50] END, "
                "       i %% 4, jsonb_build_object('i', i, 'kind', CASE WHEN n.needle THEN 'rare' ELSE 'common' END), "
                "       now() + interval '1 day', now() - interval '1 hour' + i * (interval '1 second' / %(rate)s) "
                "  FROM generate_series(1, %(rows)s) i "
                " CROSS JOIN LATERAL (SELECT %(needle)s::text IS NOT NULL AND i %% %(spread)s = 0 AS needle) n",
                {
                    "needle": tenant if shard.name == "s1" else None,
                    "spread": SPREAD,
                    "others": others,
                    "rows": rows,
                    "rate": rows // 1000,  # each shard's rows span the same 1000 s
                },
            )
            c.execute("ANALYZE orders")
    with psycopg.connect(topo.shards[1].dsn) as c:
        ids = [int(r[0]) for r in c.execute("SELECT id FROM orders WHERE tenant = %s ORDER BY id DESC", (tenant,))]
    assert len(ids) == MILLION["s1"] // SPREAD
    return tenant, ids


def test_a_tenants_events_at_a_million_rows_are_on_the_first_page_and_paged_once_each(
    million: tuple[Topology, str, list[int]], browser: Any
) -> None:
    """A tenant filter reads the tenant's own shard only: its newest events are on the first page,
    though s0's newest rows are other tenants' (a look there would find nothing); "older" pages
    through all of them, each once, newest first. Without a tenant filter, a payload filter that
    only s1's rows match still shows them on the first page: s0's empty look holds nothing back."""
    from urllib.parse import quote

    from queue_manager.web.app import WebConfig

    topo, tenant, ids = million
    with serving(WebConfig(topology=topo, tokens=web_tokens())) as url:
        page = _page(browser, url, READ)
        started = time.monotonic()
        page.goto(f"{url}/queues/orders/events?tenant={quote(tenant)}")
        first = page.locator("#events tbody tr[data-id]").evaluate_all("rows => rows.map(r => r.dataset.id)")
        per_look = 20_000 // SPREAD  # the tenant's events among s1's newest 20 000 rows
        assert first == [f"s1:{i}" for i in ids[:per_look]]
        seen = list(first)
        pages = 1
        while page.locator("#older").count():
            page.click("#older")
            page.wait_for_load_state()
            seen += page.locator("#events tbody tr[data-id]").evaluate_all("rows => rows.map(r => r.dataset.id)")
            pages += 1
            assert pages <= MILLION["s1"] // 20_000 + 2, "paging does not end"
        assert seen == [f"s1:{i}" for i in ids], "every event of the tenant once, newest first"
        paged = time.monotonic() - started

        page.goto(f"{url}/queues/orders/events?{'payload=' + quote('payload.kind = rare')}")
        rows = page.locator("#events tbody tr[data-id]").evaluate_all("rows => rows.map(r => r.dataset.id)")
        assert rows == [f"s1:{i}" for i in ids[:per_look]], "s0's empty look held s1's matches back"
        page.context.close()
    print(f"paged {len(seen)} events of a tenant over {pages} pages of a million rows in {paged:.1f} s")


def test_a_page_of_another_origin_cannot_frame_the_dashboard(server: str, browser: Any) -> None:
    """Logged in, the operator opens a page of another port of the same host that frames the
    dashboard's queue page (its pause button) and its login page: Chromium refuses both frames
    (Content-Security-Policy frame-ancestors 'none'), and the dashboard's own pages still work."""
    page = _page(browser, server, ADMIN)
    refused: list[str] = []
    page.on("console", lambda m: refused.append(m.text) if "frame-ancestors" in m.text else None)
    frames = f'<iframe id="a" src="{server}/queues/orders"></iframe><iframe id="b" src="{server}/login"></iframe>'
    with static_page(f"<!doctype html><title>elsewhere</title>{frames}") as elsewhere:
        page.goto(elsewhere)
        page.wait_for_function("() => document.readyState === 'complete'")
        children = [f for f in page.frames if f != page.main_frame]
        assert len(children) == 2
        deadline = time.monotonic() + 10
        while len(refused) < 2 and time.monotonic() < deadline:
            page.wait_for_timeout(50)  # the console messages arrive after the load event
        assert len(refused) == 2, refused
        for frame in children:
            assert not frame.url.startswith(server), frame.url  # an error page, not the dashboard
            assert frame.locator("#pause, input[name=token]").count() == 0
    page.goto(f"{server}/queues/orders")  # the dashboard itself, with its script, under the same policy
    assert page.locator("#pause").is_visible()
    page.wait_for_selector("#live[data-stream=open]")
    page.context.close()
