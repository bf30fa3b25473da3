package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/httppush"
	"github.com/bellhopq/bellhop/internal/pgtest"
	queries "github.com/bellhopq/bellhop/sql"
)

// pushOrMux serves URL consumers by HTTP push, the others from a Mux.
type pushOrMux struct {
	push *httppush.Pusher
	mux  *bellhop.Mux
}

func (r pushOrMux) Resolve(c bellhop.Consumer) bellhop.Handler {
	if c.URL == "" {
		return r.mux.Resolve(c)
	}
	h, err := r.push.Handler(c)
	if err != nil {
		return nil
	}
	return h
}

// TestLogsLeaveOutBodiesAndStacks: a failed delivery's info line ("will
// retry") and warn line ("dead-lettered") name what went wrong but leave
// out the consumer's response body, which here echoes the payload, and a
// panic's stack; the dead letter keeps both, and the debug log has them.
func TestLogsLeaveOutBodiesAndStacks(t *testing.T) {
	const secret = "payload-secret-5521"
	e := newEnv(t)
	echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusInternalServerError)
		w.Write(append([]byte("could not process "), body...))
	}))
	defer echo.Close()
	spec := bellhop.ConsumerSpec{MaxAttempts: 2, BackoffBase: time.Millisecond, BackoffCap: time.Millisecond}
	spec.Queue, spec.URL = "pushed", echo.URL
	e.consumer(t, spec)
	spec.Queue, spec.URL = "panics", ""
	e.consumer(t, spec)
	mux := bellhop.NewMux()
	mux.Handle("app", "panics", bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error {
		panic("kaboom-5521")
	}))

	for _, level := range []zerolog.Level{zerolog.InfoLevel, zerolog.DebugLevel} {
		t.Run(level.String(), func(t *testing.T) {
			logs := &syncBuffer{}
			pc, err := pgxpool.ParseConfig(e.dsn)
			if err != nil {
				t.Fatal(err)
			}
			d, err := bellhop.NewDispatcher(pc, bellhop.DispatcherConfig{
				Resolver: pushOrMux{httppush.New(httppush.Options{}), mux}, PollInterval: time.Hour,
				Logger: zerolog.New(io.MultiWriter(logs, zerolog.NewTestWriter(t))).Level(level),
			})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- d.Run(ctx) }()
			defer func() {
				cancel()
				if err := <-done; err != nil {
					t.Errorf("Run: %v", err)
				}
			}()
			waitFor(t, 10*time.Second, "dispatcher ready", func() bool { return d.Ready(ctx) == nil })

			pushed := e.enqueue(t, "pushed", map[string]string{"secret": secret}, bellhop.EnqueueOptions{})
			panicked := e.enqueue(t, "panics", map[string]string{"secret": secret}, bellhop.EnqueueOptions{})
			// The dead-letter lines are logged once the outcome is written.
			waitFor(t, 10*time.Second, "both dead-lettered and logged", func() bool {
				l := logs.String()
				return strings.Count(l, `"message":"message dead-lettered"`) == 2 &&
					(level != zerolog.DebugLevel || strings.Count(l, ` in full"`) >= 4)
			})
			// The dead letters keep the whole text.
			for id, want := range map[uuid.UUID]string{pushed: secret, panicked: "goroutine "} {
				if dl, _ := e.deadLetterOf(t, id); !strings.Contains(dl.LastError, want) {
					t.Errorf("dead letter %s: last_error %.80q… lacks %q", id, dl.LastError, want)
				}
			}

			want := map[string]string{ // info and warn lines about each message: what they must say
				pushed.String() + "/handler failed; will retry":   "consumer failed: HTTP 500",
				pushed.String() + "/message dead-lettered":        "attempts exhausted (2 of 2): consumer failed: HTTP 500",
				panicked.String() + "/handler failed; will retry": "handler panicked: kaboom-5521",
				panicked.String() + "/message dead-lettered":      "attempts exhausted (2 of 2): handler panicked: kaboom-5521",
			}
			seen := map[string]bool{}
			full := 0
			for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
				var l struct {
					Level, Message, Error string
					MessageID             string `json:"message_id"`
				}
				if err := json.Unmarshal([]byte(line), &l); err != nil {
					t.Fatalf("log line %q: %v", line, err)
				}
				if l.Level == "debug" {
					if strings.Contains(line, secret) || strings.Contains(line, "goroutine ") {
						full++
					}
					continue
				}
				if strings.Contains(line, secret) || strings.Contains(line, "goroutine ") {
					t.Errorf("a %s line carries the response body or a stack: %s", l.Level, line)
				}
				k := l.MessageID + "/" + l.Message
				if w, ok := want[k]; ok {
					seen[k] = true
					if l.Error != w {
						t.Errorf("%s: error %q, want %q", k, l.Error, w)
					}
				}
			}
			for k := range want {
				if !seen[k] {
					t.Errorf("no %q line", k)
				}
			}
			if level == zerolog.DebugLevel && full < 4 {
				t.Errorf("%d debug lines with the whole error, want at least 4 (two failures of each message)", full)
			}
		})
	}
}

// logLines returns the lines of logs whose message is msg, by level.
func logLines(t *testing.T, logs *syncBuffer, msg string) map[string]int {
	t.Helper()
	n := map[string]int{}
	for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		if line == "" {
			continue // nothing logged yet
		}
		var l struct{ Level, Message string }
		if err := json.Unmarshal([]byte(line), &l); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if strings.HasPrefix(l.Message, msg) {
			n[l.Level]++
		}
	}
	return n
}

// TestPerMessageLinesThrottled: a queue whose every message fails writes
// its per-message lines at warn level up to a burst of 10 and then one a
// second; the rest go to the debug level, none lost there. Every one was
// a warn line: a consumer that is down with 100,000 messages queued wrote
// 100,000 of them.
func TestPerMessageLinesThrottled(t *testing.T) {
	const n = 300
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", MaxInFlight: 100})
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error {
		return errors.New("consumer down")
	}))
	logs := &syncBuffer{}
	start := time.Now()
	startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour,
		Logger: zerolog.New(logs).Level(zerolog.DebugLevel)}, nil)
	if _, err := e.pool.Exec(context.Background(), `INSERT INTO queue_messages (app_id, queue_name, payload, max_attempts)
		SELECT id, 'orders', '{}', 1 FROM apps, generate_series(1, $1::int)`, n); err != nil {
		t.Fatal(err)
	}
	var lines map[string]int
	waitFor(t, 60*time.Second, "every dead letter logged", func() bool {
		lines = logLines(t, logs, "message dead-lettered")
		return lines["warn"]+lines["debug"] == n
	})
	if limit := 10 + int(time.Since(start)/time.Second) + 1; lines["warn"] < 10 || lines["warn"] > limit {
		t.Errorf("%d of %d dead letters logged at warn level (%v) in %s, want 10 to %d", lines["warn"], n, lines,
			time.Since(start).Round(time.Millisecond), limit)
	}
}

// TestPerMessageLinesAtHiddenLevels: per-message lines of a level the
// logger does not write take nothing from the lane's allowance. With the
// logger at warn, ten messages that each fail once (an info line, not
// written) and then for good (a warn line) log all ten dead letters at
// warn. Found by review: the hidden retry lines used up the burst, so the
// dead letters went to the debug level, and at --log-level warn, the
// level bellhop demo runs at, they were not logged at all.
func TestPerMessageLinesAtHiddenLevels(t *testing.T) {
	const n = 10
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", MaxInFlight: n, MaxAttempts: 2,
		BackoffBase: 10 * time.Millisecond, BackoffCap: 20 * time.Millisecond})
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error {
		return errors.New("consumer down")
	}))
	logs := &syncBuffer{}
	startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour,
		Logger: zerolog.New(logs).Level(zerolog.WarnLevel)}, nil)
	if _, err := e.pool.Exec(context.Background(), `INSERT INTO queue_messages (app_id, queue_name, payload, max_attempts)
		SELECT id, 'orders', '{}', 2 FROM apps, generate_series(1, $1::int)`, n); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "every message dead-lettered", func() bool {
		return e.count(t, `SELECT count(*) FROM dead_letters`) == n
	})
	// Each line is written just after its dead letter; 3 s allow for a
	// loaded machine, in which the allowance gives three lines more at
	// most, short of the ten.
	var lines map[string]int
	waitFor(t, 3*time.Second, "every dead letter logged at warn", func() bool {
		lines = logLines(t, logs, "message dead-lettered")
		return lines["warn"] == n
	})
}

// TestStuckClaimTimesOut: a claim pass stuck behind a lock is cancelled
// after DispatcherConfig.StatementTimeout, logged as a failed claim that says
// why, and tried again; it claims nothing meanwhile, so once the lock
// goes, the message is delivered on its first attempt. Without the
// timeout the pass waited as long as the lock lasted, and the
// dispatcher's other pass in flight was all it had left.
func TestStuckClaimTimesOut(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	rec := &recorder{}
	mux := bellhop.NewMux()
	e.consumer(t, bellhop.ConsumerSpec{Queue: "stuck", MaxAttempts: 1})
	mux.Handle("app", "stuck", rec)
	e.enqueue(t, "stuck", "waited", bellhop.EnqueueOptions{})
	// Reads go on; every claim (an UPDATE) waits.
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `LOCK TABLE queue_messages IN EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	logs := &syncBuffer{}
	startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour,
		StatementTimeout: 500 * time.Millisecond, Logger: zerolog.New(logs)}, nil)
	// The reclaim pass waits for the lock too, and says so in its own line.
	waitFor(t, 10*time.Second, "a claim failure that names the timeout", func() bool {
		return lineWith(logs, `"claim failed`, "no answer within 500ms")
	})
	if w := logLines(t, logs, "claim failed")["warn"]; w < 1 {
		t.Errorf("%d claim-failure warnings, want the timeout logged as one", w)
	}
	if rec.n.Load() != 0 {
		t.Fatal("a delivery while the table was locked")
	}
	e.waitNoLockWaiters(t)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	// The lane's next try is at most 2s away.
	waitFor(t, 10*time.Second, "the message, once the lock is gone", func() bool { return rec.n.Load() == 1 })
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if a := rec.calls[0].Attempt; a != 1 {
		t.Errorf("delivered on attempt %d, want 1: a cancelled claim spent one", a)
	}
}

// TestClaimOnSilentLinkTimesOut: a claim pass whose connection stops
// answering (the server's replies held back, as on a link that went
// silent) is cancelled after StatementTimeout. The server had already run
// and committed it, so, as docs/guarantees.md says, its message stays
// leased with an attempt spent and comes back at the lease's end: it is
// delivered once, on attempt 2, not lost and not twice.
func TestClaimOnSilentLinkTimesOut(t *testing.T) {
	const vt = 3 * time.Second
	e := newEnv(t)
	rec := &recorder{}
	mux := bellhop.NewMux()
	e.consumer(t, bellhop.ConsumerSpec{Queue: "silent", VisibilityTimeout: vt})
	mux.Handle("app", "silent", rec)
	var silent atomic.Bool
	link := silentLink(t, e.dsn, &silent)
	logs := &syncBuffer{}
	obs := &pollObserver{}
	// The poll tells the reclaimer of the lease whose claim's answer was
	// never read.
	startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, Observer: obs, PollInterval: time.Second,
		StatementTimeout: 500 * time.Millisecond, Logger: zerolog.New(logs)}, link)
	// Just after a poll: the reload after the listener connected is done
	// (the control loop runs one step at a time), and the next poll is a
	// second away.
	polls := obs.polls.Load()
	waitFor(t, 5*time.Second, "a poll", func() bool { return obs.polls.Load() > polls })
	// A connection that runs a statement from now on hears nothing back;
	// the listener runs none, so the notification still wakes the lane,
	// and its claim reaches the server.
	silent.Store(true)
	id := e.enqueue(t, "silent", "unanswered", bellhop.EnqueueOptions{})
	waitFor(t, 5*time.Second, "a claim failure that names the timeout", func() bool {
		return lineWith(logs, `"claim failed`, "no answer within 500ms")
	})
	silent.Store(false)
	var claimedAt time.Time
	var attempt int
	if err := e.pool.QueryRow(context.Background(), `SELECT claimed_at, attempt FROM queue_messages WHERE id = $1 AND claim_token IS NOT NULL`, id).Scan(&claimedAt, &attempt); err != nil {
		t.Fatalf("the message after the cancelled pass: %v; want it leased by that pass", err)
	}
	if attempt != 1 {
		t.Errorf("attempt %d after the cancelled pass, want 1", attempt)
	}
	if n := rec.n.Load(); n != 0 {
		t.Fatalf("%d deliveries of a claim whose answer never came", n)
	}
	waitFor(t, 15*time.Second, "the message, back after its lease", func() bool { return rec.n.Load() == 1 })
	for _, d := range rec.deliveries() {
		if d.Attempt != 2 {
			t.Errorf("delivered on attempt %d, want 2: the cancelled pass spent one", d.Attempt)
		}
		if end := claimedAt.Add(vt); d.Start.Before(end) {
			t.Errorf("delivered %s before the cancelled pass's lease ended", end.Sub(d.Start))
		}
	}
	waitFor(t, 5*time.Second, "the message acked", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1`, id) == 0
	})
	if n := rec.n.Load(); n != 1 {
		t.Errorf("%d deliveries, want 1", n)
	}
}

// TestSilentLinkStallsNoControlStep: while the pool's connections stop
// answering, a fallback poll and a consumer reload are cancelled after
// StatementTimeout and logged as failed, instead of waiting for an
// answer that never comes (until the kernel gives up on the connection,
// in real life); once the link answers again, polls go on and the reload
// is retried, so the new consumer's messages are delivered.
func TestSilentLinkStallsNoControlStep(t *testing.T) {
	e := newEnv(t)
	var silent atomic.Bool
	link := silentLink(t, e.dsn, &silent)
	logs := &syncBuffer{}
	obs := &pollObserver{}
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "later", rec)
	startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, Observer: obs, PollInterval: 200 * time.Millisecond,
		StatementTimeout: 500 * time.Millisecond, Logger: zerolog.New(logs)}, link)
	waitFor(t, 10*time.Second, "a first poll", func() bool { return obs.polls.Load() >= 1 })

	silent.Store(true)
	waitFor(t, 10*time.Second, "a poll that failed for its timeout", func() bool {
		return lineWith(logs, `"fallback poll failed"`, "no answer within 500ms")
	})
	// The consumer's notification reaches the listener, which runs no
	// statement; the reload it asks for gets no answer.
	e.consumer(t, bellhop.ConsumerSpec{Queue: "later"})
	waitFor(t, 10*time.Second, "a reload that failed for its timeout", func() bool {
		return lineWith(logs, `"reloading consumers failed"`, "no answer within 500ms")
	})
	silent.Store(false)

	polls := obs.polls.Load()
	waitFor(t, 10*time.Second, "polls again", func() bool { return obs.polls.Load() >= polls+2 })
	e.enqueue(t, "later", 1, bellhop.EnqueueOptions{})
	waitFor(t, 10*time.Second, "the new consumer's message, once the reload is retried", func() bool { return rec.n.Load() == 1 })
}

// TestSilentLinkStallsNoLane: a statement that a lane runs around its
// claims (its busy mark and busy key, its offer for leasing at INSERT)
// and that never gets an answer is cancelled after StatementTimeout and
// logged, and the lane goes on serving its queue once the link answers.
// Unbounded, it waited until the kernel gave up on the connection: the
// lane meanwhile claimed nothing, and a stuck busy key statement held the
// lock connection, for which every lane's claim waits.
func TestSilentLinkStallsNoLane(t *testing.T) {
	const backlog = 3
	for _, tc := range []struct {
		name   string
		sql    string // the statement whose connection goes silent
		offers bool   // LeaseAtInsert
		line   string // the message of the line that reports it
		err    string // in its error
		pause  bool   // pause the consumer, then resume it
	}{
		// A backlog's second pass takes the busy key.
		{"busy key taken", queries.BusyHold, false, "could not take the busy lock", "hold:", false},
		// Once the backlog is drained, the lane gives the key back and
		// deletes its mark.
		{"busy key given back", queries.BusyRelease, false, "could not release the busy lock", "release:", false},
		{"busy mark deleted", queries.BusyUnmark, false, "claim failed", "unmark", false},
		// An idle lane puts a token on offer, and withdraws it when its
		// consumer is paused.
		{"offer made", queries.OfferMake, true, "could not make an offer", "", false},
		{"offer withdrawn", queries.OfferDrop, true, "could not withdraw offers", "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			c := e.consumer(t, bellhop.ConsumerSpec{Queue: "q", MaxInFlight: 1})
			rec := &recorder{}
			mux := bellhop.NewMux()
			mux.Handle("app", "q", rec)
			for i := range backlog {
				e.enqueue(t, "q", i, bellhop.EnqueueOptions{})
			}
			// The statement's text up to its first argument, which the
			// driver rewrites.
			head, _, _ := strings.Cut(tc.sql, "@")
			var armed atomic.Bool
			armed.Store(true)
			link := deadOn(t, e.dsn, func(sql string) bool { return armed.Load() && strings.HasPrefix(sql, head) })
			logs := &syncBuffer{}
			// The busy key's session would end after BusyLease idle
			// (idle_session_timeout), and its connection with it, which on
			// a path that went dead the client would never hear of.
			startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, LeaseAtInsert: tc.offers, BusyLease: time.Minute,
				StatementTimeout: 500 * time.Millisecond, Logger: zerolog.New(logs).With().Timestamp().Logger()}, link)
			t.Cleanup(func() {
				if t.Failed() {
					t.Logf("the dispatcher's log:\n%s", logs.String())
				}
			})
			if tc.pause {
				waitFor(t, 10*time.Second, "the backlog delivered", func() bool { return rec.n.Load() == backlog })
				waitFor(t, 10*time.Second, "an offer", func() bool { return e.count(t, `SELECT count(*) FROM bellhop_offers`) > 0 })
				if err := e.client.SetConsumerEnabled(context.Background(), "app", c.ID, false); err != nil {
					t.Fatal(err)
				}
			}
			waitFor(t, 10*time.Second, "a line that names the timeout", func() bool {
				return lineWith(logs, `"`+tc.line, "no answer within 500ms", tc.err)
			})
			armed.Store(false)
			if tc.pause {
				if err := e.client.SetConsumerEnabled(context.Background(), "app", c.ID, true); err != nil {
					t.Fatal(err)
				}
			}
			// The first may find a statement's work done on the server (an
			// offer made) and so be delivered without the lane; the second
			// needs the lane.
			for i := range 2 {
				e.enqueue(t, "q", "after", bellhop.EnqueueOptions{})
				want := int32(backlog + i + 1)
				waitFor(t, 15*time.Second, fmt.Sprintf("message %d of 2 enqueued after the link answers again", i+1), func() bool { return rec.n.Load() == want })
			}
		})
	}
}

// TestSilentLinkStallsNoReclaim: a reclaim pass that never gets an
// answer is cancelled after StatementTimeout, logged and tried again; once
// the link answers, a lease left by a dispatcher that died comes back and
// its message is delivered. Unbounded, the pass waited until the kernel
// gave up on the connection, and no lease came back meanwhile.
func TestSilentLinkStallsNoReclaim(t *testing.T) {
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "q"})
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "q", rec)
	id := e.enqueue(t, "q", 1, bellhop.EnqueueOptions{})
	// Leased an hour ago, by a dispatcher that is gone.
	if _, err := e.pool.Exec(context.Background(), `UPDATE queue_messages
		SET claim_token = gen_random_uuid(), claimed_at = now() - interval '1 hour', attempt = 1 WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	head, _, _ := strings.Cut(queries.Reclaim, "@")
	var armed atomic.Bool
	armed.Store(true)
	// Never reaching the server: a pass the server ran would release the
	// lease whether or not its answer came.
	link := cutOn(t, e.dsn, func(sql string) bool { return armed.Load() && strings.HasPrefix(sql, head) })
	logs := &syncBuffer{}
	startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, StatementTimeout: 500 * time.Millisecond,
		Logger: zerolog.New(logs)}, link)
	waitFor(t, 10*time.Second, "a reclaim pass that failed for its timeout", func() bool {
		return lineWith(logs, `"reclaim pass failed"`, "no answer within 500ms")
	})
	if n := e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NOT NULL`, id); n != 1 || rec.n.Load() != 0 {
		t.Fatalf("the lease came back (%d leased, %d delivered) while no pass reached the server", n, rec.n.Load())
	}
	armed.Store(false)
	waitFor(t, 15*time.Second, "the message, reclaimed and delivered", func() bool { return rec.n.Load() == 1 })
	if d := rec.deliveries()[0]; d.ID != id || d.Attempt != 2 {
		t.Errorf("delivered %s on attempt %d, want %s on attempt 2", d.ID, d.Attempt, id)
	}
}

// TestLastFiredSurvivesAFailedUpdate: the once-a-second update of the
// consumers' last_fired_at that does not answer in time (here it waits
// for a row lock) is cancelled, and its consumers are written with the
// next one, rather than dropped: a consumer delivered to once would
// otherwise never show it.
func TestLastFiredSurvivesAFailedUpdate(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	c := e.consumer(t, bellhop.ConsumerSpec{Queue: "q"})
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "q", rec)
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT FROM queue_trigger_details WHERE trigger_id = $1 FOR NO KEY UPDATE`, c.ID); err != nil {
		t.Fatal(err)
	}
	logs := &syncBuffer{}
	startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, StatementTimeout: 500 * time.Millisecond,
		Logger: zerolog.New(logs)}, nil)
	e.enqueue(t, "q", 1, bellhop.EnqueueOptions{})
	waitFor(t, 10*time.Second, "the message delivered", func() bool { return rec.n.Load() == 1 })
	// Two: the second tries again what the first failed to write. (Were
	// the first's work done despite its cancel, the column would be set
	// without the retry.)
	waitFor(t, 10*time.Second, "two updates that failed for their timeout", func() bool {
		n := 0
		for line := range strings.Lines(logs.String()) {
			if strings.Contains(line, `"updating last_fired_at failed`) && strings.Contains(line, "no answer within 500ms") {
				n++
			}
		}
		return n >= 2
	})
	e.waitNoLockWaiters(t)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "last_fired_at written by a later update", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_trigger_details WHERE trigger_id = $1 AND last_fired_at IS NOT NULL`, c.ID) == 1
	})
}

// linesWith counts the lines of logs that contain every one of parts.
func linesWith(logs *syncBuffer, parts ...string) int {
	n := 0
	for line := range strings.Lines(logs.String()) {
		if !slices.ContainsFunc(parts, func(p string) bool { return !strings.Contains(line, p) }) {
			n++
		}
	}
	return n
}

// lineWith reports whether a line of logs contains every one of parts.
func lineWith(logs *syncBuffer, parts ...string) bool { return linesWith(logs, parts...) > 0 }

// TestClaimFailuresBackOff: claims that keep failing (here a CHECK that
// refuses every lease) are retried backing off from 1s, not every second,
// and the warning is written once for every lane, not once per lane per
// try. A notification still wakes a lane at once: once the failure ends,
// the next message of a queue is delivered without waiting out the
// backoff.
func TestClaimFailuresBackOff(t *testing.T) {
	const queues = 4
	e := newEnv(t)
	ctx := context.Background()
	rec := &recorder{}
	mux := bellhop.NewMux()
	for i := range queues {
		q := fmt.Sprintf("q%d", i)
		e.consumer(t, bellhop.ConsumerSpec{Queue: q})
		mux.Handle("app", q, rec)
		e.enqueue(t, q, i, bellhop.EnqueueOptions{})
	}
	if _, err := e.pool.Exec(ctx, `ALTER TABLE queue_messages ADD CONSTRAINT no_leases CHECK (claim_token IS NULL) NOT VALID`); err != nil {
		t.Fatal(err)
	}
	logs := &syncBuffer{}
	cc := &claimCounter{}
	startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour,
		Logger: zerolog.New(logs)}, func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = cc })
	waitFor(t, 10*time.Second, "the first claims", func() bool { return cc.queue.Load() >= queues })
	first := time.Now()
	// Four retries each: at 1s apart 4s; backing off, at least
	// 0.5 + 1 + 2 + 4s.
	waitFor(t, 40*time.Second, "four retries of every queue", func() bool { return cc.queue.Load() >= 5*queues })
	if d := time.Since(first); d < 6*time.Second {
		t.Errorf("four retries of %d failing queues in %s: not backing off", queues, d.Round(time.Millisecond))
	}
	if w := logLines(t, logs, "claim failed")["warn"]; w < 1 || w > 1+int(time.Since(first)/(10*time.Second)) {
		t.Errorf("%d claim-failure warnings in %s, want one every 10s", w, time.Since(first).Round(time.Millisecond))
	}
	if rec.n.Load() != 0 {
		t.Fatal("a delivery while every lease fails")
	}
	if _, err := e.pool.Exec(ctx, `ALTER TABLE queue_messages DROP CONSTRAINT no_leases`); err != nil {
		t.Fatal(err)
	}
	// The lanes' next tries are 4 to 10s away.
	e.enqueue(t, "q0", "after", bellhop.EnqueueOptions{})
	waitFor(t, 2*time.Second, "q0's new message, woken by its notification", func() bool {
		rec.mu.Lock()
		defer rec.mu.Unlock()
		return slices.ContainsFunc(rec.calls, func(d delivery) bool { return string(d.Payload) == `"after"` })
	})
}

// offerDrops counts the dispatcher's withdrawals of offers
// (sql/offer_drop.sql) that have finished.
type offerDrops struct{ n atomic.Int32 }

type offerDropKey struct{}

func (o *offerDrops) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if d.SQL == queries.OfferDrop {
		return context.WithValue(ctx, offerDropKey{}, true)
	}
	return ctx
}

func (o *offerDrops) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if ctx.Value(offerDropKey{}) != nil {
		o.n.Add(1)
	}
}

// TestLeasedReleaseWarning: a message leased at INSERT whose lease is
// heard of after its consumer was paused is released; when that release
// cannot be written (here a trigger refuses it), the warning names the
// app, the queue, the message and its attempt, like the other
// per-message lines. It named the message alone, which left whoever read
// it to find out which queue was affected.
func TestLeasedReleaseWarning(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	cons := e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	logs := &syncBuffer{}
	drops := &offerDrops{}
	d := startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, LeaseAtInsert: true, PollInterval: time.Hour,
		Logger: zerolog.New(io.MultiWriter(logs, zerolog.NewTestWriter(t)))},
		func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = drops })
	e.enqueue(t, "orders", "first", bellhop.EnqueueOptions{})
	waitFor(t, 10*time.Second, "an offer after the first delivery", func() bool { return e.offers(t) == 1 })
	// A release clears a leased message's claim_token.
	for _, sql := range []string{
		`CREATE FUNCTION refuse_release() RETURNS trigger LANGUAGE plpgsql AS $$
		 BEGIN RAISE EXCEPTION 'release refused by the test'; END $$`,
		`CREATE TRIGGER refuse_release BEFORE UPDATE ON queue_messages FOR EACH ROW
		 WHEN (OLD.claim_token IS NOT NULL AND NEW.claim_token IS NULL) EXECUTE FUNCTION refuse_release()`,
	} {
		if _, err := e.pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}

	// A producer leases its message (on its third attempt) under the
	// offer, and holds the offer until it commits.
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var id uuid.UUID
	if err := tx.QueryRow(ctx, `INSERT INTO queue_messages (app_id, queue_name, payload, attempt, max_attempts)
		VALUES ($1, 'orders', '"paused"', 2, 5) RETURNING id`, cons.AppID).Scan(&id); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SET CONSTRAINTS queue_messages_notify IMMEDIATE`); err != nil {
		t.Fatal(err)
	}
	var attempt int
	if err := tx.QueryRow(ctx, `SELECT attempt FROM queue_messages WHERE id = $1 AND claim_token IS NOT NULL`, id).Scan(&attempt); err != nil || attempt != 3 {
		t.Fatalf("the producer did not lease its message as attempt 3 (attempt %d, %v); the test needs it to", attempt, err)
	}
	if err := e.client.SetConsumerEnabled(ctx, "app", cons.ID, false); err != nil {
		t.Fatal(err)
	}
	// The paused lane withdraws its offer once it has read the pause; the
	// producer's lock makes the withdrawal skip it.
	waitFor(t, 10*time.Second, "the paused lane's withdrawal", func() bool { return drops.n.Load() >= 1 })
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	const msg = "could not release a leased message; it comes back after its lease"
	var warning map[string]any
	waitFor(t, 20*time.Second, "the warning", func() bool { // the completer tries five times first
		for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
			var l map[string]any
			if err := json.Unmarshal([]byte(line), &l); err != nil {
				t.Fatalf("log line %q: %v", line, err)
			}
			if l["message"] == msg {
				warning = l
				return true
			}
		}
		return false
	})
	for field, want := range map[string]any{
		"level":      "warn",
		"app_id":     cons.AppID.String(),
		"queue":      "orders",
		"message_id": id.String(),
		"attempt":    float64(3), // a JSON number
	} {
		if got, ok := warning[field]; !ok || got != want {
			t.Errorf("%s = %v, want %v, in %v", field, got, want, warning)
		}
	}
	if got, _ := warning["error"].(string); !strings.Contains(got, "release refused by the test") {
		t.Errorf("error %q, want the trigger's", got)
	}
	if st := d.LeaseStats(); st.Leased != 1 || rec.n.Load() != 1 {
		t.Errorf("LeaseStats %+v, %d deliveries; want the lease heard of and not delivered", st, rec.n.Load())
	}
}

// TestRemovedInvokeDeliveryLogged: an invoke delivery removed with its
// consumer while its handler ran finds no row to ack. Its warning says
// that the delivery may have been removed with its consumer, not only
// that it may be delivered again, which it will not be, and names the
// source and the consumer. Found by review: the line said the message may
// be delivered again, and logged queue "" and no consumer id.
func TestRemovedInvokeDeliveryLogged(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	cons := e.consumer(t, bellhop.ConsumerSpec{Queue: "jobs"})
	started, release := make(chan struct{}, 1), make(chan struct{})
	mux := bellhop.NewMux()
	mux.Handle("app", "jobs", bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error {
		started <- struct{}{}
		<-release
		return nil
	}))
	logs := &syncBuffer{}
	startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour,
		Logger: zerolog.New(logs).Level(zerolog.DebugLevel)}, nil)
	id, err := e.client.InvokeAsync(ctx, cons.ID, []byte(`1`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the invoke delivery did not start within 10s")
	}
	if err := e.client.RemoveConsumer(ctx, "app", cons.ID); err != nil {
		t.Fatal(err)
	}
	if n := e.count(t, `SELECT count(*) FROM outbox`); n != 0 {
		t.Fatalf("%d outbox rows after the removal, want 0", n)
	}
	close(release)
	waitFor(t, 10*time.Second, "the unapplied ack's warning", func() bool {
		return lineWith(logs, `"level":"warn"`, `"message_id":"`+id.String()+`"`)
	})
	if !lineWith(logs, `"level":"warn"`, `"message_id":"`+id.String()+`"`, `"source":"invoke"`,
		`"consumer_id":"`+cons.ID.String()+`"`, "or the delivery was removed with its consumer") {
		t.Errorf("the warning does not say the delivery may have been removed with its consumer, or lacks source or consumer_id:\n%s", logs.String())
	}
	if lineWith(logs, `"message_id":"`+id.String()+`"`, "the message may be delivered again") {
		t.Errorf("a line says the removed delivery may be delivered again:\n%s", logs.String())
	}
}

// TestWriteFailuresThrottled: deliveries whose outcomes cannot be written
// (the database refuses connections once their handlers are running) log
// "could not record outcome" at error up to the lane's burst of 10 and
// then one a second, the rest at debug; the completer logs each failed try
// at debug and a batch given up on at warn, at most once every 10 s. Each
// of the 40 deliveries wrote an error line, and each try of each batch a
// warning.
func TestWriteFailuresThrottled(t *testing.T) {
	const n = 40
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", MaxInFlight: n, VisibilityTimeout: time.Minute})
	var started atomic.Int32
	release := make(chan struct{})
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error {
		started.Add(1)
		<-release
		return nil
	}))
	logs := &syncBuffer{}
	startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour,
		Logger: zerolog.New(logs).Level(zerolog.DebugLevel)}, nil)
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	if _, err := e.pool.Exec(context.Background(), `INSERT INTO queue_messages (app_id, queue_name, payload)
		SELECT id, 'orders', '{}' FROM apps, generate_series(1, $1::int)`, n); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "every handler started", func() bool { return started.Load() == n })

	// The database refuses connections from now until the test's end.
	ctx := context.Background()
	admin, err := pgx.Connect(ctx, pgtest.AdminConnString())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close(context.Background()) })
	name := e.pool.Config().ConnConfig.Database
	if _, err := admin.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{name}.Sanitize()+" ALLOW_CONNECTIONS false"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Before the dispatcher's stop (cleanups run last first).
		if _, err := admin.Exec(context.Background(), "ALTER DATABASE "+pgx.Identifier{name}.Sanitize()+" ALLOW_CONNECTIONS true"); err != nil {
			t.Error(err)
		}
	})
	if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1`, name); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "no session left", func() bool {
		var left int
		if err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = $1`, name).Scan(&left); err != nil {
			t.Fatal(err)
		}
		return left == 0
	})
	start := time.Now()
	close(release)
	const msg = "could not record outcome"
	var lines map[string]int
	waitFor(t, 60*time.Second, "every failed write logged", func() bool {
		lines = logLines(t, logs, msg)
		return lines["error"]+lines["debug"] == n
	})
	took := time.Since(start)
	if limit := 10 + int(took/time.Second) + 1; lines["error"] < 10 || lines["error"] > limit {
		t.Errorf("%d of %d failed writes logged at error (%v) in %s, want 10 to %d", lines["error"], n, lines, took.Round(time.Millisecond), limit)
	}
	tries := logLines(t, logs, "writing message outcomes failed")
	if limit := 1 + int(took/(10*time.Second)) + 1; tries["warn"] < 1 || tries["warn"] > limit || tries["debug"] < 4 {
		t.Errorf("failed writes of outcomes logged %v in %s, want 1 to %d warn, the other tries at debug", tries, took.Round(time.Millisecond), limit)
	}
}

// TestWriteFailedUnsentWording: an outcome that no try could send (the
// pool hands out no connection until the message's lease ends) is logged
// as not recorded, the message to come back after its lease, without the
// "unless a try did" of an outcome a failed try may have committed; the
// message does come back, and its next delivery is acked.
func TestWriteFailedUnsentWording(t *testing.T) {
	e := newEnv(t)
	const vt = 2 * time.Second
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", VisibilityTimeout: vt})
	var cut atomic.Bool
	noNet := errors.New("no network (test)")
	var calls atomic.Int32
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error {
		if calls.Add(1) == 1 {
			cut.Store(true) // from now on no statement gets a connection
			return errors.New("failed, to be retried")
		}
		return nil
	}))
	obs := &settledObserver{}
	logs := &syncBuffer{}
	startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, Observer: obs, PollInterval: time.Second,
		Logger: zerolog.New(logs)}, func(pc *pgxpool.Config) {
		pc.PrepareConn = func(context.Context, *pgx.Conn) (bool, error) {
			if cut.Load() {
				return true, noNet
			}
			return true, nil
		}
	})
	id := e.enqueue(t, "orders", 1, bellhop.EnqueueOptions{})
	if _, got, _ := obs.waitSettled(t, 1); got[bellhop.WriteFailed] != 1 {
		t.Fatalf("settled as %v, want write_failed", got)
	}
	if !lineWith(logs, `"message_id":"`+id.String()+`"`, "could not record outcome; the message will be delivered again after its lease") {
		t.Errorf("no line says the outcome was not recorded and the message comes back after its lease:\n%s", logs.String())
	}
	if lineWith(logs, "unless a try did") {
		t.Errorf("a line says a try may have recorded an outcome that no try sent:\n%s", logs.String())
	}
	cut.Store(false)
	if _, got, _ := obs.waitSettled(t, 2); got[bellhop.Acked] != 1 || calls.Load() != 2 {
		t.Errorf("after the outage: settled %v in %d deliveries, want the second acked", got, calls.Load())
	}
}
