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
-- Concurrency: session state only, of a session nothing else uses.
DO $$
BEGIN
    PERFORM set_config('idle_session_timeout', '0', false);
    UNLISTEN *;
END
$$
