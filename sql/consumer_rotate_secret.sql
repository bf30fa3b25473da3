-- Gives push consumer @id of app @app_id a new signing secret, made here
-- (bellhop_push_secret) and returned, never sent as a parameter: see
-- consumer_insert.sql. The secret it replaces becomes the previous one,
-- which dispatchers sign with too until @keep_previous_ms from now
-- (migration 0068); 0 drops it at once (a secret that may have leaked),
-- and with it any previous one still signing.
--
-- A rotation that would keep the current secret while an earlier
-- rotation's previous one still signs changes no row (the caller says
-- why): it would drop that one at once, unasked, and the receivers still
-- on it would fail. Nor does a consumer served by a Go handler (no URL),
-- or one whose secret is missing (a row changed by hand), which has none
-- to keep. An expired previous secret is replaced.
--
-- One statement on one row: it takes the row's lock, so two rotations at
-- once run one after the other, and the second sees the first's previous
-- secret. Changing push_secret sends the "c" notification that makes
-- running dispatchers reload their consumers.
UPDATE queue_trigger_details AS d SET
    push_secret_previous       = CASE WHEN @keep_previous_ms::bigint > 0 THEN d.push_secret END,
    push_secret_previous_until = CASE WHEN @keep_previous_ms::bigint > 0
                                      THEN now() + @keep_previous_ms::bigint * interval '1 millisecond' END,
    push_secret                = bellhop_push_secret()
FROM triggers AS t
WHERE d.trigger_id = @id AND t.id = d.trigger_id AND t.kind = 'queue' AND t.app_id = @app_id
  AND d.push_url IS NOT NULL
  AND (@keep_previous_ms::bigint = 0
       OR (d.push_secret IS NOT NULL
           AND (d.push_secret_previous_until IS NULL OR d.push_secret_previous_until <= now())))
RETURNING d.push_secret, d.push_secret_previous_until
