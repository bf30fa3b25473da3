-- Serialises the registrations of a consumer for one (app_id,
-- queue_name) until the end of the transaction (RegisterConsumer takes
-- it; changes and removals find the consumer by id). A unique index
-- cannot enforce one consumer per queue, because queue_trigger_details
-- does not hold the app_id; this lock makes check-then-insert safe.
-- The two-key form keeps Bellhop's locks apart from other advisory locks:
-- key 1 is 'bell' in ASCII.
SELECT pg_advisory_xact_lock(1650814060, hashtext(@app_id::uuid::text || ':' || @queue_name::text))
