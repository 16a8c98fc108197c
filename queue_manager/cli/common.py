"""What every command group of the ``qm`` command line shares: the ``--topology`` option, JSON output,
and running a command with its exit status (also for ``python -m spark_jobs.<command>``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import psycopg

from queue_manager.domain.topology import Topology
from queue_manager.errors import QueueManagerError

#: ``add_subparsers()``'s object, which every group's ``register`` adds its commands to
Subparsers = Any


def with_topology(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--topology`` to a command (the topology file; default ``$QM_TOPOLOGY``)."""
    p.add_argument("--topology", help="topology TOML file (default: $QM_TOPOLOGY)")
    return p


def topology(args: argparse.Namespace) -> Topology:
    """The topology a command was given: ``--topology``, else ``$QM_TOPOLOGY``."""
    return Topology.from_option(args.topology, os.environ)


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def run(args: argparse.Namespace) -> int:
    """Run the parsed command: its own exit status, 2 for a QueueManagerError (its message), 3 for a
    database that cannot be reached."""
    try:
        result: int = args.func(args)
        return result
    except QueueManagerError as exc:
        print(f"qm: error: {exc}", file=sys.stderr)
        return 2
    except psycopg.OperationalError as exc:
        print(f"qm: database unreachable: {exc}".rstrip(), file=sys.stderr)
        return 3
