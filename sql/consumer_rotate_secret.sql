-- Gives push consumer @id of app @app_id a new signing secret, made here
-- (bellhop_push_secret) and returned, never sent as a parameter: see
-- consumer_insert.sql. The secret it replaces becomes the previous one,
-- which dispatchers sign with too until @keep_previous_ms from now
-- (migration 0068); 0 drops it at once (a secret that may have leaked).
-- A previous secret from an earlier rotation is replaced, whether or not
-- it had expired. A consumer served by a Go
-- handler (no URL) has no secret, and the statement changes no row.
--
-- One statement on one row: it takes the row's lock, so two rotations at
-- once run one after the other, and the second keeps the first's secret
-- as the previous one. Changing push_secret sends the "c" notification
-- that makes running dispatchers reload their consumers.
UPDATE queue_trigger_details AS d SET
    push_secret_previous       = CASE WHEN @keep_previous_ms::bigint > 0 THEN d.push_secret END,
    push_secret_previous_until = CASE WHEN @keep_previous_ms::bigint > 0
                                      THEN now() + @keep_previous_ms::bigint * interval '1 millisecond' END,
    push_secret                = bellhop_push_secret()
FROM triggers AS t
WHERE d.trigger_id = @id AND t.id = d.trigger_id AND t.kind = 'queue' AND t.app_id = @app_id
  AND d.push_url IS NOT NULL
RETURNING d.push_secret, d.push_secret_previous_until
