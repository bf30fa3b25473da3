#!/bin/sh
# What the queue_messages notify trigger costs a producer, part by part.
#
#   bench/trigger-cost/run.sh DATABASE_URL [CLIENTS] [SECONDS] [ROUNDS] [VARIANTS]
#
# DATABASE_URL names a scratch database that this script migrates (with
# `go run ./cmd/bellhop migrate`, so run it from the repository root) and
# may empty: it truncates queue_messages before every case. The server
# must preload pg_stat_statements. pgbench and psql must be on PATH (on
# Debian: /usr/lib/postgresql/15/bin).
#
# For each variant of variants.sql (and "off", no trigger, and "current",
# Bellhop's own), CLIENTS pgbench clients (default 32) insert one message
# per transaction into one queue for SECONDS (default 8) while a live busy
# mark is on it, as when a dispatcher drains the queue: both a queue_busy
# row (what 0041 read) and the busy key held by a session (what 0042 reads). ROUNDS (default 3)
# repeats the whole list, interleaved, because a shared machine's load
# drifts. Each line gives the transactions per second and the INSERT's mean
# execution time from pg_stat_statements, which includes the AFTER
# triggers and is steadier than the rate.
#
# The script puts Bellhop's trigger back when it ends, interrupted or
# not, and stops if pgbench fails.
set -eu
url=${1:?usage: run.sh DATABASE_URL [CLIENTS] [SECONDS] [ROUNDS] [VARIANTS]}
clients=${2:-32}
secs=${3:-8}
rounds=${4:-3}
variants=${5:-off current stmt_0041 stmt_empty stmt_loop stmt_lock stmt_lookup row_empty row_full row_memo before_memo stmt_locks row_locks}
dir=$(dirname "$0")

psql() { PGOPTIONS="-c client_min_messages=warning" command psql -X -q -At -v ON_ERROR_STOP=1 "$url" "$@"; }

go run ./cmd/bellhop --database-url "$url" migrate >/dev/null
psql -c "CREATE EXTENSION IF NOT EXISTS pg_stat_statements" -f "$dir/variants.sql"
app=$(psql -c "INSERT INTO apps (name) VALUES ('trigger-cost') ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name RETURNING id")
psql -c "DELETE FROM queue_busy WHERE app_id = '$app'" \
     -c "INSERT INTO queue_busy VALUES ('$app', 'q', gen_random_uuid(), now() + interval '1 day')"

# The lock variants' mark: a session holding the second key, as a
# draining dispatcher would, until the script kills it (psql itself, not
# the function's subshell, so that $! is its pid).
# client_connection_check_interval lets its backend notice and drop the
# lock. It holds the key in both forms: the variants' (0041, 0042) and the
# 64-bit one of the current trigger (migration 0052).
PGOPTIONS="-c client_connection_check_interval=1s" command psql -X -q -At "$url" \
    -c "SELECT pg_advisory_lock(1650814062, hashtext('$app' || ':q')), pg_advisory_lock(hashtextextended('$app' || ':q', 1650814062))" \
    -c "SELECT pg_sleep(86400)" >/dev/null &
holder=$!
script=
out=
current=
# restore runs once, on exit or on a signal: dash runs no EXIT trap when
# a signal ends it, which left the trigger replaced and the holder alive.
restored=
restore() {
    [ -z "$restored" ] || return 0
    restored=1
    kill "$holder" 2>/dev/null || true
    rm -f "$script" "$out"
    if [ -n "$current" ]; then
        psql -c "DROP TRIGGER IF EXISTS queue_messages_notify ON queue_messages" \
             -c "$current" \
             -c "DELETE FROM queue_busy WHERE app_id = '$app'" \
             -c "TRUNCATE queue_messages" ||
            echo "run.sh: could not put trigger queue_messages_notify back" >&2
    fi
}
trap restore EXIT
trap 'restore; exit 130' INT
trap 'restore; exit 143' TERM
trap 'restore; exit 129' HUP
until [ "$(psql -c "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted
                      AND ((classid = 1650814062 AND objsubid = 2)
                           OR (objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = hashtextextended('$app' || ':q', 1650814062)))")" = 2 ]; do
    sleep 0.1
done

script=$(mktemp)
out=$(mktemp)
printf "INSERT INTO queue_messages (app_id, queue_name, payload) VALUES ('%s', 'q', '{\"a\":1}');\n" "$app" >"$script"

# Bellhop's own trigger, as the migrations left it.
current=$(psql -c "SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE tgname = 'queue_messages_notify' AND tgrelid = 'queue_messages'::regclass")
[ -n "$current" ] || { echo "run.sh: trigger queue_messages_notify is missing; re-create it first" >&2; exit 1; }

install() {
    psql -c "DROP TRIGGER IF EXISTS queue_messages_notify ON queue_messages"
    fn=bench_tc_$1
    case $1 in
    off) ;;
    current) psql -c "$current" ;;
    row_*) psql -c "CREATE TRIGGER queue_messages_notify AFTER INSERT ON queue_messages FOR EACH ROW EXECUTE FUNCTION $fn()" ;;
    before_memo) psql -c "CREATE TRIGGER queue_messages_notify BEFORE INSERT ON queue_messages FOR EACH ROW
                          WHEN (current_setting('bellhop.announced', true) IS DISTINCT FROM NEW.app_id::text || ':' || NEW.queue_name)
                          EXECUTE FUNCTION $fn()" ;;
    *) psql -c "CREATE TRIGGER queue_messages_notify AFTER INSERT ON queue_messages REFERENCING NEW TABLE AS new_messages FOR EACH STATEMENT EXECUTE FUNCTION $fn()" ;;
    esac
}

echo "variant clients tps insert_mean_exec_us"
for _ in $(seq "$rounds"); do
    for v in $variants; do
        install "$v"
        psql -c "TRUNCATE queue_messages" -c "CHECKPOINT" -c "SELECT pg_stat_statements_reset()" >/dev/null
        # A pgbench that fails stops the script, rather than print an
        # empty figure.
        if ! pgbench -n -M prepared -c "$clients" -j 2 -T "$secs" -f "$script" "$url" >"$out" 2>&1; then
            echo "run.sh: pgbench failed (variant $v):" >&2
            cat "$out" >&2
            exit 1
        fi
        tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' "$out")
        if [ -z "$tps" ]; then
            echo "run.sh: no tps in pgbench's output (variant $v):" >&2
            cat "$out" >&2
            exit 1
        fi
        mean=$(psql -c "SELECT round(mean_exec_time::numeric * 1000, 1) FROM pg_stat_statements
                        WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                          AND query LIKE 'INSERT INTO queue_messages%'")
        echo "$v $clients $tps $mean"
    done
done
