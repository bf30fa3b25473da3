package integration

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/claim"
)

// TestCleanStop: cancelling Run while a handler is mid-delivery lets it
// finish within ShutdownGrace; past the grace its context is cancelled and
// its message released at once: claimable again, its attempt refunded, not
// left to its visibility timeout (30s here). (A handler that says its work
// may still be running is held to its lease: TestCleanStopHandsOver.)
// The grace was 200ms, which left the 50ms handler 150ms to be scheduled
// in on a loaded machine; the cancelled handlers run until cancelled,
// so they outlast any grace.
func TestCleanStop(t *testing.T) {
	const grace = time.Second
	cases := []struct {
		name    string
		invoke  bool          // deliver through InvokeAsync instead of the queue
		work    time.Duration // how long the handler works unless cancelled; 0: until cancelled
		wantAck bool
	}{
		{name: "queue message cancelled past the grace is released"},
		{name: "invoke delivery cancelled past the grace is released", invoke: true},
		{name: "handler done within the grace is acked", work: 50 * time.Millisecond, wantAck: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t)
			cons := e.consumer(t, bellhop.ConsumerSpec{Queue: "work"})
			started := make(chan struct{}, 1)
			ended := make(chan error, 1)
			mux := bellhop.NewMux()
			mux.Handle("app", "work", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
				started <- struct{}{}
				var err error
				if c.work == 0 {
					<-ctx.Done()
					err = ctx.Err()
				} else {
					select {
					case <-ctx.Done():
						err = ctx.Err()
					case <-time.After(c.work):
					}
				}
				ended <- err
				return err
			}))
			d := startDispatcher(t, e.dsn, bellhop.DispatcherConfig{
				Resolver: mux, PollInterval: time.Hour, ShutdownGrace: grace,
			}, nil)

			ctx := context.Background()
			id := sendOne(t, e, cons, c.invoke)
			table, target := "queue_messages", claim.Target{Source: claim.Queue, AppID: cons.AppID, Queue: "work"}
			if c.invoke {
				table, target = "outbox", claim.Target{Source: claim.Invoke, AppID: cons.AppID, TriggerID: cons.ID}
			}
			select {
			case <-started:
			case <-time.After(5 * time.Second):
				t.Fatal("handler did not start")
			}

			stopping := time.Now()
			d.stop()
			took := time.Since(stopping)
			t.Logf("Run returned %s after its cancel", took.Round(time.Millisecond))
			if took > grace+2*time.Second {
				t.Errorf("Run took %s to return with a %s grace", took, grace)
			}
			select {
			case err := <-ended:
				if c.wantAck && err != nil {
					t.Errorf("handler's context was cancelled within the grace: %v", err)
				}
				if !c.wantAck && err == nil {
					t.Error("handler's context was not cancelled past the grace")
				}
			default:
				t.Fatal("Run returned while the handler was still running")
			}

			var token *uuid.UUID
			var claimedAt *time.Time
			var attempt int
			err := e.pool.QueryRow(ctx, `SELECT claim_token, claimed_at, attempt FROM `+table+` WHERE id = $1`, id).
				Scan(&token, &claimedAt, &attempt)
			if c.wantAck {
				if err == nil {
					t.Errorf("message still in %s (attempt %d, token %v); want acked", table, attempt, token)
				}
				return
			}
			if err != nil {
				t.Fatalf("message not in %s after the stop: %v", table, err)
			}
			if token != nil || claimedAt != nil || attempt != 0 {
				t.Errorf("after the stop: claim_token %v, claimed_at %v, attempt %d; want NULL, NULL, 0 (refunded)", token, claimedAt, attempt)
			}
			msgs, _, err := claim.Claim(ctx, e.pool, target, 10)
			if err != nil {
				t.Fatal(err)
			}
			if len(msgs) != 1 || msgs[0].ID != id || msgs[0].Attempt != 1 {
				t.Errorf("claim right after the stop got %+v; want %s at attempt 1", msgs, id)
			}
		})
	}
}

// TestCleanStopHandsOver: the messages a stopping dispatcher releases go
// to the dispatchers still running at once, not at their next fallback
// poll (an hour away); queue messages and invoke deliveries alike. A
// message whose handler gave up on work that may still run (ErrAbandoned,
// as an HTTP push cut short by the stop returns) goes to them when its
// lease would have ended, and no earlier: the consumer may still be
// working on it.
func TestCleanStopHandsOver(t *testing.T) {
	const vt = 2 * time.Second
	for _, c := range []struct {
		name              string
		invoke, abandoned bool
	}{
		{name: "queue"},
		{name: "invoke", invoke: true},
		{name: "queue, abandoned", abandoned: true},
		{name: "invoke, abandoned", invoke: true, abandoned: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t)
			cons := e.consumer(t, bellhop.ConsumerSpec{Queue: "work", VisibilityTimeout: vt})
			table := "queue_messages"
			if c.invoke {
				table = "outbox"
			}
			started := make(chan time.Time, 1) // the lease's start, claimed_at
			leaving := bellhop.NewMux()
			leaving.Handle("app", "work", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
				var claimedAt time.Time
				if err := e.pool.QueryRow(context.Background(), `SELECT claimed_at FROM `+table+` WHERE id = $1`, m.ID).Scan(&claimedAt); err != nil {
					t.Errorf("read claimed_at: %v", err)
				}
				started <- claimedAt
				<-ctx.Done()
				if c.abandoned {
					return fmt.Errorf("no response yet: %w: %w", bellhop.ErrAbandoned, ctx.Err())
				}
				return ctx.Err()
			}))
			a := startDispatcher(t, e.dsn, bellhop.DispatcherConfig{
				Resolver: leaving, PollInterval: time.Hour, ShutdownGrace: 100 * time.Millisecond,
			}, nil)
			id := sendOne(t, e, cons, c.invoke)
			var claimedAt time.Time
			select {
			case claimedAt = <-started:
			case <-time.After(5 * time.Second):
				t.Fatal("handler did not start")
			}

			// Started only now, so that the first dispatcher holds the message.
			rec := &recorder{}
			staying := bellhop.NewMux()
			staying.Handle("app", "work", rec)
			startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: staying, PollInterval: time.Hour}, nil)
			if rec.n.Load() != 0 {
				t.Fatal("the second dispatcher got the message while the first held it")
			}
			stopping := time.Now()
			a.stop()
			// Ready at once, or at the lease's end; either way well before
			// the fallback poll.
			ready, limit := stopping, 2*time.Second
			if c.abandoned {
				ready, limit = claimedAt.Add(vt), time.Until(claimedAt.Add(vt))+2*time.Second
			}
			waitFor(t, limit, "the released message delivered by the other dispatcher", func() bool { return rec.n.Load() == 1 })
			d := rec.deliveries()[0]
			t.Logf("handed over %s after the cancel, %s after it was ready", d.Start.Sub(stopping).Round(time.Millisecond), d.Start.Sub(ready).Round(time.Millisecond))
			if d.ID != id || d.Attempt != 1 || d.Invoked != c.invoke {
				t.Errorf("delivered %s at attempt %d (invoked %v); want %s at attempt 1 (refunded)", d.ID, d.Attempt, d.Invoked, id)
			}
			if c.abandoned && d.Start.Before(ready) {
				t.Errorf("delivered %s before the abandoned attempt's lease ended", ready.Sub(d.Start))
			}
		})
	}
}

// TestCleanStopHandsOverRetries: a retry that a stopping dispatcher
// nacked is delivered by another dispatcher when it comes due, not at that
// one's fallback poll. A nack sends no notification, so only the nacking
// lane's timer knew the retry's time, and the stop cancelled that timer;
// the stop now wakes the other dispatchers for such lanes
// (sql/hand_over.sql), every one of them: with retries pending in a
// consumer's queue lane and in its invoke lane, both are handed over.
func TestCleanStopHandsOverRetries(t *testing.T) {
	const backoff = 2 * time.Second
	for _, c := range []struct {
		name   string
		invoke []bool // what to send: an invoke delivery (true) or a queue message
	}{
		{name: "queue", invoke: []bool{false}},
		{name: "invoke", invoke: []bool{true}},
		{name: "queue and invoke", invoke: []bool{false, true}},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t)
			cons := e.consumer(t, bellhop.ConsumerSpec{Queue: "handover", BackoffBase: backoff, BackoffCap: backoff, MaxAttempts: 5, MaxInFlight: 10})
			table := func(invoke bool) string {
				if invoke {
					return "outbox"
				}
				return "queue_messages"
			}
			started := make(chan int, 4)
			fail := make(chan struct{})
			leaving := bellhop.NewMux()
			leaving.Handle("app", "handover", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
				started <- m.Attempt
				<-fail
				return errors.New("transient failure")
			}))
			a := startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: leaving, PollInterval: time.Hour}, nil)
			want := make(map[uuid.UUID]bool) // id -> invoked
			for _, invoke := range c.invoke {
				want[sendOne(t, e, cons, invoke)] = invoke
			}
			for range want {
				select {
				case <-started:
				case <-time.After(10 * time.Second):
					t.Fatal("the first dispatcher did not deliver")
				}
			}

			// The second dispatcher starts while the first holds the
			// messages, and its start-up wake scan ends before the nacks:
			// otherwise that scan could find the retries and arm timers
			// for them by itself.
			rec := &recorder{}
			staying := bellhop.NewMux()
			staying.Handle("app", "handover", rec)
			var counter claimCounter
			startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: staying, PollInterval: time.Hour}, func(pc *pgxpool.Config) {
				pc.ConnConfig.Tracer = &counter
			})
			waitFor(t, 10*time.Second, "the second dispatcher's wake scan", func() bool {
				return counter.scans.Load() >= 1 && counter.ended.Load() == counter.n.Load()
			})
			scans := counter.scans.Load()

			close(fail)
			var due time.Time // the latest retry's
			for id, invoke := range want {
				waitFor(t, 10*time.Second, "the first dispatcher's nack", func() bool {
					return e.count(t, `SELECT count(*) FROM `+table(invoke)+` WHERE id = $1 AND claim_token IS NULL`, id) == 1
				})
				var d time.Time
				if err := e.pool.QueryRow(context.Background(), `SELECT deliver_after FROM `+table(invoke)+` WHERE id = $1`, id).Scan(&d); err != nil {
					t.Fatal(err)
				}
				if d.After(due) {
					due = d
				}
			}
			a.stop()
			if time.Now().After(due) || len(started) != 0 || counter.scans.Load() != scans {
				t.Fatalf("inconclusive: the stop ended after a retry was due, the first dispatcher delivered again (%d), or the second scanned again", len(started))
			}
			waitFor(t, time.Until(due)+5*time.Second, "the retries delivered by the other dispatcher", func() bool { return rec.n.Load() >= int32(len(want)) })
			for _, d := range rec.deliveries() {
				t.Logf("retry (invoked %v) delivered %s after the latest was due", d.Invoked, d.Start.Sub(due).Round(time.Millisecond))
				if invoked, ok := want[d.ID]; !ok || d.Attempt != 2 || d.Invoked != invoked {
					t.Errorf("delivered %s at attempt %d (invoked %v); want one of %v at attempt 2", d.ID, d.Attempt, d.Invoked, want)
				}
				delete(want, d.ID)
			}
			if len(want) != 0 {
				t.Errorf("not delivered, or delivered twice: %v", want)
			}
		})
	}
}

// sendOne puts one message in cons's queue, or, with invoke, one invoke
// delivery in its outbox, and returns its id.
func sendOne(t *testing.T, e *env, cons bellhop.Consumer, invoke bool) uuid.UUID {
	t.Helper()
	if !invoke {
		return e.enqueue(t, cons.Queue, 1, bellhop.EnqueueOptions{})
	}
	id, err := e.client.InvokeAsync(context.Background(), cons.ID, []byte(`1`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// TestStopDuringClaim: a stop that comes while a committed claim's answer
// is still on its way waits for the answer and releases what it claimed,
// attempt refunded. Cutting the claim short dropped the answer: the
// message stayed leased, its only attempt spent, until its lease ran out,
// and was then dead-lettered undelivered.
func TestStopDuringClaim(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.consumer(t, bellhop.ConsumerSpec{Queue: "work", MaxAttempts: 1})
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "work", rec)
	// Once the dispatcher is up, every answer from the server reaches it
	// half a second late, as from a distant database: a claim committed on the
	// server is seen there long before the dispatcher reads its rows.
	var slow atomic.Bool
	link := slowLink(t, e.dsn, 500*time.Millisecond, &slow)
	r := startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour}, link)
	slow.Store(true)
	id := e.enqueue(t, "work", 1, bellhop.EnqueueOptions{})
	waitFor(t, 10*time.Second, "the claim committed", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NOT NULL`, id) == 1
	})
	r.stop()

	if n := rec.n.Load(); n != 0 {
		t.Fatalf("%d deliveries; the stop came before the claim's answer, want none", n)
	}
	var token *uuid.UUID
	var attempt int
	err := e.pool.QueryRow(ctx, `SELECT claim_token, attempt FROM queue_messages WHERE id = $1`, id).Scan(&token, &attempt)
	if err != nil {
		t.Fatalf("message not in queue_messages after the stop: %v", err)
	}
	if token != nil || attempt != 0 {
		t.Fatalf("after the stop: claim_token %v, attempt %d; want NULL and 0 (released, refunded)", token, attempt)
	}
}

// slowLink returns a pool tweak that routes the pool's connections through
// a local proxy to dsn's server, which holds back every byte from the
// server for delay while slow is set.
func slowLink(t *testing.T, dsn string, delay time.Duration, slow *atomic.Bool) func(*pgxpool.Config) {
	return proxyLink(t, dsn, delay, func(client io.Reader) (io.Reader, func() bool) { return client, slow.Load })
}

// silentLink returns a pool tweak that routes the pool's connections
// through a local proxy to dsn's server, on which a connection that runs
// a statement while silent is set never hears from the server again: a
// network path that went dead after the statement reached the server.
// Connections that run nothing meanwhile (an idle one, the listener
// waiting for notifications) are left alone.
func silentLink(t *testing.T, dsn string, silent *atomic.Bool) func(*pgxpool.Config) {
	return deadOn(t, dsn, func(string) bool { return silent.Load() })
}

// deadOn returns a pool tweak that routes the pool's connections through
// a local proxy to dsn's server, on which a connection that runs a
// statement whose SQL kill accepts never hears from the server again: the
// server runs the statement, and its answer is lost.
func deadOn(t *testing.T, dsn string, kill func(sql string) bool) func(*pgxpool.Config) {
	return watchLink(t, dsn, kill, false)
}

// cutOn is deadOn on a path that goes dead both ways: the statement never
// reaches the server (it is cut at its Bind), nor does anything the client
// sends after it.
func cutOn(t *testing.T, dsn string, kill func(sql string) bool) func(*pgxpool.Config) {
	return watchLink(t, dsn, kill, true)
}

func watchLink(t *testing.T, dsn string, kill func(sql string) bool, cut bool) func(*pgxpool.Config) {
	return proxyLink(t, dsn, time.Hour, func(client io.Reader) (io.Reader, func() bool) {
		w := &watchStatements{r: client, kill: kill, cut: cut, stmts: map[string]string{}}
		return w, w.dead.Load
	})
}

// proxyLink returns a pool tweak that routes the pool's connections
// through a local proxy to dsn's server. For each connection, watch is
// given what the client sends and returns the reader to forward instead,
// and whether to hold back each chunk from the server for delay.
func proxyLink(t *testing.T, dsn string, delay time.Duration, watch func(client io.Reader) (io.Reader, func() bool)) func(*pgxpool.Config) {
	t.Helper()
	pc, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	network, addr := "tcp", net.JoinHostPort(pc.ConnConfig.Host, strconv.Itoa(int(pc.ConnConfig.Port)))
	if strings.HasPrefix(pc.ConnConfig.Host, "/") {
		network, addr = "unix", pc.ConnConfig.Host+"/.s.PGSQL."+strconv.Itoa(int(pc.ConnConfig.Port))
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var conns sync.WaitGroup // the accept loop's own included, so that its Go calls come before Wait
	stop := make(chan struct{})
	t.Cleanup(func() { l.Close(); close(stop); conns.Wait() })
	conns.Go(func() {
		for {
			client, err := l.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial(network, addr)
			if err != nil {
				client.Close()
				continue
			}
			sent, hold := watch(client)
			conns.Go(func() {
				io.Copy(server, sent)
				server.Close()
			})
			conns.Go(func() { delayCopy(client, server, delay, hold, stop) })
		}
	})
	port := l.Addr().(*net.TCPAddr).Port
	return func(c *pgxpool.Config) {
		c.ConnConfig.Host, c.ConnConfig.Port = "127.0.0.1", uint16(port)
		c.ConnConfig.TLSConfig, c.ConnConfig.Fallbacks = nil, nil
	}
}

// watchStatements reads a client's messages from r (the frontend side of
// PostgreSQL's protocol), passes them on whole, and marks its connection
// dead once it executes a statement, prepared or unnamed, whose SQL kill
// accepts; with cut, once it binds one, and that Bind and whatever follows
// it are dropped.
// Simple queries are let through: pgx sends statements with arguments, as
// every one a test picks is, with the extended protocol, and its pings,
// BEGIN and COMMIT with the simple one.
type watchStatements struct {
	r     io.Reader
	kill  func(sql string) bool
	cut   bool
	dead  atomic.Bool
	in    []byte            // read, not yet a whole message
	out   []byte            // whole messages, to pass on
	err   error             // r's, once it has failed
	typed bool              // past the start-up message, whose first byte is no type
	stmts map[string]string // prepared statements' SQL by name ("" unnamed)
	bound string            // the SQL of the portal last bound
}

// Codes of the untyped requests that may come before the start-up
// message, which is then sent on the same connection.
const (
	sslRequest    = 80877103
	gssEncRequest = 80877104
)

func (w *watchStatements) Read(b []byte) (int, error) {
	for len(w.out) == 0 {
		if w.err != nil {
			return 0, w.err
		}
		if w.cut && w.dead.Load() {
			return 0, w.discard(b)
		}
		n, err := w.r.Read(b)
		w.in = append(w.in, b[:n]...)
		w.err = err
		w.split()
	}
	n := copy(b, w.out)
	w.out = w.out[n:]
	return n, nil
}

// terminate is the protocol's Terminate message, which pgx sends when it
// closes a connection.
var terminate = []byte{'X', 0, 0, 0, 4}

// discard reads what the client sends after a cut, until it closes the
// connection; its Terminate ends the server's side then, which on a dead
// path would never hear of it: pgx would wait 15s for the server to close
// (asyncClose), and a test's stop with it.
func (w *watchStatements) discard(b []byte) error {
	for {
		n, err := w.r.Read(b)
		if bytes.Contains(b[:n], terminate) {
			return io.EOF
		}
		if err != nil {
			return err
		}
	}
}

// split moves the whole messages read to out, following each.
func (w *watchStatements) split() {
	for {
		head := 5
		if !w.typed {
			head = 4
		}
		if len(w.in) < head {
			return
		}
		size := int(binary.BigEndian.Uint32(w.in[head-4:])) + head - 4
		if size < head || (!w.typed && size < 8) || len(w.in) < size {
			return
		}
		msg := w.in[:size]
		if !w.typed {
			if code := binary.BigEndian.Uint32(msg[4:]); code != sslRequest && code != gssEncRequest {
				w.typed = true
			}
		} else if w.message(msg[0], msg[5:]) && w.cut {
			w.in = nil
			return
		}
		w.out = append(w.out, msg...)
		w.in = w.in[size:]
	}
}

// message follows one typed message: Parse names a statement, Bind binds
// one to the portal, Execute runs the portal. It reports whether the
// message killed the connection.
func (w *watchStatements) message(kind byte, body []byte) bool {
	fields := bytes.Split(body, []byte{0})
	switch {
	case kind == 'P' && len(fields) >= 2:
		w.stmts[string(fields[0])] = string(fields[1])
	case kind == 'B' && len(fields) >= 2:
		w.bound = w.stmts[string(fields[1])]
		if w.cut && w.kill(w.bound) {
			w.dead.Store(true)
			return true
		}
	case kind == 'E' && !w.cut && w.kill(w.bound):
		w.dead.Store(true)
		return true
	}
	return false
}

// delayCopy copies from src to dst, each chunk delay after it was read
// while hold says so, and at once after stop is closed. If src closes while
// hold says so, dst is closed at once and what was held back is dropped.
func delayCopy(dst, src net.Conn, delay time.Duration, hold func() bool, stop <-chan struct{}) {
	type chunk struct {
		due time.Time
		b   []byte
	}
	q := make(chan chunk, 1024)
	abandon := make(chan struct{}) // closed when src has closed while holding
	var w sync.WaitGroup
	w.Go(func() {
		defer dst.Close()
		for c := range q {
			select {
			case <-time.After(time.Until(c.due)): // the latency being simulated
			case <-stop:
			case <-abandon:
			}
			if _, err := dst.Write(c.b); err != nil {
				src.Close() // ends the reader, which closes q
				for range q {
				}
				return
			}
		}
	})
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			due := time.Now()
			if hold() {
				due = due.Add(delay)
			}
			q <- chunk{due, append([]byte(nil), buf[:n]...)}
		}
		if err != nil {
			break
		}
	}
	// What is held back would come after the close: the client gets a
	// reset instead, as on a dead path, rather than waiting for it.
	if hold() {
		dst.Close()
		close(abandon)
	}
	close(q)
	w.Wait()
}

// TestGraceCountsFromTheStop: a stop cancels handlers still running when
// ShutdownGrace has passed since the stop, also when the stop first waits
// for a claim in flight (here held by a lock on the message table). The
// grace began after that wait, up to 5s later, past what a supervisor
// sized from the grace would allow.
func TestGraceCountsFromTheStop(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.consumer(t, bellhop.ConsumerSpec{Queue: "busy"})
	e.consumer(t, bellhop.ConsumerSpec{Queue: "other"})
	cancelled := make(chan time.Time, 1)
	busy := &recorder{result: func(ctx context.Context, _ *bellhop.Message) error {
		<-ctx.Done()
		cancelled <- time.Now()
		return ctx.Err()
	}}
	mux := bellhop.NewMux()
	mux.Handle("app", "busy", busy)
	mux.Handle("app", "other", &recorder{})
	const grace = 300 * time.Millisecond
	d := startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour, ShutdownGrace: grace}, nil)
	e.enqueue(t, "busy", 1, bellhop.EnqueueOptions{})
	waitFor(t, 10*time.Second, "the busy handler running", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages WHERE claim_token IS NOT NULL`) == 1
	})

	// A claim of the other queue, woken by hand, waits behind the lock.
	locker, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Rollback(ctx)
	if _, err := locker.Exec(ctx, `LOCK TABLE queue_messages IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, `SELECT pg_notify('bellhop', 'q:' || id || ':other') FROM apps`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the other queue's claim waiting for the lock", func() bool {
		return e.count(t, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND wait_event_type = 'Lock' AND application_name = 'bellhop-dispatcher'`) > 0
	})
	stopAt := time.Now()
	stopped := make(chan struct{})
	go func() { d.stop(); close(stopped) }()
	select {
	case at := <-cancelled:
		if late := at.Sub(stopAt); late > grace+time.Second {
			t.Errorf("the handler was cancelled %s after the stop, with a grace of %s", late.Round(time.Millisecond), grace)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the handler was not cancelled within 20s of the stop")
	}
	if err := locker.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	<-stopped
}

// TestGraceWarningBeforeRunReturns: when the grace timer's callback is
// already under way as the last handler returns, Run waits for it, so
// that its warning is in the log by the time Run returns and nothing is
// written after. Run used to stop the timer and go on: the warning could
// then come after Run had returned, when a supervisor may have closed the
// log or exited. The handler returns only once the warning has reached
// the log writer, which holds it until Run has returned (or for holdMax
// at most): the callback is running when Run is about to return.
func TestGraceWarningBeforeRunReturns(t *testing.T) {
	const holdMax = time.Second // Run returns in milliseconds once not held
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "work"})
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	mux := bellhop.NewMux()
	mux.Handle("app", "work", bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error {
		started <- struct{}{}
		<-release // deaf to its context: returns when the test says
		return nil
	}))
	logs := newHeldLog("shutdown grace over", holdMax)
	d := startLogged(t, e.dsn, bellhop.DispatcherConfig{
		Resolver: mux, PollInterval: time.Hour, ShutdownGrace: 100 * time.Millisecond, Logger: zerolog.New(logs),
	}, nil)
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free) // before the dispatcher's stop, should the test fail
	e.enqueue(t, "work", 1, bellhop.EnqueueOptions{})
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("handler did not start")
	}

	var atReturn []string // the log as Run returned
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		d.stop()
		atReturn = logs.lines()
		close(logs.release)
	}()
	select {
	case <-logs.held:
	case <-time.After(10 * time.Second):
		t.Fatal("no grace warning within 10s of the stop")
	}
	free() // Run's wait for handlers ends while the callback writes its line
	select {
	case <-stopped:
	case <-time.After(40 * time.Second):
		t.Fatal("Run did not return")
	}
	select {
	case <-logs.written:
	case <-time.After(10 * time.Second):
		t.Fatal("the held grace warning was never written")
	}
	all := logs.lines()
	if !slices.ContainsFunc(atReturn, func(l string) bool { return strings.Contains(l, "shutdown grace over") }) {
		t.Errorf("the grace warning was not in the log when Run returned")
	}
	if late := all[len(atReturn):]; len(late) > 0 {
		t.Errorf("%d lines written after Run returned: %q", len(late), late)
	}
	if t.Failed() {
		t.Logf("log as Run returned: %q", atReturn)
	}
}

// heldLog is a log writer that records every line and holds back the
// first line containing match until release is closed or for max at
// most: held is closed when that line reaches Write, written once it is
// recorded.
type heldLog struct {
	match                  string
	max                    time.Duration
	held, written, release chan struct{}
	once                   sync.Once
	mu                     sync.Mutex
	all                    []string
}

func newHeldLog(match string, max time.Duration) *heldLog {
	return &heldLog{match: match, max: max,
		held: make(chan struct{}), written: make(chan struct{}), release: make(chan struct{})}
}

func (l *heldLog) Write(p []byte) (int, error) {
	line := string(p)
	hold := false
	if strings.Contains(line, l.match) {
		l.once.Do(func() { hold = true })
	}
	if hold {
		close(l.held)
		t := time.NewTimer(l.max)
		select {
		case <-l.release:
		case <-t.C:
		}
		t.Stop()
	}
	l.mu.Lock()
	l.all = append(l.all, line)
	l.mu.Unlock()
	if hold {
		close(l.written)
	}
	return len(p), nil
}

// lines returns a copy of the lines written so far.
func (l *heldLog) lines() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.all)
}
