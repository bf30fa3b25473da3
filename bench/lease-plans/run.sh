#!/bin/sh
# What a producer's lease at INSERT costs it, with an earlier migration's
# lease function (OLD, default 0046: by index whatever the statistics say;
# 0045 before it) and with the current one (0047: it also reads the
# consumer's visibility timeout), on a clean server and with an old
# snapshot open elsewhere.
#
#   bench/lease-plans/run.sh DATABASE_URL [SECONDS] [ROUNDS] [SNAPSHOT] [OLD]
#
# DATABASE_URL names a scratch database that this script migrates (with
# `go run ./cmd/bellhop migrate`, so run it from the repository root).
# pgbench and psql must be on PATH (on Debian: /usr/lib/postgresql/15/bin).
#
# A psql session holds the lease key, idle, as a leasing dispatcher's
# listener does. One pgbench client, 100 transactions a second for SECONDS
# (default 20), writes an offer for the queue, inserts a message with
# synchronous_commit off (the producer's lease happens at its commit) and
# deletes it by id, as an ack would. Each line gives the INSERT's mean
# latency, commit and lease included, for: OLD's function, the current
# one, and the key let go (no lease; the trigger sends q: instead), and how
# many offers were left unleased (none in the lease cases, one per message
# with the key free).
# ROUNDS (default 3) repeats the list, interleaved. With SNAPSHOT=snapshot
# (default none) a second idle session holds a REPEATABLE READ snapshot
# open during each lease case, as a long report or a forgotten BEGIN
# would, so that dead offers and index entries cannot be cleaned up.
#
# The script puts the current function back when it ends, interrupted or
# not, and removes its offers and messages; it stops if pgbench fails.
set -eu
url=${1:?usage: run.sh DATABASE_URL [SECONDS] [ROUNDS] [SNAPSHOT]}
secs=${2:-20}
rounds=${3:-3}
snapshot=${4:-none}
oldmig=${5:-0046}
dir=$(dirname "$0")

psql() { PGOPTIONS="-c client_min_messages=warning" command psql -X -q -At -v ON_ERROR_STOP=1 "$url" "$@"; }

go run ./cmd/bellhop --database-url "$url" migrate >/dev/null
app=$(psql -c "INSERT INTO apps (name) VALUES ('lease-plans') ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name RETURNING id")
. "$dir/consumer.sh"
current=$(psql -c "SELECT pg_get_functiondef('bellhop_lease_message(uuid, uuid, text)'::regprocedure)")
old=$(sed -n '/^CREATE \(OR REPLACE \)\{0,1\}FUNCTION bellhop_lease_message/,/^\$\$;/p' "$dir"/../../migrations/"$oldmig"_*.sql |
    sed 's/^CREATE FUNCTION/CREATE OR REPLACE FUNCTION/')
[ -n "$old" ] || { echo "run.sh: $oldmig's bellhop_lease_message not found" >&2; exit 1; }

work=$(mktemp -d)
# restore runs once, on exit or on a signal: dash runs no EXIT trap when
# a signal ends it, which left OLD's function in place.
restored=
restore() {
    [ -z "$restored" ] || return 0
    restored=1
    exec 3>&- 4>&-
    { printf '%s\n' "$current;" | psql &&
        psql -c "DELETE FROM bellhop_offers WHERE app_id = '$app'" -c "DELETE FROM queue_messages WHERE app_id = '$app'"; } ||
        echo "run.sh: could not put the current bellhop_lease_message back" >&2
    rm -rf "$work"
}
trap restore EXIT
trap 'restore; exit 130' INT
trap 'restore; exit 143' TERM
trap 'restore; exit 129' HUP
script=$work/lease.sql
cat >"$script" <<EOF
INSERT INTO bellhop_offers (token, app_id, queue_name, owner, channel, expires_at, consumer_id) SELECT gen_random_uuid(), '$app', 'q', gen_random_uuid(), 'bellhop_l_bench', now() + interval '1 minute', id FROM queue_consumers WHERE app_id = '$app' AND queue_name = 'q';
SET synchronous_commit = off;
INSERT INTO queue_messages (app_id, queue_name, payload) VALUES ('$app', 'q', '{"a":1}') RETURNING id \gset
DELETE FROM queue_messages WHERE id = ':id';
EOF

# Idle sessions fed through FIFOs: a statement that sleeps would hold a
# snapshot itself. Closing a FIFO ends its session.
mkfifo "$work/key" "$work/snap"
command psql -X -q "$url" <"$work/key" >/dev/null &
exec 3>"$work/key"

. "$dir/key.sh"

measure() { # label
    psql -c "DELETE FROM bellhop_offers WHERE app_id = '$app'" -c "VACUUM bellhop_offers" -c "VACUUM queue_messages"
    if [ "$snapshot" = snapshot ] && [ "$1" != "key free" ]; then
        command psql -X -q "$url" <"$work/snap" >/dev/null &
        exec 4>"$work/snap"
        echo "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1;" >&4
    fi
    # A pgbench that fails stops the script, rather than print an empty
    # figure.
    if ! pgbench -n -c 1 -T "$secs" -R 100 -r -f "$script" "$url" >"$work/out" 2>&1; then
        echo "run.sh: pgbench failed ($1, round $round):" >&2
        cat "$work/out" >&2
        exit 1
    fi
    ms=$(awk '/INSERT INTO queue_messages/ { print $1 }' "$work/out")
    if [ -z "$ms" ]; then
        echo "run.sh: no INSERT latency in pgbench's output ($1, round $round):" >&2
        cat "$work/out" >&2
        exit 1
    fi
    if [ "$snapshot" = snapshot ] && [ "$1" != "key free" ]; then
        exec 4>&-
    fi
    left=$(psql -c "SELECT count(*) FROM bellhop_offers WHERE app_id = '$app'")
    printf 'round %s  %-18s INSERT %s ms  (offers left unleased: %s)\n' "$round" "$1" "$ms" "$left"
}

round=1
while [ "$round" -le "$rounds" ]; do
    key take
    printf '%s\n' "$old" | psql
    measure "$oldmig's function"
    printf '%s\n' "$current;" | psql
    measure "current function"
    key drop
    measure "key free"
    round=$((round + 1))
done
