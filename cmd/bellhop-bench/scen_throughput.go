package main

import (
	"context"
	"fmt"
	"os"
	"runtime/pprof"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
)

// throughputCase is one burn-down configuration.
type throughputCase struct {
	N, Queues, InFlight int
	// DuePercent of the messages, spread evenly, wait as due retries
	// do: a deliver_after just after their enqueued_at, passed before
	// the burn-down starts.
	DuePercent int
}

func (c throughputCase) String() string {
	q := "queues"
	if c.Queues == 1 {
		q = "queue"
	}
	s := fmt.Sprintf("%s msgs, %d %s, in-flight %s", groupThousands(fmt.Sprint(c.N)), c.Queues, q, groupThousands(fmt.Sprint(c.InFlight)))
	if c.DuePercent > 0 {
		s += fmt.Sprintf(", %d %% due retries", c.DuePercent)
	}
	return s
}

func (e *env) throughputCases() []throughputCase {
	var out []throughputCase
	for _, n := range e.p.throughputSizes {
		for _, q := range e.p.throughputQueues {
			for _, f := range e.p.throughputInFlight {
				out = append(out, throughputCase{N: n, Queues: q, InFlight: f})
			}
		}
	}
	return out
}

// Throughput metric names.
const (
	mToLast  = "msgs/s, start → last handler done"
	mToEmpty = "msgs/s, start → table empty"
)

// runThroughput burns down pre-inserted backlogs with a no-op handler.
func runThroughput(ctx context.Context, e *env, run int) error {
	// As the other scenarios do, so that a drift within a run does not
	// always fall on the same case.
	for _, c := range inRunOrder(run, e.throughputCases()) {
		if _, err := throughputOnce(ctx, e, run, c, reportAs{"throughput", c.String()}); err != nil {
			return fmt.Errorf("%s: %w", c, err)
		}
	}
	e.res.Note("throughput", "backlog inserted before the dispatcher starts with Client.EnqueueMany, %d messages per statement, round-robin over the queues, then VACUUM ANALYZE queue_messages and CHECKPOINT; the clock starts just before Dispatcher.Run (so it includes connecting, loading consumers and LISTEN); the cases run in reverse order in even runs (since 2026-12-07)", e.p.prefillBatch)
	e.res.Note("throughput", "'last handler done': the N-th no-op handler returned; 'table empty': the dispatcher's Observer reported the N-th ack written (checked afterwards: count(*) = 0)")
	e.res.Note("throughput", "dispatcher pool: pool_max_conns=%d; its sessions run with synchronous_commit=off (NewDispatcher sets it)", e.p.poolMaxConns)
	return nil
}

// throughputOnce burns down one backlog, reports its rates under at and
// returns the rate to the table's emptying. Only the throughput
// scenario's evidence run is profiled and has a statement window.
func throughputOnce(ctx context.Context, e *env, run int, c throughputCase, at reportAs) (_ float64, err error) {
	db, err := e.srv.newDatabase(ctx, "tput", true)
	if err != nil {
		return 0, err
	}
	defer db.drop()
	queues := queueNames(c.Queues)
	setup, err := openPool(ctx, db.DSN, 8, setupSession)
	if err != nil {
		return 0, err
	}
	defer setup.Close()
	if err := setupConsumers(ctx, setup, queues, bellhop.ConsumerSpec{MaxInFlight: c.InFlight}); err != nil {
		return 0, fmt.Errorf("setup: %w", err)
	}
	t0 := time.Now()
	if err := prefill(ctx, setup, queues, c.N, e.p.prefillBatch); err != nil {
		return 0, fmt.Errorf("prefill: %w", err)
	}
	e.res.Add(Metric{Scenario: at.scenario, Case: at.label, Name: fmt.Sprintf("pre-insert msgs/s (EnqueueMany ×%d, setup session)", e.p.prefillBatch), Unit: "msgs/s"}, rate(c.N, time.Since(t0)))
	if c.DuePercent > 0 {
		if err := makeDueRetries(ctx, setup, c.DuePercent); err != nil {
			return 0, fmt.Errorf("due retries: %w", err)
		}
	}
	if _, err := setup.Exec(ctx, "VACUUM ANALYZE queue_messages"); err != nil {
		return 0, err
	}
	if err := e.checkpoint(ctx, setup, at.scenario, "before the burn-down"); err != nil {
		return 0, err
	}
	setup.Close()

	var handled atomic.Int64
	var firstAt, lastAt atomic.Int64
	var start time.Time
	h := bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error {
		switch handled.Add(1) {
		case 1:
			firstAt.Store(int64(time.Since(start)))
		case int64(c.N):
			lastAt.Store(int64(time.Since(start)))
		}
		return nil
	})
	obs := newObserver(c.N)
	var stopProfile func()
	if e.cpuprofile != "" && e.evidenceRun(run) && at.scenario == "throughput" {
		if stopProfile, err = e.startProfile(fmt.Sprintf("%d-q%d-f%d", c.N, c.Queues, c.InFlight)); err != nil {
			return 0, err
		}
		defer func() {
			if stopProfile != nil {
				stopProfile()
			}
		}()
	}
	var stmts *stmtWindow
	if e.evidenceRun(run) && db.s.pss {
		stmts = &stmtWindow{e: e, db: db, scenario: at.scenario, label: at.scenario + ": " + at.label + " (evidence run)", top: 6}
		stmts.open(ctx)
	}
	start = time.Now()
	obs.start = start
	d, err := e.startDispatcher(db.DSN, every(h), obs)
	if err != nil {
		return 0, err
	}
	defer d.stopInto(&err)
	select {
	case <-obs.done:
	case <-ctx.Done():
		return 0, ctx.Err()
	case <-time.After(e.p.throughputTimeout):
		return 0, fmt.Errorf("timed out after %s: %d handled, %d acked", e.p.throughputTimeout, handled.Load(), obs.acked.Load())
	}
	empty := time.Duration(obs.emptyAt.Load())
	if stopProfile != nil {
		stopProfile()
		stopProfile = nil
	}
	last := time.Duration(lastAt.Load())
	if err := d.stop(); err != nil {
		return 0, err
	}
	var left int64
	check, err := openPool(ctx, db.DSN, 1, nil)
	if err != nil {
		return 0, err
	}
	defer check.Close()
	if err := check.QueryRow(ctx, "SELECT count(*) FROM queue_messages").Scan(&left); err != nil {
		return 0, err
	}
	if left != 0 || handled.Load() != int64(c.N) || obs.other.Load() != 0 {
		return 0, fmt.Errorf("after the burn-down: %d rows left, %d handled (want %d), %d non-ack outcomes", left, handled.Load(), c.N, obs.other.Load())
	}
	e.res.Add(Metric{Scenario: at.scenario, Case: at.label, Name: mToLast, Unit: "msgs/s"}, rate(c.N, last))
	e.res.Add(Metric{Scenario: at.scenario, Case: at.label, Name: mToEmpty, Unit: "msgs/s"}, rate(c.N, empty))
	e.res.Add(Metric{Scenario: at.scenario, Case: at.label, Name: "start → first handler", Unit: "ms", LowerIsBetter: true}, float64(firstAt.Load())/1e6)
	if stmts != nil {
		stmts.close(ctx)
	}
	return rate(c.N, empty), nil
}

// startProfile starts a CPU profile written to the -cpuprofile prefix
// plus ".<name>.pprof" and returns the function that stops it.
func (e *env) startProfile(name string) (func(), error) {
	path := fmt.Sprintf("%s.%s.pprof", strings.TrimSuffix(e.cpuprofile, ".pprof"), name)
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	e.evidence.Profiles = append(e.evidence.Profiles, path)
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}

// dueRetries turns percent of the prefill's messages, spread evenly by
// their number, into due retries: a claim since 0064 reads these from the
// delayed index, beside the immediate ones from the ready index, and
// takes those that became ready first. deliver_after is enqueued_at plus
// the message's number, plus one, in microseconds (at most a few tenths of a
// second), all passed before the burn-down starts; the merge of the two
// walks then alternates between them batch by batch of the prefill.
const dueRetries = `UPDATE queue_messages
SET deliver_after = enqueued_at + ((payload->>'n')::int + 1) * interval '1 microsecond'
WHERE (payload->>'n')::int * $1 % 100 < $1`

// makeDueRetries applies dueRetries and waits until the last of them is
// due.
func makeDueRetries(ctx context.Context, pool *pgxpool.Pool, percent int) error {
	if _, err := pool.Exec(ctx, dueRetries, percent); err != nil {
		return err
	}
	var wait time.Duration
	if err := pool.QueryRow(ctx, "SELECT coalesce(max(deliver_after) - clock_timestamp(), '0') FROM queue_messages").Scan(&wait); err != nil {
		return err
	}
	if wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// retriesCases are scenario 3b's: one queue, each in-flight limit, with
// none, half and all of the backlog due retries.
func (e *env) retriesCases() []throughputCase {
	var out []throughputCase
	for _, f := range e.p.throughputInFlight {
		for _, due := range []int{0, 50, 100} {
			out = append(out, throughputCase{N: e.p.retriesN, Queues: 1, InFlight: f, DuePercent: due})
		}
	}
	return out
}

// runRetries burns down backlogs of immediate messages mixed with due
// retries: a claim locks up to its limit in each of its two walks and
// takes the limit that became ready first, so a mixed backlog makes every
// claim lock up to twice what it takes.
func runRetries(ctx context.Context, e *env, run int) error {
	for _, c := range inRunOrder(run, e.retriesCases()) {
		if _, err := throughputOnce(ctx, e, run, c, reportAs{"retries", c.String()}); err != nil {
			return fmt.Errorf("%s: %w", c, err)
		}
	}
	e.res.Note("retries", "as scenario 3, on one queue; after the prefill and before VACUUM ANALYZE, the case's share of the messages (every other one for 50 %%) get deliver_after = enqueued_at + their number plus one in microseconds, so that they wait as due retries when the burn-down starts (it waits for the last to come due); the cases run in reverse order in even runs (since 2026-12-07); since 0064 a claim reads these from idx_queue_messages_delayed and the others from idx_queue_messages_ready")
	return nil
}
