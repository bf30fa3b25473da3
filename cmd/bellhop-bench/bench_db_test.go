package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgdsn"
)

// These tests run pieces of the benchmark against a real server:
// DATABASE_URL, as the tool uses it, or a throwaway cluster without it.

// testServer starts the benchmark's server on databaseURL as run does
// (a throwaway cluster if it is empty), closed when the test ends.
func testServer(t *testing.T, databaseURL string) *server {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s, err := startServer(ctx, databaseURL, nil)
	if err != nil {
		t.Fatalf("start the server: %v", pgdsn.RedactError(err, databaseURL))
	}
	t.Cleanup(func() {
		if err := s.close(); err != nil {
			t.Errorf("close the server: %v", err)
		}
	})
	return s
}

// testEnv is an env on srv with the quick sizes and a small dispatcher
// pool; tests shrink what they run further.
func testEnv(srv *server) *env {
	p := quickParams()
	p.Runs = 1
	p.poolMaxConns = 4
	return &env{srv: srv, p: p, log: zerolog.Nop(), progress: io.Discard, res: newResults(), evidence: &Evidence{}, base: time.Now()}
}

// TestProduceForCountsItsWindow: the busy scenario's "acked while
// producing" divided the acks counted from before produceFor opened (and
// warmed) the producers' pool to after it waited for its wait-event
// sampler by the producing loop's time alone; at 32 producers in -quick
// it counted over 2.4 – 3.6 s against about 1.0 s. The counter is now
// read at the bounds of the window elapsed measures: with a clock for
// counter, the two agree.
func TestProduceForCountsItsWindow(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	e := testEnv(testServer(t, os.Getenv("DATABASE_URL")))
	db, setup, err := e.queueDB(ctx, "produce", "p")
	if err != nil {
		t.Fatal(err)
	}
	defer db.drop()
	defer setup.Close()
	t0 := time.Now()
	clock := func() int64 { return int64(time.Since(t0)) }
	pr, err := produceFor(ctx, db, 32, 300*time.Millisecond, clock)
	if err != nil {
		t.Fatal(err)
	}
	if pr.sent == 0 || pr.elapsed < 300*time.Millisecond {
		t.Fatalf("produced %d in %s", pr.sent, pr.elapsed)
	}
	// The counter is read just before the clock starts and just after it
	// stops: it may see a little more, never less.
	if extra := time.Duration(pr.counted) - pr.elapsed; extra < 0 || extra > 5*time.Millisecond {
		t.Errorf("counter counted over %s, the producers ran %s", time.Duration(pr.counted), pr.elapsed)
	}
}

// TestLimitedPrivileges runs the tool as a user with only what its -h
// text calls necessary (CREATEDB, pg_read_all_settings), without EXECUTE
// on pg_stat_statements_reset or pg_checkpoint. The busy scenario used to
// stop at its first CHECKPOINT, where the producer and throughput
// scenarios go on; and the latency, load and scale scenarios ignored a
// failed reset, then recorded the set-up's statements as those of the
// measured stretch.
func TestLimitedPrivileges(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	// The superuser's server creates pg_stat_statements in postgres,
	// which the limited user cannot.
	admin := testServer(t, os.Getenv("DATABASE_URL"))
	if !admin.pss {
		t.Fatal("pg_stat_statements is not usable on the test server: load it with shared_preload_libraries")
	}
	role := "bench_limited_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	if err := admin.adminExec(ctx, "CREATE ROLE "+ident(role)+" LOGIN CREATEDB IN ROLE pg_read_all_settings"); err != nil {
		t.Fatal(err)
	}
	// Cleanups run last in first out: the role goes after the server
	// started below has dropped its databases.
	t.Cleanup(func() {
		if err := admin.adminExec(context.Background(), "DROP ROLE IF EXISTS "+ident(role)); err != nil {
			t.Errorf("drop role: %v", err)
		}
	})
	dsn, err := pgdsn.WithUser(admin.adminDSN, role)
	if err != nil {
		t.Fatal(err)
	}
	lim := testServer(t, dsn)
	if !lim.pss {
		t.Fatal("pg_stat_statements' view is not readable by the limited user")
	}
	e := testEnv(lim)
	e.p.latencyN = 20
	e.p.latencyInterval = 5 * time.Millisecond
	if _, err := latencyOnce(ctx, e, caseGo, 1, reportAs{"latency", caseGo}); err != nil {
		t.Fatalf("latency: %v", err)
	}
	if len(e.evidence.Statements) != 0 {
		t.Errorf("statement evidence recorded without a reset: %+v", e.evidence.Statements)
	}
	if !slices.ContainsFunc(e.res.notes["latency"], func(n string) bool {
		return strings.Contains(n, "Go handler (run 1): no statement evidence: pg_stat_statements_reset failed")
	}) {
		t.Errorf("no note of the failed reset: %q", e.res.notes["latency"])
	}

	e.p.busyBacklog = 300
	e.p.producerDuration = 150 * time.Millisecond
	if err := runBusy(ctx, e, 1); err != nil {
		t.Fatalf("busy without pg_checkpoint: %v", err)
	}
	if !slices.ContainsFunc(e.res.notes["busy"], func(n string) bool { return strings.HasPrefix(n, "CHECKPOINT before a case failed") }) {
		t.Errorf("no note of the failed CHECKPOINT: %q", e.res.notes["busy"])
	}
	if v := e.res.Values("busy", busyCase(32, true, "trigger off"), "enqueues/s (1 msg per transaction)"); len(v) != 1 || v[0] <= 0 {
		t.Errorf("busy figures: %v", v)
	}
}

// TestDeliveryWarningsFiledUnderCaller: latencyRunRate serves the
// latency, load, scale and river scenarios, but filed its warning of
// duplicate deliveries under latency, once for all cases and runs.
func TestDeliveryWarningsFiledUnderCaller(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	e := testEnv(testServer(t, os.Getenv("DATABASE_URL")))
	db, err := e.srv.newDatabase(ctx, "warn", true)
	if err != nil {
		t.Fatal(err)
	}
	defer db.drop()
	rec := newRecorder(e.base, 3)
	h := rec.handler()
	// Each delivery is recorded twice, as a duplicate delivery would be.
	twice := bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		if err := h.Handle(ctx, m); err != nil {
			return err
		}
		return h.Handle(ctx, m)
	})
	if _, _, err := latencyRunRate(ctx, e, db, reportAs{"load", "some case"}, 2, []string{"w"}, bellhop.ConsumerSpec{}, every(twice), rec, 5*time.Millisecond, 1, nil); err != nil {
		t.Fatal(err)
	}
	// How many of the three were seen twice before the run ended depends
	// on the machine's load: at least one.
	want := regexp.MustCompile(`^warning: some case, run 2: [123] duplicate and 0 unparsable deliveries$`)
	if !slices.ContainsFunc(e.res.notes["load"], want.MatchString) || len(e.res.notes["latency"]) != 0 {
		t.Errorf("notes: load %q, latency %q; want one matching %q under load", e.res.notes["load"], e.res.notes["latency"], want)
	}
}

// TestScaleProducersStopAtDuration: the scale scenario's note and the
// docs say its producers stop at the end of the period whether or not
// they kept up, but it never gave latencyRunRate the duration, so
// producers that fell behind sent every message, however long it took
// (the warm-up too). At a rate no machine here keeps up with (200,000
// messages a second for 1 s, after a warm-up of 250 ms), the run now
// ends in seconds, where sending them all would take minutes, and the
// target sees the shortfall.
func TestScaleProducersStopAtDuration(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	e := testEnv(testServer(t, os.Getenv("DATABASE_URL")))
	e.p.scaleQueues = 2
	e.p.scaleRate = 200_000
	e.p.scaleDuration = time.Second
	e.res.StartRun(2)
	start := time.Now()
	// Run 2: run 1 would sample wait events and statements too.
	if err := runScale(ctx, e, 2); err != nil {
		t.Fatalf("after %s: %v", time.Since(start).Round(time.Second), err)
	}
	for _, q := range []int{1, 2} {
		rates := e.res.Values("scale", scaleCase(q, e.p.scaleRate), mAchievedRate)
		if len(rates) != 1 || rates[0] <= 0 || rates[0] >= 0.95*float64(e.p.scaleRate) {
			t.Errorf("%d queue(s): achieved %v msgs/s of %d", q, rates, e.p.scaleRate)
		}
	}
	var tg Target
	for _, x := range evaluateTargets(e.res, e.p) {
		if x.Name == "latency p99, 10k queues vs 1 queue" {
			tg = x
		}
	}
	if !tg.Known || tg.Verdict() != "FAIL" || !strings.Contains(tg.Detail, "in run 2 the 2-queue case reached") {
		t.Errorf("target: %+v", tg)
	}
}

// TestReportHidesPassword: a whole run records its command line in the
// report, on stdout and in the Markdown and JSON files; the password of a
// -database-url in it was printed as given.
func TestReportHidesPassword(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const secret = "s3cret-pw"
	dir := t.TempDir()
	o := &options{
		databaseURL: os.Getenv("DATABASE_URL"), only: []string{"floor"}, runs: 1, quick: true, poolMax: 4,
		markdown: dir + "/bench.md", jsonOut: dir + "/bench.json",
		args: []string{"bellhop-bench", "-quick", "-only", "floor", "-database-url", "postgres://bench:" + secret + "@db.example/postgres"},
	}
	var stdout bytes.Buffer
	if code, err := run(ctx, o, &stdout, io.Discard); code != 0 || err != nil {
		t.Fatalf("run: %d, %v", code, err)
	}
	md, err := os.ReadFile(o.markdown)
	if err != nil {
		t.Fatal(err)
	}
	js, err := os.ReadFile(o.jsonOut)
	if err != nil {
		t.Fatal(err)
	}
	for name, out := range map[string]string{"stdout": stdout.String(), "Markdown": string(md), "JSON": string(js)} {
		if strings.Contains(out, secret) || !strings.Contains(out, "-database-url postgres://bench:xxxxx@db.example/postgres") {
			t.Errorf("%s report:\n%s", name, out)
		}
	}
}

// TestScaleFailureStopsProfiler: a scale case that failed after its
// beforeStart hook had started the CPU profiler (-cpuprofile, run 1,
// many queues) left the profiler running, stopped only on success, so
// the next profile of the tool failed with "cpu profiling already in
// use". The context is cancelled once the profile file exists, which
// beforeStart creates just before it starts profiling and before the
// dispatcher starts: the case fails, and the profiler must be free.
func TestScaleFailureStopsProfiler(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	e := testEnv(testServer(t, os.Getenv("DATABASE_URL")))
	e.p.scaleQueues = 2
	e.p.scaleRate = 100
	e.p.scaleDuration = 5 * time.Second
	e.cpuprofile = filepath.Join(t.TempDir(), "cpu")
	profile := e.cpuprofile + ".scale.pprof"
	rctx, rcancel := context.WithCancel(ctx)
	defer rcancel()
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for rctx.Err() == nil {
			if _, err := os.Stat(profile); err == nil {
				rcancel()
				return
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
	e.res.StartRun(1)
	_, err := scaleOnce(rctx, e, 1, 2)
	rcancel()
	<-watched
	if err == nil {
		t.Fatal("the case did not fail: the context was cancelled too late to test anything")
	}
	if _, serr := os.Stat(profile); serr != nil {
		t.Fatalf("the case failed before it started the profiler (%v): %v", serr, err)
	}
	t.Logf("the case failed: %v", err)
	if err := pprof.StartCPUProfile(io.Discard); err != nil {
		t.Fatalf("the failed case left the CPU profiler running: %v", err)
	}
	pprof.StopCPUProfile()
}

// lineWatch is a progress writer that calls fn once, when what it was
// written first contains match.
type lineWatch struct {
	mu    sync.Mutex
	buf   strings.Builder
	match string
	fn    func()
	fired bool
}

func (w *lineWatch) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	if !w.fired && strings.Contains(w.buf.String(), w.match) {
		w.fired = true
		w.fn()
	}
	return len(p), nil
}

// TestBadMarkdownKeepsJSON: run wrote -markdown first and returned at its
// error, so a finished run's -json was never written. The -markdown path
// here passes the check at the start and is made a directory once the
// scenario's run is done: the JSON is still written, and the error names
// the Markdown file.
func TestBadMarkdownKeepsJSON(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := t.TempDir()
	o := &options{
		databaseURL: os.Getenv("DATABASE_URL"), only: []string{"floor"}, runs: 1, quick: true, poolMax: 4,
		markdown: filepath.Join(dir, "bench.md"), jsonOut: filepath.Join(dir, "bench.json"), args: []string{"bellhop-bench"},
	}
	var mkdirErr error
	progress := &lineWatch{match: "run 1 done in", fn: func() { mkdirErr = os.Mkdir(o.markdown, 0o755) }}
	code, err := run(ctx, o, io.Discard, progress)
	progress.mu.Lock()
	fired := progress.fired
	progress.mu.Unlock()
	if !fired || mkdirErr != nil {
		t.Fatalf("the Markdown path was not spoilt (seen %v, %v); run: %d, %v", fired, mkdirErr, code, err)
	}
	if code != 1 || err == nil || !strings.Contains(err.Error(), "-markdown:") {
		t.Errorf("run: %d, %v; want the -markdown error", code, err)
	}
	t.Logf("run: %d, %v", code, err)
	b, err := os.ReadFile(o.jsonOut)
	if err != nil {
		t.Fatalf("the JSON report was not written: %v", err)
	}
	var rep Report
	if err := json.Unmarshal(b, &rep); err != nil || len(rep.Metrics) == 0 {
		t.Errorf("JSON report: %d metrics, %v", len(rep.Metrics), err)
	}
}
