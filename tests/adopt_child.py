"""``adopt`` in a child process that halts at a phase until it is killed (for the kill tests).

    python -m tests.adopt_child TOPOLOGY QUEUE DSN PHASE NTH MAPPING_JSON

Runs ``queue_manager.adopt.adopt`` with slices of 100 rows; the NTH time PHASE ("moved",
"published" or "forgotten") has just committed, it prints ``halted at PHASE`` and sleeps, so that
the test can kill it with SIGKILL exactly between two commits.
"""

from __future__ import annotations

import json
import sys
import time

from queue_manager.adopt import AdoptOptions, Phase, adopt
from queue_manager.domain.adopt import AdoptMapping
from queue_manager.domain.topology import Topology


def main() -> None:
    topology, queue, dsn, phase, nth, mapping = sys.argv[1:7]
    seen = 0

    def hook(reached: Phase) -> None:
        nonlocal seen
        if reached == phase:
            seen += 1
            if seen == int(nth):
                print(f"halted at {phase}", flush=True)
                time.sleep(600)

    adopt(Topology.load(topology), queue, dsn, AdoptMapping.build(**json.loads(mapping)), AdoptOptions(100), hook=hook)
    print("finished", flush=True)


if __name__ == "__main__":
    main()
