"""What every command group of the ``qm`` command line shares: the ``--topology`` option, the help's
shape (a description and an example per command), durations, JSON output, and running a command with
its exit status (also for ``python -m spark_jobs.<command>``).

Nothing heavy is imported here: ``qm --help`` builds every group's parser, and each command imports
the library it needs (psycopg, the manager, alembic) when it runs.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import textwrap
from collections.abc import Callable
from typing import Any

from queue_manager.domain.durations import parse_duration
from queue_manager.domain.topology import Topology
from queue_manager.errors import QueueManagerError

#: ``add_subparsers()``'s object, which every group's ``register`` adds its commands to
Subparsers = Any


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions wrapped to the terminal paragraph by paragraph; indented lines (the examples)
    kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in text.strip("\n").split("\n\n"):
            lines = para.splitlines()
            if any(line.startswith(" ") for line in lines[1:]) or para.startswith(" "):
                out.append("\n".join(indent + line for line in lines))
            else:
                out.append(
                    textwrap.fill(" ".join(para.split()), width, initial_indent=indent, subsequent_indent=indent)
                )
        return "\n\n".join(out)


def examples(*lines: str) -> str:
    """The ``epilog`` of a command: its examples, one command line each."""
    return "example:\n" + "\n".join(f"  {line}" for line in lines)


def command(
    sub: Subparsers,
    name: str,
    func: Callable[[argparse.Namespace], int],
    *,
    doc: str = "",
    topology: bool = False,
    **defaults: Any,
) -> Any:
    """Add a command that runs ``func``, explained by ``doc`` (default: ``func``'s docstring; its
    shape is :func:`parser`'s); ``topology`` adds ``--topology``, ``defaults`` are more values of
    the parsed arguments."""
    p = parser(sub, name, doc or func.__doc__ or "")
    p.set_defaults(func=func, **defaults)
    return with_topology(p) if topology else p


def group(sub: Subparsers, name: str, doc: str, **options: Any) -> Subparsers:
    """Add a command group (``qm queue``, ``qm local``, ...) explained by ``doc``; returns its
    subparsers (``options``: more of ``add_subparsers``' arguments)."""
    p = parser(sub, name, doc)
    return p.add_subparsers(dest=f"{name}_command", required=True, metavar="COMMAND", title="commands", **options)


def parser(sub: Subparsers, name: str, doc: str) -> Any:
    """Add a command's parser, explained by ``doc``: its first paragraph is the command's line in the
    group's list, the paragraphs after it open its ``--help`` (default: that line as a sentence), and
    the last one, ``example:`` then one command line an indented line, closes it."""
    line, *description, example = inspect.cleandoc(doc).split("\n\n")
    if not example.startswith("example:\n  "):
        raise ValueError(f"the help of {name!r} does not end with its examples")
    line = " ".join(line.split())
    return sub.add_parser(
        name,
        help=line,
        description="\n\n".join(" ".join(para.split()) for para in description) or line[0].upper() + line[1:] + ".",
        epilog=example,
        formatter_class=HelpFormatter,
    )


def duration(text: str) -> float:
    """An argparse type: seconds from ``30``, ``250ms``, ``5min``, ``12h``, ``7d`` (:func:`parse_duration`)."""
    try:
        return parse_duration(text)
    except QueueManagerError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def with_topology(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--topology`` to a command (the topology file; default ``$QM_TOPOLOGY``)."""
    p.add_argument("--topology", metavar="FILE", help="the topology file, TOML (default: $QM_TOPOLOGY)")
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
    except Exception as exc:
        # psycopg is the command's to import (``qm --help`` does without it)
        psycopg = sys.modules.get("psycopg")
        if psycopg is not None and isinstance(exc, psycopg.OperationalError):
            print(f"qm: database unreachable: {exc}".rstrip(), file=sys.stderr)
            return 3
        raise
