package integration

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/internal/pgcluster"
	"github.com/bellhopq/bellhop/migrations"
	"github.com/bellhopq/bellhop/notify"
	queries "github.com/bellhopq/bellhop/sql"
)

// ownEnv is newEnv on a cluster of the test's own (ownCluster), for a test
// that freezes, stops or restarts the server: the package's shared cluster
// must not be touched. Its producer pool reaches the server over TCP.
func ownEnv(t *testing.T) (*env, *pgcluster.Cluster) {
	t.Helper()
	return ownEnvWith(t, nil)
}

// ownEnvWith is ownEnv on a cluster with the server settings given.
func ownEnvWith(t *testing.T, settings map[string]string) (*env, *pgcluster.Cluster) {
	t.Helper()
	c := ownCluster(t, settings)
	dsn := c.TCPConnString("bellhop")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if err := migrations.Migrate(ctx, conn); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	e := &env{dsn: dsn, pool: pool, client: bellhop.NewClient(pool)}
	if _, err := e.client.CreateApp(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	return e, c
}

// freeze stops every process of c's server (SIGSTOP), as a server that
// stopped answering looks from the old side of a failover, until thaw;
// thaw runs when t ends too.
func freeze(t *testing.T, c *pgcluster.Cluster) (thaw func()) {
	t.Helper()
	if err := c.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	thawed := false
	thaw = func() {
		if thawed {
			return
		}
		thawed = true
		if err := c.Signal(syscall.SIGCONT); err != nil {
			t.Errorf("thaw: %v", err)
		}
	}
	t.Cleanup(thaw)
	return thaw
}

// TestStopAgainstFrozenServer: a stop while the server no longer answers
// (frozen, as a failover looks from the old side) returns within the
// grace and StopBudget, and loses nothing: the message whose release
// could not be written comes back once the server answers again. It used
// to take a minute: the release was tried 5 times for 10 s each, then the
// busy marks' deletion and the last_fired_at update waited 5 s each.
//
// The release gets the budget, counted from the handler's return and
// ending at the stop's bound (ShutdownGrace or a claim pass's StopWait,
// then StopBudget), and its give-up says so: the bound of the handlers'
// wait used to give it up first, with the budget not run out, and the
// stop then tried the hand-over (with a handler that returns at once, a
// moment before the budget's end, when the freeze caught the lane's claim
// pass: a CI run). A handler that ignores its context's end for 6s
// leaves the release what remains of the bound: the stop used to give it
// a whole budget, and end 2s past the bound.
func TestStopAgainstFrozenServer(t *testing.T) {
	for _, tc := range []struct {
		name string
		late time.Duration // how long the handler ignores its context's end
	}{
		{"handler returns at its end", 0},
		{"handler returns 6s late", 6 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) { stopAgainstFrozenServer(t, tc.late) })
	}
}

func stopAgainstFrozenServer(t *testing.T, late time.Duration) {
	e, cluster := ownEnv(t)
	const vt = 3 * time.Second
	e.consumer(t, bellhop.ConsumerSpec{Queue: "work", VisibilityTimeout: vt})
	started := make(chan struct{}, 1)
	leaving := bellhop.NewMux()
	leaving.Handle("app", "work", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		started <- struct{}{}
		<-ctx.Done()
		<-time.After(late)
		return ctx.Err()
	}))
	logs := &syncBuffer{}
	const grace = time.Second
	d := startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: leaving, PollInterval: time.Hour, ShutdownGrace: grace,
		Logger: zerolog.New(logs).With().Timestamp().Logger()}, nil)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the stopped dispatcher's log:\n%s", logs.String())
		}
	})
	id := e.enqueue(t, "work", 1, bellhop.EnqueueOptions{})
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("handler did not start")
	}

	thaw := freeze(t, cluster)
	stopping := time.Now()
	d.stop()
	took := time.Since(stopping)
	t.Logf("Run returned %s after its cancel, with a %s grace and a %s budget", took.Round(time.Millisecond), grace, bellhop.StopBudget)
	// Run's bound: a claim pass the freeze caught (the lane's next, after
	// the delivery) gets claim.StopWait, which outlasts the grace; a run
	// under load met it (10s). A handler that ignores its context's end
	// past the bound would push it back to its return.
	if limit := max(max(grace, claim.StopWait)+bellhop.StopBudget, grace+late) + 3*time.Second; took > limit {
		t.Errorf("Run took %s to return against a frozen server, want at most %s", took.Round(time.Millisecond), limit)
	}
	if !lineWith(logs, "waiting for 1 outcome writes") {
		t.Error("the log does not say the stop waits for the outcome write")
	}
	// It counts the outcome given up on (it said 0, read once every
	// outcome was settled), and the budget gave it up.
	budget := bellhop.StopBudget.String()
	if late > 0 {
		budget = "" // what remained of the bound, a little under 3s
	}
	if !lineWith(logs, "the outcomes not written let their messages come back", `"outcomes_left":1`,
		"no answer within "+budget) {
		t.Error(`the warning of outcomes not written does not count the one given up on ("outcomes_left":1), ` +
			"or does not say the budget gave it up")
	}
	// The outcome write took the budget: every later write is skipped,
	// and the skip is said once.
	if n := linesWith(logs, "skipping its remaining writes"); n != 1 {
		t.Errorf("%d lines say the stop skips its remaining writes, want 1", n)
	}
	if !lineWith(logs, "skipping its remaining writes", `"skipped":"hand-over, busy marks, last_fired_at"`) {
		t.Error("the skip does not name the hand-over, the busy marks and last_fired_at")
	}
	thaw()

	rec := &recorder{}
	staying := bellhop.NewMux()
	staying.Handle("app", "work", rec)
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: staying, PollInterval: time.Second}, nil)
	waitFor(t, vt+15*time.Second, "the message delivered again after the thaw", func() bool { return rec.n.Load() >= 1 })
	if got := rec.deliveries()[0]; got.ID != id {
		t.Errorf("delivered %s after the thaw, want %s", got.ID, id)
	}
	waitFor(t, 10*time.Second, "the message acked", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages`) == 0
	})
}

// TestStopSkipAfterHandOver: a stop whose outcomes are all written, but
// whose hand-over of a retry time finds the server frozen, spends its
// StopBudget there; the writes after it are skipped, and the log says so
// once. It used to say nothing when the budget ran out after the
// outcomes. The retry is not lost: the message waits in the table for its
// time, an hour away.
func TestStopSkipAfterHandOver(t *testing.T) {
	e, cluster := ownEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "work"})
	var tries atomic.Int64
	mux := bellhop.NewMux()
	mux.Handle("app", "work", bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error {
		if tries.Add(1) == 1 {
			// A retry time only this dispatcher knows: its stop hands
			// it over to the others.
			return bellhop.RetryAfter(time.Hour)
		}
		return nil
	}))
	obs := &settledObserver{}
	logs := &syncBuffer{}
	d := startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, Observer: obs, PollInterval: time.Hour,
		Logger: zerolog.New(logs).With().Timestamp().Logger()}, nil)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the stopped dispatcher's log:\n%s", logs.String())
		}
	})
	id := e.enqueue(t, "work", 1, bellhop.EnqueueOptions{})
	if _, got, _ := obs.waitSettled(t, 1); got[bellhop.Nacked] != 1 {
		t.Fatalf("settled as %v, want nacked", got)
	}

	thaw := freeze(t, cluster)
	stopping := time.Now()
	d.stop()
	took := time.Since(stopping)
	t.Logf("Run returned %s after its cancel, with a %s budget", took.Round(time.Millisecond), bellhop.StopBudget)
	// Run's bound: the lane's pass after the nack, if the freeze caught
	// it, gets claim.StopWait (no handler runs, so the grace is not
	// waited for).
	if limit := claim.StopWait + bellhop.StopBudget + 3*time.Second; took > limit {
		t.Errorf("Run took %s to return against a frozen server, want at most %s", took.Round(time.Millisecond), limit)
	}
	if lineWith(logs, "outcome writes") {
		t.Error("the stop waited for outcome writes, want none left")
	}
	if !lineWith(logs, "could not wake the other dispatchers") {
		t.Error("the log does not say the hand-over failed")
	}
	if n := linesWith(logs, "skipping its remaining writes"); n != 1 {
		t.Errorf("%d lines say the stop skips its remaining writes, want 1", n)
	}
	if !lineWith(logs, "skipping its remaining writes", `"skipped":"busy marks, last_fired_at"`) {
		t.Error("the skip does not name the busy marks and last_fired_at")
	}
	thaw()

	if n := e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NULL
		AND deliver_after > now() + interval '50 minutes'`, id); n != 1 {
		t.Errorf("the nacked message is not waiting for its retry an hour away (%d rows)", n)
	}
}

// TestAckOutlastsRestart: an ack whose write finds the database stopped
// is retried until the server is back, within the message's lease, and
// lands: the work is not delivered again. The write gave up after 5 tries
// in about 0.75s, so a restart of a few seconds redelivered completed work.
func TestAckOutlastsRestart(t *testing.T) {
	e, cluster := ownEnv(t)
	const vt = 30 * time.Second
	e.consumer(t, bellhop.ConsumerSpec{Queue: "work", VisibilityTimeout: vt})
	started := make(chan struct{}, 1)
	finish := make(chan struct{})
	rec := &recorder{result: func(context.Context, *bellhop.Message) error {
		started <- struct{}{}
		<-finish
		return nil
	}}
	mux := bellhop.NewMux()
	mux.Handle("app", "work", rec)
	obs := &settledObserver{}
	logs := &syncBuffer{}
	startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, Observer: obs, PollInterval: time.Hour,
		Logger: zerolog.New(logs).Level(zerolog.DebugLevel).With().Timestamp().Logger()}, nil)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the dispatcher's log:\n%s", logs.String())
		}
	})
	id := e.enqueue(t, "work", 1, bellhop.EnqueueOptions{})
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("handler did not start")
	}

	// A fast shutdown: the claim is on disk, the connections end, and new
	// ones are refused until the restart.
	if err := cluster.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the server refusing connections", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, e.dsn)
		if err == nil {
			conn.Close(ctx)
		}
		return err != nil && strings.Contains(err.Error(), "refused")
	})
	down := time.Now()
	close(finish)
	// Past the old 5 tries, with the server still away.
	waitFor(t, 20*time.Second, "the ack's sixth try", func() bool {
		return lineWith(logs, "writing message outcomes failed; retrying", `"try":6`)
	})
	if _, got, _ := obs.report(); len(got) != 0 {
		t.Fatalf("settled as %v while the server was down", got)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := cluster.Restart(ctx, "fast"); err != nil {
		t.Fatal(err)
	}
	t.Logf("server back %s after it went down", time.Since(down).Round(time.Millisecond))
	if _, got, _ := obs.waitSettled(t, 1); got[bellhop.Acked] != 1 {
		t.Errorf("settled as %v, want acked", got)
	}
	if n := e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1`, id); n != 0 {
		t.Errorf("the message is still queued after its ack (%d rows)", n)
	}
	if n := rec.n.Load(); n != 1 {
		t.Errorf("%d deliveries, want 1", n)
	}
}

// reclaimTracer counts the reclaim passes whose batch has ended.
type reclaimTracer struct {
	noQueryTrace
	passes sync.Map // *pgx.Conn running a reclaim batch
	ended  atomic.Int32
}

func (r *reclaimTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (r *reclaimTracer) TraceBatchQuery(_ context.Context, c *pgx.Conn, d pgx.TraceBatchQueryData) {
	// Batched statements come with their named arguments made
	// positional, their opening comment intact.
	if first, _, _ := strings.Cut(queries.Reclaim, "\n"); strings.HasPrefix(d.SQL, first) {
		r.passes.Store(c, true)
	}
}

func (r *reclaimTracer) TraceBatchEnd(_ context.Context, c *pgx.Conn, _ pgx.TraceBatchEndData) {
	if _, ok := r.passes.LoadAndDelete(c); ok {
		r.ended.Add(1)
	}
}

// freezableLink returns a pool tweak that routes the pool's connections,
// and the listener's, through a local proxy to dsn's server, and freeze,
// which holds back from then on everything the server sends on the
// connections open at the time (as a failover or a partition leaves
// them: the client hears nothing, and nothing says the connection is
// gone), and returns how many there were. Connections opened later are
// left alone.
func freezableLink(t *testing.T, dsn string) (link func(*pgxpool.Config), freeze func() int) {
	open := &freezeSet{}
	link = proxyLink(t, dsn, time.Hour, func(client io.Reader) (io.Reader, func() bool) {
		frozen := new(atomic.Bool)
		open.add(frozen)
		return client, frozen.Load
	})
	return link, open.freeze
}

// TestDeadPathReplacesListener: when every connection open goes silent at
// once (a failover, a partition), the listener hears nothing, and says
// nothing; the fallback poll that gets no answer within StatementTimeout
// replaces the listener at once, and the pool's connections on the dead
// path are dropped with it. A message enqueued after the freeze is delivered after
// the reconnect, well before the next poll. The failed poll used to
// forget its heartbeat: the listener stayed in place, and the message
// waited for a poll that succeeded (17.5s in the review's run).
func TestDeadPathReplacesListener(t *testing.T) {
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	link, freezeLink := freezableLink(t, e.dsn)
	const (
		poll      = 6 * time.Second
		stmt      = time.Second
		heartbeat = time.Second
	)
	logs := &syncBuffer{}
	reclaims := &reclaimTracer{}
	d := startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: poll, StatementTimeout: stmt,
		HeartbeatTimeout: heartbeat, ReconnectDelay: 100 * time.Millisecond,
		Logger: zerolog.New(logs).With().Timestamp().Logger()}, func(pc *pgxpool.Config) {
		link(pc)
		pc.MinConns = 3 // idle connections for the poll to pick, frozen with the rest
		pc.ConnConfig.Tracer = reclaims
	})
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the dispatcher's log:\n%s", logs.String())
		}
	})
	waitFor(t, 10*time.Second, "a heartbeat heard", func() bool { return d.ListenerStats().Notifications >= 1 })
	// The start-up reclaim pass follows the first scan for work: caught
	// by the freeze, it timed out on frozen connections, which the pool
	// then replaced, and the poll found live ones.
	waitFor(t, 10*time.Second, "the start-up reclaim pass", func() bool { return reclaims.ended.Load() >= 1 })
	waitFor(t, 10*time.Second, "the pool's idle connections", func() bool {
		return e.count(t, `SELECT count(*) `+dispatcherSessions) >= 3
	})
	connects := d.ListenerStats().Connects
	if n := freezeLink(); n < 2 {
		t.Fatalf("froze %d connections, want the listener's and the pool's", n)
	}
	id := e.enqueue(t, "orders", 1, bellhop.EnqueueOptions{})
	waitFor(t, poll+stmt+5*time.Second, "a poll that got no answer", func() bool {
		return lineWith(logs, `"fallback poll failed"`, "no answer within 1s")
	})
	failed := time.Now()
	if n := rec.n.Load(); n != 0 {
		t.Fatalf("delivered %d before the listener could hear of the message", n)
	}
	waitFor(t, poll, "the message delivered", func() bool { return rec.n.Load() == 1 })
	took := time.Since(failed)
	t.Logf("delivered %s after the failed poll's timeout", took.Round(time.Millisecond))
	if d := rec.deliveries()[0]; d.ID != id {
		t.Errorf("delivered %s, want %s", d.ID, id)
	}
	// The poll was sent stmt before it failed; the next comes about poll
	// after it.
	if limit := heartbeat + 2*time.Second; took > limit {
		t.Errorf("delivered %s after the failed poll, want within %s", took.Round(time.Millisecond), limit)
	}
	// Replaced for the poll that got no answer, not for a missed
	// heartbeat: the cancelled poll's could never come back.
	if st := d.ListenerStats(); st.Connects <= connects || st.HungRestarts != 0 {
		t.Errorf("listener stats %+v: want it replaced, with no missed heartbeat counted", st)
	}
}

// TestLockedTableIsNotDeafness: polls and scans that time out on a locked
// queue_messages (a migration, say) reconnect the listener, but are not
// missed heartbeats: a listener on a direct connection is not taken for
// one that can never hear (notify.ErrDeaf, whose hint blames transaction
// pooling), and it delivers once the lock is gone. When a timed-out poll
// or scan counted its heartbeat as sent, the cancelled statement's
// notification never came back, and the listener was deaf within two
// HeartbeatTimeouts, until a poll succeeded.
func TestLockedTableIsNotDeafness(t *testing.T) {
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	ctx := context.Background()
	lock, err := pgx.Connect(ctx, e.dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close(ctx)
	tx, err := lock.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "LOCK TABLE queue_messages IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	logs := &syncBuffer{}
	d := startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: 500 * time.Millisecond,
		StatementTimeout: 500 * time.Millisecond, HeartbeatTimeout: 300 * time.Millisecond,
		ReconnectDelay: 100 * time.Millisecond, Logger: zerolog.New(logs).With().Timestamp().Logger()}, nil)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the dispatcher's log:\n%s", logs.String())
		}
	})
	// Each failed poll reconnects the listener, whose scan times out too:
	// several rounds, each of which made a missed heartbeat.
	waitFor(t, 20*time.Second, "three polls that got no answer", func() bool {
		return strings.Count(logs.String(), `"fallback poll failed"`) >= 3
	})
	if st := d.ListenerStats(); st.Deaf || st.HungRestarts != 0 {
		t.Errorf("listener stats %+v with the table locked: want no missed heartbeat, not deaf", st)
	}
	if err := d.Ready(ctx); errors.Is(err, notify.ErrDeaf) {
		t.Errorf("Ready with the table locked: %v", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	e.waitNoLockWaiters(t)
	e.enqueue(t, "orders", 1, bellhop.EnqueueOptions{})
	waitFor(t, 10*time.Second, "the message delivered once the lock is gone", func() bool { return rec.n.Load() == 1 })
	waitFor(t, 10*time.Second, "the dispatcher ready", func() bool { return d.Ready(ctx) == nil })
}
