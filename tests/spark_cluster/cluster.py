"""A Spark standalone cluster from PySpark's own distribution, for the cluster tests.

A master and two workers, each a JVM of its own started by ``spark-class`` (no Docker). Each worker
stands for a machine of its own:

- its own host address on the loopback range (``127.0.0.2``, ``127.0.0.3``; the master and the
  driver are on ``127.0.0.1``), so that Spark moves shuffle blocks between them over the network
  as between machines, instead of reading another executor's files from a disk it takes for shared;
- its own ``/tmp`` (a private mount namespace, ``unshare --mount``, with a directory of its own
  bind-mounted there), where its executors keep Spark's local directories and the JVM's temporary
  files: what the driver writes under its ``/tmp`` does not exist for them, as on a cluster;
- its own work directory (the executors' logs and the jars shipped to them).

The only directory that the driver and the executors both see is :attr:`SparkCluster.shared`,
which stands for HDFS, S3 or a shared mount: the jobs' ``--work-dir`` and ``--output`` go there.

Jobs run through ``spark-submit --master spark://...`` (:meth:`SparkCluster.submit`), the JDBC
driver shipped with ``--jars``. :meth:`SparkCluster.kill_executor` SIGKILLs an executor's JVM
(the worker then starts a new one), :meth:`SparkCluster.kill_worker` a worker's JVM and its
executors (a machine lost); :meth:`SparkCluster.ensure_workers` starts again the workers that died.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

#: cores and executor memory each worker offers: two workers of one core fill the 2-core machine
#: (their tasks and the driver's work share it); 1 GiB per executor, 256 MiB per daemon, 1 GiB for
#: the driver: about 3.8 GiB of the 24 GiB in all
WORKER_CORES = 1
WORKER_MEMORY = "1200m"
EXECUTOR_MEMORY = "1g"
DAEMON_MEMORY = "256m"
DRIVER_MEMORY = "1g"
#: the JVMs of a test cluster run short jobs: the client compiler only, and the serial collector,
#: cost a fraction of the CPU of the default (C2 and G1 threads) for the same work
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
#: settings every test submission passes, as a user would on a small cluster
SUBMIT_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.executor.memory": EXECUTOR_MEMORY,
    "spark.driver.memory": DRIVER_MEMORY,
    "spark.executor.extraJavaOptions": JVM_OPTIONS,
    "spark.driver.extraJavaOptions": JVM_OPTIONS,
}
START_TIMEOUT = 90.0


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def shared_root() -> Path:
    """A directory outside ``/tmp`` (which each worker has its own of): ``/dev/shm`` when it is
    there, else ``/var/tmp``."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else Path("/var/tmp")


def isolation_missing() -> str | None:
    """Why workers cannot get a private ``/tmp`` here (one line), or None."""
    if shutil.which("unshare") is None:
        return "the cluster tests need unshare (util-linux) for each worker's own /tmp"
    try:
        probe = subprocess.run([*_unshare(), "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unshare --mount does not work here ({exc}): the cluster tests need it for each worker's own /tmp"
    if probe.returncode != 0:
        return f"unshare --mount does not work here ({probe.stderr.strip()}): the cluster tests need it"
    return None


def _under_tmp(path: Path) -> bool:
    resolved = path.resolve()
    return resolved != Path("/tmp") and resolved.is_relative_to("/tmp")


def _unshare() -> list[str]:
    # as root a mount namespace of its own; otherwise inside a user namespace mapped to root
    return ["unshare", "--mount", "--propagation", "private"] + ([] if os.geteuid() == 0 else ["--map-root-user"])


def _children(pid: int) -> list[int]:
    """The pids of the direct children of ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(what: str, check: Callable[[], bool], timeout: float, interval: float = 0.05) -> None:
    """Wait until ``check()`` holds, or fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


@dataclass
class Worker:
    index: int
    host: str
    root: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.root / "worker.log"

    def executors(self) -> list[int]:
        """The worker's executor JVMs (its children running CoarseGrainedExecutorBackend)."""
        if self.proc is None or not _alive(self.proc.pid):
            return []
        return [p for p in _children(self.proc.pid) if "CoarseGrainedExecutorBackend" in _cmdline(p) and _alive(p)]


@dataclass
class Submission:
    """A running ``spark-submit``: its stdout lines as they come (a thread reads them)."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    stderr_path: Path | None = None
    reader: threading.Thread | None = None

    def wait_line(self, pattern: str, timeout: float) -> str:
        """The first stdout line matching ``pattern`` (a regex), waiting up to ``timeout`` s."""
        rx = re.compile(pattern)
        found: list[str] = []

        def seen() -> bool:
            found[:] = [line for line in list(self.lines) if rx.search(line)]
            return bool(found) or self.proc.poll() is not None

        wait_for(f"a line matching {pattern!r}", seen, timeout)
        if not found:
            raise AssertionError(f"spark-submit ended ({self.proc.returncode}) before {pattern!r}:\n{self.output()}")
        return found[0]

    def finish(self, timeout: float) -> int:
        """The exit code, once spark-submit ended (within ``timeout`` s) and its output was read."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
            raise AssertionError(f"spark-submit did not end within {timeout:g} s:\n{self.output()}") from None
        if self.reader is not None:
            self.reader.join(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return rc

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path else ""

    def output(self) -> str:
        """stdout, then the end of stderr (Spark's log)."""
        return "\n".join(self.lines) + "\n--- stderr (end) ---\n" + self.stderr_text()[-6000:]


class SparkCluster:
    """A master and two workers on this machine, each a JVM, started by :meth:`start`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.shared = root / "shared"
        self.home = spark_home()
        self.master_url = ""
        self.master: subprocess.Popen[bytes] | None = None
        self.workers = [Worker(i, f"127.0.0.{i + 2}", root / f"worker-{i}") for i in range(2)]
        self._submissions = 0

    # ------------------------------------------------------------------------------- life cycle

    def _env(self, host: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "SPARK_"))}
        env.pop("PYTHONPATH", None)  # the executors get no project: the jobs run no Python there
        env.update(
            SPARK_HOME=str(self.home),
            SPARK_LOCAL_IP=host,
            SPARK_PUBLIC_DNS=host,
            SPARK_DAEMON_MEMORY=DAEMON_MEMORY,
            SPARK_DAEMON_JAVA_OPTS=JVM_OPTIONS,
            SPARK_NO_DAEMONIZE="1",
        )
        return env

    def start(self) -> None:
        self.shared.mkdir(parents=True, exist_ok=True)
        master_log = self.root / "master.log"
        with open(master_log, "wb") as log:
            self.master = subprocess.Popen(
                [
                    str(self.home / "bin" / "spark-class"),
                    "org.apache.spark.deploy.master.Master",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--webui-port",
                    "0",
                ],
                env=self._env("127.0.0.1"),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        url: list[str] = []

        def master_up() -> bool:
            found = re.search(r"Starting Spark master at (spark://\S+)", master_log.read_text(errors="replace"))
            if self.master is not None and self.master.poll() is not None:
                raise AssertionError(f"the Spark master exited: {master_log.read_text(errors='replace')[-3000:]}")
            if found:
                url.append(found.group(1))
            return bool(found)

        wait_for("the Spark master", master_up, START_TIMEOUT)
        self.master_url = url[0]
        for worker in self.workers:
            self._start_worker(worker)
        self.wait_registered()

    def _start_worker(self, worker: Worker) -> None:
        tmp, work = worker.root / "tmp", worker.root / "work"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        work.mkdir(parents=True, exist_ok=True)
        env = self._env(worker.host)
        env.update(SPARK_LOCAL_DIRS="/tmp/spark-local", TMPDIR="/tmp")
        command = (
            f"{self._keep_under_tmp(tmp)}mount --rbind '{tmp}' /tmp && "
            f"exec '{self.home}/bin/spark-class' org.apache.spark.deploy.worker.Worker "
            f"--host {worker.host} --port 0 --webui-port 0 --cores {WORKER_CORES} --memory {WORKER_MEMORY} "
            f"--work-dir '{work}' {self.master_url}"
        )
        with open(worker.log, "ab") as log:
            worker.proc = subprocess.Popen(
                [*_unshare(), "sh", "-c", command],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _keep_under_tmp(self, tmp: Path) -> str:
        """Shell commands that keep what the worker needs visible through its private /tmp: the
        top directory under /tmp of the Spark home and of the cluster's root, when they lie there
        (a checkout cloned under /tmp has its virtualenv, and PySpark's distribution, there)."""
        keep = sorted(
            {Path("/tmp", p.resolve().relative_to("/tmp").parts[0]) for p in (self.home, self.root) if _under_tmp(p)}
        )
        return "".join(f"mkdir -p '{tmp / k.name}' && mount --bind '{k}' '{tmp / k.name}' && " for k in keep)

    def _registered(self, worker: Worker) -> bool:
        text = worker.log.read_text(errors="replace") if worker.log.exists() else ""
        # the last start's registration (a restarted worker appends to its log)
        starts = text.split("Started daemon with process name")
        return "Successfully registered with master" in starts[-1]

    def wait_registered(self) -> None:
        for worker in self.workers:
            if worker.proc is not None and worker.proc.poll() is not None:
                raise AssertionError(f"worker {worker.index} exited: {worker.log.read_text(errors='replace')[-3000:]}")
            wait_for(f"worker {worker.index} to register", lambda w=worker: self._registered(w), START_TIMEOUT)

    def ensure_workers(self) -> None:
        """Start again each worker that died (a test killed it), and wait until all are registered."""
        for worker in self.workers:
            if worker.proc is None or worker.proc.poll() is not None:
                self._start_worker(worker)
        self.wait_registered()

    def stop(self) -> None:
        for proc in [w.proc for w in self.workers] + [self.master]:
            if proc is not None and proc.poll() is None:
                for pid in _children(proc.pid):
                    _kill(pid, signal.SIGKILL)
                proc.terminate()
        for proc in [w.proc for w in self.workers] + [self.master]:
            if proc is not None:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=30)

    # ------------------------------------------------------------------------------- faults

    def executors(self) -> list[int]:
        return [pid for w in self.workers for pid in w.executors()]

    def kill_executor(self) -> int:
        """SIGKILL one running executor JVM; returns its pid."""
        pids: list[int] = []
        wait_for("a running executor", lambda: bool(pids.extend(self.executors()) or pids), 60)
        _kill(pids[0], signal.SIGKILL)
        return pids[0]

    def kill_worker(self, index: int = 0) -> None:
        """SIGKILL a worker's JVM and its executors: a machine lost (:meth:`ensure_workers` restarts it)."""
        worker = self.workers[index]
        assert worker.proc is not None
        executors = worker.executors()
        _kill(worker.proc.pid, signal.SIGKILL)
        for pid in executors:
            _kill(pid, signal.SIGKILL)
        worker.proc.wait(timeout=30)

    # ------------------------------------------------------------------------------- jobs

    def submit(
        self,
        script: str,
        args: Sequence[str],
        *,
        conf: dict[str, str] | None = None,
        cwd: Path | None = None,
        master: str | None = None,
    ) -> Submission:
        """``spark-submit --master <this cluster> --jars <the JDBC jar> SCRIPT ARGS``, started
        (``master``: another master, ``local[1]`` for a check of the driver's own)."""
        from spark_jobs.session import find_jdbc_jar

        jar = find_jdbc_jar()
        assert jar is not None
        self._submissions += 1
        settings = {**SUBMIT_CONF, **(conf or {})}
        command = [str(self.home / "bin" / "spark-submit"), "--master", master or self.master_url, "--jars", jar]
        for key, value in settings.items():
            command += ["--conf", f"{key}={value}"]
        command += [script, *args]
        env = self._env("127.0.0.1")
        python = os.environ.get("VIRTUAL_ENV_PYTHON") or _python()
        env.update(PYSPARK_PYTHON=python, PYSPARK_DRIVER_PYTHON=python)
        stderr_path = self.root / f"submit-{self._submissions}.err"
        with open(stderr_path, "w") as err:
            proc = subprocess.Popen(
                command,
                env=env,
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        sub = Submission(proc, stderr_path=stderr_path)
        sub.reader = _read_lines(proc.stdout, sub.lines)
        return sub


def _python() -> str:
    import sys

    return sys.executable


def _read_lines(stream: IO[str] | None, into: list[str]) -> threading.Thread:
    def pump() -> None:
        assert stream is not None
        for line in stream:
            into.append(line.rstrip("\n"))

    thread = threading.Thread(target=pump, daemon=True, name="spark-submit-stdout")
    thread.start()
    return thread


def _kill(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def new_cluster_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="qm-spark-cluster-", dir=shared_root()))
