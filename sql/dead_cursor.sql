-- Where a listing of dead letters continues after @id: the time that dead
-- letter died, among one app's (or all), NULL if none has that id. A
-- message and an invoke delivery may share an id: the later of the two is
-- taken, so that a page never skips the other (it may list it again).
SELECT max(d.died_at)
FROM dead_letters d
WHERE d.id = @id
  AND (@app_name::text IS NULL OR d.app_id = (SELECT id FROM apps WHERE name = @app_name))
