package integration

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
)

// TestListenerOutage: messages enqueued while the listener's connection
// is down notify nobody; the reconnect catches up on them at once, not
// at the next fallback poll (an hour away).
func TestListenerOutage(t *testing.T) {
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	const reconnect = 500 * time.Millisecond
	var dp atomic.Pointer[running] // set once the dispatcher is started
	connectsAtDelivery := make(chan uint64, 10)
	rec := &recorder{result: func(context.Context, *bellhop.Message) error {
		connectsAtDelivery <- dp.Load().ListenerStats().Connects
		return nil
	}}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	claims := &claimCounter{}
	d := startDispatcher(t, e.dsn, bellhop.DispatcherConfig{
		Resolver: mux, PollInterval: time.Hour, ReconnectDelay: reconnect,
	}, func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = claims })
	dp.Store(d)
	// Ready means connected; the scan for lanes to wake that follows a
	// connect runs just after. Let it finish (the queue is empty, so it
	// wakes nothing), so that it cannot pick up the messages enqueued
	// during the outage below.
	waitFor(t, 5*time.Second, "the post-connect wake scan", func() bool { return claims.scans.Load() >= 1 })
	if c := d.ListenerStats().Connects; c != 1 {
		t.Fatalf("listener connects = %d before the outage, want 1", c)
	}

	ctx := context.Background()
	var killed int
	if err := e.pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE application_name = 'bellhop-listener' AND datname = current_database()`).Scan(&killed); err != nil {
		t.Fatal(err)
	}
	if killed != 1 {
		t.Fatalf("terminated %d listener backends, want 1", killed)
	}
	outage := time.Now()
	waitFor(t, 2*time.Second, "the dispatcher to notice the outage", func() bool { return d.Ready(ctx) != nil })

	const n = 5
	for i := range n {
		e.enqueue(t, "orders", i, bellhop.EnqueueOptions{})
	}
	if c := d.ListenerStats().Connects; c != 1 {
		t.Fatalf("the listener reconnected (connects = %d) before the messages were enqueued; the test proves nothing", c)
	}
	if got := rec.n.Load(); got != 0 {
		t.Fatalf("%d messages delivered during the outage, with no listener and no poll", got)
	}

	waitFor(t, reconnect+3*time.Second, "delivery after the reconnect", func() bool { return rec.n.Load() == n })
	t.Logf("all %d delivered %s after the kill (reconnect delay %s)", n, time.Since(outage).Round(time.Millisecond), reconnect)
	close(connectsAtDelivery)
	for c := range connectsAtDelivery {
		if c < 2 {
			t.Errorf("a message was delivered before the reconnect (connects = %d)", c)
		}
	}
	if err := d.Ready(ctx); err != nil {
		t.Errorf("not ready after the reconnect: %v", err)
	}
}

// TestPoolOutage: when the pool's sessions end and the listener's stays
// (an administrator's pg_terminate_backend, a server's
// idle_session_timeout), the listener does not reconnect, and the rule
// that pings connections idle since its reconnect does not apply. A
// claim failed on a dead connection, and its message waited for the
// lane's backoff (0.5 – 1 s), and more when the retry took another dead
// one: 0.56 – 1.65 s. The lane now retries such a failure at once, and
// the pool pings the connections idle since it
// (TestClosedConnMarksPoolStale), so one claim fails, and only one.
func TestPoolOutage(t *testing.T) {
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	failures := &claimFailures{next: zerolog.NewTestWriter(t), seen: make(chan claimFailure, 1)}
	watch := &poolWatch{}
	const conns = 8
	d := startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour,
		Logger: zerolog.New(failures).With().Timestamp().Logger()},
		func(pc *pgxpool.Config) { pc.MaxConns, pc.MinConns, pc.ConnConfig.Tracer = conns, conns, watch })
	deliveredBy(t, rec, e.enqueue(t, "orders", "warm-up", bellhop.EnqueueOptions{}), 10*time.Second)
	killPoolQuiet(t, e, watch, conns)

	for i := range 3 {
		began := time.Now()
		id := e.enqueue(t, "orders", i, bellhop.EnqueueOptions{})
		t.Logf("message %d delivered %s after its Enqueue began", i, deliveredBy(t, rec, id, 30*time.Second).Sub(began).Round(time.Millisecond))
	}
	select {
	case f := <-failures.seen:
		if f.retryIn != 0 {
			t.Errorf("the claim that failed on a dead connection is retried in %s; want at once", f.retryIn)
		}
	default:
		t.Fatal("no claim failed after the pool's sessions ended: the test proves nothing")
	}
	if n := watch.failedClaims.Load(); n != 1 {
		t.Errorf("%d claims failed; want 1, the first: the retry took another dead connection, unpinged", n)
	}
	if c := d.ListenerStats().Connects; c != 1 {
		t.Fatalf("the listener reconnected (connects = %d): the test is about the pool's sessions ending alone", c)
	}
}

// killPoolQuiet ends the sessions of a dispatcher's pool of conns
// connections, all open, and waits until they are gone. They are killed
// while the dispatcher uses none of them, so that no statement of a
// delivery's aftermath finds them dead first: the next statement then
// takes the connection released last, which the rule for the listener's
// reconnect does not ping. last_fired_at is written on a 1s tick after a
// delivery: once it is, nothing is due.
func killPoolQuiet(t *testing.T, e *env, watch *poolWatch, conns int) {
	t.Helper()
	waitFor(t, 10*time.Second, "the pool's connections open", func() bool {
		return e.count(t, `SELECT count(*) `+dispatcherSessions) == conns
	})
	waitFor(t, 10*time.Second, "the warm-up's last_fired_at", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_trigger_details WHERE last_fired_at IS NOT NULL`) == 1
	})
	watch.waitQuiet(t, 10*time.Second, 300*time.Millisecond)
	var killed int
	if err := e.pool.QueryRow(context.Background(), `SELECT count(pg_terminate_backend(pid)) `+dispatcherSessions).Scan(&killed); err != nil {
		t.Fatal(err)
	}
	if killed != conns {
		t.Fatalf("terminated %d pool backends, want %d", killed, conns)
	}
	waitFor(t, 10*time.Second, "the pool's backends gone", func() bool { return e.count(t, `SELECT count(*) `+dispatcherSessions) == 0 })
}

// TestReloadAfterPoolSessionsEnd: a consumer change that reaches a
// dispatcher whose pool's sessions have ended (the listener's has not)
// fails its reload once, on a dead connection, and the reload is tried
// again at once, on a connection the pool pings first: the pause applies
// without the reload's backoff (0.5 – 1 s, and more after a retry on
// another dead connection).
func TestReloadAfterPoolSessionsEnd(t *testing.T) {
	e := newEnv(t)
	c := e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	paused := make(chan struct{})
	var once sync.Once
	resolver := resolverFunc(func(con bellhop.Consumer) bellhop.Handler {
		if !con.Enabled {
			once.Do(func() { close(paused) })
		}
		return mux.Resolve(con)
	})
	logs := &syncBuffer{}
	watch := &poolWatch{}
	const conns = 8
	d := startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: resolver, PollInterval: time.Hour,
		Logger: zerolog.New(io.MultiWriter(logs, zerolog.NewTestWriter(t)))},
		func(pc *pgxpool.Config) { pc.MaxConns, pc.MinConns, pc.ConnConfig.Tracer = conns, conns, watch })
	deliveredBy(t, rec, e.enqueue(t, "orders", "warm-up", bellhop.EnqueueOptions{}), 10*time.Second)
	killPoolQuiet(t, e, watch, conns)

	if err := e.client.SetConsumerEnabled(context.Background(), "app", c.ID, false); err != nil {
		t.Fatal(err)
	}
	select {
	case <-paused:
	case <-time.After(10 * time.Second):
		t.Fatal("the pause did not reach the Resolver within 10s")
	}
	if n := linesWith(logs, `"reloading consumers failed"`); n != 1 {
		t.Fatalf("%d failed reloads; want 1, the first, on a dead connection (the retry took another dead one, unpinged)", n)
	}
	if !lineWith(logs, `"reloading consumers failed"`, `"retry_in":"0s"`) {
		t.Errorf("the reload that failed on a dead connection was not retried at once:\n%s", logs.String())
	}
	if c := d.ListenerStats().Connects; c != 1 {
		t.Fatalf("the listener reconnected (connects = %d): the test is about the pool's sessions ending alone", c)
	}
}

// poolWatch follows, as a pgx tracer, a pool's connections in use and its
// queue claims that failed.
type poolWatch struct {
	noQueryTrace
	failedClaims atomic.Int32
	mu           sync.Mutex
	inUse        int       // acquires under way, and connections held
	last         time.Time // of the last acquire or release
}

// queueClaimKey marks a queue claim's batch; its value is set once the
// batch's failure is counted: pgx v5.12 reports a batch that failed as
// it was prepared twice, as it is sent and as it is closed.
type queueClaimKey struct{}

func (w *poolWatch) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	// From the queued statements: a batch that fails as it is prepared
	// sends none of them (TraceBatchQuery).
	for _, q := range d.Batch.QueuedQueries {
		if isQueueClaim(q.SQL) {
			return context.WithValue(ctx, queueClaimKey{}, new(atomic.Bool))
		}
	}
	return ctx
}

func (w *poolWatch) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (w *poolWatch) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchEndData) {
	if counted, ok := ctx.Value(queueClaimKey{}).(*atomic.Bool); ok && d.Err != nil && counted.CompareAndSwap(false, true) {
		w.failedClaims.Add(1)
	}
}

func (w *poolWatch) TraceAcquireStart(ctx context.Context, _ *pgxpool.Pool, _ pgxpool.TraceAcquireStartData) context.Context {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.inUse++
	w.last = time.Now()
	return ctx
}

func (w *poolWatch) TraceAcquireEnd(_ context.Context, _ *pgxpool.Pool, d pgxpool.TraceAcquireEndData) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if d.Err != nil {
		w.inUse--
	}
	w.last = time.Now()
}

func (w *poolWatch) TraceRelease(*pgxpool.Pool, pgxpool.TraceReleaseData) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.inUse--
	w.last = time.Now()
}

// waitQuiet waits until no connection has been asked for or used for quiet.
func (w *poolWatch) waitQuiet(t *testing.T, timeout, quiet time.Duration) {
	t.Helper()
	waitFor(t, timeout, "the pool unused for "+quiet.String(), func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		return w.inUse == 0 && time.Since(w.last) >= quiet
	})
}

// TestRestartCatchUpFirstTry: when every session ends at once (a fast
// restart, a failover), the pool's idle connections are dead too. The
// reload that follows the listener's reconnect, and the catch-up after
// it, must not try them one by one: each failed the reload in turn, with
// a backoff between tries, and messages enqueued during the outage came
// 10 to 25 s late. Connections idle since before the reconnect are now
// pinged, and a dead one dropped, before use.
func TestRestartCatchUpFirstTry(t *testing.T) {
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	logs := &lineCounter{match: "reloading consumers failed"}
	const idle = 4
	claims := &claimCounter{}
	d := startLogged(t, e.dsn, bellhop.DispatcherConfig{
		Resolver: mux, PollInterval: time.Hour, ReconnectDelay: time.Second, Logger: zerolog.New(logs),
	}, func(pc *pgxpool.Config) { pc.MinConns, pc.ConnConfig.Tracer = idle, claims })
	ctx := context.Background()
	// The scan for work that follows the first connect must be over, or
	// it finds the message below instead of the reconnect's.
	waitFor(t, 5*time.Second, "the post-connect wake scan", func() bool { return claims.scans.Load() >= 1 })
	waitFor(t, 10*time.Second, "the pool's idle connections", func() bool {
		return e.count(t, `SELECT count(*) `+dispatcherSessions) >= idle
	})
	connects := d.ListenerStats().Connects
	if _, err := e.pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE application_name LIKE 'bellhop-%' AND datname = current_database()`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the dispatcher to notice the outage", func() bool { return !d.ListenerStats().Connected }) // Ready would ping the pool
	e.enqueue(t, "orders", 1, bellhop.EnqueueOptions{})
	if c := d.ListenerStats().Connects; c != connects {
		// Its notification was heard, not caught up on; the reload
		// after the reconnect is still what is checked below.
		t.Logf("the listener reconnected before the message was enqueued")
	}
	waitFor(t, 20*time.Second, "delivery after the reconnect", func() bool { return rec.n.Load() == 1 })
	if claims.scans.Load() < 2 {
		t.Errorf("delivered without the reconnect's scan for work")
	}
	if n := logs.n.Load(); n != 0 {
		t.Errorf("the reload after the reconnect failed %d times on the pool's dead connections", n)
	}
}

// lineCounter is a log writer that counts the lines containing match.
type lineCounter struct {
	match string
	n     atomic.Int32
}

func (l *lineCounter) Write(p []byte) (int, error) {
	if bytes.Contains(p, []byte(l.match)) {
		l.n.Add(1)
	}
	return len(p), nil
}

// The crash test's helper process: see TestCrashRedelivery.
const (
	helperEnv    = "BELLHOP_INTEGRATION_HELPER"
	helperDSNEnv = "BELLHOP_INTEGRATION_HELPER_DSN"
	claimedLine  = "CLAIMED "
)

// TestHelperProcess is not a test: run by TestCrashRedelivery in a child
// process, it starts a dispatcher whose handler never returns and prints
// a line for every message it holds, then waits to be killed.
func TestHelperProcess(t *testing.T) {
	if os.Getenv(helperEnv) != "crash" {
		t.Skip("helper process for TestCrashRedelivery")
	}
	// Whatever happens to the parent, do not outlive it for long.
	time.AfterFunc(time.Minute, func() { os.Exit(3) })
	pc, err := pgxpool.ParseConfig(os.Getenv(helperDSNEnv))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	block := make(chan struct{}) // never closed
	mux := bellhop.NewMux()
	mux.Handle("app", "crashy", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		fmt.Fprintf(os.Stdout, "%s%s\n", claimedLine, m.ID)
		<-block // ignores ctx: a hung handler
		return nil
	}))
	d, err := bellhop.NewDispatcher(pc, bellhop.DispatcherConfig{
		Resolver: mux, Logger: zerolog.New(os.Stderr).With().Str("process", "child").Logger(),
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	_ = d.Run(context.Background()) // until SIGKILL
}

// TestCrashRedelivery: a dispatcher that dies holding leases (SIGKILL:
// no release, no outcome) loses nothing; another dispatcher delivers its
// messages again once their visibility timeout expires, and the reclaim
// dead-letters, undelivered, the one that was on its last attempt.
func TestCrashRedelivery(t *testing.T) {
	e := newEnv(t)
	const vt = 2 * time.Second
	e.consumer(t, bellhop.ConsumerSpec{Queue: "crashy", VisibilityTimeout: vt, MaxAttempts: 5})
	const n = 4 // the last one has a single attempt
	ids := map[uuid.UUID]bool{}
	var last uuid.UUID
	for i := range n {
		opts := bellhop.EnqueueOptions{}
		if i == n-1 {
			opts.MaxAttempts = 1
		}
		last = e.enqueue(t, "crashy", i, opts)
		ids[last] = true
	}

	// The crashing dispatcher: a child process (cancelling Run would
	// release its claims, which is a clean stop, not a crash).
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), helperEnv+"=crash", helperDSNEnv+"="+e.dsn)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// The reader hands the child's lines over until its stdout closes,
	// then reaps it; childErr is valid once exited is closed.
	lines := make(chan string, 16)
	exited := make(chan struct{})
	var childErr error
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		childErr = cmd.Wait()
		close(exited)
	}()
	drainAndReap := func() {
		go func() {
			for range lines {
			}
		}()
		<-exited
	}
	defer func() {
		select {
		case <-exited:
		default:
			_ = cmd.Process.Kill()
			drainAndReap()
		}
		if t.Failed() {
			t.Logf("child's stderr:\n%s", stderr.String())
		}
	}()
	held := map[uuid.UUID]bool{}
	timeout := time.After(20 * time.Second)
	for len(held) < n {
		select {
		case l, ok := <-lines:
			if !ok {
				<-exited
				t.Fatalf("child exited before claiming: %v", childErr)
			}
			if id, found := strings.CutPrefix(l, claimedLine); found {
				u, err := uuid.Parse(id)
				if err != nil || !ids[u] {
					t.Fatalf("child claimed unknown message %q", id)
				}
				held[u] = true
			}
		case <-timeout:
			t.Fatalf("child claimed %d of %d messages in 20s", len(held), n)
		}
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	drainAndReap()
	if childErr == nil {
		t.Fatal("child exited cleanly; want killed")
	}
	crashed := time.Now()

	// The kill released nothing: every message is still leased, on its
	// first attempt.
	ctx := context.Background()
	expiry := map[uuid.UUID]time.Time{}
	rows, err := e.pool.Query(ctx, `SELECT id, claimed_at, attempt FROM queue_messages WHERE claim_token IS NOT NULL`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id uuid.UUID
		var at time.Time
		var attempt int
		if err := rows.Scan(&id, &at, &attempt); err != nil {
			t.Fatal(err)
		}
		if attempt != 1 {
			t.Errorf("message %s: attempt %d while leased by the child, want 1", id, attempt)
		}
		expiry[id] = at.Add(vt)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(expiry) != n {
		t.Fatalf("%d messages leased after the crash, want %d", len(expiry), n)
	}

	// The survivor. The reclaimer learns of leases it did not take itself
	// only from the fallback poll (poll.sql returns the next lease expiry,
	// reclaim.Reclaimer.Observe arms its timer), so the poll must come
	// round within the test: 1s. Nothing else depends on the poll here.
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "crashy", rec)
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Second}, nil)
	waitFor(t, 10*time.Second, "redelivery of the crashed dispatcher's messages", func() bool { return rec.n.Load() == n-1 })
	t.Logf("redelivered %s after the crash", time.Since(crashed).Round(time.Millisecond))

	for _, d := range rec.deliveries() {
		if d.ID == last {
			t.Errorf("message %s, on its last attempt when the child died, was delivered again", d.ID)
		}
		if d.Attempt != 2 {
			t.Errorf("message %s redelivered as attempt %d, want 2", d.ID, d.Attempt)
		}
		if exp, ok := expiry[d.ID]; !ok {
			t.Errorf("unexpected delivery of %s", d.ID)
		} else if d.Start.Before(exp) {
			t.Errorf("message %s redelivered %s before its lease expired", d.ID, exp.Sub(d.Start))
		}
	}
	waitFor(t, 5*time.Second, "the redelivered messages acked and the last attempt dead-lettered", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages`) == 0
	})
	var deadID uuid.UUID
	var attempt int
	var lastError string
	var diedAt time.Time
	if err := e.pool.QueryRow(ctx, `SELECT id, attempt, last_error, died_at FROM dead_letters`).Scan(&deadID, &attempt, &lastError, &diedAt); err != nil {
		t.Fatalf("the one dead letter: %v", err)
	}
	if deadID != last || attempt != 1 || lastError != "visibility timeout expired on the last attempt" {
		t.Errorf("dead letter %s, attempt %d, %q; want %s, attempt 1, the lease's expiry", deadID, attempt, lastError, last)
	}
	if diedAt.Before(expiry[last]) {
		t.Errorf("dead-lettered %s before its lease expired", expiry[last].Sub(diedAt))
	}
}
