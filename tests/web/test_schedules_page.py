"""The schedules page: every shard's schedules with their next runs and last slot, pause and resume
for an admin token (audited), refused for a read-only one and for a bad name."""

from __future__ import annotations

import psycopg
from starlette.testclient import TestClient

from queue_manager.admin import schedules
from queue_manager.domain.topology import Topology
from tests.conftest import tenants_of
from tests.web.conftest import ADMIN, READ, login

HTML = {"accept": "text/html"}


def test_the_schedules_page_lists_next_runs_and_pauses_and_resumes(client: TestClient, topology: Topology) -> None:
    s0, s1 = topology.shards
    schedules.add(topology, schedules.Definition("nightly", "orders", tenants_of(s0, 1)[0], cron="30 2 * * *",
                                                 timezone="Europe/Berlin"))  # fmt: skip
    schedules.add(topology, schedules.Definition("beat", "orders", tenants_of(s1, 1)[0], every=30, paused=True))
    login(client, READ)
    page = client.get("/schedules", headers=HTML)
    assert page.status_code == 200
    html = page.text
    assert 'id="schedule-nightly"' in html and 'id="schedule-beat"' in html
    assert "cron &#39;30 2 * * *&#39; in Europe/Berlin" in html or "cron '30 2 * * *' in Europe/Berlin" in html
    assert html.count("T00:30:00+00:00") + html.count("T01:30:00+00:00") == 3  # nightly's next three runs
    assert '<span class="paused">paused</span>' in html
    assert "<button" not in html.split('id="schedules"')[1]  # read-only: no actions
    r = client.post("/schedules/pause", data={"name": "nightly", "csrf": "x"})
    assert r.status_code == 403
    client.cookies.clear()
    csrf = login(client, ADMIN)
    r = client.post("/schedules/pause", data={"name": "nightly", "csrf": csrf})
    assert r.status_code == 303 and r.headers["location"].endswith("/schedules?changed=paused")
    r = client.post("/schedules/resume", data={"name": "beat", "csrf": csrf})
    assert r.status_code == 303
    r = client.post("/schedules/pause", data={"name": "ghost", "csrf": csrf}, headers=HTML)
    assert r.status_code == 400 and "no schedule named &#39;ghost&#39;" in r.text
    r = client.post("/schedules/launch", data={"name": "beat", "csrf": csrf}, headers=HTML)
    assert r.status_code == 404
    with psycopg.connect(s0.dsn) as c:
        assert c.execute("SELECT paused FROM qm.schedules WHERE name = 'nightly'").fetchone() == (True,)
        assert c.execute("SELECT action, via, actor FROM qm.audit ORDER BY id DESC LIMIT 1").fetchone() == (
            "schedule_pause",
            "web",
            "alice",
        )
    with psycopg.connect(s1.dsn) as c:
        assert c.execute("SELECT paused FROM qm.schedules WHERE name = 'beat'").fetchone() == (False,)
    assert client.get("/schedules?queue=bad-name", headers=HTML).status_code == 400
