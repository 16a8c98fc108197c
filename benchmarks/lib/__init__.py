"""What the benchmarks share, one module per concern (public names only):

- :mod:`benchmarks.lib.server`: ``bench_server`` (a throw-away database on a given or embedded
  server), ``one_shard_queue``, ``server_info``, ``QUEUE`` (the one-shard benchmarks' queue);
- :mod:`benchmarks.lib.backlog`: the queue between measurements: ``reset``, ``preload``,
  ``state_counts``, ``event_rows``;
- :mod:`benchmarks.lib.fleet`: the processes of a one-shard run: ``manager_process``,
  ``start_receivers``, ``start_producer``, ``make_events``;
- :mod:`benchmarks.lib.procs`: their entry points (spawned; the parent uses ``fleet``);
- :mod:`benchmarks.lib.machine`: ``machine_info``, ``code_version``, CPU accounting from /proc
  (``count_server``, ``cpu_snapshot``, ``cpu_delta``); standard library only;
- :mod:`benchmarks.lib.report`: the report's ``header`` and ``emit``, ``run_main`` (the
  ``__main__`` block of a long benchmark: its exit status, Ctrl-C quiet), ``summary_ms``,
  ``pct_ms``, ``depth_series``, ``median_of``, ``ratio``; every percentile is
  :func:`queue_manager.domain.stats.percentile`;
- :mod:`benchmarks.lib.timings`: an e2e latency run's ``first_receipts`` and ``latencies`` (ours and the
  peers'; standard library only);
- :mod:`benchmarks.lib.peers`: the PgQueuer/Procrastinate comparison of the e2e benchmark.

A new benchmark is a module ``benchmarks/<name>.py`` with a ``main()`` run under
``if __name__ == "__main__"``, a ``make bench-<name>`` target, and a typical head of::

    from benchmarks.lib.machine import code_version, machine_info
    from benchmarks.lib.report import emit, header
    from benchmarks.lib.server import bench_server, one_shard_queue, server_info
"""
