"""Jittered exponential back-off for reconnecting: a small pure class, no clock and no sleep.

backoff = Backoff(initial=0.1, maximum=2.0)
delay = backoff.next()      # 0.1 s +- jitter, then 0.2, 0.4, ... up to 2 s
backoff.reset()             # after a connection that worked
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Delays ``initial * factor**n``, capped at ``maximum``, each scaled by a random factor in
    ``[1 - jitter, 1 + jitter]`` (and capped again), so that many receivers that lost the same
    manager do not all come back in the same millisecond.

    ``rng`` is injectable for tests; ``attempts`` counts the delays handed out since the last
    :meth:`reset`.
    """

    initial: float = 0.1
    #: a receiver waits at most about this long (and half again, the jitter) between rounds of probes
    #: while no manager of its shard can be reached at all (receivers.md, "Failover"): a probe that
    #: is refused at once costs the dead manager nothing, and a manager that comes back is found
    #: within seconds, not after 10 s and more (the cap until 2026-11-29)
    maximum: float = 2.0
    factor: float = 2.0
    jitter: float = 0.5
    rng: random.Random = field(default_factory=random.Random, repr=False)
    attempts: int = 0

    def __post_init__(self) -> None:
        if not self.initial > 0:
            raise ValueError(f"initial must be positive, got {self.initial!r}")
        if not self.maximum >= self.initial:
            raise ValueError(f"maximum ({self.maximum!r}) may not be below initial ({self.initial!r})")
        if not self.factor >= 1:
            raise ValueError(f"factor must be at least 1, got {self.factor!r}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter!r}")

    def peek(self) -> float:
        """The delay before jitter that :meth:`next` would scale."""
        # factor ** attempts can overflow a float after ~1000 failures: stop growing at the cap
        base = self.initial
        for _ in range(self.attempts):
            base *= self.factor
            if base >= self.maximum:
                return self.maximum
        return min(base, self.maximum)

    def next(self) -> float:
        """The next delay in seconds, and count it."""
        base = self.peek()
        self.attempts += 1
        scaled = base * self.rng.uniform(1.0 - self.jitter, 1.0 + self.jitter)
        return min(scaled, self.maximum)

    def reset(self) -> None:
        """Start again from ``initial`` (call it once a connection has worked)."""
        self.attempts = 0
