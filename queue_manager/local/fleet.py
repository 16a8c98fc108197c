"""A fleet on this machine: embedded PostgreSQL shards, ``qm manager`` and ``qm receive`` in child
processes, their token file and their ports.

The one place that spells a manager's or a receiver's command line and starts it: the demo, the
tests, the fault suite and the benchmarks start their processes here, so that a new flag or a new
way to start changes one module.

* :func:`start_shards`: N shards in a directory, migrated, with ``DIR/topology.toml`` (``qm local start``);
* :func:`write_tokens`: a receivers' token file (``[[token]]``, and ``[[web_token]]`` for ``qm web``);
* :func:`free_port`: a free TCP port on 127.0.0.1;
* :func:`qm`, :func:`manager_argv`, :func:`receiver_argv`: the command lines;
* :class:`Child`, :class:`ManagerProcess`, :class:`ReceiverProcess`: the processes, with their
  log file, signals, stop (drain, then kill) and restart.
"""

from __future__ import annotations

import contextlib
import json
import re
import select
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import queue_manager
from queue_manager.domain.topology import Shard, Topology, even_ranges, shard_names
from queue_manager.domain.topology_file import write_topology_file
from queue_manager.local.embedded import LocalCluster, free_port

__all__ = [
    "TOPOLOGY_FILE",
    "Child",
    "ManagerProcess",
    "ReceiverProcess",
    "Token",
    "WebToken",
    "flags",
    "free_port",
    "manager_argv",
    "manager_flags",
    "qm",
    "receiver_argv",
    "start_shards",
    "write_tokens",
]

#: the directory the children run in: the project's, so that ``python -m`` finds its modules
ROOT = Path(queue_manager.__file__).resolve().parents[1]
#: the topology file a local cluster's directory holds
TOPOLOGY_FILE = "topology.toml"
#: how long a manager may take to print its address line
MANAGER_START_TIMEOUT = 60.0
#: the line ``qm manager`` prints once it listens
_ADDRESS_LINE = re.compile(r"ws://[^\s/]+:(\d+)/")

#: an option's value: a flag with a value, a bare flag (True), left out (None or False), or repeated (a sequence)
Option = str | int | float | bool | Sequence[str] | None


# --------------------------------------------------------------------------- shards


def start_shards(directory: Path, shards: int, *, settings: Mapping[str, str] | None = None) -> Topology:
    """Start ``shards`` embedded PostgreSQL servers in ``directory`` (reusing its data), split the keyspace
    evenly between them, write ``directory/topology.toml`` and migrate every shard. The managers the file
    records (its shards' ``managers``, which each ``qm manager`` adds itself to) are kept."""
    from queue_manager.db.migrate import migrate_topology  # alembic: only for the processes that start shards

    dsns = LocalCluster(directory, shards, settings=settings).start()
    topology = Topology(
        tuple(Shard(n, d, r) for n, d, r in zip(shard_names(len(dsns)), dsns, even_ranges(len(dsns)), strict=True))
    )
    topology = write_topology_file(directory / TOPOLOGY_FILE, topology, keep_managers=True)
    migrate_topology(topology)
    return topology


# --------------------------------------------------------------------------- tokens


@dataclass(frozen=True)
class Token:
    """A receivers' token (docs/protocol.md, "Tokens"): ``queues`` it may receive, ``tenants`` it is limited to."""

    name: str
    secret: str
    queues: tuple[str, ...] = ("*",)
    tenants: tuple[str, ...] | None = None

    def entry(self) -> dict[str, Any]:
        """The token as a ``[[token]]`` table (what ``TokenStore.from_entries`` takes)."""
        entry: dict[str, Any] = {"name": self.name, "secret": self.secret, "queues": list(self.queues)}
        if self.tenants is not None:
            entry["tenants"] = list(self.tenants)
        return entry


@dataclass(frozen=True)
class WebToken:
    """A dashboard login (``qm web``, docs/dashboard.md): ``scope`` is ``read`` or ``admin``."""

    name: str
    secret: str
    scope: str = "admin"

    def entry(self) -> dict[str, Any]:
        """The login as a ``[[web_token]]`` table."""
        return {"name": self.name, "secret": self.secret, "scope": self.scope}


def write_tokens(path: Path, tokens: Sequence[Token], web: Sequence[WebToken] = ()) -> Path:
    """Write a token file that ``qm manager --tokens`` (and ``qm web --tokens``) read; readable by its owner only."""

    def value(v: str | list[str]) -> str:  # a JSON string is a TOML basic string
        return json.dumps(v) if isinstance(v, str) else "[" + ", ".join(json.dumps(x) for x in v) + "]"

    def table(kind: str, entry: dict[str, Any]) -> str:
        return f"[[{kind}]]\n" + "".join(f"{k} = {value(v)}\n" for k, v in entry.items())

    text = "\n".join([table("token", t.entry()) for t in tokens] + [table("web_token", w.entry()) for w in web])
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- command lines


def qm(*argv: str) -> list[str]:
    """The command line of ``qm ARGV`` run by this interpreter."""
    return [sys.executable, "-m", "queue_manager.cli.main", *argv]


def flags(**options: Option) -> list[str]:
    """``--name value`` for each option (``snake_case`` names become ``--kebab-case``): a bare flag for
    True, nothing for None or False, the flag repeated for a sequence (a list or a tuple)."""
    out: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list | tuple):
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, str(value)]
    return out


def manager_argv(topology: Path, shard: str, tokens: Path, *, port: int = 0, **options: Option) -> list[str]:
    """The arguments of ``qm manager`` for ``shard`` (options: its flags, e.g. ``lease_ttl=2.0``)."""
    return [
        "manager",
        "--topology",
        str(topology),
        "--shard",
        shard,
        "--tokens",
        str(tokens),
        "--port",
        str(port),
        *flags(**options),
    ]


def receiver_argv(
    queue: str,
    handler: str,
    *,
    topology: Path | None = None,
    managers: Mapping[str, Sequence[str]] | None = None,
    **options: Option,
) -> list[str]:
    """The arguments of ``qm receive``: ``managers`` by shard (``--manager SHARD=URL``; with a topology file
    that records them, none are needed), ``options`` its other flags (e.g. ``concurrency=8``, ``tenant=[...]``)."""
    return [
        "receive",
        "--queue",
        queue,
        *flags(topology=str(topology) if topology is not None else None),
        *manager_flags(managers or {}),
        *flags(**options),
        handler,
    ]


def manager_flags(managers: Mapping[str, Sequence[str]]) -> list[str]:
    """``--manager SHARD=URL`` for each manager of each shard (``qm receive``, ``qm web``)."""
    return flags(manager=[f"{name}={url}" for name, urls in managers.items() for url in urls])


# --------------------------------------------------------------------------- processes


class Child:
    """One command in a child process, run in the project's directory.

    ``log``: its output is appended there (else dropped); ``new_session``: a Ctrl-C of the parent's
    terminal does not reach it. :meth:`start` again after it ended starts it again, with the same command.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        new_session: bool = False,
        start: bool = True,
    ) -> None:
        self.argv = list(argv)
        self.log = log
        self.env = dict(env) if env is not None else None
        self.new_session = new_session
        self.proc: subprocess.Popen[str] | None = None
        self._log: IO[str] | None = None
        if start:
            self.start()

    def start(self) -> None:
        self._close()
        self._log = self.log.open("a") if self.log is not None else None
        out = self._log if self._log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if self._reads_stdout() else out,
            stderr=out,
            text=True,
            cwd=ROOT,
            env=self.env,
            start_new_session=self.new_session,
        )

    def _reads_stdout(self) -> bool:
        return False

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` if the process still runs."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> bool:
        """True when the process has ended (within ``timeout`` seconds; None: however long it takes)."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (after a SIGCONT: a stopped process cannot act on it), SIGKILL if it has not ended
        within ``timeout`` seconds; then its pipes and log are closed."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        if not self.wait(timeout):
            self.kill()
        self._close()

    def kill(self) -> None:
        """SIGKILL, and wait for the process to end."""
        self.signal(signal.SIGKILL)
        self.wait(30)

    def _close(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None


class ManagerProcess(Child):
    """``qm manager`` for one shard in a child process; started when made, once it printed its address.

    ``port`` 0 takes a free one (a restart then takes another; give a :func:`free_port` to keep it).
    ``options`` are its flags (``lease_ttl=2.0``, ``drain_timeout=2``, ...), ``extra`` more arguments.
    Its log lines (stderr) go to ``log``; stdout carries the address line only.
    """

    def __init__(
        self,
        topology: Path,
        tokens: Path,
        shard: str,
        *extra: str,
        port: int = 0,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        new_session: bool = False,
        start: bool = True,
        **options: Option,
    ) -> None:
        self.shard = shard
        self.port = port
        argv = qm(*manager_argv(topology, shard, tokens, port=port, **options), *extra)
        super().__init__(argv, log=log, env=env, new_session=new_session, start=start)

    def _reads_stdout(self) -> bool:
        return True

    def start(self) -> None:
        super().start()
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], MANAGER_START_TIMEOUT)
        line = self.proc.stdout.readline() if ready else ""
        match = _ADDRESS_LINE.search(line)
        if match is None:
            self.kill()
            self._close()
            where = f"; see {self.log}" if self.log is not None else ""
            raise RuntimeError(f"qm manager for shard {self.shard} did not start: {line!r}{where}")
        self.port = int(match.group(1))

    @property
    def url(self) -> str:
        """Its websocket URL."""
        return f"ws://127.0.0.1:{self.port}/"

    def health(self, path: str = "/health", timeout: float = 1.0) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON body) of a health endpoint; (0, {}) when it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as resp:
                return int(resp.status), json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return int(err.code), json.loads(err.read())
        except (OSError, ValueError):
            return 0, {}

    def role(self, timeout: float = 1.0) -> str:
        """``leader`` or ``standby`` (from ``/health``), ``down`` when the process has ended, ``starting``
        when it does not answer."""
        if not self.alive():
            return "down"
        status, body = self.health(timeout=timeout)
        return str(body.get("role", "?")) if status else "starting"


class ReceiverProcess(Child):
    """``qm receive`` in a child process (arguments: :func:`receiver_argv`); started when made."""

    def __init__(
        self,
        queue: str,
        handler: str,
        *,
        topology: Path | None = None,
        managers: Mapping[str, Sequence[str]] | None = None,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        new_session: bool = False,
        start: bool = True,
        **options: Option,
    ) -> None:
        argv = qm(*receiver_argv(queue, handler, topology=topology, managers=managers, **options))
        super().__init__(argv, log=log, env=env, new_session=new_session, start=start)
