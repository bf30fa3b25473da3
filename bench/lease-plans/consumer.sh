# Sourced by run.sh and wal.sh: registers app $app's consumer of queue q,
# if it has none, with SQL. Since migration 0047 a producer leases only to
# an offer whose consumer still serves the queue. Needs the caller's psql
# function (with its URL) and $app.

principal=$(psql -c "INSERT INTO principals (app_id, name) VALUES ('$app', 'lease-bench') ON CONFLICT (app_id, name) DO UPDATE SET name = EXCLUDED.name RETURNING id")
psql -c "WITH t AS (INSERT INTO triggers (app_id, kind, principal_id)
                    SELECT '$app', 'queue', '$principal'
                    WHERE NOT EXISTS (SELECT 1 FROM queue_consumers WHERE app_id = '$app' AND queue_name = 'q')
                    RETURNING id)
         INSERT INTO queue_trigger_details (trigger_id, queue_name) SELECT id, 'q' FROM t"
