-- Creates an app and its "default" principal in one statement, so an app
-- never exists without a principal to act for it.
WITH app AS (
    INSERT INTO apps (name) VALUES (@name)
    RETURNING id, name, created_at
), principal AS (
    INSERT INTO principals (app_id, name) SELECT id, 'default' FROM app
    RETURNING id
)
SELECT app.id, app.name, app.created_at, principal.id FROM app, principal
