"""Bad values on every filter and every form of the dashboard (issue 36, "bad filter values"): each
is refused up front with HTTP 400 and the rule it breaks, nothing changes on any shard, and a 503
("a shard did not answer") comes only from a shard that really did not answer."""

from __future__ import annotations

import json
from collections.abc import Callable

import psycopg
import pytest
from psycopg import errors as pg
from starlette.testclient import TestClient

from queue_manager import admin
from queue_manager.domain.topology import Shard, Topology
from queue_manager.errors import InvalidInputError, QueueManagerError
from queue_manager.web import shards
from tests.conftest import tenants_of
from tests.web.conftest import ADMIN, login

HTML = {"accept": "text/html"}
NUL = "acme\x00x"
NUL_RULE = "NUL character"
#: a payload filter value, and the words of its rule
PAYLOADS = [
    ('payload.a = "\\u0000"', NUL_RULE),
    ('payload.a = {"k\\u0000": 1}', NUL_RULE),
    ('payload."a\x00" = 1', NUL_RULE),
    ('payload.a = "\\ud800"', "lone surrogate"),
    ("payload.a = 1e999999", "digits before the point"),
    ("payload.a = -1e999999", "digits before the point"),
    ("payload.a = [1, 1e-999999]", "digits after the point"),
]
#: every filter field with a bad value, and the words of its rule
FILTERS = [
    ({"tenant": NUL}, NUL_RULE),
    ({"dedup_key": NUL}, NUL_RULE),
    ({"state": "failed\x00"}, NUL_RULE),
    ({"shard": "s0\x00"}, NUL_RULE),
    ({"id": "1\x00"}, NUL_RULE),
    ({"fire_from": "2026-01-01\x00"}, NUL_RULE),
    ({"created_to": "2026-01-01\x00"}, NUL_RULE),
    *(({"payload": text}, rule) for text, rule in PAYLOADS),
]


def snapshot(topology: Topology) -> dict[str, object]:
    """Everything an action could change: every event's state and fire_at, the audit, the tenant
    overrides and the queue's settings, per shard."""
    out: dict[str, object] = {}
    for s in topology.shards:
        with psycopg.connect(s.dsn) as c:
            out[s.name] = (
                c.execute("SELECT id, state::text, fire_at, attempts FROM orders ORDER BY id").fetchall(),
                c.execute("SELECT count(*) FROM qm.audit").fetchall(),
                c.execute("SELECT * FROM qm.tenant_settings ORDER BY 1, 2").fetchall(),
            )
    out["queues"] = admin.list_queues(topology)
    return out


@pytest.fixture
def filled(topology: Topology) -> Topology:
    """Dead letters and scheduled events on both shards, for every action to find."""
    for shard in topology.shards:
        with psycopg.connect(shard.dsn, autocommit=True) as c:
            for i, tenant in enumerate(tenants_of(shard, 3)):
                c.execute(
                    "INSERT INTO orders (tenant, payload, fire_at, dedup_key) "
                    "VALUES (%s, %s, now() + interval '1 hour', %s)",
                    (tenant, json.dumps({"a": i}), f"k-{i}"),
                )
            c.execute("UPDATE orders SET state = 'failed', attempts = 2 WHERE id = 1")
    return topology


@pytest.mark.parametrize(("fields", "rule"), FILTERS, ids=[str(f) for f, _ in FILTERS])
def test_a_bad_filter_value_is_a_400_with_its_rule_on_the_page_and_for_every_bulk_form(
    client: TestClient, filled: Topology, fields: dict[str, str], rule: str
) -> None:
    before = snapshot(filled)
    csrf = login(client, ADMIN)
    r = client.get("/queues/orders/events", params=fields, headers=HTML)
    assert r.status_code == 400 and rule in r.text, r.text[-800:]
    r = client.get("/queues/orders/events", params=fields)
    assert r.status_code == 400 and rule in r.text and "<html" not in r.text
    for do in ("retry_dead/all", "fire_now/all", "reschedule/all", "cancel/all"):
        form = {"csrf": csrf, "do": do, "new_fire_at": "2030-01-01T00:00:00Z", **fields}
        r = client.post("/queues/orders/bulk", data=form)
        assert r.status_code == 400 and rule in r.text, (do, r.text)
        r = client.post("/queues/orders/bulk/confirm", data={**form, "bound": "s0:1;s1:1"})
        assert r.status_code == 400 and rule in r.text, (do, r.text)
    assert snapshot(filled) == before


@pytest.mark.parametrize(
    ("path", "form", "rule"),
    [
        ("/queues/orders/tenants", {"tenant": NUL, "weight": "2"}, NUL_RULE),
        ("/queues/orders/tenants/unset", {"tenant": NUL}, NUL_RULE),
        ("/queues/orders/tenants", {"tenant": "acme", "weight": "1e999999"}, "must be finite"),
        ("/queues/orders/limits", {"max_qps": "1e999999"}, "must be finite"),
        ("/queues/orders/limits", {"max_concurrency": "9" * 5000}, "is not an integer"),
        ("/queues/orders/settings", {"window_seconds": "1e999999"}, "must be finite"),
        ("/queues/orders/settings", {"max_attempts": "1\x00"}, "is not an integer"),
        ("/queues/orders/bulk", {"do": "reschedule/all", "new_fire_at": "2030-01-01\x00"}, "not a time"),
        ("/queues/orders/bulk", {"do": "retry_dead/selection", "sel": "s0:1\x00"}, "not shard:id"),
        ("/queues/orders/bulk/confirm", {"do": "retry_dead/all", "bound": "s0:" + "9" * 5000}, "bound events"),
        ("/queues/orders/bulk/confirm", {"do": "retry_dead/all", "bound": "s0:1\x00"}, "bound events"),
        ("/queues/orders/bulk/confirm", {"do": "retry_dead/all", "bound": "s0:99999-1"}, "more than"),
        ("/queues/orders/bulk/confirm", {"do": "retry_dead/all", "bound": "s0:3-5"}, "range high-low"),
        ("/queues/orders/bulk/confirm", {"do": "retry_dead/all"}, "confirm the events shown"),
    ],
)
def test_a_bad_value_in_a_form_is_a_400_with_its_rule_and_changes_nothing(
    client: TestClient, filled: Topology, path: str, form: dict[str, str], rule: str
) -> None:
    before = snapshot(filled)
    csrf = login(client, ADMIN)
    r = client.post(path, data={"csrf": csrf, **form}, headers=HTML)
    assert r.status_code == 400 and rule in r.text, r.text[-800:]
    assert snapshot(filled) == before


def test_a_bad_login_target_goes_home(client: TestClient) -> None:
    r = client.post("/login", data={"token": ADMIN, "next": "/queues/orders\x00\r\nX-Evil: 1"})
    assert r.status_code == 303 and r.headers["location"] == "/" and "x-evil" not in r.headers
    r = client.post("/login", data={"token": NUL, "next": "/"})
    assert r.status_code == 401


def test_the_operator_actions_refuse_bad_values_before_any_shard(filled: Topology) -> None:
    before = snapshot(filled)
    for call in (
        lambda: admin.set_tenant(filled, "orders", NUL, {"weight": 2.0}),
        lambda: admin.unset_tenant(filled, "orders", NUL),
        lambda: admin.retry_failed(filled, "orders", tenant=NUL),
        lambda: admin.retry_failed(filled, "orders", ids=[2**63]),
        lambda: admin.retry_failed(filled, "orders", ids=[0]),
    ):
        with pytest.raises(InvalidInputError):
            call()
    assert snapshot(filled) == before


def test_only_a_shard_that_did_not_answer_is_unavailable(topology: Topology) -> None:
    """The dashboard's reading of the driver's errors: a value the database refused is the
    request's fault (400), a statement past the timeout is a 504, only a connection that failed
    is a shard that did not answer (503)."""
    shard = topology.shards[0]
    with psycopg.connect(shard.dsn, autocommit=True) as c:
        refused: list[psycopg.Error] = []
        for statement in ("SELECT %s::text", "SELECT '1e999999'::jsonb", "SELECT 1 / 0"):
            try:
                c.execute(statement, ("a\x00",) if "%s" in statement else None)
            except psycopg.Error as exc:
                refused.append(exc)
        try:
            c.execute("SET statement_timeout = 10; SELECT pg_sleep(1)")
        except pg.QueryCanceled as exc:
            cancelled = exc
    try:
        psycopg.connect("host=127.0.0.1 port=1 dbname=qm connect_timeout=2")
    except psycopg.OperationalError as exc:
        down = exc
    assert len(refused) == 3
    for exc in refused:
        assert isinstance(shards.on_error(shard, "orders", exc), InvalidInputError)
    assert isinstance(shards.on_error(shard, "orders", cancelled), shards.StatementTimeout)
    assert isinstance(shards.on_error(shard, "orders", down), shards.ShardUnavailable)
    assert isinstance(shards.on_error(Shard("s0", "", shard.key_range), "orders", down), QueueManagerError)


def test_a_shard_down_is_still_a_503(app_for: Callable[..., TestClient], topology: Topology) -> None:
    from queue_manager.domain.topology import Shard
    from queue_manager.web.app import WebConfig, create_app
    from tests.web.conftest import web_tokens

    s0, s1 = topology.shards
    down = Topology((s0, Shard("s1", "host=127.0.0.1 port=1 dbname=qm user=postgres", s1.key_range)))
    with TestClient(create_app(WebConfig(topology=down, tokens=web_tokens())), follow_redirects=False) as client:
        login(client, ADMIN)
        r = client.get("/queues/orders/events", params={"tenant": tenants_of(s1, 1)[0]})
        assert r.status_code == 503 and "did not answer" in r.text
        r = client.get("/queues/orders/events", params={"tenant": NUL})
        assert r.status_code == 400 and NUL_RULE in r.text
