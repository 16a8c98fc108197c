"""The registry of advisory locks: every advisory lock the queue manager takes has its class here.

Every lock is the two-key form, ``pg_advisory*(class integer, key integer)``. The class is one of
the fixed values below, one per purpose; the key says which object of that purpose is locked. No
lock takes a queue id (or anything else that varies) as its class, and none uses the one-key
(bigint) form, which PostgreSQL keeps in a key space of its own: two purposes never wait on each
other, whatever the queue ids, names and hashes.

SQL spells a class ``qm.lock_class('wake')`` (``qm.lock_classes()`` lists them all, for reading
``pg_locks``: ``pg_locks.classid`` is the class, ``objid`` the key, ``objsubid`` 2); Python spells it
``LockClass.WAKE``. Both lists live in one place each: this module and
``sql/schema/locks/lock_classes.sql``. ``tests/unit/test_lock_registry.py`` checks that they are the
same and that no SQL or Python source takes an advisory lock of a class spelled any other way;
``tests/integration/test_lock_registry.py`` checks every function of a migrated database, the
generated ones of each queue included.

A class that is no longer used is removed, and its number is not given to another purpose (29038
and 29040 held the load counters' locks until the counters became approximate by design).
"""

from __future__ import annotations

from enum import IntEnum


class LockClass(IntEnum):
    """One advisory lock class per purpose; the comment of each says what its key is."""

    #: key 0: one migration of a database at a time (queue_manager.db.migrate, alembic/env.py);
    #: transaction-level, exclusive
    MIGRATION = 29036
    #: key: queue id. A manager waiting for a queue's events holds it exclusively (session-level);
    #: a producer's statement trigger tries it shared and sends NOTIFY when the try fails (docs/design.md,
    #: "Waking the manager without a NOTIFY per producer")
    WAKE = 29037
    #: key: the job's position in qm.maintenance_jobs() (1, 2, 3). Adds up the events counter of a
    #: maintenance job across managers (qm.count_maintenance); transaction-level, exclusive
    MAINTENANCE = 29039
    #: key: hashtext(adoption name). One run of an adoption at a time, on every shard (adopt.sql);
    #: session-level
    ADOPT = 29041
    #: key: hashtext(queue || chr(31) || run id). One live Spark enqueue run per (queue, run id), on
    #: the coordinating shard (spark.sql); session-level
    SPARK_RUN = 29042
    #: key: hashtext(queue id || chr(31) || tenant || chr(31) || dedup key). Serialises producers of
    #: one dedup key in the route trigger, so READ COMMITTED sees a committed twin; transaction-level
    DEDUP = 29043
    #: key 0: one reshard process at a time, taken on every shard of the reshard (queue_manager.reshard);
    #: session-level
    RESHARD = 29044

    @property
    def purpose(self) -> str:
        """The name SQL gives the class: ``qm.lock_class('<purpose>')``."""
        return self.name.lower()
