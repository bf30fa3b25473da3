-- Inserts one message: enqueue.sql for the common case of a single
-- message, with scalar arguments. enqueue.sql unnests array arguments, and
-- PostgreSQL plans that statement anew on every call (its generic plan
-- assumes arrays of many elements, so a custom plan always looks cheaper):
-- about 0.3 ms per call, a third of a paced enqueue. With scalars the
-- generic plan costs the same as a custom one, and after a few calls the
-- server reuses it. Results, checks and enqueued_at (bellhop.enqueue_seq)
-- are those of enqueue.sql, and so is the lock on the app's row.
WITH app AS (
    SELECT id FROM apps WHERE name = @app_name FOR KEY SHARE
), seq AS MATERIALIZED (
    SELECT coalesce(substring(current_setting('bellhop.enqueue_seq', true) FROM '^[0-9]{1,9}$')::bigint, 0) AS base
), foreign_principal AS (
    SELECT @principal::uuid IS NOT NULL
           AND NOT EXISTS (SELECT 1 FROM principals p JOIN app ON p.app_id = app.id
                           WHERE p.id = @principal::uuid) AS bad
), inserted AS (
    INSERT INTO queue_messages (id, app_id, queue_name, payload, enqueued_at, deliver_after, max_attempts, enqueued_by_principal)
    -- max_attempts defaults as in enqueue.sql.
    SELECT @id::uuid, app.id, @queue_name::text, @payload::jsonb,
           now() + (SELECT base FROM seq) * interval '1 microsecond',
           coalesce(@deliver_after::timestamptz, clock_timestamp() + @delay_us::bigint * interval '1 microsecond'),
           coalesce(@max_attempts::int,
                    (SELECT max_attempts FROM queue_consumers
                     WHERE app_id = app.id AND queue_name = @queue_name::text LIMIT 1),
                    3),
           @principal::uuid
    FROM app
    WHERE NOT (SELECT bad FROM foreign_principal)
    RETURNING 1
), counted AS (
    SELECT c.n, set_config('bellhop.enqueue_seq', (seq.base + c.n)::text, true)
    FROM (SELECT count(*) AS n FROM inserted) AS c, seq
)
SELECT EXISTS (SELECT 1 FROM app) AS app_found,
       (SELECT bad FROM foreign_principal)::int::int8 AS foreign_principals,
       (SELECT n FROM counted) AS inserted,
       CASE WHEN (SELECT bad FROM foreign_principal) THEN 1::int8 END AS first_foreign
