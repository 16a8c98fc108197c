"""JSON-printing benchmarks: each module here is one benchmark, run from the project root as
``.venv/bin/python -m benchmarks.<name>`` (``make bench-<name>``), one JSON object on stdout,
logs on stderr. The helpers they share are the public names of :mod:`benchmarks.lib`; a
benchmark imports no other benchmark (tests/unit/test_benchmark_imports.py). The peers' side of
the e2e comparison is :mod:`benchmarks.peers`.
"""
