"""Regenerate routing_vectors.json from the Python reference implementation.

Run only when the routing *spec* changes on purpose: the vectors pin the behaviour that
Python, SQL and Spark SQL must all reproduce (tests/*/test_*routing*).
"""

from __future__ import annotations

import json
from pathlib import Path

from queue_manager.domain import routing

TENANTS = [
    "a",
    "tenant-1",
    "tenant-2",
    "acme",
    "Acme",
    "acme ",
    "globex-corp",
    "user:42",
    "42",
    "日本語テナント",
    "émilie",
    "emoji-🚀",
    "x" * 200,
    "tab\tseparated",
    "quote'd",
    'dq"x',
    "0",
    "ff",
    "zz-top",
    "tenant-999",
]
SHAPES = [
    (1, 1),
    (2, 1),
    (16, 4),
    (16, 3),
    (16, 16),
    (10, 3),
    (64, 8),
    (7, 2),
    (1024, 5),
    (5, 5),
    # wide groups (revision 0005): every partition must be reachable
    (1024, 16),
    (256, 10),
    (1000, 9),
    (1024, 1),
    (100, 12),
    (1024, 8),
]


def main() -> None:
    vectors = []
    for t in TENANTS:
        vectors.append(
            {
                "tenant": t,
                "md5": routing.tenant_hash(t),
                "sha256": routing.draw_hash(t),
                "keyspace_hex": routing.keyspace_hex(t),
                "keyspace_id": str(routing.keyspace_id(t)),
                "shuffle": {f"{n}/{k}": list(routing.shuffle_set(t, n, k)) for n, k in SHAPES},
            }
        )
    out = {"shapes": [list(s) for s in SHAPES], "vectors": vectors}
    path = Path(__file__).with_name("routing_vectors.json")
    path.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main()
