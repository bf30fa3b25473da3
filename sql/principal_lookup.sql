-- Resolves an app name and one of its principals, named by id or, when
-- principal_id is NULL, by name. No row: the app is unknown. A NULL
-- principal id: the app has no such principal (the principal may belong
-- to another app). The principal's name lets a client acting as one
-- principal refuse to name another.
SELECT a.id, p.id, p.name
FROM apps a
LEFT JOIN principals p
       ON p.app_id = a.id
      AND (p.id = @principal_id OR (@principal_id::uuid IS NULL AND p.name = @principal_name))
WHERE a.name = @app_name
