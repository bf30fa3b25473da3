-- Withdraws offers: those of @tokens, or all of @owner's when @tokens is
-- NULL (a stopping dispatcher). Skips offers a producer has locked: it is
-- taking them, and its lease is then found by offer_recover.sql. Returns
-- the tokens withdrawn, whose leases can no longer be made.
DELETE FROM bellhop_offers AS o
WHERE o.token IN (SELECT token FROM bellhop_offers
                  WHERE owner = @owner AND (@tokens::uuid[] IS NULL OR token = ANY(@tokens::uuid[]))
                  FOR UPDATE SKIP LOCKED)
RETURNING o.token
