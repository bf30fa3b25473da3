-- Adds a principal to an app. No row: the app is unknown.
INSERT INTO principals (app_id, name)
SELECT id, @principal_name FROM apps WHERE name = @app_name
RETURNING id
