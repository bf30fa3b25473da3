-- Resolves an app name and one of its principals' names. No row: the app
-- is unknown. A NULL principal id: the app has no principal of that name.
SELECT a.id, p.id
FROM apps a
LEFT JOIN principals p ON p.app_id = a.id AND p.name = @principal_name
WHERE a.name = @app_name
