"""The dashboard over HTTP (Starlette's TestClient) against two real shards: the auth and CSRF
matrix, bad input (a clear 4xx, never a 500), the event browser's filters and keyset paging, and
the bulk retry of dead letters with its audit rows."""

from __future__ import annotations

import html
import json
import re
import uuid
from collections.abc import Callable

import psycopg
import pytest
from starlette.testclient import TestClient

from queue_manager import admin
from queue_manager.domain.topology import Topology
from queue_manager.web.shards import Limits
from tests.conftest import tenants_of
from tests.web.conftest import ADMIN, READ, csrf_of, login

HTML = {"accept": "text/html"}


def insert(topology: Topology, rows: list[tuple[str, dict[str, object]]]) -> None:
    for tenant, payload in rows:
        with psycopg.connect(topology.shard_for(tenant).dsn, autocommit=True) as c:
            c.execute("INSERT INTO orders (tenant, payload) VALUES (%s, %s)", (tenant, json.dumps(payload)))


def kill(topology: Topology, where: str = "true") -> None:
    """Dead-letter events directly (as the manager does after the last attempt)."""
    for s in topology.shards:
        with psycopg.connect(s.dsn, autocommit=True) as c:
            c.execute(f"UPDATE orders SET state = 'failed', attempts = 2, last_error = 'boom' WHERE {where}")


def paused(topology: Topology) -> list[bool]:
    return [r["paused"] for rows in admin.list_queues(topology).values() for r in rows if r["name"] == "orders"]


def registry(topology: Topology, key: str) -> list[object]:
    return [r[key] for rows in admin.list_queues(topology).values() for r in rows if r["name"] == "orders"]


def ids_on(html: str) -> list[str]:
    return re.findall(r'<tr data-id="([^"]+)"', html)


def confirm_form(preview: str) -> dict[str, str]:
    """The hidden fields of a confirmation page's form (what confirming posts)."""
    return {
        k: html.unescape(v) for k, v in re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', preview)
    }


def notice(client: TestClient, r: object) -> str:
    """The notice of the page an action's 303 leads to (the queue page, telling it from the audit)."""
    assert r.status_code == 303, r.text  # type: ignore[attr-defined]
    location = r.headers["location"]  # type: ignore[attr-defined]
    assert "notice" not in location and "done=" in location, location
    page = client.get(location, headers=HTML).text
    found = re.search(r'<p class="notice" role="status"[^>]*>([^<]*)</p>', page)
    assert found, page[-600:]
    return html.unescape(found.group(1))


# ------------------------------------------------------------------------------ access


def test_health_needs_no_login_and_names_each_shard(client: TestClient) -> None:
    r = client.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "shards": {"s0": "ok", "s1": "ok"}}


def test_pages_need_a_login(client: TestClient) -> None:
    r = client.get("/queues/orders", headers=HTML)
    assert r.status_code == 303 and r.headers["location"] == "/login?next=%2Fqueues%2Forders"
    r = client.get("/queues/orders")
    assert r.status_code == 401 and "log in first" in r.text
    r = client.post("/queues/orders/pause")
    assert r.status_code == 401
    r = client.post("/login", data={"token": "not-a-known-token!!", "next": "/"})
    assert r.status_code == 401 and "unknown token" in r.text
    client.cookies.set("qm_session", "forged.value.here")
    assert client.get("/").status_code == 401


def test_login_never_redirects_to_another_site(client: TestClient) -> None:
    r = client.post("/login", data={"token": READ, "next": "//evil.example/"})
    assert r.status_code == 303 and r.headers["location"] == "/"
    r = client.post("/login", data={"token": READ, "next": "https://evil.example/"})
    assert r.headers["location"] == "/"


def test_read_only_token_sees_every_page_and_every_action_refused(client: TestClient, topology: Topology) -> None:
    insert(topology, [(tenants_of(topology.shards[0], 1)[0], {"n": 1})])
    kill(topology)
    before = registry(topology, "max_attempts")
    csrf = login(client, READ)
    for path in ("/", "/partials/overview", "/queues/orders", "/queues/orders/events", "/database", "/audit"):
        page = client.get(path, headers=HTML)
        assert page.status_code == 200, path
        assert "Set override" not in page.text and "Save settings" not in page.text
        assert "Pause dispatch" not in page.text and "retry-all" not in page.text and "cancel-all" not in page.text
    for path, form in (
        ("/queues/orders/pause", {}),
        ("/queues/orders/resume", {}),
        ("/queues/orders/limits", {"max_qps": "5"}),
        ("/queues/orders/settings", {"max_attempts": "3"}),
        ("/queues/orders/tenants", {"tenant": "acme", "weight": "2"}),
        ("/queues/orders/tenants/unset", {"tenant": "acme"}),
        ("/queues/orders/bulk", {"do": "retry_dead/all"}),
        ("/queues/orders/bulk/confirm", {"do": "retry_dead/all", "confirm": "1"}),
        ("/queues/orders/bulk/confirm", {"do": "fire_now/all", "confirm": "1"}),
        ("/queues/orders/bulk", {"do": "cancel/all"}),
        ("/queues/orders/bulk/confirm", {"do": "cancel/all", "confirm": "1"}),
    ):
        r = client.post(path, data={"csrf": csrf, **form})
        assert r.status_code == 403 and "read-only" in r.text, path
    assert paused(topology) == [False, False]
    assert admin.list_tenants(topology, "orders") == []
    assert registry(topology, "max_attempts") == before
    assert admin.status(topology)["shards"][0]["queues"][0]["counts"]["failed"] == 1


def test_actions_need_the_sessions_csrf_token_and_the_same_origin(client: TestClient, topology: Topology) -> None:
    csrf = login(client, ADMIN)
    assert client.post("/queues/orders/pause").status_code == 403
    r = client.post("/queues/orders/pause", data={"csrf": "stale"})
    assert r.status_code == 403 and "CSRF" in r.text
    r = client.post("/queues/orders/pause", data={"csrf": csrf}, headers={"sec-fetch-site": "cross-site"})
    assert r.status_code == 403 and "cross-site" in r.text
    r = client.post("/queues/orders/pause", data={"csrf": csrf}, headers={"origin": "https://evil.example"})
    assert r.status_code == 403 and "cross-origin" in r.text
    assert paused(topology) == [False, False]

    r = client.post("/queues/orders/pause", data={"csrf": csrf}, headers={"origin": "http://testserver"})
    assert r.status_code == 303 and paused(topology) == [True, True]
    r = client.post("/queues/orders/resume", headers={"x-csrf-token": csrf, "sec-fetch-site": "same-origin"})
    assert r.status_code == 303 and paused(topology) == [False, False]
    audit = client.get("/audit", headers=HTML).text
    assert "pause" in audit and "resume" in audit and "alice" in audit


def test_bearer_tokens_act_without_a_session(client: TestClient, topology: Topology) -> None:
    r = client.post("/queues/orders/pause", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 303 and paused(topology) == [True, True]
    r = client.post("/queues/orders/resume", headers={"authorization": f"Bearer {READ}"})
    assert r.status_code == 403 and paused(topology) == [True, True]
    r = client.post(
        "/queues/orders/resume", headers={"authorization": f"Bearer {ADMIN}", "sec-fetch-site": "cross-site"}
    )
    assert r.status_code == 403


def test_limits_reach_every_shard_and_bad_values_are_refused(client: TestClient, topology: Topology) -> None:
    csrf = login(client, ADMIN)
    r = client.post("/queues/orders/limits", data={"csrf": csrf, "max_qps": "12.5", "max_concurrency": ""})
    assert r.status_code == 303
    rows = [r for rows in admin.list_queues(topology).values() for r in rows]
    assert [(r["max_qps"], r["max_concurrency"]) for r in rows] == [(12.5, None), (12.5, None)]
    r = client.post("/queues/orders/limits", data={"csrf": csrf, "max_qps": "fast"})
    assert r.status_code == 400 and "max_qps" in r.text
    r = client.post("/queues/orders/limits", data={"csrf": csrf, "max_qps": "-3"})
    assert r.status_code == 400 and "max_qps" in r.text


def per_shard(topology: Topology, statement: str) -> dict[str, list[tuple[object, ...]]]:
    """``statement``'s rows on each shard."""
    out = {}
    for shard in topology.shards:
        with psycopg.connect(shard.dsn) as c:
            out[shard.name] = c.execute(statement).fetchall()  # type: ignore[arg-type]
    return out


def overrides_by_shard(topology: Topology) -> dict[str, list[tuple[object, ...]]]:
    return per_shard(
        topology,
        "SELECT t.tenant, t.weight, t.max_in_flight FROM qm.tenant_settings t"
        " JOIN qm.queues q ON q.id = t.queue_id WHERE q.name = 'orders' ORDER BY t.tenant",
    )


def web_audit(shard_dsn: str) -> list[tuple[str, str, str, dict[str, object]]]:
    with psycopg.connect(shard_dsn) as c:
        rows = c.execute("SELECT actor, action, queue, filter FROM qm.audit ORDER BY id").fetchall()
    return [(a, b, q, json.loads(f)) for a, b, q, f in rows]


def test_tenant_overrides_are_set_and_removed_on_the_tenants_shard_and_audited(
    client: TestClient, topology: Topology
) -> None:
    t0, t1 = tenants_of(topology.shards[0], 1)[0], tenants_of(topology.shards[1], 1)[0]
    csrf = login(client, ADMIN)
    assert 'id="tenant-set"' in client.get("/queues/orders", headers=HTML).text
    r = client.post("/queues/orders/tenants", data={"csrf": csrf, "tenant": t0, "weight": "2.5", "max_in_flight": "7"})
    assert f"tenant {t0}: max_in_flight 7, weight 2.5 (on its shard)" in notice(client, r)
    r = client.post("/queues/orders/tenants", data={"csrf": csrf, "tenant": t1, "max_in_flight": "3"})
    assert r.status_code == 303
    assert overrides_by_shard(topology) == {"s0": [(t0, 2.5, 7)], "s1": [(t1, 1.0, 3)]}
    # one field at a time: the other stays; the checkbox drops the tenant's own cap
    r = client.post("/queues/orders/tenants", data={"csrf": csrf, "tenant": t0, "default_max_in_flight": "1"})
    assert r.status_code == 303
    assert overrides_by_shard(topology)["s0"] == [(t0, 2.5, None)]
    page = client.get("/queues/orders", headers=HTML).text
    assert t0 in page and t1 in page and "tenants/unset" in page

    r = client.post("/queues/orders/tenants/unset", data={"csrf": csrf, "tenant": t0})
    assert "overrides removed" in notice(client, r)
    assert overrides_by_shard(topology) == {"s0": [], "s1": [(t1, 1.0, 3)]}
    r = client.post("/queues/orders/tenants/unset", data={"csrf": csrf, "tenant": t0})
    assert "none to remove" in notice(client, r)

    assert web_audit(topology.shards[0].dsn) == [
        ("alice", "tenant_set", "orders", {"tenant": t0, "weight": 2.5, "max_in_flight": 7}),
        ("alice", "tenant_set", "orders", {"tenant": t0, "max_in_flight": None}),
        ("alice", "tenant_unset", "orders", {"tenant": t0}),
        ("alice", "tenant_unset", "orders", {"tenant": t0}),
    ]
    assert web_audit(topology.shards[1].dsn) == [("alice", "tenant_set", "orders", {"tenant": t1, "max_in_flight": 3})]


@pytest.mark.parametrize(
    ("form", "says"),
    [
        ({"weight": "-1"}, "'weight' must be > 0"),
        ({"weight": "0"}, "'weight' must be > 0"),
        ({"weight": "5000"}, "<= 1000"),
        ({"weight": "heavy"}, "weight: 'heavy' is not a number"),
        ({"weight": "nan"}, "must be finite"),
        ({"max_in_flight": "0"}, "'max_in_flight' must be >= 1"),
        ({"max_in_flight": "2.5"}, "max_in_flight: '2.5' is not an integer"),
        ({"max_in_flight": "lots"}, "is not an integer"),
        ({}, "nothing to change"),
        ({"tenant": "", "weight": "2"}, "give the tenant"),
    ],
)
def test_bad_tenant_overrides_are_refused(
    client: TestClient, topology: Topology, form: dict[str, str], says: str
) -> None:
    csrf = login(client, ADMIN)
    r = client.post("/queues/orders/tenants", data={"csrf": csrf, "tenant": "acme", **form}, headers=HTML)
    assert r.status_code == 400 and says in html.unescape(r.text), r.text
    assert overrides_by_shard(topology) == {"s0": [], "s1": []}


def test_tenant_overrides_of_an_unknown_queue_are_a_404(client: TestClient) -> None:
    csrf = login(client, ADMIN)
    r = client.post("/queues/nosuch/tenants", data={"csrf": csrf, "tenant": "acme", "weight": "2"})
    assert r.status_code == 404
    r = client.post("/queues/nosuch/tenants/unset", data={"csrf": csrf, "tenant": "acme"})
    assert r.status_code == 404


def test_tenant_overrides_need_the_csrf_token(client: TestClient, topology: Topology) -> None:
    login(client, ADMIN)
    r = client.post("/queues/orders/tenants", data={"csrf": "stale", "tenant": "acme", "weight": "2"})
    assert r.status_code == 403 and "CSRF" in r.text
    assert overrides_by_shard(topology) == {"s0": [], "s1": []}


def test_settings_form_applies_only_changed_values_on_every_shard_and_is_audited(
    client: TestClient, topology: Topology
) -> None:
    csrf = login(client, ADMIN)
    page = client.get("/queues/orders", headers=HTML).text
    form = {k: html.unescape(v) for k, v in re.findall(r'<input name="([a-z_]+)" size="12" value="([^"]*)"', page)}
    assert "partitions" in form and "max_attempts" in form and "paused" not in form
    r = client.post("/queues/orders/settings", data={"csrf": csrf, **form})
    assert r.status_code == 400 and "nothing to change" in r.text
    form.update(max_attempts="7", window_seconds="12.5", tenant_max_in_flight="4")
    r = client.post("/queues/orders/settings", data={"csrf": csrf, **form})
    assert r.status_code == 303, r.text
    assert registry(topology, "max_attempts") == [7, 7]
    assert registry(topology, "window_seconds") == [12.5, 12.5]
    assert registry(topology, "tenant_max_in_flight") == [4, 4]
    form.update(tenant_max_in_flight="")
    assert client.post("/queues/orders/settings", data={"csrf": csrf, **form}).status_code == 303
    assert registry(topology, "tenant_max_in_flight") == [None, None]
    for shard in topology.shards:
        assert web_audit(shard.dsn) == [
            ("alice", "settings", "orders", {"max_attempts": 7, "window_seconds": 12.5, "tenant_max_in_flight": 4}),
            ("alice", "settings", "orders", {"tenant_max_in_flight": None}),
        ]


@pytest.mark.parametrize(
    ("form", "says"),
    [
        ({"max_attempts": "0"}, "'max_attempts' must be >= 1 and <= 1000"),
        ({"max_attempts": "many"}, "max_attempts: 'many' is not an integer"),
        ({"window_seconds": "-1"}, "'window_seconds' must be > 0"),
        ({"partitions": ""}, "partitions: give a value"),
        ({"shuffle": "32"}, "'shuffle' must be >= 1 and <= 16"),
        ({"backoff_min_seconds": "500", "backoff_max_seconds": "10"}, "may not be below"),
    ],
)
def test_bad_settings_are_refused(client: TestClient, topology: Topology, form: dict[str, str], says: str) -> None:
    before = admin.list_queues(topology)
    csrf = login(client, ADMIN)
    r = client.post("/queues/orders/settings", data={"csrf": csrf, **form}, headers=HTML)
    assert r.status_code == 400 and says in html.unescape(r.text), r.text
    assert admin.list_queues(topology) == before


def test_mounted_under_a_sub_path(app_for: Callable[..., TestClient]) -> None:
    client = app_for(root_path="/qm")
    assert client.get("/qm/health").status_code == 200
    assert client.get("/qm/", headers=HTML).headers["location"] == "/qm/login?next=%2Fqm%2F"
    r = client.post("/qm/login", data={"token": ADMIN, "next": "/qm/queues/orders"})
    assert r.status_code == 303 and r.headers["location"] == "/qm/queues/orders"
    assert "Path=/qm" in r.headers["set-cookie"]
    page = client.get("/qm/queues/orders", headers=HTML)
    assert page.status_code == 200 and 'action="/qm/queues/orders/pause"' in page.text
    overview = client.get("/qm/", headers=HTML).text
    assert 'src="/qm/static/live.js"' in overview and 'data-live="/qm/live/overview"' in overview
    assert client.get("/qm/static/live.js").status_code == 200


def test_the_overview_streams_its_live_part_as_server_sent_events(
    app_for: Callable[..., TestClient], topology: Topology
) -> None:
    client = app_for(stream_seconds=0)  # one event, then the stream ends (a browser reconnects)
    assert client.get("/live/overview").status_code == 401
    insert(topology, [(tenants_of(topology.shards[1], 1)[0], {"n": 1})])
    r = client.get("/live/overview", headers={"authorization": f"Bearer {READ}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    head, event = r.text.split("\n\n", 1)
    assert head == "retry: 1000"
    lines = event.rstrip("\n").split("\n")
    assert lines[0] == "event: live" and all(line.startswith("data: ") for line in lines[1:])
    html = "\n".join(line[len("data: ") :] for line in lines[1:])
    assert '<tr data-queue="orders" data-shard="s1">' in html and "Read at" in html


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("path", "status", "says"),
    [
        ("/queues/orders/events?payload=payload.order.id+%3E+3", 400, "expected = or !="),
        ("/queues/orders/events?payload=payload.a+%3D+%7Bbroken", 400, "neither JSON nor a plain word"),
        ("/queues/orders/events?state=done", 400, "not a state"),
        ("/queues/orders/events?id=1e9", 400, "not an event id"),
        ("/queues/orders/events?fire_from=tomorrow", 400, "not a time"),
        ("/queues/orders/events?cursor=s0:abc", 400, "cursor"),
        ("/queues/orders/events?shard=s7", 400, "no shard named"),
        ("/queues/Bad-Name/events", 400, "invalid queue name"),
        ("/queues/nosuch/events", 404, "no queue named"),
        ("/queues/nosuch", 404, "no queue named"),
        ("/queues/orders/events/s0/abc", 400, "not an event id"),
        ("/queues/orders/events/s9/1", 404, "no shard named"),
        ("/queues/orders/events/s0/999", 404, "no event 999"),
    ],
)
def test_bad_input_gets_a_clear_message(client: TestClient, path: str, status: int, says: str) -> None:
    login(client, READ)
    r = client.get(path, headers=HTML)
    assert r.status_code == status, r.text[:500]
    assert says in r.text
    r = client.get(path)
    assert r.status_code == status and says in r.text and "<html" not in r.text


def test_bad_bulk_requests_are_refused(client: TestClient) -> None:
    csrf = login(client, ADMIN)
    for form, says in (
        ({"do": "retry_dead/selection"}, "nothing selected"),
        ({"do": "retry_dead/selection", "sel": "s0:x"}, "not shard:id"),
        ({"do": "retry_dead/selection", "sel": "s9:1"}, "not shard:id"),
        ({"do": "retry_dead/all", "payload": "payload."}, "payload filter"),
        ({"do": "drop_table/all"}, "unknown bulk action"),
        ({"do": "retry_dead/everything"}, "unknown bulk action"),
        ({"do": "reschedule/all"}, "give the new fire_at"),
        ({"do": "reschedule/all", "new_fire_at": "soon"}, "not a time"),
    ):
        r = client.post("/queues/orders/bulk", data={"csrf": csrf, **form})
        assert r.status_code == 400 and says in r.text, (form, r.text)
    r = client.post("/queues/orders/bulk/confirm", data={"csrf": csrf, "do": "retry_dead/all"})
    assert r.status_code == 400 and "confirm" in r.text


# ------------------------------------------------------------------------------ the event browser


def test_payload_path_filter_finds_the_event(client: TestClient, topology: Topology) -> None:
    t0, t1 = tenants_of(topology.shards[0], 1)[0], tenants_of(topology.shards[1], 1)[0]
    insert(topology, [(t0, {"order": {"id": 41}}), (t1, {"order": {"id": 42}}), (t0, {"order": {"id": "42"}})])
    login(client, READ)
    r = client.get("/queues/orders/events", params={"payload": "payload.order.id = 42"}, headers=HTML)
    assert r.status_code == 200 and ids_on(r.text) == ["s1:1"]
    r = client.get("/queues/orders/events", params={"payload": 'payload.order.id = "42"'}, headers=HTML)
    assert ids_on(r.text) == ["s0:2"]
    r = client.get("/queues/orders/events", params={"payload": "payload.order.id != 42", "tenant": t0}, headers=HTML)
    assert ids_on(r.text) == ["s0:2", "s0:1"]
    r = client.get("/queues/orders/events", params={"id": "1", "shard": "s1"}, headers=HTML)
    assert ids_on(r.text) == ["s1:1"]
    page = client.get("/queues/orders/events/s1/1", headers=HTML)
    assert page.status_code == 200 and "&#34;id&#34;: 42" in page.text and t1 in page.text


@pytest.mark.parametrize("scan", [20_000, 3])
def test_keyset_pages_list_every_event_once_newest_first(
    app_for: Callable[..., TestClient], topology: Topology, scan: int
) -> None:
    client = app_for(limits=Limits(page_size=4, scan_rows=scan))
    tenants = tenants_of(topology.shards[0], 2) + tenants_of(topology.shards[1], 2)
    insert(topology, [(tenants[i % 4], {"i": i, "even": i % 2 == 0}) for i in range(13)])
    login(client, READ)
    seen: list[str] = []
    url = "/queues/orders/events?payload=payload.even+%3D+true"
    for _ in range(20):
        page = client.get(url, headers=HTML)
        assert page.status_code == 200
        seen += ids_on(page.text)
        older = re.search(r'id="older" href="([^"]+)"', page.text)
        if older is None:
            break
        url = older.group(1).replace("&amp;", "&")
    payloads = []
    for item in seen:
        shard, _, n = item.partition(":")
        with psycopg.connect(topology.by_name(shard).dsn) as c:
            row = c.execute("SELECT payload FROM orders WHERE id = %s", (int(n),)).fetchone()
            assert row is not None
            payloads.append(row[0]["i"])
    assert payloads == [12, 10, 8, 6, 4, 2, 0]


def test_a_tenant_filter_reads_the_tenants_shard_only_and_nothing_holds_its_events_back(
    app_for: Callable[..., TestClient], topology: Topology
) -> None:
    client = app_for(limits=Limits(page_size=4, scan_rows=3))
    t1 = tenants_of(topology.shards[1], 1)[0]
    insert(topology, [(t1, {"n": i}) for i in range(2)])
    # newer rows of s0's own tenants: a look at s0 would find none of t1's
    insert(topology, [(t, {"hay": 1}) for t in tenants_of(topology.shards[0], 5)])
    login(client, READ)
    page = client.get("/queues/orders/events", params={"tenant": t1}, headers=HTML)
    assert page.status_code == 200 and ids_on(page.text) == ["s1:2", "s1:1"]
    assert 'id="older"' not in page.text  # s0 was never looked at: nothing more to page through
    # the tenant's shard is not the one named: nothing matches, and no page looks anywhere
    page = client.get("/queues/orders/events", params={"tenant": t1, "shard": "s0"}, headers=HTML)
    assert page.status_code == 200 and ids_on(page.text) == [] and 'id="older"' not in page.text
    # the same events by payload, every shard looked at: s0's capped, empty look holds none back
    page = client.get("/queues/orders/events", params={"payload": "payload.n"}, headers=HTML)
    assert ids_on(page.text) == ["s1:2", "s1:1"] and 'id="older"' in page.text


# ------------------------------------------------------------------------------ bulk retry


def audit_rows(topology: Topology) -> dict[str, list[tuple[object, ...]]]:
    return per_shard(
        topology,
        "SELECT actor, via, action, filter, requested, affected, finished_at IS NOT NULL FROM qm.audit ORDER BY id",
    )


def test_bulk_retry_of_all_matching_is_confirmed_capped_and_audited(
    app_for: Callable[..., TestClient], topology: Topology
) -> None:
    client = app_for(limits=Limits(bulk_cap=5, bulk_slice=2))
    t0, t1 = tenants_of(topology.shards[0], 1)[0], tenants_of(topology.shards[1], 1)[0]
    insert(topology, [(t0, {"k": "x"})] * 4 + [(t1, {"k": "x"})] * 3 + [(t1, {"k": "y"})] * 2)
    kill(topology)
    csrf = login(client, ADMIN)
    form = {"csrf": csrf, "do": "retry_dead/all", "state": "failed", "payload": "payload.k = x"}
    preview = client.post("/queues/orders/bulk", data=form, headers=HTML)
    assert preview.status_code == 200
    # the count is the truth (7 match), the cap binds the newest 5: t1's 3 and t0's 2 newest
    assert "<strong>7</strong> dead letters match" in preview.text and '<strong id="bound">5</strong>' in preview.text
    assert "<li>s0: 4 match, 2 bound</li>" in preview.text and "<li>s1: 3 match, 3 bound</li>" in preview.text
    confirm = confirm_form(preview.text)
    assert confirm["bound"] == "s0:4-3;s1:3-1" and confirm["payload"] == 'payload.k = "x"'
    done = client.post("/queues/orders/bulk/confirm", data={**confirm, "csrf": csrf_of(preview.text)})
    assert "Retry: 5 dead letters of orders changed, of 5 bound (s0 2 of 2, s1 3 of 3)" in notice(client, done)
    counts = {s["shard"]: s["queues"][0]["counts"] for s in admin.status(topology)["shards"]}
    assert (counts["s0"]["to_be_fired"], counts["s1"]["to_be_fired"]) == (2, 3)
    assert counts["s0"]["failed"] + counts["s1"]["failed"] == 4
    what = 'state failed, payload payload.k = "x"'
    assert audit_rows(topology) == {
        "s0": [("alice", "web", "retry_dead", what, 2, 2, True)],
        "s1": [("alice", "web", "retry_dead", what, 3, 3, True)],
    }
    page = client.get("/audit", headers=HTML).text  # one line for the action, its counts per shard
    assert page.count("<tr data-action=") == 1 and "s0 2 of 2" in page and "s1 3 of 3" in page


def test_bulk_retry_of_a_selection_moves_only_dead_letters(client: TestClient, topology: Topology) -> None:
    t0 = tenants_of(topology.shards[0], 1)[0]
    insert(topology, [(t0, {"n": i}) for i in range(3)])
    kill(topology, "id IN (1, 2)")
    csrf = login(client, ADMIN)
    preview = client.post(
        "/queues/orders/bulk", data={"csrf": csrf, "do": "retry_dead/selection", "sel": ["s0:1", "s0:3"]}, headers=HTML
    )
    assert preview.status_code == 200 and "<strong>1</strong>" in preview.text
    confirm = confirm_form(preview.text)
    assert confirm["bound"] == "s0:1"
    r = client.post("/queues/orders/bulk/confirm", data=confirm)
    assert "Retry: 1 dead letters of orders changed, of 1 bound" in notice(client, r)
    with psycopg.connect(topology.shards[0].dsn) as c:
        states = dict(c.execute("SELECT id, state::text FROM orders ORDER BY id").fetchall())
    assert states == {1: "to_be_fired", 2: "failed", 3: "to_be_fired"}


def test_fire_now_and_reschedule_touch_only_events_not_yet_fired(client: TestClient, topology: Topology) -> None:
    s0 = topology.shards[0]
    t0 = tenants_of(s0, 1)[0]
    with psycopg.connect(s0.dsn, autocommit=True) as c:
        for i in range(4):
            c.execute(
                "INSERT INTO orders (tenant, payload, fire_at) VALUES (%s, %s, now() + interval '1 hour')",
                (t0, json.dumps({"n": i})),
            )
        c.execute("UPDATE orders SET state = 'fired', attempts = 1 WHERE id = 4")  # held by a manager
    csrf = login(client, ADMIN)
    preview = client.post("/queues/orders/bulk", data={"csrf": csrf, "do": "fire_now/all", "tenant": t0}, headers=HTML)
    assert "<strong>3</strong>" in preview.text
    confirm = confirm_form(preview.text)
    with psycopg.connect(s0.dsn, autocommit=True) as c:  # id 1 is fired meanwhile: the confirmation skips it
        c.execute("UPDATE orders SET state = 'fired', attempts = 1 WHERE id = 1")
    r = client.post("/queues/orders/bulk/confirm", data=confirm)
    assert "Fire now: 2 scheduled events of orders changed, of 3 bound" in notice(client, r)
    with psycopg.connect(s0.dsn, autocommit=True) as c:
        due = c.execute("SELECT id, fire_at <= now(), state::text FROM orders ORDER BY id").fetchall()
        c.execute("UPDATE orders SET state = 'to_be_fired', attempts = 0 WHERE id = 1")
    assert due == [(1, False, "fired"), (2, True, "to_be_fired"), (3, True, "to_be_fired"), (4, False, "fired")]

    when = "2027-01-02T03:04:05+00:00"
    form = {"csrf": csrf, "do": "reschedule/selection", "sel": ["s0:1", "s0:4"], "new_fire_at": when}
    preview = client.post("/queues/orders/bulk", data=form, headers=HTML)
    assert "<strong>1</strong>" in preview.text and when in preview.text
    r = client.post("/queues/orders/bulk/confirm", data=confirm_form(preview.text))
    assert r.status_code == 303
    with psycopg.connect(s0.dsn) as c:
        rows = c.execute(
            "SELECT id, to_char(fire_at AT TIME ZONE 'UTC', 'YYYY') FROM orders WHERE id IN (1, 4)"
        ).fetchall()
        audit = c.execute("SELECT action, requested, affected FROM qm.audit ORDER BY id").fetchall()
    years = dict(rows)
    assert years[1] == "2027" and years[4] != "2027"
    assert audit == [("fire_now", 3, 2), ("reschedule", 1, 1)]
    # a fire_at the queue would refuse at an insert is refused here too, before any shard
    for bad in ("1999-12-31T00:00:00Z", "2099-01-01T00:00:00Z"):
        form["new_fire_at"] = bad
        r = client.post("/queues/orders/bulk", data=form)
        assert r.status_code == 400 and "out of range" in r.text


def loads(topology: Topology) -> dict[str, list[int]]:
    """Each shard's load counters of the queue (enqueued minus done, per partition)."""
    out = {}
    for s in topology.shards:
        with psycopg.connect(s.dsn) as c:
            row = c.execute("SELECT qm.partition_loads('orders')").fetchone()
            assert row is not None
            out[s.name] = list(row[0])
    return out


def test_cancel_takes_only_events_not_yet_settled_and_counts_the_scheduled_ones_done(
    client: TestClient, topology: Topology
) -> None:
    s0 = topology.shards[0]
    t0 = tenants_of(s0, 1)[0]
    with psycopg.connect(s0.dsn, autocommit=True) as c:
        for i in range(6):
            c.execute(
                "INSERT INTO orders (tenant, payload, fire_at) VALUES (%s, %s, now() + interval '1 hour')",
                (t0, json.dumps({"n": i})),
            )
        c.execute("UPDATE orders SET fire_at = now() - interval '1 second' WHERE id = 2")  # due
        c.execute("UPDATE orders SET state = 'fired', attempts = 1 WHERE id = 3")  # held by a manager
        c.execute("UPDATE orders SET state = 'acked', attempts = 1, acked_at = now() WHERE id = 4")
        c.execute("UPDATE orders SET state = 'failed', attempts = 2 WHERE id = 5")
        partition = dict(c.execute("SELECT id, partition FROM orders").fetchall())
    before = loads(topology)
    picked = [f"s0:{i}" for i in range(1, 7)]

    r = client.post(
        "/queues/orders/bulk/confirm",
        data={"do": "cancel/selection", "sel": picked, "bound": "s0:6-1"},
        headers={"authorization": f"Bearer {READ}"},
    )
    assert r.status_code == 403 and "read-only" in r.text

    csrf = login(client, ADMIN)
    form = {"csrf": csrf, "do": "cancel/selection", "sel": picked}
    preview = client.post("/queues/orders/bulk", data=form, headers=HTML)
    assert (
        preview.status_code == 200
        and "<strong>4</strong>" in preview.text
        and "<li>s0: 4 match, 4 bound</li>" in preview.text
    )
    assert "Cancel 4 events not yet settled" in preview.text
    # a forged confirmation binding every id changes only what the action may: still 4
    r = client.post("/queues/orders/bulk/confirm", data={**confirm_form(preview.text), "bound": "s0:6-1"})
    assert "Cancel: 4 events not yet settled of orders changed, of 6 bound" in notice(client, r)
    with psycopg.connect(s0.dsn) as c:
        left = dict(c.execute("SELECT id, state::text FROM orders ORDER BY id").fetchall())
        audit = c.execute("SELECT action, requested, affected, finished_at IS NOT NULL FROM qm.audit").fetchall()
    assert left == {1: "cancelled", 2: "cancelled", 3: "cancelled", 4: "acked", 5: "failed", 6: "cancelled"}
    assert audit == [("cancel", 6, 4, True)]
    # the scheduled and due ones are counted done at once; a fired one by its manager, which hears of it
    expected = list(before["s0"])
    for gone in (1, 2, 6):
        expected[partition[gone]] -= 1
    assert loads(topology) == {**before, "s0": expected}


def test_cancel_of_all_matching_is_confirmed_capped_and_audited(
    app_for: Callable[..., TestClient], topology: Topology
) -> None:
    client = app_for(limits=Limits(bulk_cap=3, bulk_slice=2))
    t0, t1 = tenants_of(topology.shards[0], 1)[0], tenants_of(topology.shards[1], 1)[0]
    for tenant, n in ((t0, 3), (t1, 2)):
        with psycopg.connect(topology.shard_for(tenant).dsn, autocommit=True) as c:
            for i in range(n):
                c.execute(
                    "INSERT INTO orders (tenant, payload, fire_at) VALUES (%s, %s, now() + interval '1 hour')",
                    (tenant, json.dumps({"n": i})),
                )
    before = loads(topology)
    csrf = login(client, ADMIN)
    form = {"csrf": csrf, "do": "cancel/all", "state": "to_be_fired"}
    preview = client.post("/queues/orders/bulk", data=form, headers=HTML)
    assert preview.status_code == 200
    assert (
        "<strong>5</strong> events not yet settled match" in preview.text
        and '<strong id="bound">3</strong>' in preview.text
    )
    assert "<li>s0: 3 match, 1 bound</li>" in preview.text and "<li>s1: 2 match, 2 bound</li>" in preview.text
    confirm = confirm_form(preview.text)
    assert confirm["bound"] == "s0:3;s1:2-1"
    done = client.post("/queues/orders/bulk/confirm", data={**confirm, "csrf": csrf_of(preview.text)})
    changed = "Cancel: 3 events not yet settled of orders changed, of 3 bound (s0 1 of 1, s1 2 of 2)"
    assert changed in notice(client, done)
    counts = {s["shard"]: s["queues"][0]["counts"]["to_be_fired"] for s in admin.status(topology)["shards"]}
    assert counts == {"s0": 2, "s1": 0}
    assert audit_rows(topology) == {
        "s0": [("alice", "web", "cancel", "state to_be_fired", 1, 1, True)],
        "s1": [("alice", "web", "cancel", "state to_be_fired", 2, 2, True)],
    }
    after = loads(topology)
    assert sum(after["s0"]) == sum(before["s0"]) - 1 and sum(after["s1"]) == sum(before["s1"]) - 2


def test_the_health_page_shows_spark_runs_and_transactions_left_prepared(
    client: TestClient, topology: Topology
) -> None:
    s1 = topology.shards[1]
    gid = f"qm-web-test-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(s1.dsn, autocommit=True) as c:
        c.execute(
            "INSERT INTO qm.spark_runs (run_id, queue, state, staged_rows) VALUES ('run-7', 'orders', 'staged', 12)"
        )
        c.execute(
            "INSERT INTO qm.archive_runs (run_id, stage, planned, archived, deleted) "
            "VALUES ('archive-20261127-ab12', 'deleted', 40, 40, 39)"
        )
    prepared = psycopg.connect(s1.dsn)
    try:
        prepared.execute("SELECT 1")
        prepared.execute(f"PREPARE TRANSACTION '{gid}'")
        login(client, READ)  # after both: the page shows the shared reading of the login's overview
        page = client.get("/database", headers=HTML)
        assert page.status_code == 200
        assert "run-7" in page.text and ">staged<" in page.text and gid in page.text
        assert "qm spark recover" in page.text
        archive = page.text.split('class="grid archive"', 1)[1].split("</table>", 1)[0]
        assert "archive-20261127-ab12" in archive and ">deleted<" in archive and '<td class="n">39</td>' in archive
    finally:
        prepared.close()
        with psycopg.connect(s1.dsn, autocommit=True) as c:
            c.execute(f"ROLLBACK PREPARED '{gid}'")


def test_a_shard_down_gets_a_clear_message_never_a_500(topology: Topology) -> None:
    from queue_manager.domain.topology import Shard
    from queue_manager.web.app import WebConfig, create_app
    from tests.web.conftest import web_tokens

    s0, s1 = topology.shards
    down = Topology((s0, Shard("s1", "host=127.0.0.1 port=1 dbname=qm user=postgres", s1.key_range)))
    with TestClient(create_app(WebConfig(topology=down, tokens=web_tokens())), follow_redirects=False) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["shards"]["s0"] == "ok"
        assert "s1" in health.json()["shards"] and health.json()["shards"]["s1"] != "ok"
        login(client, READ)
        overview = client.get("/", headers=HTML)
        assert overview.status_code == 200 and "unreachable" in overview.text
        for path in ("/queues/orders", "/queues/orders/events", "/queues/orders/events/s1/1"):
            r = client.get(path, headers=HTML)
            assert r.status_code == 503, (path, r.status_code)
            assert "s1" in r.text or "did not answer" in r.text, (path, r.text[-500:])


# ------------------------------------------------------------------------------ the confirmation and the notices


def test_a_confirmation_binds_the_events_it_counted_and_newer_matches_are_not_taken(
    app_for: Callable[..., TestClient], topology: Topology
) -> None:
    client = app_for()
    t0, t1 = tenants_of(topology.shards[0], 1)[0], tenants_of(topology.shards[1], 1)[0]
    insert(topology, [(t0, {"n": i}) for i in range(3)] + [(t1, {"n": i}) for i in range(2)])
    kill(topology)
    csrf = login(client, ADMIN)
    preview = client.post("/queues/orders/bulk", data={"csrf": csrf, "do": "retry_dead/all"}, headers=HTML)
    assert "<strong>5</strong> dead letters match" in preview.text
    confirm = confirm_form(preview.text)
    # after the confirmation page: two newer dead letters, one on each shard
    insert(topology, [(t0, {"newer": 1}), (t1, {"newer": 1})])
    kill(topology, "payload ? 'newer'")
    r = client.post("/queues/orders/bulk/confirm", data=confirm)
    assert "Retry: 5 dead letters of orders changed, of 5 bound" in notice(client, r)
    for shard in topology.shards:
        with psycopg.connect(shard.dsn) as c:
            failed = c.execute("SELECT payload FROM orders WHERE state = 'failed'").fetchall()
        assert failed == [({"newer": 1},)], shard.name  # the newer ones still wait for their own confirmation
    # a count past its cap says so, rather than a number that is not the truth
    kill(topology)
    insert(topology, [(t0, {"more": i}) for i in range(3)])
    kill(topology)  # 7 on s0, 3 on s1
    client = app_for(limits=Limits(bulk_cap=3, bulk_count_cap=4))
    csrf = login(client, ADMIN)
    preview = client.post("/queues/orders/bulk", data={"csrf": csrf, "do": "retry_dead/all"}, headers=HTML)
    assert "<strong>7</strong>+ dead letters match (more than 4 on a shard: the count stopped there)" in preview.text
    assert '<strong id="bound">3</strong>' in preview.text
    assert "<li>s0: more than 4 match, 3 bound</li>" in preview.text and "<li>s1: 3 match, 0 bound</li>" in preview.text


def test_a_notice_is_told_from_the_audit_never_from_the_url(client: TestClient, topology: Topology) -> None:
    csrf = login(client, ADMIN)
    for query in ("notice=<b>forged</b>", "done=forged", f"done={uuid.uuid4()}", "done=" + "9" * 5000):
        page = client.get(f"/queues/orders?{query}", headers=HTML)
        assert page.status_code == 200 and "forged" not in page.text and 'class="notice"' not in page.text, query
    r = client.post("/queues/orders/pause", data={"csrf": csrf})
    assert notice(client, r) == "orders paused on every shard"
    r = client.post("/queues/orders/limits", data={"csrf": csrf, "max_qps": "7.5", "max_concurrency": ""})
    assert notice(client, r) == "orders: max_concurrency none, max_qps 7.5 on every shard"
    # the audit says who did it, from where, and how far it got on each shard
    page = client.get("/audit", headers=HTML).text
    assert page.count("<tr data-action=") == 2 and 'alice <span class="hint">(web)</span>' in page
    assert '<span class="part">s0 1 of 1</span> · <span class="part">s1 1 of 1</span>' in page


def test_the_read_only_events_page_renders_no_bulk_form(client: TestClient, topology: Topology) -> None:
    insert(topology, [(tenants_of(topology.shards[0], 1)[0], {"n": 1})])
    kill(topology)
    login(client, READ)
    page = client.get("/queues/orders/events", headers=HTML).text
    assert ids_on(page) == ["s0:1"]
    assert (
        'id="bulk"' not in page
        and "/bulk" not in page
        and 'name="sel"' not in page
        and 'method="post"' not in page.split("</header>", 1)[1]
    )
    login(client, ADMIN)
    page = client.get("/queues/orders/events", headers=HTML).text
    assert 'id="bulk"' in page and 'name="sel"' in page


def test_reschedule_moves_events_to_another_priority_and_the_queue_page_shows_keys_and_their_settings(
    client: TestClient, topology: Topology
) -> None:
    s0 = topology.shards[0]
    t0 = tenants_of(s0, 1)[0]
    with psycopg.connect(s0.dsn, autocommit=True) as c:
        for i in range(3):
            c.execute(
                "INSERT INTO orders (tenant, payload, fire_at, concurrency_key) "
                "VALUES (%s, %s, now() + interval '1 hour', 'acct')",
                (t0, json.dumps({"n": i})),
            )
        c.execute("UPDATE orders SET state = 'fired', attempts = 1 WHERE id IN (2, 3)")  # in hand
    csrf = login(client, ADMIN)
    form = {"csrf": csrf, "do": "reschedule/selection", "sel": ["s0:1", "s0:2"], "new_priority": "1"}
    preview = client.post("/queues/orders/bulk", data=form, headers=HTML)
    assert "<strong>1</strong>" in preview.text and "at priority 1" in preview.text
    r = client.post("/queues/orders/bulk/confirm", data=confirm_form(preview.text))
    assert r.status_code == 303
    with psycopg.connect(s0.dsn) as c:
        got = c.execute("SELECT id, priority, fire_at > now() FROM orders ORDER BY id").fetchall()
    assert got == [(1, 1, True), (2, 3, True), (3, 3, True)]  # the fire_at kept; only the row not fired moved
    bad = client.post("/queues/orders/bulk", data={**form, "new_priority": "9"}, headers=HTML)
    assert bad.status_code == 400 and "must be 1 (highest) to 5" in bad.text
    page = client.get("/queues/orders", headers=HTML).text
    assert 'name="default_priority"' in page and 'name="key_max_in_flight"' in page
    keys = page[page.index('id="keys"') : page.index('id="keys-at-limit"')]
    assert t0 in keys and ">acct<" in keys and ">2<" in keys
    form = {k: html.unescape(v) for k, v in re.findall(r'<input name="([a-z_]+)" size="12" value="([^"]*)"', page)}
    form.update(key_max_in_flight="2", priority_aging_seconds="")
    assert client.post("/queues/orders/settings", data={"csrf": csrf, **form}).status_code == 303
    assert registry(topology, "key_max_in_flight") == [2, 2]
    assert registry(topology, "priority_aging_seconds") == [None, None]
    page = client.get("/queues/orders", headers=HTML).text
    assert "(at its limit)" in page and "s0: 1 keys at their limit" in page
