#!/bin/sh
# What the UPDATE in a producer's lease costs it: the INSERT's latency and
# the WAL per transaction, with the lease as it is, with the UPDATE of the
# new row replaced by a read of it (what a lease written by a BEFORE
# INSERT trigger would leave), and with the key let go (no lease).
#
#   bench/lease-plans/wal.sh DATABASE_URL [SECONDS] [ROUNDS]
#
# DATABASE_URL names a scratch database that this script migrates (with
# `go run ./cmd/bellhop migrate`, so run it from the repository root).
# pgbench and psql must be on PATH (on Debian: /usr/lib/postgresql/15/bin).
#
# A psql session holds the lease key, idle, as a leasing dispatcher's
# listener does. One pgbench client, 100 transactions a second for SECONDS
# (default 15), writes an offer for the queue, inserts a message with
# synchronous_commit on (then off, in a second pass) and deletes it by id
# with synchronous_commit off. Each line gives the INSERT's mean latency,
# commit and lease included, and the WAL written per transaction (the
# whole script's, from pg_current_wal_lsn()). ROUNDS (default 3) repeats
# the list, interleaved; every case starts after VACUUM and CHECKPOINT.
#
# The script puts the current function back when it ends, interrupted or
# not, and removes its offers and messages; it stops if pgbench fails.
set -eu
url=${1:?usage: wal.sh DATABASE_URL [SECONDS] [ROUNDS]}
secs=${2:-15}
rounds=${3:-3}
dir=$(dirname "$0")

psql() { PGOPTIONS="-c client_min_messages=warning" command psql -X -q -At -v ON_ERROR_STOP=1 "$url" "$@"; }

go run ./cmd/bellhop --database-url "$url" migrate >/dev/null
app=$(psql -c "INSERT INTO apps (name) VALUES ('lease-wal') ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name RETURNING id")
. "$dir/consumer.sh"
current=$(psql -c "SELECT pg_get_functiondef('bellhop_lease_message(uuid, uuid, text)'::regprocedure)")
# The UPDATE ... RETURNING ... INTO m becomes a SELECT of the same values
# INTO m: the lease's every other statement stays.
noupdate=$(printf '%s\n' "$current" | awk '
    /^    UPDATE queue_messages$/ { skip = 1
        print "    SELECT id, payload::text AS body, attempt + 1 AS attempt, max_attempts, enqueued_at,"
        print "           clock_timestamp() AS claimed_at, enqueued_by_principal"
        print "    INTO m FROM queue_messages WHERE id = p_id;"
        next }
    skip && /INTO m;$/ { skip = 0; next }
    !skip { print }')
[ "$noupdate" != "$current" ] || { echo "wal.sh: the lease's UPDATE was not found" >&2; exit 1; }

work=$(mktemp -d)
for sc in on off; do
    cat >"$work/lease_$sc.sql" <<SQL
INSERT INTO bellhop_offers (token, app_id, queue_name, owner, channel, expires_at, consumer_id) SELECT gen_random_uuid(), '$app', 'q', gen_random_uuid(), 'bellhop_l_bench', now() + interval '1 minute', id FROM queue_consumers WHERE app_id = '$app' AND queue_name = 'q';
SET synchronous_commit = $sc;
INSERT INTO queue_messages (app_id, queue_name, payload) VALUES ('$app', 'q', '{"a":1}') RETURNING id \gset
SET synchronous_commit = off;
DELETE FROM queue_messages WHERE id = ':id';
SQL
done

mkfifo "$work/key"
command psql -X -q "$url" <"$work/key" >/dev/null &
exec 3>"$work/key"

# restore runs once, on exit or on a signal: dash runs no EXIT trap when
# a signal ends it, which left the function without its UPDATE in place.
restored=
restore() {
    [ -z "$restored" ] || return 0
    restored=1
    exec 3>&-
    { printf '%s\n' "$current;" | psql &&
        psql -c "DELETE FROM bellhop_offers WHERE app_id = '$app'" -c "DELETE FROM queue_messages WHERE app_id = '$app'"; } ||
        echo "wal.sh: could not put the current bellhop_lease_message back" >&2
    rm -rf "$work"
}
trap restore EXIT
trap 'restore; exit 130' INT
trap 'restore; exit 143' TERM
trap 'restore; exit 129' HUP

. "$dir/key.sh"

measure() { # label sync
    psql -c "DELETE FROM bellhop_offers WHERE app_id = '$app'" -c "VACUUM bellhop_offers" -c "VACUUM queue_messages" -c "CHECKPOINT"
    lsn=$(psql -c "SELECT pg_current_wal_lsn()")
    # A pgbench that fails stops the script, rather than print an empty
    # figure.
    if ! out=$(pgbench -n -c 1 -T "$secs" -R 100 -r -f "$work/lease_$2.sql" "$url" 2>&1); then
        echo "wal.sh: pgbench failed ($1, synchronous_commit $2, round $round):" >&2
        printf '%s\n' "$out" >&2
        exit 1
    fi
    ms=$(printf '%s\n' "$out" | awk '/INSERT INTO queue_messages/ { print $1 }')
    if [ -z "$ms" ]; then
        echo "wal.sh: no INSERT latency in pgbench's output ($1, synchronous_commit $2, round $round):" >&2
        printf '%s\n' "$out" >&2
        exit 1
    fi
    n=$(printf '%s\n' "$out" | awk -F': ' '/number of transactions actually processed/ { split($2, a, "/"); print a[1] }')
    wal=$(psql -c "SELECT (pg_current_wal_lsn() - '$lsn'::pg_lsn)::bigint / greatest($n, 1)")
    printf 'round %s  synchronous_commit %-3s  %-22s INSERT %s ms  WAL %s B/transaction\n' "$round" "$2" "$1" "$ms" "$wal"
}

round=1
while [ "$round" -le "$rounds" ]; do
    for sc in on off; do
        key take
        printf '%s\n' "$current;" | psql
        measure "lease" "$sc"
        printf '%s\n' "$noupdate;" | psql
        measure "lease without UPDATE" "$sc"
        key drop
        measure "key free" "$sc"
    done
    round=$((round + 1))
done
