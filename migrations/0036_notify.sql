-- Wake-ups: every change a dispatcher must react to is announced on ONE
-- channel, "bellhop". Payloads are small, deterministic text, so that
-- PostgreSQL folds duplicates within a transaction:
--
--   q:<app_id>:<queue_name>   messages were inserted into that queue
--   o:<app_id>:<trigger_id>   invoke_async deliveries were added for a consumer
--   c                         consumers were added, changed or removed
--   h:<token>                 a dispatcher's own heartbeat (sent by its poll)
--   b:<app_id>:<owner>:<queue_name>
--                             a dispatcher marked the queue busy (0041)
--
-- A payload never nears the 8000-byte limit: a queue name is at most 128
-- bytes (constraint queue_messages_queue_name_check), so "q:" payloads are
-- at most 167 bytes.
--
-- The payload does not carry deliver_after. A message due in the future
-- still notifies; the woken dispatcher's claim pass finds nothing ready and
-- reads the queue's next due time in the same round trip, then arms a timer.

-- Statement-level with a transition table: a multi-row INSERT or a COPY
-- sends one notification per distinct (app_id, queue_name), not one per row.
CREATE FUNCTION bellhop_notify_queue_messages() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('bellhop', 'q:' || d.app_id::text || ':' || d.queue_name)
    FROM (SELECT DISTINCT app_id, queue_name FROM new_messages) AS d;
    RETURN NULL;
END
$$;

CREATE TRIGGER queue_messages_notify
    AFTER INSERT ON queue_messages
    REFERENCING NEW TABLE AS new_messages
    FOR EACH STATEMENT EXECUTE FUNCTION bellhop_notify_queue_messages();

CREATE FUNCTION bellhop_notify_outbox() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('bellhop', 'o:' || d.app_id::text || ':' || d.trigger_id::text)
    FROM (SELECT DISTINCT app_id, trigger_id FROM new_rows WHERE source_kind = 'invoke') AS d;
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_notify
    AFTER INSERT ON outbox
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION bellhop_notify_outbox();
