"""What ``qm web`` serves: :class:`WebConfig`, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from queue_manager.domain.topology import Topology
from queue_manager.errors import ConfigurationError
from queue_manager.web import managers
from queue_manager.web.access import WebTokens
from queue_manager.web.shards import Limits


@dataclass
class WebConfig:
    """What ``qm web`` serves."""

    #: the shards read (every one of them)
    topology: Topology
    #: who may log in
    tokens: WebTokens
    #: signs the session cookies; None: a random one per process (a restart logs everyone out)
    session_secret: str | None = None
    #: serve every route under this path ("/qm"), for a reverse proxy or a host application
    root_path: str = ""
    #: cost guards
    limits: Limits = field(default_factory=Limits)
    #: the overview's live part is pushed at most this often to an open, visible tab, seconds (at least 1)
    refresh_seconds: float = 1.0
    #: a live stream ends after this long, seconds (the browser opens a new one at once)
    stream_seconds: float = 300.0
    #: the overview's reading is taken at least this often, seconds, notified of a change or not
    #: (a manager's own acks send no notification); it is also the charts' sample interval
    idle_seconds: float = 5.0
    #: the health page's reading is shared by every open tab for this long, seconds
    cache_seconds: float = 5.0
    #: the health page's reading is taken again only after 1/db_share times as long as the last one took
    db_share: float = 0.015
    #: each shard's managers (``ws://host:port/``), whose /health the overview reads
    managers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: how long the overview waits for a manager's /health, seconds
    manager_timeout: float = 1.0
    #: the session cookie is sent over HTTPS only
    secure_cookie: bool = False

    def __post_init__(self) -> None:
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ConfigurationError(f"root path {self.root_path!r}: start it with / and end it without, e.g. /qm")
        if not 0 < self.db_share <= 1:
            raise ConfigurationError("db_share is a fraction of the time: give 0 < db_share <= 1")
        if self.refresh_seconds < 1:
            raise ConfigurationError("the live refresh is at most once a second: give refresh_seconds >= 1")
        if self.idle_seconds < self.refresh_seconds:
            raise ConfigurationError(
                "idle_seconds is the longest wait between readings: give idle_seconds >= refresh_seconds"
            )
        known = {s.name for s in self.topology.shards}
        for shard, urls in self.managers.items():
            if shard not in known:
                raise ConfigurationError(f"managers: no shard named {shard!r} (shards: {', '.join(sorted(known))})")
            for url in urls:
                managers.health_url(url)
