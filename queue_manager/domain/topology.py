"""Shards, keyspace ranges (Vitess notation) and the topology file.

A topology file is TOML::

    [[shards]]
    name = "s0"
    dsn = "postgresql://postgres@127.0.0.1:5432/qm"
    range = "-80"

    [[shards]]
    name = "s1"
    dsn = "postgresql://postgres@127.0.0.1:5433/qm"
    range = "80-"
    managers = ["ws://mgr-c:8765/", "ws://mgr-d:8765/"]   # optional: where receivers find it

Loading validates that the ranges cover the whole keyspace exactly once and says precisely
what is wrong otherwise (which gap, which overlap, which shard).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

from queue_manager.domain import routing
from queue_manager.domain.names import check_shard_name
from queue_manager.errors import ConfigurationError, TopologyError

#: the environment variable a command reads the topology file's path from when not given ``--topology``
TOPOLOGY_ENV = "QM_TOPOLOGY"

_BOUND_RE = re.compile(r"^(?:[0-9a-fA-F]{2}){0,8}$")


def _normalise_bound(bound: str, *, what: str, spec: str) -> str:
    if not _BOUND_RE.match(bound):
        raise TopologyError(
            f"key range {spec!r}: {what} bound {bound!r} must be hex bytes "
            "(an even number of hex digits, at most 16), e.g. '80' or '4000'"
        )
    return bound.lower().ljust(routing.KEYSPACE_HEX_DIGITS, "0") if bound else ""


@dataclass(frozen=True, order=True)
class KeyRange:
    """A half-open keyspace range ``[start, end)``; bounds are 16 hex digits or '' (open)."""

    #: inclusive lower bound, 16 lowercase hex digits, '' for the start of the keyspace
    start: str
    #: exclusive upper bound, 16 lowercase hex digits, '' for the end of the keyspace
    end: str

    @classmethod
    def parse(cls, spec: str) -> KeyRange:
        """Parse Vitess notation: ``-80``, ``40-80``, ``80-`` or ``-`` (the whole keyspace)."""
        if spec.count("-") != 1:
            raise TopologyError(
                f"key range {spec!r} must be written 'start-end' in hex, e.g. '-80', '40-80', '80-' or '-'"
            )
        raw_start, raw_end = spec.split("-")
        start = _normalise_bound(raw_start, what="start", spec=spec)
        end = _normalise_bound(raw_end, what="end", spec=spec)
        if start == "0" * routing.KEYSPACE_HEX_DIGITS:
            start = ""
        if end == "0" * routing.KEYSPACE_HEX_DIGITS:
            raise TopologyError(f"key range {spec!r} is empty: its end is the start of the keyspace")
        if start and end and start >= end:
            raise TopologyError(f"key range {spec!r} is empty: its start must be below its end")
        return cls(start, end)

    def contains_hex(self, kid_hex: str) -> bool:
        """Whether a 16-digit keyspace id falls in the range."""
        return (not self.start or kid_hex >= self.start) and (not self.end or kid_hex < self.end)

    def contains(self, tenant: str) -> bool:
        """Whether the tenant's keyspace id falls in the range."""
        return self.contains_hex(routing.keyspace_hex(tenant))

    def __str__(self) -> str:
        def short(b: str) -> str:
            return b.rstrip("0").ljust(2, "0") if b else ""

        def even(b: str) -> str:
            s = short(b)
            return s if len(s) % 2 == 0 else s + "0"

        return f"{even(self.start)}-{even(self.end)}"


@dataclass(frozen=True)
class Shard:
    """One PostgreSQL database owning one keyspace range."""

    #: unique shard name (allow-listed: it appears in errors and metrics)
    name: str
    #: libpq connection string of the shard's primary
    dsn: str
    #: the keyspace range the shard owns
    key_range: KeyRange
    #: base URLs of the shard's managers (``ws://host:port/``), for receivers; may be empty
    managers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Topology:
    """The shards of a deployment; validated to cover the keyspace exactly."""

    shards: tuple[Shard, ...]

    def __post_init__(self) -> None:
        validate_coverage(self.shards)

    def shard_for(self, tenant: str) -> Shard:
        """The shard that owns the tenant."""
        kid = routing.keyspace_hex(tenant)
        for shard in self.shards:
            if shard.key_range.contains_hex(kid):
                return shard
        raise AssertionError("a validated topology covers the whole keyspace")  # pragma: no cover

    def by_name(self, name: str) -> Shard:
        """The shard called ``name``; TopologyError if there is none."""
        for shard in self.shards:
            if shard.name == name:
                return shard
        known = ", ".join(s.name for s in self.shards)
        raise TopologyError(f"no shard named {name!r} in the topology (shards: {known})")

    @classmethod
    def from_dict(cls, data: dict[str, object], *, source: str = "topology") -> Topology:
        """Build from parsed TOML (``{"shards": [{"name", "dsn", "range"}, ...]}``)."""
        raw = data.get("shards")
        if not isinstance(raw, list) or not raw:
            raise TopologyError(f"{source}: expected a non-empty [[shards]] array")
        shards = [shard_from_dict(entry, where=f"{source}: shards[{i}]") for i, entry in enumerate(raw)]
        try:
            return cls(tuple(shards))
        except TopologyError as exc:
            raise TopologyError(f"{source}: {exc}") from None

    @classmethod
    def from_option(cls, path: str | None, environ: Mapping[str, str]) -> Topology:
        """The topology a command names: its ``--topology`` ``path``, else ``$QM_TOPOLOGY`` in ``environ``."""
        path = path or environ.get(TOPOLOGY_ENV)
        if not path:
            raise ConfigurationError(f"no topology: pass --topology FILE or set {TOPOLOGY_ENV}")
        return cls.load(path)

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        """Read and validate a topology TOML file."""
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise TopologyError(f"topology file {p} does not exist (create it, or run 'qm local start')") from None
        except tomllib.TOMLDecodeError as exc:
            raise TopologyError(f"topology file {p} is not valid TOML: {exc}") from None
        return cls.from_dict(data, source=str(p))

    def to_toml(self) -> str:
        """Serialise back to the TOML form ``load`` reads."""
        out = []
        for s in self.shards:
            text = f'[[shards]]\nname = "{s.name}"\ndsn = "{s.dsn}"\nrange = "{s.key_range}"\n'
            if s.managers:
                text += "managers = [" + ", ".join(f'"{u}"' for u in s.managers) + "]\n"
            out.append(text)
        return "\n".join(out)

    def with_manager(self, shard: str, url: str) -> Topology:
        """The topology with ``url`` among the managers of ``shard`` (unchanged if it is there, or if
        there is no such shard); TopologyError for a malformed URL."""
        check_manager_url(url, where=f"shard {shard}")
        return self._managers(shard, lambda urls: urls if url in urls else (*urls, url))

    def without_manager(self, shard: str, url: str) -> Topology:
        """The topology without ``url`` among the managers of ``shard``."""
        return self._managers(shard, lambda urls: tuple(u for u in urls if u != url))

    def with_managers_of(self, other: Topology) -> Topology:
        """The topology with, for each shard, the managers ``other`` has for a shard of the same name
        added after its own."""
        theirs = {s.name: s.managers for s in other.shards}
        return Topology(
            tuple(
                replace(s, managers=(*s.managers, *(u for u in theirs.get(s.name, ()) if u not in s.managers)))
                for s in self.shards
            )
        )

    def _managers(self, shard: str, change: Callable[[tuple[str, ...]], tuple[str, ...]]) -> Topology:
        return Topology(tuple(replace(s, managers=change(s.managers)) if s.name == shard else s for s in self.shards))


class TopologyFile:
    """A topology file watched for changes. A reshard's switch rewrites it (a new file renamed into
    place); what follows it (receivers, a manager's limit peers) calls :meth:`changed` on a timer. A
    check is one ``stat``: the file is read only when its modification time, size or inode moved."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def load(self) -> Topology:
        """Read the file now; the next :meth:`changed` compares with the file as it was read."""
        self._stamp = self._stat()
        return Topology.load(self.path)

    def changed(self) -> Topology | None:
        """The file's topology when it changed since it was last read (the first call reads it);
        None when it did not, or cannot be seen now. A changed file that is invalid raises
        TopologyError once: it is read again when it changes again."""
        stamp = self._stat()
        if stamp is None or stamp == self._stamp:
            return None
        self._stamp = stamp
        return Topology.load(self.path)


def shard_from_dict(entry: object, *, where: str) -> Shard:
    """One ``[[shards]]`` table: string keys name, dsn, range; optional ``managers``, a list of URLs."""
    if not isinstance(entry, dict):
        raise TopologyError(f"{where} must be a table")
    missing = [key for key in ("name", "dsn", "range") if not isinstance(entry.get(key), str)]
    if missing:
        raise TopologyError(f"{where} needs string keys {', '.join(missing)}")
    unknown = sorted(set(entry) - {"name", "dsn", "range", "managers"})
    if unknown:
        raise TopologyError(f"{where} has unknown keys {', '.join(unknown)}")
    name = str(entry["name"])
    check_shard_name(name)
    managers = _managers(entry.get("managers", []), where=f"{where} ({name})")
    return Shard(name, str(entry["dsn"]), KeyRange.parse(str(entry["range"])), managers)


def _managers(raw: object, *, where: str) -> tuple[str, ...]:
    """The ``managers`` of a shard: a list of distinct manager URLs (``ws``, ``wss``, ``http``, ``https``)."""
    if not isinstance(raw, list) or not all(isinstance(u, str) for u in raw):
        raise TopologyError(f'{where}: managers must be a list of URLs, e.g. managers = ["ws://mgr-a:8765/"]')
    for url in raw:
        check_manager_url(url, where=where)
    dupes = sorted({u for u in raw if raw.count(u) > 1})
    if dupes:
        raise TopologyError(f"{where}: managers repeats {', '.join(dupes)}")
    return tuple(raw)


def check_manager_url(url: str, *, where: str) -> None:
    """TopologyError unless ``url`` is a manager's base URL: ``ws://host:port/`` (or wss, http, https)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a bad port raises ValueError
    except ValueError as exc:
        raise TopologyError(f"{where}: manager URL {url!r} is malformed: {exc}") from None
    if parts.scheme not in ("ws", "wss", "http", "https") or not parts.hostname or '"' in url or "\\" in url:
        raise TopologyError(f"{where}: manager URL {url!r}: use ws://host:port/ (or wss://, http://, https://)")


def validate_coverage(shards: Sequence[Shard]) -> None:
    """Raise TopologyError unless the shards' ranges cover the keyspace with no gap or overlap."""
    if not shards:
        raise TopologyError("a topology needs at least one shard")
    names = [s.name for s in shards]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise TopologyError(f"shard names must be unique; repeated: {', '.join(dupes)}")
    end_of_keyspace = "g"  # sorts after every hex bound
    ordered = sorted(shards, key=lambda s: (s.key_range.start, s.key_range.end or end_of_keyspace))
    problems = []
    cursor = ""  # everything below cursor is owned by exactly one shard seen so far
    prev: Shard | None = None
    for s in ordered:
        kr = s.key_range
        if kr.start > cursor:
            where = f"after shard {prev.name!r} ({prev.key_range})" if prev else "at the start of the keyspace"
            problems.append(f"gap {_fmt(cursor)}-{_fmt(kr.start)} {where}: no shard owns it")
        elif prev is not None and kr.start < cursor:
            problems.append(f"overlap: shard {s.name!r} ({kr}) overlaps shard {prev.name!r} ({prev.key_range})")
        cursor = max(cursor, kr.end or end_of_keyspace)
        prev = s
    if cursor != end_of_keyspace:
        assert prev is not None
        problems.append(
            f"gap {_fmt(cursor)}- at the end of the keyspace: the last shard {prev.name!r} ({prev.key_range}) "
            "stops before it"
        )
    if problems:
        raise TopologyError("key ranges must cover the keyspace exactly: " + "; ".join(problems))


def _fmt(bound: str) -> str:
    if not bound:
        return ""
    s = bound.rstrip("0")
    return s + "0" if len(s) % 2 else (s or "00")


def even_ranges(count: int) -> list[KeyRange]:
    """``count`` equal keyspace ranges (count must be a power of two up to 256)."""
    if count < 1 or count > 256 or count & (count - 1):
        raise TopologyError(f"shard count must be a power of two between 1 and 256, got {count}")
    step = 256 // count
    bounds = ["" if i in (0, count) else f"{i * step:02x}" for i in range(count + 1)]
    return [KeyRange.parse(f"{bounds[i]}-{bounds[i + 1]}") for i in range(count)]


def shard_names(count: int) -> Iterable[str]:
    """Default shard names ``s0``, ``s1``, ..."""
    return (f"s{i}" for i in range(count))
