-- Whether the lease holder `holder` still has a connection to this database: the backend it last
-- renewed the lease from (`holder_pid`), or any other backend its process opened (a manager names
-- each of its connections 'qm-manager-<role> <holder>', cut to the 63 characters of an
-- application_name). A leader's process that died has none: its connections closed with it. A live
-- leader has its session's connections, even while it reconnects its control connection. Only what
-- pg_stat_activity shows every role is read (pid, application_name).
CREATE OR REPLACE FUNCTION qm.holder_connected(holder text, holder_pid integer) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT FROM pg_stat_activity a
         WHERE a.pid = holder_pid
            OR (a.application_name LIKE 'qm-manager-% %'
                AND substr(a.application_name, strpos(a.application_name, ' ') + 1)
                    = left(holder, 63 - strpos(a.application_name, ' ')))
    )
$$;
