-- Readies the notification listener's session (notify.Listener) before
-- OnConnect and its LISTENs, in one statement, so in one round trip:
--
-- idle_session_timeout off: set for the role or the database (PostgreSQL
-- 14 and later), it ends the listener's session every timeout, since the
-- server counts a session that waits for notifications as idle, receiving
-- them or not. A statement, not a start-up parameter, which PgBouncer
-- refuses unless told to ignore it (as busy_hold.sql does for the busy-lock
-- connection). The listener never holds a transaction open, so
-- idle_in_transaction_session_timeout (and transaction_timeout) cannot
-- end it.
--
-- UNLISTEN *: a session that a pooler hands over listening already (a
-- session-pooling PgBouncer whose server_reset_query is not DISCARD ALL)
-- would bring notifications on channels the listener has no handler for.
--
-- pg_stat_statements.track_utility off, where the role may set it (a
-- superuser, or one granted SET on it): pg_stat_statements keeps a
-- utility statement's text as it was, so LISTEN on a lease channel
-- (leasing at INSERT) would stay there by name, readable by members of
-- pg_read_all_stats, and the name is what keeps leased payloads from
-- other sessions (docs/lease-at-insert.md). Other roles are refused
-- (insufficient_privilege) and go on: an operator can set it for the
-- dispatcher's role instead. Without the extension loaded, the name is a
-- placeholder that any role may set, and nothing records statements.
--
-- Concurrency: session state only, of a session nothing else uses.
DO $$
BEGIN
    PERFORM set_config('idle_session_timeout', '0', false);
    BEGIN
        PERFORM set_config('pg_stat_statements.track_utility', 'off', false);
    EXCEPTION WHEN insufficient_privilege THEN
        NULL;
    END;
    UNLISTEN *;
END
$$
