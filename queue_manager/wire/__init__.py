"""Protocol ``qm.v1``, written once for the manager and the receivers.

- :mod:`.frames` parses and builds frames (the codec; docs/protocol.md is its specification);
- :mod:`.ledger` records which connection holds which event at which attempt;
- :mod:`.session` is the server side of one receiver connection, sans I/O: frames in, actions out;
- :mod:`.client` is the receiver's side of a shard's connections, sans I/O: frames in, frames and
  effects out (with :mod:`.credit`, the credit a receiver's free handler slots allow).

Nothing here does I/O or imports the manager, the database layer or asyncio.
"""
