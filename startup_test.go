package bellhop

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/internal/syncbuf"
	queries "github.com/bellhopq/bellhop/sql"
)

// startTracer records when the wake scan and the reclaim pass's statement
// first start, and holds the listener's connection attempts while hold is
// open; with onLoad, it opens hold once the first consumer load has ended,
// and records when (openedAt). It records when the first consumer load
// ended (loaded) either way.
type startTracer struct {
	mu                                sync.Mutex
	scan, reclaimed, openedAt, loaded time.Time
	hold                              chan struct{}
	onLoad                            bool
	opened                            sync.Once
}

type consumerLoad struct{}

func (s *startTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	switch d.SQL {
	case queries.WakeScan:
		s.mu.Lock()
		if s.scan.IsZero() {
			s.scan = time.Now()
		}
		s.mu.Unlock()
	case queries.ConsumerList:
		return context.WithValue(ctx, consumerLoad{}, true)
	}
	return ctx
}

func (s *startTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if ctx.Value(consumerLoad{}) == nil {
		return
	}
	s.mu.Lock()
	if s.loaded.IsZero() {
		s.loaded = time.Now()
	}
	s.mu.Unlock()
	if s.onLoad {
		s.open()
	}
}

func (s *startTracer) open() {
	s.opened.Do(func() {
		s.mu.Lock()
		s.openedAt = time.Now()
		s.mu.Unlock()
		close(s.hold)
	})
}

// TraceBatchStart records the reclaim pass as its batch is sent: pgx
// traces a batched statement (TraceBatchQuery) only once its results are
// read, after the server has run and committed it, so the test could see
// the lease returned before the pass was recorded (CI at 14a2096).
func (s *startTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	first, _, _ := strings.Cut(queries.Reclaim, "\n")
	for _, q := range d.Batch.QueuedQueries {
		if strings.HasPrefix(q.SQL, first) {
			s.mu.Lock()
			if s.reclaimed.IsZero() {
				s.reclaimed = time.Now()
			}
			s.mu.Unlock()
		}
	}
	return ctx
}

func (s *startTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (s *startTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (s *startTracer) TraceConnectStart(ctx context.Context, d pgx.TraceConnectStartData) context.Context {
	if d.ConnConfig.RuntimeParams["application_name"] == "bellhop-listener" {
		<-s.hold
	}
	return ctx
}

func (s *startTracer) TraceConnectEnd(context.Context, pgx.TraceConnectEndData) {}

// TestStartupReclaimAfterFirstScan: the reclaim pass that Run makes at
// start-up, for leases that ran out while no dispatcher ran, waits for
// the first scan for work, which it used to hold up (it took the pool's
// one connection, and the scan opened another, 40 to 50 ms in front of
// the first delivery); and when that scan is late (here the listener,
// whose connect asks for it, cannot connect), it runs anyway, within
// startupReclaimWait. Each case checks that the lease that had run out is
// returned.
func TestStartupReclaimAfterFirstScan(t *testing.T) {
	for _, late := range []bool{false, true} {
		name := "after the first scan"
		if late {
			name = "the scan late"
		}
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			cfg, client, _ := reloadSetup(t, ConsumerSpec{Queue: "a"})
			id, err := client.Enqueue(ctx, "app", "a", []byte(`{}`), EnqueueOptions{})
			if err != nil {
				t.Fatal(err)
			}
			// A lease that ran out while no dispatcher ran.
			if _, err := client.db.Exec(ctx, `UPDATE queue_messages SET claim_token = gen_random_uuid(),
				claimed_at = now() - interval '1 hour', attempt = 1 WHERE id = $1`, id); err != nil {
				t.Fatal(err)
			}
			// Without the wait, the pass began as the consumers were
			// loaded; the listener's connect is held until then, so that
			// its scan cannot come first by chance.
			tr := &startTracer{hold: make(chan struct{}), onLoad: !late}
			cfg.ConnConfig.Tracer = tr
			d, err := NewDispatcher(cfg, DispatcherConfig{
				Resolver: resolverFunc(func(Consumer) Handler {
					return HandlerFunc(func(context.Context, *Message) error { return nil })
				}),
				PollInterval: time.Hour, Logger: zerolog.Nop(),
			})
			if err != nil {
				t.Fatal(err)
			}
			started := time.Now()
			runUntilCleanup(t, d, tr.open)
			eventually(t, "the lease returned", func() bool {
				var claimed bool
				if err := client.db.QueryRow(ctx, `SELECT claim_token IS NOT NULL AND claimed_at < now() - interval '1 minute'
					FROM queue_messages WHERE id = $1`, id).Scan(&claimed); err != nil {
					return errors.Is(err, pgx.ErrNoRows) // delivered and acked
				}
				return !claimed
			})
			tr.mu.Lock()
			defer tr.mu.Unlock()
			if tr.reclaimed.IsZero() {
				t.Fatal("the lease came back without a reclaim pass")
			}
			if late {
				if !tr.scan.IsZero() {
					t.Fatalf("a scan for work ran %v after the start, with the listener held", tr.scan.Sub(started))
				}
				// Run sets the pass's bound once the load has ended: a slow
				// connect, schema check or load before it is not the pass's.
				if tr.loaded.IsZero() {
					t.Fatal("no consumer load was traced")
				}
				if after := tr.reclaimed.Sub(tr.loaded); after > startupReclaimWait+time.Second {
					t.Errorf("with the scan late, the start-up reclaim pass ran %v after the consumers were loaded; want about %v", after, startupReclaimWait)
				}
				return
			}
			// Run sets the pass's bound once the load has ended, after the
			// hold opened. A listener that takes longer than that bound to
			// connect and scan (on a loaded machine: CI's connect and
			// session set-up alone took nearly 200ms) is rightly overtaken
			// by the pass at its bound, and the lease may be back before
			// the scan runs at all: that pass did not start before its
			// bound.
			if (tr.scan.IsZero() || tr.scan.Sub(tr.openedAt) >= startupReclaimWait) &&
				tr.reclaimed.Sub(tr.openedAt) >= startupReclaimWait {
				t.Logf("no scan for work within the pass's bound of the load's end; the pass ran %v after it", tr.reclaimed.Sub(tr.openedAt))
				return
			}
			if tr.scan.IsZero() || tr.reclaimed.Before(tr.scan) || tr.reclaimed.Sub(tr.scan) > startupReclaimWait/2 {
				t.Errorf("the start-up reclaim pass began %v after the start, the first scan for work %v: want it just after the scan",
					tr.reclaimed.Sub(started), tr.scan.Sub(started))
			}
		})
	}
}

// TestNotReadyWhileStarting: Ready fails while Run still loads its
// consumers, although the listener, which connects beside that load, is
// already connected; and succeeds once Run has started. It said ready
// during the load, and during the schema check of a database that then
// turned out to have no schema, so that a readiness probe could pass a
// dispatcher about to fail (found by review).
func TestNotReadyWhileStarting(t *testing.T) {
	cfg, _, _ := reloadSetup(t, ConsumerSpec{Queue: "a"})
	release := make(chan struct{})
	var once sync.Once
	d, err := NewDispatcher(cfg, DispatcherConfig{
		Resolver: resolverFunc(func(Consumer) Handler {
			<-release // the first load waits here
			return HandlerFunc(func(context.Context, *Message) error { return nil })
		}),
		PollInterval: time.Hour, Logger: zerolog.Nop(),
	})
	if err != nil {
		t.Fatal(err)
	}
	open := func() { once.Do(func() { close(release) }) }
	runUntilCleanup(t, d, open)
	eventually(t, "the listener connected", d.listener.Connected)
	if err := d.Ready(context.Background()); err == nil || !strings.Contains(err.Error(), "starting") {
		t.Fatalf("Ready during Run's first consumer load = %v, want an error saying the dispatcher is starting", err)
	}
	open()
	eventually(t, "ready once started", func() bool { return d.Ready(context.Background()) == nil })
}

// TestUnreachableServerNoListenerLine: Run against a server that refuses
// connections fails with an error naming the connect, and its listener,
// which starts only once the pool's first connection answers, logs no
// line saying it is retrying. Started with that connection, it logged
// "could not connect the listener; retrying" from a Run about to fail
// (found by review).
func TestUnreachableServerNoListenerLine(t *testing.T) {
	// Nobody answers on port 1 of loopback; a port freed by a listener of
	// our own could be taken by a parallel test's server.
	cfg, err := pgxpool.ParseConfig("postgres://nobody@127.0.0.1:1/none?connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	// The pool's connection attempt fails 200 ms late (the listener's
	// does not go through BeforeConnect): a listener started beside it
	// would have failed, and said so, by then.
	cfg.BeforeConnect = func(context.Context, *pgx.ConnConfig) error {
		time.Sleep(200 * time.Millisecond) // the delay being arranged, not a synchronisation
		return nil
	}
	logs := &syncbuf.Buffer{}
	d, err := NewDispatcher(cfg, DispatcherConfig{Resolver: NewMux(), ReconnectDelay: 50 * time.Millisecond,
		Logger: zerolog.New(logs)})
	if err != nil {
		t.Fatal(err)
	}
	err = d.Run(context.Background())
	if err == nil || !strings.Contains(err.Error(), "connect") {
		t.Fatalf("Run against a closed port = %v, want an error naming the connect", err)
	}
	if strings.Contains(logs.String(), "listener") {
		t.Errorf("Run failed to connect, and the log speaks of the listener:\n%s", logs.String())
	}
}
