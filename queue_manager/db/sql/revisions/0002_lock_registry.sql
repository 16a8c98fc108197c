-- Revision 0002_lock_registry: the advisory lock classes have one registry, qm.lock_class(purpose)
-- and qm.lock_classes() in SQL (sql/schema/locks/), queue_manager/db/locks.py in Python. The
-- functions that named four of the classes one by one go; nothing calls them once the functions
-- are applied from the source. (A database built from 0001_baseline never had them.)
DROP FUNCTION IF EXISTS qm.wake_lock_key();
DROP FUNCTION IF EXISTS qm.load_lock_key();
DROP FUNCTION IF EXISTS qm.maintenance_lock_key();
DROP FUNCTION IF EXISTS qm.enq_lock_key();
