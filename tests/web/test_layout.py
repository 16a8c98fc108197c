"""The dashboard's layout (issue 37): one module per page beside the pieces they share, none over
300 lines, and no operator action of its own: it borrows no SQL from the manager's file nor runs
an action's statement; the actions are the admin API's."""

from __future__ import annotations

import re
from pathlib import Path

WEB = Path(__file__).resolve().parents[2] / "queue_manager" / "web"
MOST_LINES = 300


def test_one_module_per_page_and_none_over_300_lines() -> None:
    pages = {p.stem for p in (WEB / "pages").glob("*.py")} - {"__init__"}
    assert pages == {"overview", "queue", "events", "event", "health", "audit", "schedules"}
    lines = {str(p.relative_to(WEB)): len(p.read_text().splitlines()) for p in WEB.rglob("*.py")}
    long = {name: n for name, n in lines.items() if n > MOST_LINES}
    assert long == {}, f"modules of queue_manager/web over {MOST_LINES} lines"


def test_the_dashboard_performs_no_action_of_its_own() -> None:
    action_sql = re.compile(r"manager\.sql|admin\.sql|events_(retry|fire_now|reschedule|cancel|wake)|audit_record")
    found = {
        str(p.relative_to(WEB)): action_sql.findall(p.read_text())
        for p in WEB.rglob("*.py")
        if action_sql.search(p.read_text()) and p.name != "shards.py"
    }
    assert found == {}, "the dashboard names an action's SQL: call queue_manager.admin instead"
    # shards.py names admin.sql once: for the event filters the browser shares with the actions
    assert re.findall(r'"admin\.sql"', (WEB / "shards.py").read_text()) == ['"admin.sql"']
    web_sql = (WEB.parent / "db" / "sql" / "web.sql").read_text()
    assert not re.search(r"^\s*(UPDATE|DELETE|INSERT)\b", web_sql, re.M | re.I), "web.sql only reads"
