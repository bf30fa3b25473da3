-- Sets or refreshes this dispatcher's busy mark on a queue, with a lease
-- of lease_ms from now (the database's clock, which producers read too).
-- Sent in the same round trip as a claim pass while the queue is busy (a
-- backlog, or a steady stream: lane.go, DispatcherConfig.BusyWindow), on
-- the first busy pass and then once half the lease has gone. When the
-- mark is new (no live mark of this owner before), it
-- also tells every dispatcher ("b:<app_id>:<owner>:<queue>"), so that idle
-- ones watch the queue until the mark is gone, then make sure no producer
-- that skipped its notification is left unclaimed: that bounds how long a
-- crash or a stop of this dispatcher can leave messages unannounced.
WITH prev AS (
    SELECT lease_until > clock_timestamp() AS live
    FROM queue_busy
    WHERE app_id = @app_id AND queue_name = @queue_name AND owner = @owner
), up AS (
    INSERT INTO queue_busy AS b (app_id, queue_name, owner, lease_until)
    VALUES (@app_id, @queue_name, @owner, clock_timestamp() + @lease_ms * interval '1 millisecond')
    ON CONFLICT (app_id, queue_name, owner) DO UPDATE SET lease_until = EXCLUDED.lease_until
    RETURNING 1
)
SELECT count(pg_notify('bellhop', 'b:' || @app_id::uuid::text || ':' || @owner::uuid::text || ':' || @queue_name::text))
FROM up
WHERE NOT coalesce((SELECT live FROM prev), false)
