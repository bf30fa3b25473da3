package claim_test

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/internal/syncbuf"
)

// TestDeadLetterErrorText: a handler's error text that PostgreSQL would
// refuse (a NUL byte, invalid UTF-8) or that is huge is cleaned before it
// is stored with the dead letter, so it cannot fail the batch it is
// written in: the ack written with it applies too. Both tables.
func TestDeadLetterErrorText(t *testing.T) {
	ctx := context.Background()
	pool, client, appID := setup(t)
	cases := []struct {
		name, text string
		want       string // prefix of the stored text
	}{
		{"NUL byte", "upstream said \x00 here", "upstream said \uFFFD here"},
		{"invalid UTF-8", "upstream said \xff\xfe here", "upstream said \uFFFD here"},
		{"huge", strings.Repeat("é", claim.MaxErrorBytes), "éééé"},
		{"plain", "boom", "boom"},
	}
	n := 0
	for _, source := range []claim.Source{claim.Queue, claim.Invoke} {
		for _, tc := range cases {
			t.Run(source.String()+"/"+tc.name, func(t *testing.T) {
				n++
				queue := "text-" + string(rune('a'+n))
				acked, table, target := newMessage(t, client, appID, source, queue)
				dead, _, _ := newMessage(t, client, appID, claim.Queue, queue+"-dead")
				ma := claimOne(t, pool, target, acked)
				md := claimOne(t, pool, claim.Target{Source: claim.Queue, AppID: appID, Queue: queue + "-dead"}, dead)
				applied, err := claim.Write(ctx, pool, []claim.Outcome{
					{Message: &ma, Verdict: claim.Ack},
					{Message: &md, Verdict: claim.DeadLetter, Error: tc.text, Queue: queue + "-dead"},
				})
				if err != nil {
					t.Fatalf("write: %v", err)
				}
				if !applied.Has(&ma) || !applied.Has(&md) {
					t.Fatalf("applied %v, want both", applied)
				}
				if s := snapshot(t, pool, table, acked); s != "" {
					t.Errorf("the ack batched with the dead letter left its message: %s", s)
				}
				var stored string
				if err := pool.QueryRow(ctx, `SELECT last_error FROM dead_letters WHERE id = $1`, dead).Scan(&stored); err != nil {
					t.Fatalf("dead letter: %v", err)
				}
				if !utf8.ValidString(stored) || strings.ContainsRune(stored, 0) || len(stored) > claim.MaxErrorBytes {
					t.Errorf("stored %d bytes, valid UTF-8 %v, NUL %v", len(stored), utf8.ValidString(stored), strings.ContainsRune(stored, 0))
				}
				if !strings.HasPrefix(stored, tc.want) {
					t.Errorf("stored %.40q…, want it to start with %q", stored, tc.want)
				}
				if tc.name == "plain" && stored != tc.text {
					t.Errorf("stored %q, want it unchanged", stored)
				}
			})
		}
	}
}

// TestCompleterAnswerLost: when the connection is cut after the server
// committed a batch of outcomes but before its answer arrived, the
// Completer's retry finds the token gone. It reports the outcome as
// unknown (ErrOutcomeUnknown), not as a lease lost, so that the lane of a
// nack still reads the message's new due time rather than leave it to the
// fallback poll. So it does when the database is unreachable for every
// retry after the cut: that was reported as an outcome not written, the
// lease left to expire, though the nack was applied.
func TestCompleterAnswerLost(t *testing.T) {
	for _, tc := range []struct {
		name string
		down bool // no new connection after the cut
	}{{"then retried", false}, {"then the database unreachable", true}} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			pool, client, appID := setup(t)
			id, _, target := newMessage(t, client, appID, claim.Queue, "lost")
			m := claimOne(t, pool, target, id)

			var armed, down atomic.Bool
			var cuts atomic.Int32
			cfg := pool.Config().Copy()
			cfg.MaxConns = 1
			// The cut reads the protocol, so it must be in the clear.
			cfg.ConnConfig.TLSConfig, cfg.ConnConfig.Fallbacks = nil, nil
			var dialer net.Dialer
			cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
				if down.Load() {
					return nil, errors.New("database unreachable (test)")
				}
				conn, err := dialer.DialContext(ctx, network, addr)
				if err != nil {
					return nil, err
				}
				return &cutConn{Conn: conn, armed: &armed, cuts: &cuts}, nil
			}
			cutting, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer cutting.Close()
			if err := cutting.Ping(ctx); err != nil {
				t.Fatal(err)
			}
			comp := claim.NewCompleter(cutting, zerolog.Nop(), 1, 10)
			defer comp.Close()

			type answer struct {
				applied bool
				err     error
			}
			done := make(chan answer, 1)
			armed.Store(true)
			down.Store(tc.down)
			comp.Submit(claim.Outcome{Message: &m, Verdict: claim.Nack, Delay: time.Hour, Done: func(applied bool, err error) {
				done <- answer{applied, err}
			}})
			var a answer
			select {
			case a = <-done:
			case <-time.After(30 * time.Second):
				t.Fatal("the outcome was not answered")
			}
			if n := cuts.Load(); n != 1 {
				t.Fatalf("%d connections cut, want 1", n)
			}
			if a.applied || !errors.Is(a.err, claim.ErrOutcomeUnknown) {
				t.Errorf("Done(%v, %v), want (false, ErrOutcomeUnknown)", a.applied, a.err)
			}
			if tc.down != errors.Is(a.err, claim.ErrWriteFailed) {
				t.Errorf("Done's error %v: ErrWriteFailed %t, want %t", a.err, errors.Is(a.err, claim.ErrWriteFailed), tc.down)
			}
			if tc.down && (a.err == nil || !strings.Contains(a.err.Error(), "database unreachable (test)")) {
				t.Errorf("Done's error %v does not say why the last try failed", a.err)
			}
			// The first try did commit: the message is released, due in an hour.
			var token *uuid.UUID
			var due time.Time
			if err := pool.QueryRow(ctx, `SELECT claim_token, deliver_after FROM queue_messages WHERE id = $1`, id).Scan(&token, &due); err != nil {
				t.Fatal(err)
			}
			if token != nil || time.Until(due) < 50*time.Minute {
				t.Errorf("after the cut write: claim_token %v, deliver_after in %s; want no token, in about an hour", token, time.Until(due).Round(time.Second))
			}
		})
	}
}

// cutConn is a connection to the server that, once armed, is cut right
// after the server's answer to a query that returned rows has ended (its
// ReadyForQuery): the server has committed, and the client never hears.
// Armed only between queries, it reads the server's messages from their
// start.
type cutConn struct {
	net.Conn
	armed *atomic.Bool
	cuts  *atomic.Int32
	buf   []byte // the server's bytes since armed, from a message's start
	rows  bool   // a DataRow came since the last ReadyForQuery
}

func (c *cutConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if !c.armed.Load() {
		c.buf, c.rows = c.buf[:0], false
		return n, err
	}
	c.buf = append(c.buf, p[:n]...)
	for len(c.buf) >= 5 {
		size := 1 + int(binary.BigEndian.Uint32(c.buf[1:5]))
		if len(c.buf) < size {
			break
		}
		switch c.buf[0] {
		case 'D':
			c.rows = true
		case 'Z':
			if c.rows && c.armed.CompareAndSwap(true, false) {
				c.Conn.Close()
				c.cuts.Add(1)
				return 0, errors.New("connection cut by the test")
			}
			c.rows = false
		}
		c.buf = c.buf[size:]
	}
	return n, err
}

// TestCompleterRetriesUntilLeaseEnds: while the database cannot be
// reached, a batch is retried until its lease ends (Message.LeaseEnd), with
// pauses of at most a second, and given up on then: not after 5 tries in
// 0.75s, and not past the lease, when the message may be delivered again.
func TestCompleterRetriesUntilLeaseEnds(t *testing.T) {
	ctx := context.Background()
	pool, client, appID := setup(t)
	id, _, target := newMessage(t, client, appID, claim.Queue, "away")
	m := claimOne(t, pool, target, id)
	cfg := pool.Config().Copy()
	var dials atomic.Int32
	cfg.ConnConfig.DialFunc = func(context.Context, string, string) (net.Conn, error) {
		dials.Add(1)
		return nil, errors.New("database unreachable (test)")
	}
	away, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer away.Close()
	comp := claim.NewCompleter(away, zerolog.Nop(), 1, 10)
	defer comp.Close()
	const lease = 2500 * time.Millisecond
	took, got := ackUntil(t, comp, &m, lease)
	t.Logf("given up after %s and %d dials", took.Round(time.Millisecond), dials.Load())
	if !errors.Is(got, claim.ErrWriteFailed) {
		t.Errorf("Done's error %v, want ErrWriteFailed", got)
	}
	// The last try is made 100ms before the lease ends at the latest.
	if took < lease-500*time.Millisecond || took > lease+500*time.Millisecond {
		t.Errorf("given up after %s, want about the lease's %s", took.Round(time.Millisecond), lease)
	}
	if n := dials.Load(); n <= 5 {
		t.Errorf("%d tries, want more than 5 within the lease", n)
	}
}

// hangingPool is a pool on pool's database whose dials never complete, as
// to a host whose packets are dropped: each blocks until its context ends
// (the pool's close, pgxpool's dials running on past the Acquire that
// started them), counted in dials.
func hangingPool(t *testing.T, cfg *pgxpool.Config, dials *atomic.Int32) *pgxpool.Pool {
	t.Helper()
	cfg = cfg.Copy()
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, _ string) (net.Conn, error) {
		dials.Add(1)
		<-ctx.Done()
		return nil, &net.OpError{Op: "dial", Net: network, Err: ctx.Err()}
	}
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// ackUntil submits m's ack to comp, its lease ending lease from now, and
// returns how long after the submit Done came, and the error it got.
func ackUntil(t *testing.T, comp *claim.Completer, m *claim.Message, lease time.Duration) (time.Duration, error) {
	t.Helper()
	start := time.Now()
	m.LeaseEnd = start.Add(lease)
	done := make(chan error, 1)
	comp.Submit(claim.Outcome{Message: m, Verdict: claim.Ack, Done: func(_ bool, err error) { done <- err }})
	select {
	case err := <-done:
		return time.Since(start), err
	case <-time.After(30 * time.Second):
		t.Fatal("the outcome was not answered")
		return 0, nil
	}
}

// TestCompleterRetriesWhileDialHangs: a try that gets no connection in
// time, its dial hanging (a host that drops packets, a partition) or the
// pool full of such dials, is an outage too: the batch is retried until
// its lease ends. pgxpool returns the bare context.DeadlineExceeded then,
// which was taken for a live connection's silence: the batch was given up
// after 5 tries (about 51s with 10s tries), so an ack made during the
// outage was lost for a lease longer than that. As no try sent the batch,
// Done's error says it was not written, not that it may have been.
func TestCompleterRetriesWhileDialHangs(t *testing.T) {
	pool, client, appID := setup(t)
	id, _, target := newMessage(t, client, appID, claim.Queue, "hang")
	m := claimOne(t, pool, target, id)
	var dials atomic.Int32
	hanging := hangingPool(t, pool.Config(), &dials)
	logs := &syncbuf.Buffer{}
	comp := claim.NewCompleter(hanging, zerolog.New(logs), 1, 10)
	// 5 tries of 200ms and their pauses took 1.75s: well within the lease.
	claim.SetTryTimeout(comp, 200*time.Millisecond)
	defer comp.Close()
	const lease = 4 * time.Second
	took, got := ackUntil(t, comp, &m, lease)
	var line struct {
		Try     int    `json:"try"`
		Message string `json:"message"`
	}
	for l := range strings.Lines(logs.String()) {
		if strings.Contains(l, "gave up") {
			if err := json.Unmarshal([]byte(l), &line); err != nil {
				t.Fatalf("the give-up line %q: %v", l, err)
			}
		}
	}
	t.Logf("given up after %s, %d tries and %d dials: %s; Done: %v", took.Round(time.Millisecond), line.Try, dials.Load(), line.Message, got)
	if took < lease-500*time.Millisecond || took > lease+500*time.Millisecond {
		t.Errorf("given up after %s, want about the lease's %s", took.Round(time.Millisecond), lease)
	}
	if line.Try <= 5 {
		t.Errorf("given up after %d tries, want more than 5 within the lease", line.Try)
	}
	if !strings.Contains(line.Message, "leases have ended") || !strings.Contains(line.Message, "no try got a connection") {
		t.Errorf("the give-up line %q does not say the leases ended and no try got a connection", line.Message)
	}
	if !errors.Is(got, claim.ErrWriteFailed) || !errors.Is(got, context.DeadlineExceeded) {
		t.Errorf("Done's error %v, want ErrWriteFailed and the try's deadline", got)
	}
	if errors.Is(got, claim.ErrOutcomeUnknown) {
		t.Errorf("Done's error %v says an earlier try may have committed; none sent anything", got)
	}
}

// TestCompleterNoConnectionIsNotUnknown: a retry that finds the token
// gone after tries that got no connection reports the lease lost
// (Done(false, nil)), not the outcome unknown: nothing was sent before.
func TestCompleterNoConnectionIsNotUnknown(t *testing.T) {
	pool, client, appID := setup(t)
	id, _, target := newMessage(t, client, appID, claim.Queue, "stale")
	m := claimOne(t, pool, target, id)
	m.Token = uuid.New() // reclaimed meanwhile: the write changes nothing
	cfg := pool.Config().Copy()
	var dials atomic.Int32
	var d net.Dialer
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if dials.Add(1) <= 2 {
			return nil, errors.New("database unreachable (test)")
		}
		return d.DialContext(ctx, network, addr)
	}
	flaky, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer flaky.Close()
	comp := claim.NewCompleter(flaky, zerolog.Nop(), 1, 10)
	defer comp.Close()
	m.LeaseEnd = time.Now().Add(time.Minute)
	type answer struct {
		applied bool
		err     error
	}
	done := make(chan answer, 1)
	comp.Submit(claim.Outcome{Message: &m, Verdict: claim.Ack, Done: func(applied bool, err error) { done <- answer{applied, err} }})
	select {
	case a := <-done:
		if a.applied || a.err != nil {
			t.Errorf("Done(%v, %v) after %d dials, want (false, nil): the lease lost", a.applied, a.err, dials.Load())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the outcome was not answered")
	}
}

// TestTransient: the errors an outage makes are retried until the leases
// end; any other, the server's or the client's own, a few times only, as
// it fails every try alike. An error that was not the server's counted as
// an outage's, so that one pgx could not encode would have held back every
// later outcome for up to a lease of 12h; so did a try that got no answer
// in time on a live connection, such as a write waiting on a row lock.
func TestTransient(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// Port 1 on loopback: refused at once.
	_, refused := pgconn.Connect(ctx, "postgres://bellhop@127.0.0.1:1/bellhop?connect_timeout=5&sslmode=disable")
	if refused == nil {
		t.Fatal("connected to 127.0.0.1:1")
	}
	// A dial that hangs: pgxpool gives the bare context.DeadlineExceeded
	// once the try's time is up, as it does when the pool stays full.
	cfg, err := pgxpool.ParseConfig("postgres://bellhop@127.0.0.1:1/bellhop?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	var dials atomic.Int32
	hctx, hcancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer hcancel()
	_, hung := claim.Write(hctx, hangingPool(t, cfg, &dials), []claim.Outcome{{Message: &claim.Message{}, Verdict: claim.Ack}})
	if !errors.Is(hung, context.DeadlineExceeded) {
		t.Fatalf("a write whose dial hangs failed with %v, want context.DeadlineExceeded", hung)
	}
	// A database that is not there: the server refuses the session.
	gcfg, err := pgxpool.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	gcfg.ConnConfig.Database = "bellhop_no_such_database"
	gone, err := pgxpool.NewWithConfig(ctx, gcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer gone.Close()
	_, noDB := claim.Write(ctx, gone, []claim.Outcome{{Message: &claim.Message{}, Verdict: claim.Ack}})
	if pe := (*pgconn.PgError)(nil); !errors.As(noDB, &pe) || pe.Code != "3D000" {
		t.Fatalf("a write to a database not there failed with %v, want 3D000", noDB)
	}
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{"connection refused", refused, true},
		{"database not there", noDB, false},
		{"dial hangs", hung, true},
		{"no connection from a full pool", claim.NoConn(context.DeadlineExceeded), true},
		{"no connection, too many clients", claim.NoConn(&pgconn.PgError{Code: "53300"}), true},
		{"no connection, starting up", claim.NoConn(&pgconn.PgError{Code: "57P03"}), true},
		// Refused for good: retrying until the leases end cannot help.
		{"no connection, a bad password", claim.NoConn(&pgconn.PgError{Code: "28P01"}), false},
		// 28000 is also an LDAP, PAM or RADIUS server out of reach.
		{"no connection, authentication failed", claim.NoConn(&pgconn.PgError{Code: "28000"}), true},
		{"no connection, the database gone", claim.NoConn(&pgconn.PgError{Code: "3D000"}), false},
		{"no connection, no CONNECT privilege", claim.NoConn(&pgconn.PgError{Code: "42501"}), false},
		{"connection cut", fmt.Errorf("receive message failed: %w", &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}), true},
		{"connection closed", fmt.Errorf("receive message failed: %w", io.ErrUnexpectedEOF), true},
		{"no answer in time", fmt.Errorf("timeout: %w", context.DeadlineExceeded), false},
		{"admin shutdown", &pgconn.PgError{Code: "57P01"}, true},
		{"cannot connect now", &pgconn.PgError{Code: "57P03"}, true},
		{"too many clients", &pgconn.PgError{Code: "53300"}, true},
		{"read-only standby", &pgconn.PgError{Code: "25006"}, true},
		{"connection failure", &pgconn.PgError{Code: "08006"}, true},
		{"deadlock", fmt.Errorf("write: %w", &pgconn.PgError{Code: "40P01"}), true},
		{"undefined table", &pgconn.PgError{Code: "42P01"}, false},
		{"check violation", &pgconn.PgError{Code: "23514"}, false},
		{"cannot encode", errors.New("failed to encode args[3]: unable to encode"), false},
	}
	for _, tc := range tests {
		if got := claim.Transient(tc.err); got != tc.want {
			t.Errorf("%s: transient(%v) = %t, want %t", tc.name, tc.err, got, tc.want)
		}
	}
}

// TestShutdownCountsGivenUp: Shutdown reports how many outcomes its
// budget's end gave up on, and why, and nothing when none was. A stop
// logged Pending() after Shutdown, always 0 since Close waits until every
// outcome is settled, and warned of outcomes not written whenever the
// budget had ended, also when none was pending (closeOffers had spent
// it).
func TestShutdownCountsGivenUp(t *testing.T) {
	budgetOver := errors.New("the test's budget ran out")
	t.Run("given up", func(t *testing.T) {
		pool, client, appID := setup(t)
		var dials atomic.Int32
		comp := claim.NewCompleter(hangingPool(t, pool.Config(), &dials), zerolog.Nop(), 1, 10)
		var failed atomic.Int32
		const n = 3
		for range n {
			id, _, target := newMessage(t, client, appID, claim.Queue, "given-up")
			m := claimOne(t, pool, target, id)
			m.LeaseEnd = time.Now().Add(time.Minute)
			comp.Submit(claim.Outcome{Message: &m, Verdict: claim.Ack, Done: func(_ bool, err error) {
				if errors.Is(err, claim.ErrWriteFailed) {
					failed.Add(1)
				}
			}})
		}
		ctx, cancel := context.WithTimeoutCause(context.Background(), 500*time.Millisecond, budgetOver)
		defer cancel()
		givenUp, err := comp.Shutdown(ctx)
		t.Logf("Shutdown: (%d, %v); %d Done calls with ErrWriteFailed", givenUp, err, failed.Load())
		if givenUp != n || int(failed.Load()) != n {
			t.Errorf("Shutdown reported %d outcomes given up, Done got ErrWriteFailed %d times; want %d", givenUp, failed.Load(), n)
		}
		if !errors.Is(err, budgetOver) {
			t.Errorf("Shutdown's error %v, want the budget's cause", err)
		}
	})
	t.Run("nothing pending, budget already over", func(t *testing.T) {
		pool, client, appID := setup(t)
		comp := claim.NewCompleter(pool, zerolog.Nop(), 1, 10)
		id, _, target := newMessage(t, client, appID, claim.Queue, "written")
		m := claimOne(t, pool, target, id)
		m.LeaseEnd = time.Now().Add(time.Minute)
		written := make(chan error, 1)
		comp.Submit(claim.Outcome{Message: &m, Verdict: claim.Ack, Done: func(_ bool, err error) { written <- err }})
		select {
		case err := <-written:
			if err != nil {
				t.Fatalf("the ack before the stop: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("the ack before the stop was not answered")
		}
		ctx, cancel := context.WithCancelCause(context.Background())
		cancel(budgetOver)
		if givenUp, err := comp.Shutdown(ctx); givenUp != 0 || err != nil {
			t.Errorf("Shutdown with nothing pending = (%d, %v), want (0, nil): no outcome was given up", givenUp, err)
		}
	})
}

// TestTrySubmitNeverWaits: TrySubmit queues an outcome while the queue
// has room, and refuses one at once, uncounted, when it is full (here
// behind a batch whose dial hangs); what it queued is written as any
// submitted outcome is.
func TestTrySubmitNeverWaits(t *testing.T) {
	pool, client, appID := setup(t)
	var dials atomic.Int32
	comp := claim.NewCompleter(hangingPool(t, pool.Config(), &dials), zerolog.Nop(), 1, 1) // a queue of 4
	t.Cleanup(func() {
		comp.Abandon(errors.New("test over"))
		comp.Close()
	})
	id, _, target := newMessage(t, client, appID, claim.Queue, "try")
	m := claimOne(t, pool, target, id)
	m.LeaseEnd = time.Now().Add(time.Minute)
	queued := 0
	for comp.TrySubmit(claim.Outcome{Message: &m, Verdict: claim.Ack}) {
		queued++
		if queued > 5 {
			t.Fatal("TrySubmit queued more than the writer's batch and a queue of 4")
		}
	}
	if queued < 4 {
		t.Errorf("TrySubmit refused with %d queued, want room for the queue's 4", queued)
	}
	if n := comp.Pending(); n != queued {
		t.Errorf("Pending = %d after %d queued and one refused, want %d", n, queued, queued)
	}
}

// TestWriteErrorNamesStatement: a batch of outcomes that fails says which
// of its statements failed, with how many outcomes it held: all of the
// batch is retried or given up together, and "settle 3 messages" alone
// did not say which outcome was refused.
func TestWriteErrorNamesStatement(t *testing.T) {
	ctx := context.Background()
	pool, client, appID := setup(t)
	acked, _, ta := newMessage(t, client, appID, claim.Queue, "acked")
	nacked, _, tn := newMessage(t, client, appID, claim.Queue, "nacked")
	dead, _, td := newMessage(t, client, appID, claim.Queue, "dead")
	ma, mn, md := claimOne(t, pool, ta, acked), claimOne(t, pool, tn, nacked), claimOne(t, pool, td, dead)
	if _, err := pool.Exec(ctx, `
		CREATE FUNCTION refuse_dead_letter() RETURNS trigger LANGUAGE plpgsql AS
		$$ BEGIN RAISE EXCEPTION 'dead letters refused by the test'; END $$;
		CREATE TRIGGER refuse_dead_letter BEFORE INSERT ON dead_letters
		FOR EACH ROW EXECUTE FUNCTION refuse_dead_letter()`); err != nil {
		t.Fatal(err)
	}
	_, err := claim.Write(ctx, pool, []claim.Outcome{
		{Message: &ma, Verdict: claim.Ack},
		{Message: &mn, Verdict: claim.Nack, Delay: time.Second},
		{Message: &md, Verdict: claim.DeadLetter, Error: "boom"},
	})
	if err == nil || !strings.Contains(err.Error(), "settle 3 messages: dead-letter 1: ") ||
		!strings.Contains(err.Error(), "dead letters refused by the test") {
		t.Fatalf("write: %v; want the dead-letter statement named", err)
	}
}
