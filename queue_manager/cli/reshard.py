"""``qm reshard``: move whole shards' key ranges to new shards while they serve (docs/operations.md,
"Resharding").

    qm reshard plan --target NAME RANGE DSN ...    what moves where (nothing changes)
    qm reshard start --target NAME RANGE DSN ...   prepare the targets, capture, copy (rerun resumes)
    qm reshard status [--json]                     phase, rows copied and left, lag, catch-up estimate
    qm reshard sync                                apply the captured changes now
    qm reshard switch [--timeout S]                the cut-over to the targets (rerun resumes)
    qm reshard reverse [--timeout S]               back to the sources (until cleanup)
    qm reshard cleanup                             drop the sources' events; the reshard is over
    qm reshard cancel                              before the switch: drop the copy

Exit status: 0 done, 2 an error (the message says what to do), 3 a database unreachable, 4 a lock
not granted (a lock timeout, or a deadlock with an application's transaction): a cut-over stopped
so rolled back and the sources serve; run the command again.

A RANGE that starts at the keyspace's start begins with "-" (``-40``, ``-a0``) and is read as a
value, not as an option.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from queue_manager.cli.common import command, duration, group
from queue_manager.domain.topology import Shard, shard_from_dict
from queue_manager.errors import ConfigurationError
from queue_manager.reshard.plan import FREEZE_ATTEMPTS, LOCK_TIMEOUT

if TYPE_CHECKING:
    from queue_manager.reshard.workflow import Reshard

#: the exit status of a cut-over stopped by a lock (a lock timeout or a deadlock), rolled back
EXIT_LOCK = 4


class _RangeParser(argparse.ArgumentParser):
    """A parser that reads a key range starting with "-" (``-a0``) as a value, as argparse reads a
    negative number: argparse takes any other word starting with "-" for an option. No option of
    the reshard commands looks like a range (a hex digit after one "-"), which argparse needs for
    this (it checks options against the same pattern)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-[0-9a-fA-F]+$|^-\d*\.\d+$")


def _lock_errors_exit_4(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A cut-over stopped by a lock exits with EXIT_LOCK and says so (never "unreachable")."""

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        from psycopg import errors as pg

        from queue_manager.reshard.workflow import ReshardLockError

        try:
            return func(args)
        except ReshardLockError as exc:
            print(f"qm: {exc.kind}: {exc}", file=sys.stderr)
        except (pg.DeadlockDetected, pg.LockNotAvailable) as exc:
            kind = "deadlock" if isinstance(exc, pg.DeadlockDetected) else "lock timeout"
            print(f"qm: {kind}: {str(exc).strip()}; run the command again", file=sys.stderr)
        return EXIT_LOCK

    return run


def _reshard(args: argparse.Namespace) -> Reshard:
    """The reshard recorded next to the topology file (the workflow, and alembic with it, load here)."""
    from queue_manager.reshard.workflow import Reshard

    return Reshard(_path(args), say=_say)


def _path(args: argparse.Namespace) -> Path:
    path = args.topology or os.environ.get("QM_TOPOLOGY")
    if not path:
        raise ConfigurationError("no topology: pass --topology FILE or set QM_TOPOLOGY")
    return Path(path)


def _targets(args: argparse.Namespace) -> list[Shard]:
    managers: dict[str, list[str]] = {}
    for entry in args.target_manager or []:
        name, sep, url = entry.partition("=")
        if not sep or not name or not url:
            raise ConfigurationError(f"--target-manager {entry!r}: give NAME=URL, e.g. s2=ws://mgr-e:8765/")
        managers.setdefault(name, []).append(url)
    out = []
    for name, spec, dsn in args.target or []:
        urls = managers.pop(name, [])
        out.append(shard_from_dict({"name": name, "dsn": dsn, "range": spec, "managers": urls}, where="--target"))
    if managers:
        raise ConfigurationError(f"--target-manager names no --target: {', '.join(sorted(managers))}")
    return out


def _say(line: str) -> None:
    print(line, flush=True)


def cmd_plan(args: argparse.Namespace) -> int:
    """what moves where (nothing changes)

    Print what a reshard to these targets would move, and the topology file after the switch. Nothing changes.

    example:
      qm reshard plan --target s2 -40 postgresql://db-c/qm --target s3 40-80 postgresql://db-d/qm
    """
    with _reshard(args) as r:
        plan = r.plan(_targets(args))
        for line in plan.describe():
            print(line)
        print("\nthe topology after the switch:\n")
        print(plan.new.to_toml())
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    """prepare the targets, capture changes, copy every event (a rerun resumes)

    Migrate the targets, start capturing the sources' changes, then copy every event of the moving key ranges while the
    sources keep serving. Recorded next to the topology file: a rerun resumes.

    example:
      qm reshard start --target s2 -40 postgresql://db-c/qm --target s3 40-80 postgresql://db-d/qm --target-manager s2=ws://mgr-e:8765/
    """
    with _reshard(args) as r:
        r.start(_targets(args), batch=args.batch)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """phase, rows copied and left, lag, estimated catch-up (also while another command runs)

    example:
      qm reshard status --json
    """
    with _reshard(args) as r:
        data = r.status()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"{data['kind']}: {', '.join(data['sources'])} -> {', '.join(data['targets'])}")
    print(
        f"phase {data['phase']}, the {data['serving']} serve, "
        f"snapshot copy {'complete' if data['copied'] else 'running'}"
    )
    if "cutover" in data:
        c = data["cutover"]
        print(f"cut-over to the {c['to']} interrupted after {c['last_step']!r}: next {c['next_step']!r} (rerun it)")
    for key, entry in data.get("snapshot", {}).items():
        print(f"  {key}: copied up to id {entry['copied_up_to_id']}, {entry['left']} left")
    if "lag" in data:
        lag: dict[str, Any] = data["lag"]
        print(f"lag (changes not yet applied): {', '.join(f'{k} {v}' for k, v in lag.items())}")
        if data["estimated_catch_up_seconds"] is not None:
            print(f"estimated catch-up at the cut-over: {data['estimated_catch_up_seconds']:.3f}s")
    return 0


def cmd_sync(args: argparse.Namespace) -> int:
    """apply the captured changes now

    example:
      qm reshard sync
    """
    with _reshard(args) as r:
        p = r.sync(batch=args.batch)
    print(f"applied {p.rows} changes in {p.seconds:.3f}s")
    return 0


def cmd_switch(args: argparse.Namespace) -> int:
    """cut over to the targets (a rerun resumes an interrupted one)

    The cut-over: freeze the moving ranges' writes (a second or so), apply the last changes, write the new topology
    file; producers, receivers and managers follow it. A rerun resumes an interrupted switch.

    example:
      qm reshard switch --timeout 10
    """
    with _reshard(args) as r:
        r.switch(timeout=args.timeout, lock_timeout=args.lock_timeout)
    return 0


def cmd_reverse(args: argparse.Namespace) -> int:
    """cut back over to the sources (allowed until cleanup)

    example:
      qm reshard reverse
    """
    with _reshard(args) as r:
        r.reverse(timeout=args.timeout, lock_timeout=args.lock_timeout)
    return 0


def cmd_cleanup(args: argparse.Namespace) -> int:
    """after the switch: drop the sources' events; ends the reshard

    example:
      qm reshard cleanup
    """
    with _reshard(args) as r:
        r.cleanup()
    print("cleaned up: the reshard is done")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """before the switch: drop the targets' copy; the sources keep serving

    example:
      qm reshard cancel
    """
    with _reshard(args) as r:
        r.cancel()
    print("cancelled: the sources serve, the targets' copy is dropped")
    return 0


RESHARD_HELP = """split or merge shards online (docs/operations.md, 'Resharding')

Move whole shards' key ranges to new shards while they serve: plan, start (copy), switch (the cut-over), then cleanup;
reverse until cleanup. See docs/operations.md, 'Resharding'.

example:
  qm reshard plan --target s2 -40 DSN --target s3 40-80 DSN
  qm reshard status
"""


def register(sub: Any) -> None:
    """Add ``qm reshard ...`` to the ``qm`` parser's subcommands."""
    verbs = group(sub, "reshard", RESHARD_HELP, parser_class=_RangeParser)

    def with_targets(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--target",
            nargs=3,
            action="append",
            metavar=("NAME", "RANGE", "DSN"),
            help="a new shard: its name, key range (e.g. -40, -a0, 40-80, c0-) and DSN; repeat for each",
        )
        p.add_argument(
            "--target-manager",
            action="append",
            metavar="NAME=URL",
            help="a manager of a target, written to the topology file at the switch for receivers (repeat)",
        )

    with_targets(command(verbs, "plan", cmd_plan, topology=True))
    p = command(verbs, "start", _lock_errors_exit_4(cmd_start), topology=True)
    with_targets(p)
    p.add_argument("--batch", type=int, default=2000, help="events per copy page (default 2000)")
    p = command(verbs, "status", cmd_status, topology=True)
    p.add_argument("--json", action="store_true", help="as JSON")
    p = command(verbs, "sync", _lock_errors_exit_4(cmd_sync), topology=True)
    p.add_argument("--batch", type=int, default=2000, help="changes applied per page (default 2000)")
    for name, func in (("switch", cmd_switch), ("reverse", cmd_reverse)):
        p = command(verbs, name, _lock_errors_exit_4(func), topology=True)
        p.add_argument(
            "--timeout",
            type=duration,
            default=10.0,
            metavar="DURATION",
            help="bound on the frozen catch-up (default 10 s)",
        )
        p.add_argument(
            "--lock-timeout",
            type=duration,
            default=LOCK_TIMEOUT,
            metavar="DURATION",
            help=f"bound on each lock wait of the freeze (default {LOCK_TIMEOUT:g} s; {FREEZE_ATTEMPTS} tries)",
        )
    command(verbs, "cleanup", _lock_errors_exit_4(cmd_cleanup), topology=True)
    command(verbs, "cancel", _lock_errors_exit_4(cmd_cancel), topology=True)
