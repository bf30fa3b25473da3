package main

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bellhopq/bellhop"
)

func triggerLabel(on bool) string {
	if on {
		return "trigger on"
	}
	return "trigger off"
}

func producerCase(p int, on bool) string {
	s := "producers"
	if p == 1 {
		s = "producer"
	}
	return fmt.Sprintf("%d %s, %s", p, s, triggerLabel(on))
}

// runProducer measures what the notify trigger costs producers: enqueue
// throughput from concurrent producers, one message per transaction, and
// one large INSERT, with the trigger enabled and disabled. No dispatcher
// runs: the rows stay in the table (truncated between cases).
func runProducer(ctx context.Context, e *env, run int) error {
	db, setup, err := e.queueDB(ctx, "producer", "p")
	if err != nil {
		return err
	}
	defer db.drop()
	defer setup.Close()
	setTrigger := func(on bool) error {
		verb := "DISABLE"
		if on {
			verb = "ENABLE"
		}
		_, err := setup.Exec(ctx, "ALTER TABLE queue_messages "+verb+" TRIGGER queue_messages_notify")
		return err
	}
	reset := func() error {
		if _, err := setup.Exec(ctx, "TRUNCATE queue_messages"); err != nil {
			return err
		}
		return e.checkpoint(ctx, setup, "producer", "after the TRUNCATE before a case")
	}
	// Trigger on first in odd runs, off first in even ones, as the busy
	// scenario alternates its modes.
	order := inRunOrder(run, []bool{true, false})
	for _, p := range e.p.producerConcurrency {
		for _, on := range order {
			if err := setTrigger(on); err != nil {
				return err
			}
			if err := reset(); err != nil {
				return err
			}
			r, err := produceFor(ctx, db, p, e.p.producerDuration, produceOpts{sampleWaits: e.evidenceRun(run)})
			if err != nil {
				return fmt.Errorf("%s: %w", producerCase(p, on), err)
			}
			e.res.Add(Metric{Scenario: "producer", Case: producerCase(p, on), Name: "enqueues/s (1 msg per transaction)", Unit: "msgs/s"}, rate(r.sent, r.elapsed))
			if e.evidenceRun(run) {
				e.evidence.WaitEvents = append(e.evidence.WaitEvents, WaitSample{Case: "producer: " + producerCase(p, on) + " (evidence run), producers' sessions", Counts: r.waits})
			}
		}
	}
	for _, on := range order {
		if err := setTrigger(on); err != nil {
			return err
		}
		if err := reset(); err != nil {
			return err
		}
		d, err := bulkInsert(ctx, db, e.p.bulkRows)
		if err != nil {
			return err
		}
		e.res.Add(Metric{Scenario: "producer", Case: fmt.Sprintf("one %s-row INSERT, %s", groupThousands(fmt.Sprint(e.p.bulkRows)), triggerLabel(on)), Name: "duration incl. commit", Unit: "ms", LowerIsBetter: true}, float64(d.Microseconds())/1e3)
	}
	if err := setTrigger(true); err != nil {
		return err
	}
	e.res.Note("producer", "no dispatcher runs (nobody LISTENs; PostgreSQL still queues every notification); one queue with a registered consumer; each producer goroutine has its own connection and loops Client.Enqueue (one INSERT, one transaction, server default synchronous_commit) for %s; queue_messages is truncated (and CHECKPOINTed) before each case; for each producer count, and for the large INSERT, the trigger-on case runs first in odd runs and the trigger-off case first in even ones", e.p.producerDuration)
	e.res.Note("producer", "trigger off: ALTER TABLE queue_messages DISABLE TRIGGER queue_messages_notify; the large INSERT is one Client.EnqueueMany of %d messages to one queue (one statement, one notification)", e.p.bulkRows)
	return nil
}

// produced is what produceFor measured.
type produced struct {
	// sent is how many messages the producers enqueued in elapsed, the
	// exact time from their start to the return of the last.
	sent    int
	elapsed time.Duration
	// counted is how much the counter given to produceFor grew over
	// that same window.
	counted int64
	// waits are wait events of the producers' backends sampled every
	// 50ms, with produceOpts.sampleWaits.
	waits map[string]int
}

// produceOpts are what produceFor does besides producing.
type produceOpts struct {
	// counter, if not nil, is read right as the producers start and
	// right as the last returns, so that what it counts (the
	// dispatcher's acks, say) is over the window that elapsed measures,
	// not over the opening of the producers' pool before it or the wait
	// for the sampler after.
	counter func() int64
	// atEnd, if not nil, runs right after counter's second read, before
	// anything else can change what it looks at (the busy scenario's
	// count of the backlog left).
	atEnd func() error
	// sampleWaits samples the producers' wait events: a query of
	// pg_stat_activity every 50ms, beside the producers it watches, so
	// only the evidence run asks for it.
	sampleWaits bool
}

// produceFor runs p producers for d.
func produceFor(ctx context.Context, db *database, p int, d time.Duration, o produceOpts) (produced, error) {
	pool, err := openPool(ctx, db.DSN, p, map[string]string{"application_name": "bench-producer"})
	if err != nil {
		return produced{}, err
	}
	defer pool.Close()
	client := bellhop.NewClient(pool)
	var count atomic.Int64
	var firstErr error
	var once sync.Once
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	waits := map[string]int{}
	sampled := make(chan struct{})
	if o.sampleWaits {
		go func() {
			defer close(sampled)
			sampleWaits(rctx, db, "bench-producer", waits)
		}()
	} else {
		close(sampled)
	}
	counter := o.counter
	if counter == nil {
		counter = func() int64 { return 0 }
	}
	c0 := counter()
	start := time.Now()
	deadline := start.Add(d)
	var wg sync.WaitGroup
	for range p {
		wg.Go(func() {
			for time.Now().Before(deadline) {
				if _, err := client.Enqueue(rctx, benchApp, "p", []byte(`{"k":1}`), bellhop.EnqueueOptions{}); err != nil {
					once.Do(func() { firstErr = err })
					return
				}
				count.Add(1)
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	counted := counter() - c0
	if o.atEnd != nil && firstErr == nil {
		firstErr = o.atEnd()
	}
	cancel()
	<-sampled
	return produced{sent: int(count.Load()), elapsed: elapsed, counted: counted, waits: waits}, firstErr
}

// sampleWaits counts the wait events of db's sessions every 50ms until
// ctx ends: of the sessions named app, or, if app is "", of all, keyed
// by application name too.
func sampleWaits(ctx context.Context, db *database, app string, into map[string]int) {
	conn, err := pgx.Connect(ctx, db.s.adminDSN)
	if err != nil {
		return
	}
	defer conn.Close(context.Background())
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rows, err := conn.Query(ctx, `SELECT CASE WHEN $2 = '' THEN application_name || ' ' ELSE '' END
				|| coalesce(wait_event_type || ':' || wait_event, state)
			FROM pg_stat_activity
			WHERE datid = $1 AND ($2 = '' OR application_name = $2) AND pid <> pg_backend_pid()`, db.OID, app)
		if err != nil {
			return
		}
		for rows.Next() {
			var w string
			if rows.Scan(&w) == nil {
				into[w]++
			}
		}
		rows.Close()
	}
}

// bulkInsert times one EnqueueMany of n messages, commit included.
func bulkInsert(ctx context.Context, db *database, n int) (time.Duration, error) {
	pool, err := openPool(ctx, db.DSN, 1, nil)
	if err != nil {
		return 0, err
	}
	defer pool.Close()
	msgs := make([]bellhop.NewMessage, n)
	for i := range msgs {
		msgs[i] = bellhop.NewMessage{Queue: "p", Payload: []byte(`{"k":1}`)}
	}
	c := bellhop.NewClient(pool)
	// One small batch first, so that the statement is prepared and the
	// plan cached, as for a producer that runs for a while.
	if _, err := c.EnqueueMany(ctx, benchApp, msgs[:10]); err != nil {
		return 0, err
	}
	t0 := time.Now()
	if _, err := c.EnqueueMany(ctx, benchApp, msgs); err != nil {
		return 0, err
	}
	return time.Since(t0), nil
}

// WaitSample is the distribution of wait events sampled during a case.
type WaitSample struct {
	Case   string         `json:"case"`
	Counts map[string]int `json:"counts"`
}

// String lists w's wait events with their shares, most frequent first.
func (w WaitSample) String() string {
	type kv struct {
		k string
		v int
	}
	var all []kv
	total := 0
	for k, v := range w.Counts {
		all = append(all, kv{k, v})
		total += v
	}
	sort.Slice(all, func(i, j int) bool { return all[i].v > all[j].v || all[i].v == all[j].v && all[i].k < all[j].k })
	var parts []string
	for _, x := range all {
		parts = append(parts, fmt.Sprintf("%s %.0f%%", x.k, 100*float64(x.v)/float64(max(total, 1))))
	}
	return strings.Join(parts, ", ")
}
