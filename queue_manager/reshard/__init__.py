"""Online resharding: move whole shards' key ranges to new shards while they serve (``qm reshard``).

``plan`` is the pure core (which shards move where, the state machine of a reshard and its
cut-over steps); ``workflow`` moves the rows and runs the steps against the databases.
docs/operations.md, "Resharding", is the runbook.
"""
