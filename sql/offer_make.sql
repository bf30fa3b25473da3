-- Makes one offer (migrations/0044_lease_at_insert.sql): the next ready
-- message a producer inserts into the queue is leased under @token and
-- announced on @channel. Returns the database's clock, read after the
-- offer was written, which bounds how far ahead of the dispatcher's clock
-- the database's is (a producer's claimed_at is later than it).
INSERT INTO bellhop_offers (token, app_id, queue_name, owner, channel, expires_at)
VALUES (@token, @app_id, @queue_name, @owner, @channel, now() + make_interval(secs => @ttl_ms::float8 / 1000))
RETURNING clock_timestamp() AS db_now
