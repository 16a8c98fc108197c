-- How many hex digits of the tenant's draw hash one group's draw takes, for a shuffle set of k
-- partitions (routing.draw_width): 7 up to k = 8, 4 beyond, so that the draws of a 16-digit word
-- never straddle two words (16 / w draws per word).
CREATE OR REPLACE FUNCTION qm.draw_width(k integer) RETURNS integer
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN CASE WHEN k <= 8 THEN 7 ELSE 4 END;
