-- All apps, by name.
SELECT id, name, created_at FROM apps ORDER BY name
