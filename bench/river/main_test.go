package main

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/url"
	"os"
	"reflect"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
)

func TestParseFlagsDefaults(t *testing.T) {
	o, err := parseFlags([]string{"-database-url", "dsn", "-scenario", "latency"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.N != 2000 || o.Interval != 10*time.Millisecond || o.Schema != "river_bench" || o.Workers != 100 {
		t.Fatalf("unexpected defaults: %+v", o)
	}
	if o.effectiveFetchCooldown() != 100*time.Millisecond || o.effectiveFetchPollInterval() != time.Second {
		t.Fatalf("unexpected effective fetch settings: %s %s", o.effectiveFetchCooldown(), o.effectiveFetchPollInterval())
	}

	o, err = parseFlags([]string{"-database-url", "dsn", "-scenario", "burndown"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.N != 20000 {
		t.Fatalf("burndown default n = %d, want 20000", o.N)
	}
}

func TestParseFlagsErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-scenario", "latency"}, "-database-url is required"},
		{[]string{"-database-url", "x"}, "-scenario is required"},
		{[]string{"-database-url", "x", "-scenario", "soak"}, `-scenario "soak"`},
		{[]string{"-database-url", "x", "-scenario", "latency", "-schema", "Bad-Name"}, "-schema"},
		{[]string{"-database-url", "x", "-scenario", "latency", "-workers", "0"}, "-workers 0"},
		{[]string{"-database-url", "x", "-scenario", "latency", "-n", "-1"}, "-n -1"},
		{[]string{"-database-url", "x", "-scenario", "latency", "-fetch-poll-interval", "20ms"}, "shorter than fetch cooldown"},
		{[]string{"-database-url", "x", "-scenario", "latency", "-fetch-cooldown", "1us"}, "-fetch-cooldown"},
		{[]string{"-database-url", "x", "-scenario", "latency", "extra"}, "unexpected argument"},
		{[]string{"-database-url", "x", "-scenario", "latency", "-interval", "soon"}, "invalid value"},
	} {
		var stderr strings.Builder
		_, err := parseFlags(tc.args, &stderr)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parseFlags(%q) = %v, want error containing %q", tc.args, err, tc.want)
		}
	}
}

func TestParseFlagsFastFetch(t *testing.T) {
	o, err := parseFlags([]string{"-database-url", "x", "-scenario", "latency",
		"-fetch-cooldown", "2ms", "-fetch-poll-interval", "20ms"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.effectiveFetchCooldown() != 2*time.Millisecond || o.effectiveFetchPollInterval() != 20*time.Millisecond {
		t.Fatalf("unexpected fetch settings: %+v", o)
	}
}

func TestPercentile(t *testing.T) {
	s := make([]int64, 100)
	for i := range s {
		s[i] = int64(i + 1)
	}
	for _, tc := range []struct {
		p    float64
		want int64
	}{{0.5, 50}, {0.9, 90}, {0.99, 99}, {1, 100}, {0.001, 1}} {
		if got := percentile(s, tc.p); got != tc.want {
			t.Errorf("percentile(1..100, %v) = %d, want %d", tc.p, got, tc.want)
		}
	}
	if got := percentile([]int64{7}, 0.99); got != 7 {
		t.Errorf("percentile([7], 0.99) = %d, want 7", got)
	}
}

func TestSplitOf(t *testing.T) {
	// Unsorted nanoseconds in, microseconds out.
	ns := []int64{9_000, 1_000, 5_000, 3_000, 7_000, 2_000, 4_000, 6_000, 8_000, 10_000}
	got := splitOf(ns)
	if want := (split{P50US: 5, P99US: 10}); got != want {
		t.Errorf("splitOf = %+v, want %+v", got, want)
	}
}

func TestParseFlagsCheckpoint(t *testing.T) {
	for args, want := range map[string]bool{"": false, "-checkpoint": true} {
		a := []string{"-database-url", "x", "-scenario", "burndown"}
		if args != "" {
			a = append(a, args)
		}
		o, err := parseFlags(a, io.Discard)
		if err != nil || o.Checkpoint != want {
			t.Errorf("parseFlags(%q): checkpoint %v, %v; want %v", a, o != nil && o.Checkpoint, err, want)
		}
	}
}

// TestLatencyFromMonotonicOffsets: a latency was the wall clock at Work
// minus the wall clock stamped before Insert, so a step of the clock
// between them (NTP) went into the figure. Both are now offsets on the
// monotonic clock from the worker's base; a wall-clock stamp in the job
// would give a latency of decades here.
func TestLatencyFromMonotonicOffsets(t *testing.T) {
	w := &latencyWorker{base: time.Now(), latencies: make([]int64, 2), started: make([]int64, 2), seen: make([]atomic.Bool, 2), done: make(chan struct{})}
	// Job 1 was stamped 5 ms before now.
	stamp := w.since() - int64(5*time.Millisecond)
	if err := w.Work(context.Background(), &river.Job[latencyArgs]{Args: latencyArgs{Seq: 1, EnqueuedAtOffset: stamp}}); err != nil {
		t.Fatal(err)
	}
	if got := time.Duration(w.latencies[1]); got < 5*time.Millisecond || got > time.Minute {
		t.Errorf("latency %s, want a little over 5ms", got)
	}
	if got := time.Duration(w.started[1]); got <= 0 || got > time.Minute {
		t.Errorf("started at %s since the base", got)
	}
	if w.received.Load() != 1 {
		t.Errorf("received %d", w.received.Load())
	}
}

// TestBurndownCheckpoints: Bellhop's burn-down backlog got VACUUM ANALYZE
// and CHECKPOINT before the clock started, River's only VACUUM ANALYZE.
// With -checkpoint River's gets both; a user without pg_checkpoint gets a
// result that says why it did not, as Bellhop's side notes it.
func TestBurndownCheckpoints(t *testing.T) {
	ctx, dsn, admin := adminConn(t)
	suffix := strconv.FormatInt(time.Now().UnixNano(), 36)
	role, db := "river_ckpt_"+suffix, "river_ckpt_"+suffix
	if _, err := admin.Exec(ctx, "CREATE ROLE "+role+" LOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := admin.Exec(context.Background(), "DROP ROLE IF EXISTS "+role); err != nil {
			t.Errorf("drop role: %v", err)
		}
	})
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+db+" OWNER "+role); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := admin.Exec(context.Background(), "DROP DATABASE IF EXISTS "+db+" WITH (FORCE)"); err != nil {
			t.Errorf("drop database: %v", err)
		}
	})
	superuser := admin.Config().User
	asUser := func(user string) string {
		t.Helper()
		var out string
		if u, err := url.Parse(dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
			u.User, u.Path = url.User(user), "/"+db
			out = u.String()
		} else {
			out = dsn + " user=" + user + " dbname=" + db
		}
		// River's tables must land in the test's database, as its user.
		if c, err := pgx.ParseConfig(out); err != nil || c.User != user || c.Database != db {
			t.Fatalf("DSN for %s in %s: %v", user, db, err)
		}
		return out
	}
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, tc := range []struct {
		user, schema string
		want         bool
	}{{superuser, "river_super", true}, {role, "river_limited", false}} {
		opts, err := parseFlags([]string{"-database-url", asUser(tc.user), "-schema", tc.schema, "-scenario", "burndown", "-n", "50", "-workers", "5", "-checkpoint"}, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		res, err := run(ctx, opts, logger)
		if err != nil {
			t.Fatalf("as %s: %v", tc.user, err)
		}
		b := res.(*burndownResult)
		if b.Checkpointed != tc.want || (tc.want == (b.CheckpointError != "")) || b.JobsPerSec <= 0 {
			t.Errorf("as %s: %+v", tc.user, b)
		}
		if !tc.want && !strings.Contains(b.CheckpointError, "CHECKPOINT") {
			t.Errorf("as %s: checkpoint error %q", tc.user, b.CheckpointError)
		}
	}
}

// TestPoolConfigsSynchronousCommit: -client-synchronous-commit sets
// synchronous_commit on the River client's pool only; the jobs' inserts
// go to a second pool that keeps the server's setting, so that a River
// whose fetches and completions do not wait for the WAL flush still
// inserts as Bellhop's producer does. Without the flag there is one pool,
// as before, and it sets nothing.
func TestPoolConfigsSynchronousCommit(t *testing.T) {
	for _, tc := range []struct {
		flag       []string
		wantClient string // "" = not set
		wantInsert bool   // a separate insert pool
	}{
		{nil, "", false},
		{[]string{"-client-synchronous-commit", "off"}, "off", true},
		{[]string{"-client-synchronous-commit", "local"}, "local", true},
	} {
		args := append([]string{"-database-url", "postgres://u@/db?host=/tmp&pool_max_conns=7", "-scenario", "latency",
			"-fetch-cooldown", "2ms", "-fetch-poll-interval", "20ms", "-schema", "rb"}, tc.flag...)
		o, err := parseFlags(args, io.Discard)
		if err != nil {
			t.Fatalf("%q: %v", tc.flag, err)
		}
		client, insert, err := poolConfigs(o)
		if err != nil {
			t.Fatalf("%q: %v", tc.flag, err)
		}
		got, ok := client.ConnConfig.RuntimeParams["synchronous_commit"]
		if got != tc.wantClient || ok != (tc.wantClient != "") {
			t.Errorf("%q: client pool synchronous_commit %q (set %v), want %q", tc.flag, got, ok, tc.wantClient)
		}
		if (insert != nil) != tc.wantInsert {
			t.Fatalf("%q: insert pool %v, want one: %v", tc.flag, insert != nil, tc.wantInsert)
		}
		for name, cfg := range map[string]*pgxpool.Config{"client": client, "insert": insert} {
			if cfg == nil {
				continue
			}
			if cfg.ConnConfig.RuntimeParams["search_path"] != "rb" || cfg.MaxConns != 7 {
				t.Errorf("%q: %s pool search_path %q, max conns %d", tc.flag, name, cfg.ConnConfig.RuntimeParams["search_path"], cfg.MaxConns)
			}
		}
		if insert != nil {
			if v, ok := insert.ConnConfig.RuntimeParams["synchronous_commit"]; ok {
				t.Errorf("%q: insert pool sets synchronous_commit %q", tc.flag, v)
			}
		}
	}
	for _, bad := range []string{"of", "OFF", "false"} {
		_, err := parseFlags([]string{"-database-url", "x", "-scenario", "latency", "-client-synchronous-commit", bad}, io.Discard)
		if err == nil || !strings.Contains(err.Error(), "-client-synchronous-commit") {
			t.Errorf("-client-synchronous-commit %s: %v", bad, err)
		}
	}
}

// TestClientSynchronousCommitOnServer runs both scenarios with
// -client-synchronous-commit off and checks, by what each pool's
// connections report (SHOW), that the client's pool commits without
// waiting for the flush and the insert pool with it; without the flag
// the result names neither.
func TestClientSynchronousCommitOnServer(t *testing.T) {
	ctx, dsn, admin := adminConn(t)
	var server string
	if err := admin.QueryRow(ctx, "SHOW synchronous_commit").Scan(&server); err != nil {
		t.Fatal(err)
	}
	if server == "off" {
		t.Skip("the server's synchronous_commit is off: the insert pool would not differ")
	}
	schema := scratchSchema(t, admin, "river_sc_")
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, tc := range []struct {
		scenario string
		flag     []string
		client   string
		insert   string
	}{
		{"latency", []string{"-client-synchronous-commit", "off"}, "off", server},
		{"burndown", []string{"-client-synchronous-commit", "off"}, "off", server},
		{"latency", nil, "", ""},
	} {
		args := append([]string{"-database-url", dsn, "-schema", schema, "-scenario", tc.scenario, "-n", "20", "-interval", "1ms",
			"-settle", "100ms", "-workers", "5", "-fetch-cooldown", "2ms", "-fetch-poll-interval", "20ms"}, tc.flag...)
		opts, err := parseFlags(args, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		res, err := run(ctx, opts, logger)
		if err != nil {
			t.Fatalf("%s %q: %v", tc.scenario, tc.flag, err)
		}
		var c common
		switch r := res.(type) {
		case *latencyResult:
			c = r.common
			if r.N != 20 || r.P50US <= 0 {
				t.Errorf("%s %q: %+v", tc.scenario, tc.flag, r)
			}
		case *burndownResult:
			c = r.common
			if r.JobsPerSec <= 0 {
				t.Errorf("%s %q: %+v", tc.scenario, tc.flag, r)
			}
		}
		if c.ClientSynchronousCommit != tc.client || c.InsertSynchronousCommit != tc.insert {
			t.Errorf("%s %q: client pool %q, insert pool %q; want %q, %q", tc.scenario, tc.flag,
				c.ClientSynchronousCommit, c.InsertSynchronousCommit, tc.client, tc.insert)
		}
		out, err := json.Marshal(res)
		if err != nil {
			t.Fatal(err)
		}
		if has := strings.Contains(string(out), "synchronous_commit"); has != (tc.flag != nil) {
			t.Errorf("%s %q: JSON names synchronous_commit: %v: %s", tc.scenario, tc.flag, has, out)
		}
	}
}

// TestInsertClientConfiguredAsWorker: the insert-only client of
// -client-synchronous-commit is the worker's configuration without its
// queues. It had River's default FetchCooldown, 100 ms, which also
// limits a client's insert notifications to one per queue per 100 ms:
// of jobs 10 ms apart most waited for the worker's 20 ms poll.
func TestInsertClientConfiguredAsWorker(t *testing.T) {
	o, err := parseFlags([]string{"-database-url", "x", "-scenario", "latency", "-fetch-cooldown", "2ms", "-fetch-poll-interval", "20ms",
		"-client-synchronous-commit", "off", "-schema", "rb"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	workers := river.NewWorkers()
	ins, cli := insertClientConfig(o, logger, workers), clientConfig(o, logger, workers)
	if ins.Queues != nil || len(cli.Queues) != 1 {
		t.Errorf("queues: insert client %v, worker %v", ins.Queues, cli.Queues)
	}
	cli.Queues = nil
	if !reflect.DeepEqual(ins, cli) {
		t.Errorf("insert client config %+v, worker's without queues %+v", ins, cli)
	}
	if ins.FetchCooldown != 2*time.Millisecond || ins.FetchPollInterval != 20*time.Millisecond || ins.Schema != "rb" || ins.Workers != workers {
		t.Errorf("insert client config %+v", ins)
	}
}

// TestInsertNotificationsReachWorker: with a poll interval of 5 s, a job
// is worked within a second only if its insert's notification reached
// the worker. Jobs 30 ms apart, with a 2 ms fetch cooldown, must each
// send one, whichever client inserts them.
func TestInsertNotificationsReachWorker(t *testing.T) {
	ctx, dsn, admin := adminConn(t)
	schema := scratchSchema(t, admin, "river_nt_")
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, flag := range [][]string{nil, {"-client-synchronous-commit", "off"}} {
		args := append([]string{"-database-url", dsn, "-schema", schema, "-scenario", "latency", "-n", "4", "-interval", "30ms",
			"-settle", "200ms", "-workers", "5", "-fetch-cooldown", "2ms", "-fetch-poll-interval", "5s"}, flag...)
		opts, err := parseFlags(args, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		res, err := run(ctx, opts, logger)
		if err != nil {
			t.Fatalf("%q: %v", flag, err)
		}
		if r := res.(*latencyResult); r.MaxUS >= 1_000_000 {
			t.Errorf("%q: a job waited %d µs for the poll: %+v", flag, r.MaxUS, r)
		}
	}
}

// adminConn returns a context bounding a database test, the server's
// DSN (DATABASE_URL) and a connection to it, closed when the test ends
// (after the test's own cleanups, which may use it). It skips the test
// without DATABASE_URL: this module starts no server of its own (CI runs
// its tests under internal/pgcluster/pgrun, which sets it).
func adminConn(t *testing.T) (context.Context, string, *pgx.Conn) {
	t.Helper()
	dsn := os.Getenv("DATABASE_URL")
	if dsn == "" {
		t.Skip("DATABASE_URL is not set: this module starts no server of its own")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	admin, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close(context.Background()) })
	return ctx, dsn, admin
}

// scratchSchema names a schema for River's tables, unique to the test
// (prefix and the time), dropped when the test ends.
func scratchSchema(t *testing.T, admin *pgx.Conn, prefix string) string {
	t.Helper()
	schema := prefix + strconv.FormatInt(time.Now().UnixNano(), 36)
	t.Cleanup(func() {
		if _, err := admin.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+schema+" CASCADE"); err != nil {
			t.Errorf("drop schema: %v", err)
		}
	})
	return schema
}
