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
