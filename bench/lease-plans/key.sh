# Sourced by run.sh and wal.sh: the lease key, held by an idle psql
# session fed through file descriptor 3, as a leasing dispatcher's
# listener holds it. Needs the caller's psql function (with its URL).

keyholders() {
    psql -c "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 1650814063 AND objid = 0 AND granted"
}

key() { # take | drop
    if [ "$1" = take ]; then
        echo "SELECT pg_advisory_lock_shared(1650814063, 0);" >&3
        until [ "$(keyholders)" -ge 1 ]; do sleep 0.1; done
    else
        echo "SELECT pg_advisory_unlock_shared(1650814063, 0);" >&3
        until [ "$(keyholders)" = 0 ]; do sleep 0.1; done
    fi
}
