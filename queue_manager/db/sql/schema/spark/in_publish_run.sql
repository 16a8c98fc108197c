-- Whether the caller runs inside qm.publish_run (its call is in the PL/pgSQL call stack): the verify
-- triggers leave their rules to the Spark publish, which tests them set-wise, only then, so that
-- setting qm.publish_checked elsewhere skips nothing. Called only when that setting names the queue.
CREATE OR REPLACE FUNCTION qm.in_publish_run() RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    stack text;
BEGIN
    GET DIAGNOSTICS stack = PG_CONTEXT;
    RETURN position('function qm.publish_run(' IN stack) > 0;
END
$$;
