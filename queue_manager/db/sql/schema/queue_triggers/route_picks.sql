-- The statements of the route trigger that pick the row's partition, from g (the tenant's sha256,
-- hex) and the queue's counters (seqs, dseqs), ending with the assignment to NEW.partition.
-- b<i> is the 64-bit value of the i-th 16-digit word of g; group j's draw (w hex digits at digit
-- o = w * (j mod per) of word j div per) is bits [64 - 4(o + w), 64 - 4o) of that word, and its
-- pick (+ 1) is c<j> = lo_j + 1 + draw mod size_j (for a power-of-two size_j that is
-- draw & (size_j - 1): one operator less per pick). With load * 2048 + c as key, least() gives the
-- least-loaded pick, ties to the lowest partition. load = enqueue counter - published done counter,
-- both sequences: reading a sequence is a function call in the same expression, where reading a
-- table would be a query.
CREATE OR REPLACE FUNCTION qm.route_picks(q qm.queues) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    n integer := q.partitions;
    k integer := q.shuffle;
    w integer := qm.draw_width(k);
    per integer := 16 / w;                             -- draws per 16-digit word of the draw hash
    size_j integer;
    words text := '';
    picks text := '';
    keys text[] := '{}';
BEGIN
    FOR i IN 0 .. (k - 1) / per LOOP
        words := words || format(E'    b%s := (''x'' || substr(g, %s, 16))::bit(64)::bigint;\n', i, 1 + 16 * i);
    END LOOP;
    FOR j IN 0 .. k - 1 LOOP
        size_j := ((j + 1) * n) / k - (j * n) / k;
        picks := picks || format(E'    c%s := %s + ', j, (j * n) / k + 1)
                 || CASE WHEN size_j & (size_j - 1) = 0
                         THEN format(E'((b%s >> %s) & %s);\n', j / per, 64 - 4 * (w * (j % per) + w), size_j - 1)
                         ELSE format(E'((b%s >> %s) & %s) %% %s;\n', j / per, 64 - 4 * (w * (j % per) + w),
                                     (1::bigint << (4 * w)) - 1, size_j)
                    END;
        keys := keys || format('(coalesce(pg_sequence_last_value(seqs[c%1$s]), 0) '
                               '- coalesce(pg_sequence_last_value(dseqs[c%1$s]), 0)) * 2048 + c%1$s', j);
    END LOOP;
    RETURN words || picks
           || CASE WHEN k = 1 THEN E'    NEW.partition := c0 - 1;\n'
                   ELSE format(E'    NEW.partition := (least(%s) & 2047) - 1;\n', array_to_string(keys, E',\n        '))
              END;
END
$$;
