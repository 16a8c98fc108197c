"""What every command group of the ``qm`` command line shares: the ``--topology`` option, JSON output."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from queue_manager.domain.topology import Topology

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
