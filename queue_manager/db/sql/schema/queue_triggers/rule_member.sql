-- The rule that a row's partition is in its tenant's shuffle set, as an expression over a row
-- variable (%1$s) and the sha256 (hex) of its tenant (%2$s), both filled in by format(); by the
-- closed formula of routing.py: partition p lies in group j and must equal that group's pick.
-- Constant arrays give, per partition, the group's first partition, the 1-based offset of its
-- draw in the tenant's sha256 (hex) and the group's size.
CREATE OR REPLACE FUNCTION qm.rule_member(q qm.queues) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    n integer := q.partitions;
    k integer := q.shuffle;
    w integer := qm.draw_width(k);
    per integer := 16 / w;                             -- draws per 16-digit word of the draw hash
    lo_arr integer[];
    off_arr integer[];
    size_arr integer[];
BEGIN
    SELECT array_agg((g.j * n) / k ORDER BY p), array_agg(1 + 16 * (g.j / per) + w * (g.j % per) ORDER BY p),
           array_agg(((g.j + 1) * n) / k - (g.j * n) / k ORDER BY p)
      INTO lo_arr, off_arr, size_arr
      FROM generate_series(0, n - 1) p
     CROSS JOIN LATERAL (SELECT ((p + 1) * k - 1) / n AS j) g;
    RETURN format('%%1$s.partition >= 0 AND %%1$s.partition < %s AND %%1$s.partition - (%L::integer[])[%%1$s.partition + 1] = '
                  '(''x'' || substr(%%2$s, (%L::integer[])[%%1$s.partition + 1], %s))::bit(%s)::integer'
                  ' %%%% (%L::integer[])[%%1$s.partition + 1]',
                  n, lo_arr, off_arr, w, w * 4, size_arr);
END
$$;
