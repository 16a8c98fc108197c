"""Handlers for ``qm receive`` run as a subprocess by the tests (tests/integration/test_receiver_library.py).

``blocking``: records ``started/<id>-<attempt>`` in ``$QM_TEST_HANDLER_DIR``, waits until the
file ``release`` appears there, then records ``done/<id>-<attempt>`` and returns (ack).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from receivers import Event

#: importing this module must not fail; a test checks that a failing import is reported
NOT_A_FUNCTION = 42


def blocking(event: Event) -> None:
    root = Path(os.environ["QM_TEST_HANDLER_DIR"])
    name = f"{event.id}-{event.attempt}"
    (root / "started").mkdir(exist_ok=True)
    (root / "started" / name).touch()
    deadline = time.monotonic() + 30
    while not (root / "release").exists():  # the test's signal to finish
        if time.monotonic() > deadline:
            raise TimeoutError("never released")
        time.sleep(0.01)
    (root / "done").mkdir(exist_ok=True)
    (root / "done" / name).touch()
