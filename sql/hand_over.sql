-- Wakes the other dispatchers for queues (q:) and consumers' invoke
-- deliveries (o:) whose next due time a stopping dispatcher may have been
-- the only one to know: a nack sends no notification (nack.sql), so its
-- retry time lived in the nacking lane's timer, which the stop cancelled.
-- Each dispatcher that hears one runs a claim pass, which reads the due
-- time and arms a timer of its own. Without this they would find the
-- retry only at their fallback poll. A lane stopped while producers may
-- have skipped announcing (they saw its busy key) sends one too, for its
-- queue, once they have committed (lane.settleGone).
SELECT count(pg_notify('bellhop', p)) FROM unnest(@payloads::text[]) AS p
