"""The peers' side of ``benchmarks.e2e``: PgQueuer and Procrastinate measured the way the e2e
benchmark measures this project (a drain of a preloaded backlog; commit -> handler start at a
steady rate), on the same PostgreSQL server in the same run.

These modules run in the peers' own virtualenv (``make bench-peers-setup``: ``.venv-peers/``,
pinned versions in ``requirements.txt``), which does not have this project installed: they
import the standard library, the peer libraries and their drivers, :mod:`benchmarks.peers.harness`
and :mod:`benchmarks.lib.machine`, :mod:`benchmarks.lib.wal` and :mod:`benchmarks.lib.timings`
only. Each prints one JSON object on stdout with its raw timings; ``benchmarks.lib.peers`` (in the
project's virtualenv) runs them and summarises the timings with the same percentile as ours.

    .venv-peers/bin/python -m benchmarks.peers.pgqueuer_e2e drain --dsn URI --events 20000 --procs 2 --batch-size 500
    .venv-peers/bin/python -m benchmarks.peers.procrastinate_e2e latency --dsn URI --events 500 --rate 200
"""
