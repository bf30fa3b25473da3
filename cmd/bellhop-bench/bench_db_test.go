package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"maps"
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
	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgcluster"
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

// testEnv is an env on srv with the quick sizes, one scored run (so run
// 2 is the evidence run, as run sets it up) and a small dispatcher pool;
// tests shrink what they run further.
func testEnv(srv *server) *env {
	p := quickParams()
	p.Runs = 1
	p.poolMaxConns = 4
	res := newResults()
	res.SetEvidenceRun(p.Runs + 1)
	return &env{srv: srv, p: p, log: zerolog.Nop(), progress: io.Discard, res: res, evidence: &Evidence{}, base: time.Now()}
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
	pr, err := produceFor(ctx, db, 32, 300*time.Millisecond, produceOpts{counter: clock})
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
	// The evidence run: only it keeps a statement window.
	if _, err := latencyOnce(ctx, e, caseGo, e.p.Runs+1, reportAs{"latency", caseGo}); err != nil {
		t.Fatalf("latency: %v", err)
	}
	if len(e.evidence.Statements) != 0 {
		t.Errorf("statement evidence recorded without a reset: %+v", e.evidence.Statements)
	}
	if !slices.ContainsFunc(e.res.notes["latency"], func(n string) bool {
		return strings.Contains(n, "Go handler (evidence run): no statement evidence: pg_stat_statements_reset failed")
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
	e.res.StartRun(1)
	start := time.Now()
	// Run 1, a scored run: the evidence run's figures are not in the
	// targets.
	if err := runScale(ctx, e, 1); err != nil {
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
	if !tg.Known || tg.Verdict() != "FAIL" || !strings.Contains(tg.Detail, "in run 1 the 2-queue case reached") {
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
// beforeStart hook had started the CPU profiler (-cpuprofile, the
// evidence run) left the profiler running, stopped only on success, so
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
	profile := e.cpuprofile + ".scale-q2.pprof"
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
	e.res.StartRun(e.p.Runs + 1)
	_, err := scaleOnce(rctx, e, e.p.Runs+1, 2)
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

// TestInstrumentationOnlyInEvidenceRun: the scale scenario profiled,
// sampled and reset pg_stat_statements around its 10,000-queue case in
// run 1 but not around the 1-queue case it is divided by, and the
// throughput scenario profiled its run 1, whose figures went into the
// medians. A scored run now gathers none of it; the evidence run gathers
// it, for both scale cases alike.
func TestInstrumentationOnlyInEvidenceRun(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e := testEnv(testServer(t, os.Getenv("DATABASE_URL")))
	e.p.scaleQueues = 2
	e.p.scaleRate = 100
	e.p.scaleDuration = time.Second
	dir := t.TempDir()
	e.cpuprofile = filepath.Join(dir, "cpu")
	c := throughputCase{N: 200, Queues: 1, InFlight: 10}
	both := func(run int) {
		t.Helper()
		e.res.StartRun(run)
		if err := runScale(ctx, e, run); err != nil {
			t.Fatalf("scale, run %d: %v", run, err)
		}
		if _, err := throughputOnce(ctx, e, run, c, reportAs{"throughput", c.String()}); err != nil {
			t.Fatalf("throughput, run %d: %v", run, err)
		}
	}
	both(1)
	files, _ := filepath.Glob(filepath.Join(dir, "*"))
	if ev := e.evidence; len(ev.Profiles)+len(ev.WaitEvents)+len(ev.Statements)+len(files) != 0 {
		t.Fatalf("a scored run gathered evidence: %+v, files %v", ev, files)
	}
	both(e.p.Runs + 1)
	// The evidence run, run 2, is even: its scale cases run in reverse
	// order.
	wantProfiles := []string{e.cpuprofile + ".scale-q2.pprof", e.cpuprofile + ".scale-q1.pprof", e.cpuprofile + ".200-q1-f10.pprof"}
	if !slices.Equal(e.evidence.Profiles, wantProfiles) {
		t.Errorf("profiles %v, want %v", e.evidence.Profiles, wantProfiles)
	}
	for _, p := range wantProfiles {
		if fi, err := os.Stat(p); err != nil || fi.Size() == 0 {
			t.Errorf("profile %s: %v", p, err)
		}
	}
	var waits []string
	for _, w := range e.evidence.WaitEvents {
		waits = append(waits, w.Case)
	}
	wantWaits := []string{"scale: " + scaleCase(2, 100) + " (evidence run), all sessions", "scale: " + scaleCase(1, 100) + " (evidence run), all sessions"}
	if !slices.Equal(waits, wantWaits) {
		t.Errorf("wait samples %q, want %q", waits, wantWaits)
	}
	if e.srv.pss {
		var stmts []string
		for _, s := range e.evidence.Statements {
			stmts = append(stmts, s.Case)
		}
		want := []string{"scale: " + scaleCase(2, 100) + " (evidence run), while producing", "scale: " + scaleCase(1, 100) + " (evidence run), while producing", "throughput: " + c.String() + " (evidence run)"}
		if !slices.Equal(stmts, want) {
			t.Errorf("statement windows %q, want %q", stmts, want)
		}
	}
	// The table holds run 1 only; the evidence run's figures are apart.
	if runs := e.res.RunValues("throughput", c.String(), mToEmpty); len(runs) != 1 || runs[0].Run != 1 {
		t.Errorf("throughput values in the table: %+v", runs)
	}
	var evidence int
	for _, f := range e.res.EvidenceFigures() {
		if f.Run != e.p.Runs+1 {
			t.Errorf("evidence figure of run %d: %+v", f.Run, f)
		}
		if f.Name == mScaleP99Ratio || f.Name == mToEmpty {
			evidence++
		}
	}
	if evidence != 2 {
		t.Errorf("the evidence run's scale ratio and throughput rate: %d of 2 found in %+v", evidence, e.res.EvidenceFigures())
	}
}

// TestProducerOrderAlternates: the producer scenario ran trigger on
// before trigger off in every run, so a drift within a run always fell
// on the same side; even runs now take trigger off first, as the busy
// scenario reverses its modes.
func TestProducerOrderAlternates(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	e := testEnv(testServer(t, os.Getenv("DATABASE_URL")))
	e.p.producerConcurrency = []int{1}
	e.p.producerDuration = 100 * time.Millisecond
	e.p.bulkRows = 20
	bulk := func(on bool) string { return "one 20-row INSERT, " + triggerLabel(on) }
	for run, first := range map[int]bool{1: true, 2: false} {
		e.res = newResults()
		e.res.StartRun(run)
		if err := runProducer(ctx, e, run); err != nil {
			t.Fatalf("run %d: %v", run, err)
		}
		// Metrics are listed in the order they were first recorded.
		var got []string
		for _, m := range e.res.order {
			got = append(got, m.Case)
		}
		want := []string{producerCase(1, first), producerCase(1, !first), bulk(first), bulk(!first)}
		if !slices.Equal(got, want) {
			t.Errorf("run %d: cases in order %q, want %q", run, got, want)
		}
	}
}

// TestLoadWarmsUp: the load scenario measured from the first message on,
// while the producers' and the dispatcher's pools were still opening
// connections (server sessions that are slow at first); the scale
// scenario had a warm-up for that. Load has one now, the same one, and
// its messages are delivered but not measured.
func TestLoadWarmsUp(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	e := testEnv(testServer(t, os.Getenv("DATABASE_URL")))
	e.p.loadDuration = time.Second
	e.res.StartRun(1)
	rec, err := loadOnce(ctx, e, loadRun{rate: 200}, 1)
	if err != nil {
		t.Fatal(err)
	}
	// 250 ms at 200/s: about 50, fewer if the producers fell behind.
	if w := rec.warm.Load(); w == 0 || w > 50 {
		t.Errorf("%d warm-up messages delivered", w)
	}
	if got := rec.got.Load(); got == 0 || got > 200 || rec.bad.Load() != 0 {
		t.Errorf("%d measured, %d unparsable", got, rec.bad.Load())
	}
	if v := e.res.Values("load", loadCase(200, 0), "p50"); len(v) != 1 {
		t.Errorf("p50 values: %v", v)
	}
}

// startPSSCluster starts a throwaway cluster with pg_stat_statements and
// settings, and the benchmark's server on it as on a DATABASE_URL.
func startPSSCluster(t *testing.T, settings map[string]string) *server {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s := map[string]string{"shared_preload_libraries": "pg_stat_statements", "fsync": "off"}
	maps.Copy(s, settings)
	c, err := pgcluster.Start(ctx, pgcluster.Options{Settings: s})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Stop(); err != nil {
			t.Errorf("stop the cluster: %v", err)
		}
	})
	return testServer(t, c.ConnString("postgres"))
}

// setting returns the value srv recorded for name.
func setting(srv *server, name string) (string, bool) {
	for _, kv := range srv.settings {
		if kv[0] == name {
			return kv[1], true
		}
	}
	return "", false
}

// churnStatements runs distinct statements on srv's postgres database
// until ctx ends, 300 kinds in turn: more than a pg_stat_statements.max
// of 100 holds, so it keeps evicting entries.
func churnStatements(ctx context.Context, t *testing.T, srv *server) <-chan struct{} {
	done := make(chan struct{})
	conn, err := pgx.Connect(ctx, srv.adminDSN)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(done)
		defer conn.Close(context.Background())
		for i := 0; ctx.Err() == nil; i = (i + 1) % 300 {
			// Each count of columns is a statement of its own.
			if _, err := conn.Exec(ctx, "SELECT "+strings.Repeat("1, ", i)+"1"); err != nil && ctx.Err() == nil {
				t.Errorf("churn: %v", err)
				return
			}
		}
	}()
	return done
}

// TestIdleEvictions: the idle scenario's statement counts depend on
// pg_stat_statements settings the report did not record, and an entry
// evicted to make room took its calls out of the count unnoticed. The
// settings are recorded now, and a count taken while entries were
// evicted is left out: here a cluster whose pg_stat_statements holds 100
// entries, while another session keeps running 300 kinds of statement.
func TestIdleEvictions(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	srv := startPSSCluster(t, map[string]string{"pg_stat_statements.max": "100"})
	for name, want := range map[string]string{"pg_stat_statements.max": "100", "pg_stat_statements.track": "top", "pg_stat_statements.track_utility": "on"} {
		if v, ok := setting(srv, name); v != want {
			t.Errorf("%s recorded as %q (%v), want %q", name, v, ok, want)
		}
	}
	d0, err := srv.stmtDeallocs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cctx, stopChurn := context.WithCancel(ctx)
	churned := churnStatements(cctx, t, srv)
	defer func() {
		stopChurn()
		<-churned
	}()
	e := shortIdleRun(ctx, t, srv)
	if d1, err := srv.stmtDeallocs(ctx); err != nil || d1 <= d0 {
		t.Fatalf("no evictions to test with: dealloc %d → %d, %v", d0, d1, err)
	}
	if v := e.res.Values("idle", idleCase(e.p), mIdleStatements); len(v) != 0 {
		t.Errorf("statements/min recorded despite evictions: %v", v)
	}
	if !slices.ContainsFunc(e.res.notes["idle"], func(n string) bool {
		return strings.HasPrefix(n, "run 1: '"+mIdleStatements+"' left out: pg_stat_statements evicted entries")
	}) {
		t.Errorf("notes: %q", e.res.notes["idle"])
	}
	// What pg_stat_statements does not count stands.
	if v := e.res.Values("idle", idleCase(e.p), "transactions/min (pg_stat_database)"); len(v) != 1 {
		t.Errorf("transactions/min: %v", v)
	}
}

// TestIdleCountsOnOwnCluster: the throwaway cluster is started with room
// for 20,000 statements (a full run creates about a hundred databases,
// whose entries stay after they are dropped), records it, and an idle
// run there keeps its count.
func TestIdleCountsOnOwnCluster(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srv := testServer(t, "")
	if v, _ := setting(srv, "pg_stat_statements.max"); v != "20000" {
		t.Errorf("pg_stat_statements.max recorded as %q", v)
	}
	e := shortIdleRun(ctx, t, srv)
	if v := e.res.Values("idle", idleCase(e.p), mIdleStatements); len(v) != 1 {
		t.Errorf("statements/min: %v; notes %q", v, e.res.notes["idle"])
	}
	if v := e.res.Values("idle", idleCase(e.p), "start-up statements"); len(v) != 1 || v[0] == 0 {
		t.Errorf("start-up statements: %v; notes %q", v, e.res.notes["idle"])
	}
}

// shortIdleRun runs one idle scenario run on srv, small and short: 5
// consumers, a second's window.
func shortIdleRun(ctx context.Context, t *testing.T, srv *server) *env {
	t.Helper()
	e := testEnv(srv)
	e.p.idleConsumers = 5
	e.p.idleSettle = 200 * time.Millisecond
	e.p.idleDuration = time.Second
	e.res.StartRun(1)
	if err := runIdle(ctx, e, 1); err != nil {
		t.Fatal(err)
	}
	return e
}

// TestDueRetries: scenario 3b's cases turn their share of the backlog,
// spread evenly, into due retries, and burn all of it down.
func TestDueRetries(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e := testEnv(testServer(t, os.Getenv("DATABASE_URL")))
	db, setup, err := e.queueDB(ctx, "due", "q")
	if err != nil {
		t.Fatal(err)
	}
	defer db.drop()
	defer setup.Close()
	for _, tc := range []struct{ percent, delayed, evenDelayed int }{{0, 0, 0}, {50, 50, 50}, {100, 100, 50}} {
		if _, err := setup.Exec(ctx, "TRUNCATE queue_messages"); err != nil {
			t.Fatal(err)
		}
		if err := prefill(ctx, setup, []string{"q"}, 100, 30); err != nil {
			t.Fatal(err)
		}
		if tc.percent > 0 {
			if err := makeDueRetries(ctx, setup, tc.percent); err != nil {
				t.Fatal(err)
			}
		}
		var delayed, evenDelayed, notDue int
		if err := setup.QueryRow(ctx, `SELECT count(deliver_after), count(deliver_after) FILTER (WHERE (payload->>'n')::int % 2 = 0),
			count(*) FILTER (WHERE deliver_after > now() OR deliver_after <= enqueued_at) FROM queue_messages`).Scan(&delayed, &evenDelayed, &notDue); err != nil {
			t.Fatal(err)
		}
		if delayed != tc.delayed || evenDelayed != tc.evenDelayed || notDue != 0 {
			t.Errorf("%d %%: %d delayed (want %d), %d of them even (want %d), %d not due or not after enqueued_at", tc.percent, delayed, tc.delayed, evenDelayed, tc.evenDelayed, notDue)
		}
	}

	c := throughputCase{N: 200, Queues: 1, InFlight: 10, DuePercent: 50}
	if _, err := throughputOnce(ctx, e, 1, c, reportAs{"retries", c.String()}); err != nil {
		t.Fatal(err)
	}
	if v := e.res.Values("retries", "200 msgs, 1 queue, in-flight 10, 50 % due retries", mToEmpty); len(v) != 1 || v[0] <= 0 {
		t.Errorf("burn-down figures: %v", v)
	}
}
