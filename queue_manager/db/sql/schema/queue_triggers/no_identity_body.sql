-- The body of a queue's route and verify functions while the shard has no identity (qm migrate
-- never ran on it): every insert is refused, with what to run.
CREATE OR REPLACE FUNCTION qm.no_identity_body() RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN E'BEGIN\n    RAISE EXCEPTION ''this database has no shard identity yet'' USING ERRCODE = ''55000'', '
       'HINT = ''run: qm migrate --topology <file>'';\nEND';
