"""The receiver library's errors; they derive from :class:`queue_manager.errors.QueueManagerError`,
so ``qm receive`` reports them as a clean one-line error."""

from __future__ import annotations

from queue_manager.errors import QueueManagerError


class ReceiverError(QueueManagerError):
    """The receiver cannot go on: its configuration is wrong (token refused, queue forbidden, bad handler)."""


class HandlerImportError(ReceiverError):
    """The handler named ``module:function`` cannot be imported."""


class EventNotFiredError(ReceiverError):
    """An ack by SQL found the event not fired at the attempt it was delivered with: it is no longer
    this receiver's to settle (already settled, re-fired after its ack deadline, or deleted)."""

    def __init__(self, message: str, *, state: str | None = None, attempts: int | None = None) -> None:
        super().__init__(message)
        #: the row's state when checked (None: no such row)
        self.state = state
        #: the row's attempt count when checked
        self.attempts = attempts
