-- Whether a consumer's push secret is @secret, for `bellhop setup-demo`,
-- which keeps a consumer whose secret file still holds its secret. The
-- comparison happens here so that the secret is never read back out. No
-- row: the consumer is gone.
SELECT coalesce(push_secret = @secret, false) FROM queue_consumers WHERE id = @id
