"""The ``qm`` command line explains itself, and starts light.

- every command has a description and an example in its ``--help``, every option a help text;
- ``qm queue alter`` says "(unchanged if omitted)", ``qm queue create`` its defaults, durations in
  units people read (no ``2.592e+06``);
- ``qm --version``; ``--log-level`` on every command, and the default level per command;
- building the parser (``qm --help``, and before any command runs) imports no migration tool, no
  SQLAlchemy and no reshard workflow: each command imports what it uses (``qm enqueue`` against a
  real shard: tests/integration/test_cli.py). The CPU ``qm --help`` costs is measured by
  ``make bench-cli``.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queue_manager.cli.main import build_parser, log_level
from queue_manager.domain.durations import format_duration, parse_duration
from queue_manager.domain.settings import SETTINGS
from queue_manager.errors import ConfigurationError

#: what building the parser must not load
HEAVY = ("alembic", "sqlalchemy", "queue_manager.reshard.workflow", "queue_manager.db.migrate", "pyspark")


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser of ``qm``, with its command path (``("queue", "alter")``)."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


ALL = list(commands(build_parser()))
LEAVES = [(path, p) for path, p in ALL if p.get_default("func") is not None]


def help_of(*path: str) -> str:
    return dict(ALL)[path].format_help()


def test_every_command_has_a_description_and_an_example() -> None:
    missing = [
        " ".join(path) or "qm"
        for path, p in ALL
        if not (p.description and p.description.strip() and p.epilog and "example:\n  qm " in p.epilog)
    ]
    assert not missing, f"commands without a description or an example: {missing}"
    assert len(LEAVES) > 30


def test_every_option_and_argument_has_a_help_text() -> None:
    missing = [
        f"{' '.join(path)} {action.option_strings or action.dest}"
        for path, p in ALL
        for action in p._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
        and not (action.help and action.help.strip())
    ]
    assert not missing, missing


def test_alter_leaves_what_is_omitted_and_create_shows_its_defaults_in_units() -> None:
    alter, create = (" ".join(help_of("queue", verb).split()) for verb in ("alter", "create"))
    assert "default" not in alter.replace("(default: $QM_TOPOLOGY)", "").replace("--default-priority", "")
    assert alter.count("(unchanged if omitted)") == sum(1 for spec in SETTINGS.values() if spec.flag)
    for text in ("(default 7 days)", "(default 30 days)", "(default 30 s)", "(default 5 min)", "(default 10 years)"):
        assert text in create, text
    for path, p in ALL:
        assert "e+0" not in p.format_help(), f"a number in scientific notation in qm {' '.join(path)} --help"


def test_durations_are_read_in_units() -> None:
    args = build_parser().parse_args(["queue", "alter", "q", "--retention", "14d", "--ack-timeout", "90s"])
    assert (args.retention_seconds, args.ack_timeout_seconds) == (14 * 86400, 90)
    args = build_parser().parse_args(["manager", "--shard", "s0", "--lease-ttl", "2500ms"])
    assert args.lease_ttl == 2.5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["queue", "alter", "q", "--retention", "two weeks"])


@given(st.integers(min_value=1, max_value=10**6), st.sampled_from([0.001, 1, 60, 3600, 86400, 31_557_600]))
def test_a_formatted_duration_reads_back_as_itself(n: int, unit: float) -> None:
    seconds = n * unit
    text = format_duration(seconds)
    assert "e+" not in text and "e-" not in text
    assert parse_duration(text) == pytest.approx(seconds, rel=5e-3)


def test_durations_in_the_units_people_read() -> None:
    assert [format_duration(s) for s in (604_800, 2_592_000, 315_576_000, 300, 30, 1.5, 0.25, 90, 0)] == [
        "7 days",
        "30 days",
        "10 years",
        "5 min",
        "30 s",
        "1.5 s",
        "250 ms",
        "90 s",
        "0 s",
    ]
    assert [parse_duration(t) for t in ("30", "250ms", "5min", "5 min", "12h", "7d", "7 days", "2w")] == [
        30,
        0.25,
        300,
        300,
        43_200,
        604_800,
        604_800,
        1_209_600,
    ]
    for bad in ("", "d", "-5s", "5 fortnights", "1e3"):
        with pytest.raises(ConfigurationError, match="invalid duration"):
            parse_duration(bad)


def test_version() -> None:
    out = subprocess.run([sys.executable, "-m", "queue_manager.cli.main", "--version"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("qm ") and "queue-manager" in out.stdout


def test_every_command_takes_a_log_level_and_each_has_its_default() -> None:
    assert [" ".join(path) for path, p in LEAVES if "--log-level" not in p._option_string_actions] == []
    parse = build_parser().parse_args
    assert log_level(parse(["status"])) == logging.WARNING
    assert log_level(parse(["-v", "status"])) == logging.INFO
    assert log_level(parse(["status", "--log-level", "debug"])) == logging.DEBUG
    assert log_level(parse(["--log-level", "ERROR", "manager", "--shard", "s0"])) == logging.ERROR
    for long_running in (["manager", "--shard", "s0"], ["receive", "--queue", "q", "m:f"], ["web"]):
        assert log_level(parse(long_running)) == logging.INFO
    with pytest.raises(SystemExit):
        parse(["status", "--log-level", "chatty"])


def test_building_the_parser_imports_no_migration_tool_no_sqlalchemy_no_reshard_workflow() -> None:
    code = (
        "import json, sys\n"
        "from queue_manager.cli.main import build_parser\n"
        "build_parser().format_help()\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    heavy = [m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert heavy == []
    assert "queue_manager.manager.server" not in loaded and "websockets" not in loaded
