-- The name of the app a principal belongs to (no row: no such principal).
-- A Client made with As lists this app's queues, consumers and dead
-- letters when it names none, never every app's.
SELECT a.name FROM principals p JOIN apps a ON a.id = p.app_id WHERE p.id = @principal_id
