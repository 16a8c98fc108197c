"""Structured log fields reach the output."""

from __future__ import annotations

import logging

from queue_manager.logs import FORMAT, ExtraFormatter


def record(**extra: object) -> logging.LogRecord:
    r = logging.LogRecord("queue_manager.manager.leadership", logging.WARNING, __file__, 1, "stepping down", None, None)
    for k, v in extra.items():
        setattr(r, k, v)
    return r


def test_extra_fields_follow_the_message_action_first() -> None:
    line = ExtraFormatter("%(levelname)s %(name)s %(message)s").format(
        record(term=7, reason="lease taken over", action="step_down")
    )
    assert (
        line
        == 'WARNING queue_manager.manager.leadership stepping down action=step_down reason="lease taken over" term=7'
    )


def test_a_record_without_extra_is_the_plain_line_and_odd_values_are_quoted() -> None:
    f = ExtraFormatter(FORMAT)
    assert f.format(record()).endswith("WARNING queue_manager.manager.leadership stepping down")
    line = f.format(record(error='a "quoted" = thing', tasks=["qm-dispatch"], port=None))
    assert line.endswith('error="a \\"quoted\\" = thing" port=null tasks=["qm-dispatch"]')


def test_an_outage_is_logged_once_then_every_30_s_then_when_it_ends() -> None:
    from queue_manager.clock import FakeClock
    from queue_manager.manager.leadership import OUTAGE_REMINDER, OutageLog

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("test.outage")
    log.addHandler(Keep())
    log.propagate = False
    clock = FakeClock()
    outage = OutageLog(log, clock.monotonic)
    outage.succeeded()  # nothing was lost: nothing to say
    for _ in range(4 * 65):  # 65 s of attempts every 0.25 s
        outage.failed("connection refused")
        clock.advance(0.25)
    assert [r.action for r in records] == ["db_lost", "db_still_lost", "db_still_lost"]
    assert records[1].down_s == OUTAGE_REMINDER
    outage.succeeded()
    outage.succeeded()
    assert [r.action for r in records][3:] == ["db_back"]
    assert records[3].attempts == 260 and not outage.down
