"""Fault injection for tests: the fault suite's TCP proxy (faults/proxy.py), which can cut, stall
and slow a client's link to its server."""

from faults.proxy import TcpProxy

__all__ = ["TcpProxy"]
