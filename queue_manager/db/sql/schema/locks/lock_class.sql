-- The advisory lock class of a purpose (qm.lock_classes() lists them). IMMUTABLE: a call with a
-- constant argument is folded into the plan of the statement that makes it, once per plan, so a
-- lock written pg_advisory_xact_lock(qm.lock_class('wake'), q.id) costs what a literal class does.
-- An unknown purpose is an error, never a NULL class (with which the lock functions would lock
-- nothing and say so by returning NULL).
CREATE OR REPLACE FUNCTION qm.lock_class(purpose text) RETURNS integer
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    found_class integer;
BEGIN
    SELECT l.lock_class INTO found_class FROM qm.lock_classes() l WHERE l.purpose = lock_class.purpose;
    IF found_class IS NULL THEN
        RAISE EXCEPTION 'no advisory lock class named %; known: %', quote_nullable(purpose),
            (SELECT string_agg(l.purpose, ', ') FROM qm.lock_classes() l)
            USING ERRCODE = '22023';
    END IF;
    RETURN found_class;
END
$$;
