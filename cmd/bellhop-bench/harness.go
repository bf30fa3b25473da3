package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
)

// benchApp is the app every scenario's queues belong to.
const benchApp = "bench"

// env is what every scenario run gets.
type env struct {
	srv      *server
	p        params
	log      zerolog.Logger // the dispatcher's logger
	progress io.Writer      // progress lines (stderr)
	res      *Results
	evidence *Evidence
	// base is the zero of the monotonic clock that latency payloads carry.
	base       time.Time
	cpuprofile string
	riverBin   string
	timeline   bool
	dump       string // -dump: a folder for per-message CSVs
}

// evidenceRun tells whether run is the evidence run, the one after the
// scored runs: only it samples wait events, keeps statement windows and
// writes CPU profiles, which would slow the figures they explain.
func (e *env) evidenceRun(run int) bool { return run > e.p.Runs }

func (e *env) logf(format string, args ...any) {
	fmt.Fprintf(e.progress, "%s  %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}

// openPool opens a pool of at most maxConns connections. runtime adds
// session settings.
func openPool(ctx context.Context, dsn string, maxConns int, runtime map[string]string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = int32(maxConns)
	for k, v := range runtime {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if err := warm(ctx, pool, maxConns); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// warm opens n connections of pool up front, so that no measured
// statement pays for a connect.
func warm(ctx context.Context, pool *pgxpool.Pool, n int) error {
	conns := make([]*pgxpool.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	for range n {
		c, err := pool.Acquire(ctx)
		if err != nil {
			return err
		}
		conns = append(conns, c)
	}
	return nil
}

// setupSession is for setup work that is not measured (registering
// consumers, pre-inserting backlogs): it skips the wait for the WAL flush,
// which makes registering 10,000 consumers take seconds instead of
// minutes. Measured producers never use it.
var setupSession = map[string]string{"synchronous_commit": "off", "application_name": "bench-setup"}

// setupConsumers creates the bench app and registers one consumer per
// queue, from a few goroutines.
func setupConsumers(ctx context.Context, pool *pgxpool.Pool, queues []string, spec bellhop.ConsumerSpec) error {
	c := bellhop.NewClient(pool)
	if _, err := c.CreateApp(ctx, benchApp); err != nil && !errors.Is(err, bellhop.ErrAppExists) {
		return err
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range min(8, len(queues)) {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= len(queues) {
					return
				}
				s := spec
				s.App, s.Queue = benchApp, queues[i]
				if _, err := c.RegisterConsumer(ctx, s); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// inRunOrder returns a copy of cases, reversed in even runs, so that a
// drift within a run (autovacuum, the machine's load, what the previous
// case or scenario left behind) does not always fall on the same case.
func inRunOrder[T any](run int, cases []T) []T {
	out := slices.Clone(cases)
	if run%2 == 0 {
		slices.Reverse(out)
	}
	return out
}

// queueNames returns q0000, q0001, ...
func queueNames(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("q%05d", i)
	}
	return out
}

// queueDB makes a fresh database with a default consumer on each of
// queues, and returns it with an open setup pool. The caller closes the
// pool and drops the database.
func (e *env) queueDB(ctx context.Context, prefix string, queues ...string) (*database, *pgxpool.Pool, error) {
	db, err := e.srv.newDatabase(ctx, prefix, true)
	if err != nil {
		return nil, nil, err
	}
	setup, err := openPool(ctx, db.DSN, 2, setupSession)
	if err != nil {
		db.drop()
		return nil, nil, err
	}
	if err := setupConsumers(ctx, setup, queues, bellhop.ConsumerSpec{}); err != nil {
		setup.Close()
		db.drop()
		return nil, nil, fmt.Errorf("setup: %w", err)
	}
	return db, setup, nil
}

// checkpoint runs CHECKPOINT on pool, so that the WAL of the set-up
// before a case (a backlog, a TRUNCATE) does not bring a checkpoint, and
// its full-page writes, into the case. It takes superuser or, since
// PostgreSQL 15, pg_checkpoint: without either the run goes on, noted
// under scenario (what names the step), as its cases may then overlap a
// checkpoint. It fails only when ctx has ended.
func (e *env) checkpoint(ctx context.Context, pool *pgxpool.Pool, scenario, what string) error {
	if _, err := pool.Exec(ctx, "CHECKPOINT"); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		e.res.Note(scenario, "CHECKPOINT %s failed (%v); cases may overlap a checkpoint", what, err)
	}
	return nil
}

// prefill inserts n messages spread round-robin over queues with
// EnqueueMany in batches.
func prefill(ctx context.Context, pool *pgxpool.Pool, queues []string, n, batch int) error {
	c := bellhop.NewClient(pool)
	msgs := make([]bellhop.NewMessage, 0, batch)
	for i := 0; i < n; {
		msgs = msgs[:0]
		for ; i < n && len(msgs) < batch; i++ {
			msgs = append(msgs, bellhop.NewMessage{Queue: queues[i%len(queues)], Payload: []byte(`{"n":` + strconv.Itoa(i) + `}`)})
		}
		if _, err := c.EnqueueMany(ctx, benchApp, msgs); err != nil {
			return err
		}
	}
	return nil
}

// resolverFunc adapts a function to bellhop.Resolver.
type resolverFunc func(bellhop.Consumer) bellhop.Handler

func (f resolverFunc) Resolve(c bellhop.Consumer) bellhop.Handler { return f(c) }

// every serves every consumer with h.
func every(h bellhop.Handler) bellhop.Resolver {
	return resolverFunc(func(bellhop.Consumer) bellhop.Handler { return h })
}

var noop = bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error { return nil })

// running is a dispatcher running in this process.
type running struct {
	d      *bellhop.Dispatcher
	cancel context.CancelFunc
	done   chan error
	// Start is taken just before Run was called.
	Start time.Time

	stopOnce sync.Once
	stopErr  error
}

// startDispatcher runs a dispatcher on dsn with a pool of
// params.poolMaxConns connections.
func (e *env) startDispatcher(dsn string, res bellhop.Resolver, obs bellhop.Observer) (*running, error) {
	return e.startDispatcherWith(dsn, bellhop.DispatcherConfig{Resolver: res, Observer: obs}, nil)
}

// startDispatcherWith is startDispatcher with more of the config set; a
// tracer, if not nil, traces the dispatcher's pool.
func (e *env) startDispatcherWith(dsn string, dc bellhop.DispatcherConfig, tracer pgx.QueryTracer) (*running, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = int32(e.p.poolMaxConns)
	cfg.ConnConfig.Tracer = tracer
	dc.Logger = e.log
	d, err := bellhop.NewDispatcher(cfg, dc)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{d: d, cancel: cancel, done: make(chan error, 1)}
	r.Start = time.Now()
	go func() { r.done <- d.Run(ctx) }()
	return r, nil
}

// ready waits until the dispatcher's listener is connected.
func (r *running) ready(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		if r.d.Ready(ctx) == nil {
			return nil
		}
		select {
		case err := <-r.done:
			r.done <- err
			return fmt.Errorf("dispatcher exited: %v", err)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(2 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("dispatcher not ready after %s", timeout)
		}
	}
}

// stop stops the dispatcher and waits for Run to return. It may be
// called more than once.
func (r *running) stop() error {
	r.stopOnce.Do(func() {
		r.cancel()
		select {
		case r.stopErr = <-r.done:
		case <-time.After(2 * time.Minute):
			r.stopErr = errors.New("dispatcher did not stop within 2 minutes")
		}
	})
	return r.stopErr
}

// stopInto stops r, for a defer, and sets *err to the stop's error
// unless *err holds one already: a dispatcher that did not stop may still
// hold sessions and claims that would run into the next case, so the run
// fails rather than go on.
func (r *running) stopInto(err *error) {
	if serr := r.stop(); serr != nil && *err == nil {
		*err = fmt.Errorf("stop the dispatcher: %w", serr)
	}
}

// observer counts what a dispatcher reports.
type observer struct {
	start   time.Time
	target  int64
	acked   atomic.Int64
	other   atomic.Int64
	emptyAt atomic.Int64 // since start, when the target-th ack was written
	done    chan struct{}
	polls   atomic.Int64
	missed  atomic.Int64
}

func newObserver(target int) *observer {
	return &observer{target: int64(target), done: make(chan struct{})}
}

func (o *observer) Delivered(*bellhop.Message) {}
func (o *observer) Settled(_ *bellhop.Message, out bellhop.Outcome, _ time.Duration) {
	if out != bellhop.Acked {
		o.other.Add(1)
		return
	}
	if o.acked.Add(1) == o.target {
		o.emptyAt.Store(int64(time.Since(o.start)))
		close(o.done)
	}
}
func (o *observer) Polled(missed int) {
	o.polls.Add(1)
	o.missed.Add(int64(missed))
}
func (o *observer) Reclaimed(int64, int64) {}

// recorder records, per message, the time from just before its enqueue to
// the start of its handler. Messages carry their sequence number and the
// enqueue time on the monotonic clock since base.
type recorder struct {
	base time.Time
	lat  []int64
	// enq is how long each Enqueue call took; handled when each handler
	// started (since base) and returned when each Enqueue returned, to
	// tell the producer's part from the dispatcher's.
	enq, started, returned []int64
	// due is when each message was due by the producers' schedule (since
	// base; 0 if none was given): latency from it counts the time a
	// producer that fell behind took to get to the message, which
	// latency from the send leaves out.
	due  []int64
	seen []atomic.Bool
	got  atomic.Int64
	dups atomic.Int64
	warm atomic.Int64 // warm-up messages delivered
	bad  atomic.Int64
	done chan struct{}
}

func newRecorder(base time.Time, n int) *recorder {
	return &recorder{base: base, lat: make([]int64, n), seen: make([]atomic.Bool, n), done: make(chan struct{}),
		enq: make([]int64, n), started: make([]int64, n), returned: make([]int64, n), due: make([]int64, n)}
}

// payload stamps message seq with the current time, which it returns
// too.
func (r *recorder) payload(seq int) ([]byte, int64) {
	t := int64(time.Since(r.base))
	return []byte(`{"s":` + strconv.Itoa(seq) + `,"t":` + strconv.FormatInt(t, 10) + `}`), t
}

type stamp struct {
	S int   `json:"s"`
	T int64 `json:"t"`
	// W marks a warm-up message (hooks.warmup), counted but not measured.
	W bool `json:"w,omitempty"`
}

// warmupBody is the payload of a warm-up message.
var warmupBody = []byte(`{"w":true}`)

func (r *recorder) record(now int64, body []byte) {
	var s stamp
	err := json.Unmarshal(body, &s)
	if err == nil && s.W {
		r.warm.Add(1)
		return
	}
	if err != nil || s.S < 0 || s.S >= len(r.lat) {
		r.bad.Add(1)
		return
	}
	if r.seen[s.S].Swap(true) {
		r.dups.Add(1)
		return
	}
	r.lat[s.S] = now - s.T
	r.started[s.S] = now
	if r.got.Add(1) == int64(len(r.lat)) {
		close(r.done)
	}
}

// handler is a Go handler that records the latency of each message.
func (r *recorder) handler() bellhop.Handler {
	return bellhop.HandlerFunc(func(_ context.Context, m *bellhop.Message) error {
		now := int64(time.Since(r.base))
		r.record(now, m.Payload)
		return nil
	})
}

// httpHandler is an HTTP endpoint that records the latency of each pushed
// message at the start of the request's handler.
func (r *recorder) httpHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		now := int64(time.Since(r.base))
		body, err := io.ReadAll(req.Body)
		if err != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		r.record(now, body)
		w.WriteHeader(http.StatusNoContent)
	})
}

// wait waits until n messages were recorded.
func (r *recorder) wait(ctx context.Context, n int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for r.got.Load() < int64(n) {
		if time.Now().After(deadline) {
			return fmt.Errorf("only %d of %d messages reached the handler within %s", r.got.Load(), n, timeout)
		}
		select {
		case <-r.done:
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Millisecond):
		}
	}
	return nil
}

// seenOnly returns the values of xs at the messages that were recorded.
func (r *recorder) seenOnly(xs []int64) []int64 {
	out := make([]int64, 0, len(xs))
	for i, v := range xs {
		if r.seen[i].Load() {
			out = append(out, v)
		}
	}
	return out
}

func (r *recorder) stats() latencyStats { return summarize(r.seenOnly(r.lat)) }

// dueAt notes when message seq was due by the schedule.
func (r *recorder) dueAt(seq int, due time.Time) { r.due[seq] = int64(due.Sub(r.base)) }

// fromDue returns the latencies from each message's due time (dueAt) to
// the start of its handler, of the messages recorded with one.
func (r *recorder) fromDue() latencyStats {
	out := make([]int64, 0, len(r.lat))
	for i := range r.lat {
		if r.seen[i].Load() && r.due[i] != 0 {
			out = append(out, r.started[i]-r.due[i])
		}
	}
	return summarize(out)
}

// deliveredBy returns the rate at which handlers started between the
// first Enqueue and end (both since base): how fast the dispatcher kept
// up while the producers ran.
func (r *recorder) deliveredBy(end time.Duration) float64 {
	first, ok := r.firstSend()
	if !ok {
		return 0
	}
	n := 0
	for i := range r.lat {
		if r.seen[i].Load() && r.started[i] <= int64(end) {
			n++
		}
	}
	return rate(n, end-time.Duration(first))
}

// firstSend returns when (since base) the earliest Enqueue call of the
// recorded messages began; ok is false if none was recorded.
func (r *recorder) firstSend() (first int64, ok bool) {
	for i := range r.lat {
		if !r.seen[i].Load() {
			continue
		}
		if t0 := r.returned[i] - r.enq[i]; !ok || t0 < first {
			first, ok = t0, true
		}
	}
	return first, ok
}

// enqueued notes that message seq's Enqueue call, begun at t (since
// base), returned now.
func (r *recorder) enqueued(seq int, t int64) {
	now := int64(time.Since(r.base))
	r.enq[seq] = now - t
	r.returned[seq] = now
}

// dump writes every delivered message of a case run as CSV to the -dump
// folder, if one was given: when its Enqueue began (µs since base), how
// long the call took, its latency and its latency from its due time (µs;
// empty if it had none). The last column comes last so that readers of
// the first three (bench/tail) read files of either age.
func (r *recorder) dump(e *env, scenario, cas string, run int) error {
	if e.dump == "" {
		return nil
	}
	if err := os.MkdirAll(e.dump, 0o755); err != nil {
		return err
	}
	slug := strings.Map(func(c rune) rune {
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' {
			return c
		}
		return '-'
	}, cas)
	var b strings.Builder
	b.WriteString("enqueued_us,enqueue_call_us,latency_us,latency_from_due_us\n")
	for i := range r.lat {
		if r.seen[i].Load() {
			fromDue := ""
			if r.due[i] != 0 {
				fromDue = strconv.FormatInt((r.started[i]-r.due[i])/1000, 10)
			}
			fmt.Fprintf(&b, "%d,%d,%d,%s\n", (r.returned[i]-r.enq[i])/1000, r.enq[i]/1000, r.lat[i]/1000, fromDue)
		}
	}
	return os.WriteFile(filepath.Join(e.dump, fmt.Sprintf("%s-%s-run%d.csv", scenario, slug, run)), []byte(b.String()), 0o644)
}

// split returns the Enqueue call durations and the times from the
// return of Enqueue to the start of the handler (negative when the
// handler started first).
func (r *recorder) split() (enq, after latencyStats) {
	a := make([]int64, len(r.lat))
	for i := range a {
		a[i] = r.started[i] - r.returned[i]
	}
	return summarize(r.seenOnly(r.enq)), summarize(r.seenOnly(a))
}

// pace calls send(i, due) for i in [0, total), each at due = begin +
// i*interval by the schedule, from workers goroutines; a worker that
// falls behind sends at once, after due. With a deadline (> 0), nothing
// is sent once it has passed since begin, so a producer that cannot keep
// up sends fewer. It returns how many were sent and how long the sends
// took, from begin to the return of the last one.
func pace(ctx context.Context, total int, interval, deadline time.Duration, workers int, send func(ctx context.Context, i int, due time.Time) error) (int, time.Duration, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var next, sent atomic.Int64
	var lastDone atomic.Int64
	var firstErr error
	var errOnce sync.Once
	begin := time.Now()
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for ctx.Err() == nil {
				i := int(next.Add(1)) - 1
				if i >= total {
					return
				}
				due := begin.Add(time.Duration(i) * interval)
				if d := time.Until(due); d > 0 {
					time.Sleep(d)
				}
				if deadline > 0 && time.Since(begin) >= deadline {
					return
				}
				if err := send(ctx, i, due); err != nil {
					errOnce.Do(func() { firstErr = fmt.Errorf("send %d: %w", i, err); cancel() })
					return
				}
				sent.Add(1)
				t := int64(time.Since(begin))
				for {
					old := lastDone.Load()
					if t <= old || lastDone.CompareAndSwap(old, t) {
						break
					}
				}
			}
		})
	}
	wg.Wait()
	return int(sent.Load()), time.Duration(lastDone.Load()), firstErr
}

// vmRSS returns this process's resident set size from /proc/self/status.
func vmRSS() (int64, error) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			fields := strings.Fields(rest)
			kb, err := strconv.ParseInt(fields[0], 10, 64)
			return kb << 10, err
		}
	}
	return 0, errors.New("no VmRSS in /proc/self/status")
}

// cpuTimes are the machine's CPU times from /proc/stat, in clock ticks:
// the "cpu" line's user, nice, system, idle, iowait, irq, softirq and
// steal.
type cpuTimes [8]uint64

// readCPUTimes reads cpuTimes; ok is false where /proc/stat is missing or
// has another layout.
func readCPUTimes() (t cpuTimes, ok bool) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return t, false
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return t, false
	}
	for i := range t {
		if t[i], err = strconv.ParseUint(f[i+1], 10, 64); err != nil {
			return t, false
		}
	}
	return t, true
}

// cpuShare describes how the machine's CPU time went between two
// readings: busy (user, nice, system, irq, softirq), iowait, and steal,
// the time the hypervisor gave this VM's CPUs to others. A run whose
// figures fall with steal or iowait high met a slower machine, not
// slower code.
func cpuShare(a, b cpuTimes) string {
	var d cpuTimes
	var total uint64
	for i := range d {
		d[i] = b[i] - a[i]
		total += d[i]
	}
	if total == 0 {
		return "cpu unknown"
	}
	pct := func(v uint64) float64 { return 100 * float64(v) / float64(total) }
	return fmt.Sprintf("cpu busy %.0f%%, iowait %.1f%%, steal %.1f%%", pct(d[0]+d[1]+d[2]+d[5]+d[6]), pct(d[4]), pct(d[7]))
}

// loadavg returns the 1, 5 and 15 minute load averages.
func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

// sleepCtx sleeps for d or until ctx is done.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// settleStatements waits until db's statement count in pg_stat_statements
// has not grown for a second (a starting dispatcher claims once on every
// lane), looking every 100ms, for at least minWait and at most maxWait.
// It returns when, after its start, the count last grew: how long the
// statements took, not how long it took to be sure they had ended. settled
// is false when that time is not known: without pg_stat_statements (it
// then waits maxWait, so that the start-up claims are likely over), or
// when the count still grew at maxWait (the claims had not ended). A
// caller records the time only when settled.
func settleStatements(ctx context.Context, db *database, minWait, maxWait time.Duration) (d time.Duration, settled bool, err error) {
	if !db.s.pss {
		return 0, false, sleepCtx(ctx, maxWait)
	}
	count := func(ctx context.Context) (int64, error) {
		st, err := db.statements(ctx)
		return sumCalls(st), err
	}
	return settleCount(ctx, count, minWait, maxWait, time.Second, 100*time.Millisecond)
}

// settleCount is settleStatements on any count: it reads count every tick
// until it has not changed for quiet, for at least minWait and at most
// maxWait.
func settleCount(ctx context.Context, count func(context.Context) (int64, error), minWait, maxWait, quiet, tick time.Duration) (time.Duration, bool, error) {
	start := time.Now()
	last, lastChange := int64(-1), start
	for time.Since(start) < maxWait {
		n, err := count(ctx)
		if err != nil {
			return 0, false, err
		}
		if n != last {
			last, lastChange = n, time.Now()
		} else if time.Since(lastChange) >= quiet && time.Since(start) >= minWait {
			return lastChange.Sub(start), true, nil
		}
		if err := sleepCtx(ctx, tick); err != nil {
			return 0, false, err
		}
	}
	return lastChange.Sub(start), false, nil
}
