-- The timeout floors' trigger functions (0047, 0054) are SECURITY DEFINER,
-- and PUBLIC could execute them. Any role, with the TEMP privilege every
-- role has by default, could attach one to a temporary table of its own
-- and fire it with the OLD and NEW rows it chose; run as the owner, it
-- wrote a floor for any queue of any app, up to 12 hours (the longest
-- visibility timeout), pending until a reclaim pass saw it and pending
-- again at each call. The reclaim then gave back that queue's expired
-- leases, a crashed consumer's messages, only once the floor ended.
--
-- EXECUTE is checked when a trigger is created, not when it fires: the
-- triggers on Bellhop's own tables, which the owner created, fire for
-- every role as before. 0051 closed the same hole in
-- bellhop_lease_message, which triggers of every role's INSERTs call, by
-- checking the row instead.
REVOKE EXECUTE ON FUNCTION bellhop_vt_lowered() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION bellhop_vt_removed() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION bellhop_start_vt_floors() FROM PUBLIC;
