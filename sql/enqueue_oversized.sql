-- The position (from 1) of the first payload of a batch that is over 1 MiB
-- as jsonb text, the form the table's constraint measures: that constraint
-- refuses the whole batch without saying which message, and the error
-- should. Run only after such a refusal, outside its (aborted)
-- transaction; it reads no table.
SELECT min(ord)::int
FROM unnest(@payloads::jsonb[]) WITH ORDINALITY AS u(payload, ord)
WHERE octet_length(payload::text) > 1048576
