#!/bin/sh
# What the producer's enqueue statement costs the server beyond a plain
# INSERT into the seed's table, with and without the notify trigger.
#
#   bench/enqueue-cost/run.sh DATABASE_URL [SECONDS] [ROUNDS] [RATE]
#
# DATABASE_URL names a scratch database that this script migrates (with
# `go run ./cmd/bellhop migrate`, so run it from the repository root).
# The server must preload pg_stat_statements. pgbench and psql must be on
# PATH (on Debian: /usr/lib/postgresql/15/bin).
#
# Four cases, one pgbench client each at RATE transactions a second
# (default 100, paced as the latency scenario's producer), for SECONDS
# (default 10), repeated ROUNDS times (default 5), interleaved:
#
#   enqueue          sql/enqueue_one.sql as Client.Enqueue sends it (its
#                    parameters as literals), notify trigger on
#   insert           a plain INSERT of the same message, trigger on
#   insert, no trig  the plain INSERT, trigger disabled
#   enqueue, no trig sql/enqueue_one.sql, trigger disabled
#
# Each line gives pgbench's per-statement latency (client side: the round
# trip and the commit with its WAL flush) and the statement's mean
# execution time from pg_stat_statements (server side, the commit not
# included: the notify trigger's function and, since migration 0067, the
# foreign key's check run there; queueing them is the statement's).
# The script enables the trigger when it ends, interrupted or not, and
# stops if pgbench fails.
set -eu
url=${1:?usage: run.sh DATABASE_URL [SECONDS] [ROUNDS] [RATE]}
secs=${2:-10}
rounds=${3:-5}
rate=${4:-100}
dir=$(dirname "$0")

psql() { PGOPTIONS="-c client_min_messages=warning" command psql -X -q -At -v ON_ERROR_STOP=1 "$url" "$@"; }

go run ./cmd/bellhop --database-url "$url" migrate >/dev/null
psql -c "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"
bellhop() { go run ./cmd/bellhop --database-url "$url" "$@" >/dev/null; }
# The app and its consumer (whose max_attempts the enqueue statement
# reads), through the CLI as a user would make them, once.
if [ -z "$(psql -c "SELECT id FROM apps WHERE name = 'enqueue-cost'")" ]; then
    bellhop app create enqueue-cost
fi
app=$(psql -c "SELECT id FROM apps WHERE name = 'enqueue-cost'")
if [ "$(psql -c "SELECT count(*) FROM queue_consumers WHERE app_id = '$app' AND queue_name = 'q'")" = 0 ]; then
    bellhop consumer add --app enqueue-cost --queue q --url http://127.0.0.1:9/hook
fi

enqueue=$(mktemp)
insert=$(mktemp)
out=$(mktemp)
# restore runs once, on exit or on a signal: dash runs no EXIT trap when
# a signal ends it, which left the trigger disabled.
restored=
restore() {
    [ -z "$restored" ] || return 0
    restored=1
    rm -f "$enqueue" "$insert" "$out"
    psql -c "ALTER TABLE queue_messages ENABLE TRIGGER queue_messages_notify" ||
        echo "run.sh: could not enable trigger queue_messages_notify again" >&2
}
trap restore EXIT
trap 'restore; exit 130' INT
trap 'restore; exit 143' TERM
trap 'restore; exit 129' HUP
grep -v '^ *--' "$dir/../../sql/enqueue_one.sql" |
    sed -e "s/@app_name/'enqueue-cost'/g" -e "s/@principal/NULL/g" -e "s/@id/gen_random_uuid()/g" \
        -e "s/@queue_name/'q'/g" -e "s/@payload/'{\"n\":1}'/g" -e "s/@deliver_after/NULL/g" \
        -e "s/@delay_us/0/g" -e "s/@max_attempts/NULL/g" | tr '\n' ' ' >"$enqueue"
echo ';' >>"$enqueue"
if grep -q @ "$enqueue"; then
    echo "run.sh: sql/enqueue_one.sql has a parameter this script does not fill: $(grep -o '@[a-z_]*' "$enqueue" | head -1)" >&2
    exit 1
fi
printf "INSERT INTO queue_messages (id, app_id, queue_name, payload) VALUES (gen_random_uuid(), '%s', 'q', '{\"n\":1}');\n" "$app" >"$insert"

echo "case,round,client_ms,server_exec_ms"
for round in $(seq "$rounds"); do
    for case in enqueue insert insert_notrigger enqueue_notrigger; do
        case $case in
        *_notrigger) psql -c "ALTER TABLE queue_messages DISABLE TRIGGER queue_messages_notify" ;;
        *) psql -c "ALTER TABLE queue_messages ENABLE TRIGGER queue_messages_notify" ;;
        esac
        script=$insert
        case $case in enqueue*) script=$enqueue ;; esac
        psql -c "SELECT pg_stat_statements_reset()" >/dev/null
        # A pgbench that fails stops the script, rather than print an
        # empty figure.
        if ! pgbench -n -M prepared -r -T "$secs" -R "$rate" -f "$script" "$url" >"$out" 2>&1; then
            echo "run.sh: pgbench failed ($case, round $round):" >&2
            cat "$out" >&2
            exit 1
        fi
        client=$(awk '/statement latencies/ { getline; print $1 }' "$out")
        if [ -z "$client" ]; then
            echo "run.sh: no statement latency in pgbench's output ($case, round $round):" >&2
            cat "$out" >&2
            exit 1
        fi
        server=$(psql -c "SELECT round((sum(total_exec_time) / sum(calls))::numeric, 3) FROM pg_stat_statements
                          WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                            AND query LIKE '%INSERT INTO queue_messages%' AND calls > 1")
        echo "$case,$round,$client,$server"
    done
done
