-- The maintenance jobs whose slices are counted shard-wide, in this order (qm.maintenance_counts).
-- Each has four sequences, qm.maint_<job>_{recruited,finished,aborted,events}: a job added here
-- needs a revision that creates its sequences.
CREATE OR REPLACE FUNCTION qm.maintenance_jobs() RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN ARRAY['collector', 'retention', 'reconciliation'];
