-- Whether a consumer's push secret is the one whose SHA-256, after the
-- prefix 'bellhop secret check:', is @secret_sha256, for `bellhop setup-demo`, which keeps a consumer whose
-- secret file still holds its secret. The comparison happens here so
-- that the secret is never read back out, and on digests so that it is
-- never sent either: a server run with log_statement = all or
-- log_min_duration_statement = 0 writes every bind parameter to its log.
-- The prefix keeps the digest from ever being one HMAC could sign with:
-- HMAC hashes a key longer than SHA-256's block (64 bytes) to the plain
-- SHA-256 of it. No row: the consumer is gone.
SELECT coalesce(sha256(convert_to('bellhop secret check:' || push_secret, 'UTF8')) = @secret_sha256::bytea, false)
FROM queue_consumers WHERE id = @id
