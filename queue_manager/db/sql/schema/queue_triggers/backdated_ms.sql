-- How much older than its insert a row's fire_at may be and still not be announced to a manager
-- that is not waiting (see qm.verify_source): the manager's picks start at what it has already
-- fired, and only a notice tells it to look further back.
CREATE OR REPLACE FUNCTION qm.backdated_ms() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN 10;
