"""``python -m conformance``: the qm.v1 conformance suite (docs/conformance.md).

Starts a shard and two managers, then runs every case against each client under test, printing one
JSON line per (client, case): ``{"client", "case", "status": "pass"|"fail"|"skip", "detail",
"seconds"}``. Exits 1 when a case failed.

    python -m conformance                          # the Python library and the TypeScript client
    python -m conformance --client python --case drain
    python -m conformance --command mine="./my-client --verbose"   # any client under the contract
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from conformance.cases import CASES, run_case
from conformance.fleet import running

ROOT = Path(__file__).resolve().parents[1]
#: the clients this repository ships, and the command that starts each under the contract
CLIENTS: dict[str, list[str]] = {
    "python": [sys.executable, "-m", "conformance.python_client"],
    "typescript": ["node", str(ROOT / "clients" / "typescript" / "dist" / "src" / "conformance.js")],
}


def missing(client: str, command: list[str]) -> str | None:
    """Why a client cannot start here (None when it can)."""
    if shutil.which(command[0]) is None:
        return f"{command[0]} is not installed (make setup installs it)"
    if client == "typescript" and not Path(command[1]).exists():
        return f"{command[1]} is not built (make setup builds clients/typescript)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__.splitlines()[0])
    parser.add_argument("--client", action="append", choices=sorted(CLIENTS), help="a shipped client (repeat)")
    parser.add_argument("--command", action="append", default=[], metavar="NAME=COMMAND", help="another client")
    parser.add_argument("--case", action="append", choices=list(CASES), help="run only this case (repeat)")
    args = parser.parse_args(argv)
    clients = {name: CLIENTS[name] for name in (args.client or ([] if args.command else list(CLIENTS)))}
    for value in args.command:
        name, sep, command = value.partition("=")
        if not sep or not name or not command.strip():
            parser.error(f"--command takes NAME=COMMAND, got {value!r}")
        clients[name] = shlex.split(command)
    cases = args.case or list(CASES)
    failed = False
    logs = Path(tempfile.mkdtemp(prefix="qm-conformance-logs-"))
    with running() as fleet:
        for client, command in clients.items():
            why = missing(client, command)
            for case in cases:
                if why is not None:
                    result = {"client": client, "case": case, "status": "fail", "detail": why, "seconds": 0}
                else:
                    result = run_case(case, fleet, client, command, logs)
                failed |= result["status"] == "fail"
                print(json.dumps(result), flush=True)
    if not failed:
        shutil.rmtree(logs, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
