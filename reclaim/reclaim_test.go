package reclaim

import (
	"context"
	"encoding/json"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/internal/syncbuf"
)

// Most of the reclaimer's tests are in claim/, beside the claims whose
// leases it returns. These need its retry timing shortened.

func TestMain(m *testing.M) { pgtest.Main(m) }

// failure is a "reclaim pass failed" log line: the timeout of the next
// pass and the wait before it, in milliseconds.
type failure struct {
	Timeout float64
	RetryIn float64
}

// failures returns the failures logged so far.
func failures(t *testing.T, logs *syncbuf.Buffer) []failure {
	t.Helper()
	var out []failure
	for _, line := range strings.Split(logs.String(), "\n") {
		if len(line) == 0 {
			continue
		}
		var l struct {
			Message string `json:"message"`
			Timeout string `json:"timeout"`
			RetryIn string `json:"retry_in"`
		}
		if err := json.Unmarshal([]byte(line), &l); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if l.Message != "reclaim pass failed" {
			continue
		}
		timeout, err := time.ParseDuration(l.Timeout)
		if err != nil {
			t.Fatalf("log line %q: timeout: %v", line, err)
		}
		retryIn, err := time.ParseDuration(l.RetryIn)
		if err != nil {
			t.Fatalf("log line %q: retry_in: %v", line, err)
		}
		ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
		out = append(out, failure{Timeout: ms(timeout), RetryIn: ms(retryIn)})
	}
	return out
}

// slowPasses returns a pool on a fresh database in which every reclaim
// pass runs body, in language, where it calls
// bellhop_start_seen_vt_floors(); quick_floors() is the original, and the
// sequence passes is there to count them.
func slowPasses(t *testing.T, language, body string) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.NewPool(t)
	if _, err := pool.Exec(context.Background(), `ALTER FUNCTION bellhop_start_seen_vt_floors() RENAME TO quick_floors;
		CREATE SEQUENCE passes;
		CREATE FUNCTION bellhop_start_seen_vt_floors() RETURNS bigint LANGUAGE `+language+`
		AS $$ `+body+` $$`); err != nil {
		t.Fatal(err)
	}
	return pool
}

// run runs r until the test ends.
func run(t *testing.T, r *Reclaimer) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
}

// TestGrowthAndRetryAreCapped: a pass that never answers in time (here
// each one sleeps 10 s on the server) is retried with its timeout doubled
// after each, up to 32 times Options.Timeout and no further, so that a
// pass on a dead connection is still cancelled within that bound; and the
// wait before each retry doubles up to the ceiling and no further, with
// jitter down to half. The retry timing is shortened from 1 – 30 s to
// 5 – 40 ms so that the test sees the caps within seconds.
func TestGrowthAndRetryAreCapped(t *testing.T) {
	t.Parallel()
	pool := slowPasses(t, "sql", `SELECT pg_sleep(10); SELECT quick_floors()`)
	logs := &syncbuf.Buffer{}
	base := 20 * time.Millisecond
	r := New(pool, zerolog.New(logs), Options{DefaultVT: 5 * time.Second, Timeout: base})
	r.retryBase, r.retryCeiling = 5*time.Millisecond, 40*time.Millisecond
	run(t, r)
	r.Observe(time.Now())

	// The timeouts after each failure: 40, 80 ... 640 ms, then 640 ms
	// again. The passes take about 3.3 s in all.
	const want = 9
	deadline := time.Now().Add(60 * time.Second)
	var got []failure
	for got = failures(t, logs); len(got) < want; got = failures(t, logs) {
		if time.Now().After(deadline) {
			t.Fatalf("%d failed passes logged within 60s, want %d", len(got), want)
		}
		time.Sleep(10 * time.Millisecond)
	}
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	for i, f := range got[:want] {
		wantTimeout := min(base<<(i+1), maxGrowth*base)
		if f.Timeout != ms(wantTimeout) {
			t.Errorf("failure %d: next timeout %gms, want %gms", i+1, f.Timeout, ms(wantTimeout))
		}
		// Retry i+1 waits base·2^i capped at the ceiling, of which a
		// random half is jitter.
		full := min(r.retryBase<<i, r.retryCeiling)
		if f.RetryIn < ms(full/2) || f.RetryIn > ms(full) {
			t.Errorf("failure %d: retry in %gms, want %g – %gms", i+1, f.RetryIn, ms(full/2), ms(full))
		}
	}
}

// TestPathSuspectResetsGrowth: after PathSuspect (the dispatcher dropped
// the pool's connections, none of which answered), the timeout that the
// timed-out passes doubled goes back to Options.Timeout: they may have
// waited on a dead connection, and it grew through an outage to 32 times
// Options.Timeout, which a pass on a connection still dead would then hold
// the expired leases for (found by the lifecycle review).
func TestPathSuspectResetsGrowth(t *testing.T) {
	t.Parallel()
	pool := slowPasses(t, "sql", `SELECT pg_sleep(10); SELECT quick_floors()`)
	logs := &syncbuf.Buffer{}
	base := 20 * time.Millisecond
	r := New(pool, zerolog.New(logs), Options{DefaultVT: 5 * time.Second, Timeout: base})
	r.retryBase, r.retryCeiling = 5*time.Millisecond, 10*time.Millisecond
	run(t, r)
	r.Observe(time.Now())
	atLeast := func(n int) []failure {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			if got := failures(t, logs); len(got) >= n {
				return got
			}
			if time.Now().After(deadline) {
				t.Fatalf("fewer than %d failed passes logged within 30s", n)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	// Grown to 160 ms after three timeouts.
	n := len(atLeast(3))
	r.PathSuspect()
	// The pass in flight, if any, ends with its grown timeout doubled;
	// the next one after it began at base again and ends with it doubled.
	got := atLeast(n + 2)
	if got[n].Timeout != ms(2*base) && got[n+1].Timeout != ms(2*base) {
		t.Errorf("the timeouts after the two failures that followed PathSuspect: %gms, %gms; want one of %gms (Options.Timeout, doubled)",
			got[n].Timeout, got[n+1].Timeout, ms(2*base))
	}
}

// TestRetryWaitsDespiteObserve: while passes fail, a lease end observed
// before the retry is due, during a pass or between passes, does not bring
// the retry forward. Every claim a dispatcher's lanes make observes its
// lease's end, so a pass that kept failing (a revoked grant, a broken
// function) was retried at each lease's end, not backing off, while its
// log line named a wait it did not keep.
func TestRetryWaitsDespiteObserve(t *testing.T) {
	t.Parallel()
	pool := slowPasses(t, "plpgsql", `BEGIN PERFORM pg_sleep(0.3); RAISE EXCEPTION 'broken (test)'; END`)
	logs := &syncbuf.Buffer{}
	r := New(pool, zerolog.New(logs), Options{DefaultVT: 5 * time.Second, Timeout: 5 * time.Second})
	r.retryBase, r.retryCeiling = 2*time.Second, 2*time.Second // a wait of 1 – 2 s
	run(t, r)
	// Leases ending 10 ms ahead, observed every 10 ms, as lanes claiming.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(10 * time.Millisecond):
				r.Observe(time.Now().Add(10 * time.Millisecond))
			}
		}
	}()
	// When each failure was logged, to within the 5 ms of the polling.
	var at []time.Time
	deadline := time.Now().Add(30 * time.Second)
	for len(at) < 4 {
		if time.Now().After(deadline) {
			t.Fatalf("%d failed passes within 30s, want 4", len(at))
		}
		for n := len(failures(t, logs)); len(at) < n; {
			at = append(at, time.Now())
		}
		time.Sleep(5 * time.Millisecond)
	}
	got := failures(t, logs)
	for i := 1; i < len(at); i++ {
		promised := time.Duration(got[i-1].RetryIn * float64(time.Millisecond))
		if gap := at[i].Sub(at[i-1]); gap < promised-20*time.Millisecond {
			t.Errorf("failure %d came %s after the one before, which said retry in %s", i+1, gap.Round(time.Millisecond), promised)
		}
	}
}

// TestGrownTimeoutKept: after a pass that needed a grown timeout
// succeeds, the passes after it get as long, rather than
// Options.Timeout again, at which every other pass ran out of time and
// was retried after a backoff. Each pass here takes 0.3 s on the server,
// over its 0.2 s Options.Timeout: the first runs out of time, and so may
// its retries on a loaded machine, each with twice the timeout before;
// once one succeeds, none runs out again. So each failure logs a longer
// timeout than the one before it; falling back to Options.Timeout after a
// success, the next failure logged 0.4 s again.
func TestGrownTimeoutKept(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := slowPasses(t, "sql", `SELECT nextval('passes'); SELECT pg_sleep(0.3); SELECT quick_floors()`)
	logs := &syncbuf.Buffer{}
	r := New(pool, zerolog.New(logs), Options{DefaultVT: 5 * time.Second, Timeout: 200 * time.Millisecond})
	r.retryBase, r.retryCeiling = 5*time.Millisecond, 10*time.Millisecond
	run(t, r)

	// Ask for a pass every 50 ms until four have begun after the last
	// failure logged: three of them at least have ended, after a success.
	deadline := time.Now().Add(60 * time.Second)
	var got []failure
	for {
		var began int
		if err := pool.QueryRow(ctx, `SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM passes`).Scan(&began); err != nil {
			t.Fatal(err)
		}
		got = failures(t, logs)
		if len(got) > 0 && began >= len(got)+4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d passes began within 60s, %d of them ran out of time", began, len(got))
		}
		r.Observe(time.Now())
		time.Sleep(50 * time.Millisecond)
	}
	for i := 1; i < len(got); i++ {
		if got[i].Timeout <= got[i-1].Timeout {
			t.Errorf("failure %d logged a timeout of %gms after %gms: the timeout fell back after a success; failures %+v",
				i+1, got[i].Timeout, got[i-1].Timeout, got)
		}
	}
}

// TestFullBatchFollowedAtOnce: a pass that filled its batch is followed by
// the next at once, not when the timer would start one. The timer's least
// wait is lengthened from 100 ms to 10 s, so that a second pass that came
// by the timer is told from one that came at once by seconds, which a
// loaded machine cannot blur.
func TestFullBatchFollowedAtOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.NewPool(t)
	if _, err := pool.Exec(ctx, `WITH a AS (INSERT INTO apps (name) VALUES ('app') RETURNING id)
		INSERT INTO queue_messages (app_id, queue_name, payload, claim_token, claimed_at, attempt)
		SELECT a.id, 'q', '{}', gen_random_uuid(), now() - interval '1 hour', 1 FROM a, generate_series(1, 25)`); err != nil {
		t.Fatal(err)
	}
	var passes, released atomic.Int64
	r := New(pool, zerolog.Nop(), Options{DefaultVT: 5 * time.Second, Batch: 10,
		OnPass: func(res Result) { passes.Add(1); released.Add(res.Released) }})
	r.rearm = 10 * time.Second
	run(t, r)
	r.Observe(time.Now())
	deadline := time.Now().Add(8 * time.Second)
	for released.Load() != 25 {
		if time.Now().After(deadline) {
			t.Fatalf("%d passes released %d of 25 expired leases within 8 s; want 3 passes, one after the other", passes.Load(), released.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n := passes.Load(); n != 3 {
		t.Errorf("%d passes released 25 leases in batches of 10, want 3", n)
	}
}
