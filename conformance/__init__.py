"""The conformance suite of protocol qm.v1: real shards and managers, a client under test driven
through a small command-line contract (:mod:`conformance.contract`), one JSON line per (client,
case). ``python -m conformance``; docs/conformance.md."""
