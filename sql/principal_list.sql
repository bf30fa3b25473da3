-- Principals, optionally of one app, by app and principal name. A plain
-- read of committed rows: a principal added meanwhile is listed or not.
SELECT p.id, a.name, p.name, p.created_at
FROM principals p
JOIN apps a ON a.id = p.app_id
WHERE @app_name::text IS NULL OR a.name = @app_name
ORDER BY a.name, p.name
