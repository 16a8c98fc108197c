"""The fault suite (``make faults``): a workload on two shards under a nemesis, a recorded history,
and a checker over it (docs/faults.md).

* :mod:`faults.history`: the records and their JSON-lines files;
* :mod:`faults.checker`: the pure checker (history in, counts and verdict out);
* :mod:`faults.proxy`, :mod:`faults.cluster`, :mod:`faults.workload`, :mod:`faults.receiver_proc`,
  :mod:`faults.nemesis`: the harness (real servers, real processes);
* ``python -m faults``: the command line.
"""
