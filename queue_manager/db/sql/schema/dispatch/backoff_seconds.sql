-- Back-off before attempt `attempts + 1`: exponential from min, jittered by +-33 %, within [min, max].
CREATE OR REPLACE FUNCTION qm.backoff_seconds(attempts integer, min_s double precision, max_s double precision) RETURNS double precision
LANGUAGE sql VOLATILE PARALLEL SAFE
RETURN least(max_s, greatest(min_s, least(max_s, min_s * power(2.0, least(greatest(attempts - 1, 0), 60))) * (0.67 + random() * 0.66)));
