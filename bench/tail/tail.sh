#!/bin/sh
# Where the slowest messages of a benchmark run spent their time, from the
# per-message CSVs that `bellhop-bench -dump DIR` writes.
#
#   bench/tail/tail.sh DIR/latency-*.csv
#
# Per file: the number of messages; latency, Enqueue call and "after" (the
# rest: from the return of Enqueue to the handler) at p50 and p99; then, of
# the messages at or above the p99 latency, how many spent at least half of it inside
# Enqueue, the median of their Enqueue and after parts, and in how many
# distinct seconds of the run they came.
#
# Percentiles are nearest-rank, as bellhop-bench computes them.
set -eu
[ $# -ge 1 ] || { echo "usage: tail.sh FILE.csv ..." >&2; exit 2; }
printf '%-48s %5s %7s %7s %7s %7s %7s %7s  %s\n' file n lat50 lat99 enq50 enq99 aft50 aft99 'at or above p99: enq>=half, enq50, aft50, seconds'
for f in "$@"; do
    # Columns: enqueued_us, enqueue_call_us, latency_us; files written
    # since 2026-12-07 have a fourth, latency_from_due_us, not read here.
    tail -n +2 "$f" | awk -F, -v name="$(basename "$f" .csv)" '
    function pct(a, n, p,   k) { k = int(p * n); if (k < p * n) k++; if (k < 1) k = 1; if (k > n) k = n; return a[k] }
    function sift(a, i, n,   c, t) {
        while ((c = 2 * i) <= n) {
            if (c < n && a[c + 1] > a[c]) c++
            if (a[i] >= a[c]) return
            t = a[i]; a[i] = a[c]; a[c] = t; i = c
        }
    }
    function sortn(a, n,   i, t) {  # heapsort, ascending (mawk has no asort)
        for (i = int(n / 2); i >= 1; i--) sift(a, i, n)
        for (i = n; i > 1; i--) { t = a[1]; a[1] = a[i]; a[i] = t; sift(a, 1, i - 1) }
    }
    { n++; st[n] = $1; enq[n] = $2; lat[n] = $3; aft[n] = $3 - $2 }
    END {
        if (n == 0) { printf "%-48s %5d\n", name, 0; exit }
        for (i = 1; i <= n; i++) { l[i] = lat[i]; e[i] = enq[i]; a[i] = aft[i] }
        sortn(l, n); sortn(e, n); sortn(a, n)
        cut = pct(l, n, 0.99)
        k = 0; half = 0
        for (i = 1; i <= n; i++) if (lat[i] >= cut) {
            k++; te[k] = enq[i]; ta[k] = aft[i]
            if (2 * enq[i] >= lat[i]) half++
            sec[int(st[i] / 1000000)] = 1
        }
        secs = 0; for (s in sec) secs++
        sortn(te, k); sortn(ta, k)
        printf "%-48s %5d %7d %7d %7d %7d %7d %7d  %d of %d, %d, %d, %d\n", name, n,
            pct(l, n, 0.5), cut, pct(e, n, 0.5), pct(e, n, 0.99), pct(a, n, 0.5), pct(a, n, 0.99),
            half, k, pct(te, k, 0.5), pct(ta, k, 0.5), secs
    }'
done
