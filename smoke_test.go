package bellhop_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgtest"
)

// TestSmoke: one dispatcher, with the fallback poll an hour away, handles
// 100 enqueued messages once each, acks them all, and stops cleanly.
func TestSmoke(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dsn := pgtest.ConnString(t)
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	c := bellhop.NewClient(pool)
	if _, err := c.CreateApp(ctx, "shop"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders"}); err != nil {
		t.Fatal(err)
	}
	var got atomic.Int32
	mux := bellhop.NewMux()
	mux.Handle("shop", "orders", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		got.Add(1)
		return nil
	}))
	stop := smokeDispatcher(t, dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour})

	const n = 100
	for range n {
		if _, err := c.Enqueue(ctx, "shop", "orders", []byte(`{"n":1}`), bellhop.EnqueueOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	smokeWait(t, 10*time.Second, "all messages handled", func() bool { return got.Load() >= n })
	// Acks are recorded after the handler returns: wait for the queue to
	// empty rather than reading it once.
	var left int
	smokeWait(t, 10*time.Second, "every message acked", func() bool {
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM queue_messages`).Scan(&left); err != nil {
			t.Fatalf("count queue_messages: %v", err)
		}
		return left == 0
	})
	if err := stop(); err != nil {
		t.Fatalf("dispatcher: %v", err)
	}
	// Nothing was delivered twice, nor after the stop.
	if h := got.Load(); h != n {
		t.Errorf("handled %d deliveries, want %d", h, n)
	}
	var dead int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM dead_letters`).Scan(&dead); err != nil {
		t.Fatalf("count dead_letters: %v", err)
	}
	if dead != 0 {
		t.Errorf("%d dead letters, want 0", dead)
	}
}

// smokeDispatcher runs a Dispatcher on dsn until stop is called or the
// test ends, and waits until it is ready. stop cancels Run and returns
// its error, or an error of its own if Run does not return within 30s;
// later calls return the first call's result. The test's cleanup stops
// it too, so that a failed test never leaves it running, and then
// silences its log: a dispatcher that logged through t after the test
// ended would panic the test binary.
func smokeDispatcher(t *testing.T, dsn string, dc bellhop.DispatcherConfig) (stop func() error) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	logs := &smokeLog{t: t}
	dc.Logger = zerolog.New(logs).Level(zerolog.InfoLevel)
	d, err := bellhop.NewDispatcher(cfg, dc)
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(rctx) }()
	var (
		once   sync.Once
		result error
	)
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case result = <-done:
			case <-time.After(30 * time.Second):
				result = errors.New("Run did not return within 30s of its cancel")
			}
		})
		return result
	}
	t.Cleanup(func() {
		// Reported here only if the test did not stop it itself (it
		// failed first), or stopped it and it has not returned since.
		if err := stop(); err != nil {
			t.Errorf("dispatcher: %v", err)
		}
		logs.silence()
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		select {
		case err := <-done:
			// Run gave up before it was ready: put its result back for
			// stop, and fail.
			done <- err
			t.Fatalf("Dispatcher.Run returned before it was ready: %v", err)
		default:
		}
		err := d.Ready(rctx)
		if err == nil {
			return stop
		}
		if time.Now().After(deadline) {
			t.Fatalf("dispatcher not ready within 10s: %v", err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// smokeLog passes a dispatcher's log lines to t until silenced.
type smokeLog struct {
	mu     sync.Mutex
	t      *testing.T
	silent bool
}

func (l *smokeLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.silent {
		l.t.Log(strings.TrimSuffix(string(p), "\n"))
	}
	return len(p), nil
}

func (l *smokeLog) silence() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.silent = true
}

// smokeWait polls cond every 5ms until it holds, and fails t if it does
// not within timeout.
func smokeWait(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestRetryAfterOnLastAttemptDeadLetters: RetryAfter counts as an attempt.
// On a message's last attempt it does not delay a further one: the
// message is dead-lettered at once, attempts exhausted, as the README's
// status table says of a push consumer's 429 or 503 with Retry-After.
// Earlier attempts are retried at its time.
func TestRetryAfterOnLastAttemptDeadLetters(t *testing.T) {
	e := fxNew(t)
	ctx, c := e.ctx, e.client
	e.app("shop")
	if _, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders", MaxAttempts: 2}); err != nil {
		t.Fatal(err)
	}
	var attempts atomic.Int32
	mux := bellhop.NewMux()
	mux.Handle("shop", "orders", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		attempts.Add(1)
		if m.Attempt == 1 {
			return bellhop.RetryAfter(time.Millisecond)
		}
		// An hour: were it honoured, the message would stay queued.
		return bellhop.RetryAfter(time.Hour)
	}))
	smokeDispatcher(t, e.pool.Config().ConnString(), bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour})
	id, err := c.Enqueue(ctx, "shop", "orders", []byte(`{"n":1}`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var ds []bellhop.DeadLetter
	smokeWait(t, 15*time.Second, "the message dead-lettered", func() bool {
		ds, err = c.DeadLetters(ctx, bellhop.DeadFilter{App: "shop", ID: id})
		if err != nil {
			t.Fatalf("DeadLetters: %v", err)
		}
		return len(ds) == 1
	})
	if d := ds[0]; d.Attempt != 2 || d.MaxAttempts != 2 || !strings.Contains(d.LastError, "attempts exhausted (2 of 2)") || !strings.Contains(d.LastError, "retry after 1h0m0s") {
		t.Errorf("dead letter at attempt %d of %d with %q; want attempt 2 of 2, attempts exhausted by a RetryAfter", d.Attempt, d.MaxAttempts, d.LastError)
	}
	if n := attempts.Load(); n != 2 {
		t.Errorf("handler called %d times, want 2", n)
	}
}
