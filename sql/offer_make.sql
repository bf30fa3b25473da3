-- Makes one offer (migrations/0044_lease_at_insert.sql): the next ready
-- message a producer inserts into the queue is leased under @token and
-- announced on @channel. Returns the database's clock at the statement's
-- start, which bounds how far ahead of the dispatcher's clock the
-- database's is (offers.go, timedRow; a producer's claimed_at is later
-- than it).
-- @consumer_id names the lane's consumer, whose visibility timeout the
-- producer's lease reads by primary key (migration 0047).
INSERT INTO bellhop_offers (token, app_id, queue_name, owner, channel, expires_at, consumer_id)
VALUES (@token, @app_id, @queue_name, @owner, @channel, now() + make_interval(secs => @ttl_ms::float8 / 1000),
        @consumer_id)
RETURNING statement_timestamp() AS db_start
