-- claim_token and claimed_at are set and cleared together: a claim or a
-- lease sets both, a settle or a reclaim clears both. A row with a token
-- but no claimed_at would be neither claimable (claim_token IS NULL) nor
-- reclaimable (claimed_at < now() - timeout is NULL): a committed message
-- never delivered. Bellhop never writes one, but producers may INSERT
-- directly (docs/roles.sql lets the producer role set only the message's
-- own columns; an owner or superuser can set any). The CHECK makes such an
-- INSERT fail and name the constraint. Of the outbox it covers the invoke
-- deliveries only: the other kinds belong to the base system.
--
-- Rows that already break it are freed first, so that none is stuck and
-- the constraint can be added: they were never leased by Bellhop.
--
-- Both tables are locked first, in one order, for the whole migration: the
-- ALTERs need ACCESS EXCLUSIVE, and asking for it only after the UPDATEs'
-- weaker locks could deadlock with a dispatcher's statement that holds one
-- table and wants the other. Producers and dispatchers wait while the
-- tables, which hold the backlog and pending invoke deliveries, are read.
LOCK TABLE queue_messages, outbox IN ACCESS EXCLUSIVE MODE;

UPDATE queue_messages SET claim_token = NULL, claimed_at = NULL
WHERE (claim_token IS NULL) <> (claimed_at IS NULL);

UPDATE outbox SET claim_token = NULL, claimed_at = NULL
WHERE source_kind = 'invoke' AND (claim_token IS NULL) <> (claimed_at IS NULL);

ALTER TABLE queue_messages
    ADD CONSTRAINT queue_messages_claim_pair_check
        CHECK ((claim_token IS NULL) = (claimed_at IS NULL));

ALTER TABLE outbox
    ADD CONSTRAINT outbox_claim_pair_check
        CHECK (source_kind <> 'invoke' OR (claim_token IS NULL) = (claimed_at IS NULL));
