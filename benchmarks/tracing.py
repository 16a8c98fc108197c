"""The cost of tracing: the receiver library's drain with OpenTelemetry off and on, alternated.

One shard, the e2e benchmark's queue and harness (``benchmarks.e2e``: a manager process, receiver
processes with :class:`receivers.Receiver` and a no-op handler, ``--events`` preloaded). Off:
events without a trace context and no OpenTelemetry in any process (today's path). On: every event
has a traceparent; the receivers make a ``process`` and a settle span per event and the manager a
span for ``--trace-sample`` of its fire and ack batches, into the SDK's batch span processor (an
exporter that drops the spans, so no network is measured). Prints one JSON object: each side's
drain (median of ``--reps`` and the samples), the ratio, and the cost per event in microseconds
(difference of the medians' seconds per event). ``make bench-e2e ARGS=--tracing`` measures the same
inside the full end-to-end run.

    .venv/bin/python -m benchmarks.tracing [--events 30000] [--reps 3] [--receivers 1] [--credit 1000]
                                           [--trace-sample 0.01] [--dsn URI]
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from benchmarks.e2e import QUEUE_SETTINGS, DrainConfig, bench_tracing
from benchmarks.lib.machine import code_version
from benchmarks.lib.report import emit, header
from benchmarks.lib.server import QUEUE, bench_server, one_shard_queue, server_info


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tracing", description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=30_000, help="backlog size of each drain (default 30000)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each side (default 3)")
    p.add_argument("--receivers", type=int, default=1, help="receiver processes (default 1)")
    p.add_argument("--credit", type=int, default=1000, help="handler slots per receiver (default 1000)")
    p.add_argument("--trace-sample", type=float, default=0.01, help="the manager's batch sample (default 0.01)")
    p.add_argument("--dsn", help="administrative database of an existing server (default: an embedded one)")
    args = p.parse_args(argv)
    if min(args.events, args.reps, args.receivers, args.credit) < 1:
        p.error("--events, --reps, --receivers and --credit must be positive")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    code = code_version()
    with bench_server(args.dsn, "tracing") as (_admin, dsn):
        one_shard_queue(dsn, QUEUE, QUEUE_SETTINGS)
        info = server_info(dsn)
        result = bench_tracing(
            dsn, DrainConfig(args.receivers, args.credit, args.credit), args.events, args.reps, args.trace_sample
        )
    emit({**header("tracing"), "code": code, "server": info, "tracing": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
