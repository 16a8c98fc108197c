-- The tenant's shuffle set of k partitions of N, ascending, as specified in routing.py: N is cut
-- into k groups, and group j's pick is its first partition + a draw of w hex digits of the tenant's
-- draw hash (7 digits up to k = 8, 4 beyond; never straddling a 16-digit word) modulo its size.
-- Used by qm.refuse_event's messages and by tests; the generated code has the same formula inline.
CREATE OR REPLACE FUNCTION qm.shuffle_set(tenant text, n integer, k integer) RETURNS smallint[]
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    g text := qm.draw_hex(tenant);
    w integer := qm.draw_width(k);
    per integer := 16 / w;
    lo integer;
    hi integer;
    picks smallint[] := '{}';
BEGIN
    IF n < 1 OR n > 1024 OR k < 1 OR k > 16 OR k > n THEN
        RAISE EXCEPTION 'qm.shuffle_set: need 1 <= k <= min(n, 16) and 1 <= n <= 1024, got n=%, k=%', n, k
            USING ERRCODE = '22023';
    END IF;
    FOR j IN 0 .. k - 1 LOOP
        lo := (j * n) / k;
        hi := ((j + 1) * n) / k;
        picks := picks || (lo + ('x' || lpad(substr(g, 1 + 16 * (j / per) + w * (j % per), w), 8, '0'))::bit(32)::integer
                                % (hi - lo))::smallint;
    END LOOP;
    RETURN picks;
END
$$;
