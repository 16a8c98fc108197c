"""Receivers of protocol ``qm.v1`` (docs/receivers.md).

- :class:`Receiver` / :func:`run_receiver`: the library (leader discovery and failover, credit
  from free handler slots, acks, nacks, lease extensions, handler timeouts, drain);
- :func:`ack_in_transaction`: ack an event in the handler's own database transaction;
- :mod:`receivers.testing`: the minimal client the tests and benchmarks use (``MinimalClient``).
"""

from queue_manager.wire.credit import CreditBook
from receivers.backoff import Backoff
from receivers.errors import EventNotFiredError, HandlerImportError, ReceiverError
from receivers.loading import load_handler
from receivers.receiver import Event, Handler, Receiver, ReceiverStats, Retry, run_receiver
from receivers.sql import ack_in_transaction, ack_in_transaction_async

__all__ = [
    "Backoff",
    "CreditBook",
    "Event",
    "EventNotFiredError",
    "Handler",
    "HandlerImportError",
    "Receiver",
    "ReceiverError",
    "ReceiverStats",
    "Retry",
    "ack_in_transaction",
    "ack_in_transaction_async",
    "load_handler",
    "run_receiver",
]
