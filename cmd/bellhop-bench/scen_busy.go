package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
)

// busyModes are the producer-side settings compared while a dispatcher
// drains the queue: the trigger off (no notification at all), the trigger
// with busy marks (the default), and the trigger with marks disabled (every
// producer transaction notifies).
var busyModes = []struct {
	label        string
	trigger      bool
	disableMarks bool
}{
	{"trigger off", false, false},
	{"trigger on, busy marks", true, false},
	{"trigger on, busy marks disabled", true, true},
}

// busyCase names a case of scenario 6b.
func busyCase(p int, backlog bool, mode string) string {
	if backlog {
		return fmt.Sprintf("%d producers, dispatcher draining, %s", p, mode)
	}
	return fmt.Sprintf("%d producers, dispatcher keeping up (no backlog), %s", p, mode)
}

// runBusy measures issue 7's target: enqueue throughput of concurrent
// producers, one message per transaction, while a dispatcher drains the
// queue, with and without busy marks, against the trigger disabled.
//
// "Draining" cases put a backlog in front of the producers, so that the
// dispatcher works through the same stream of claims in every mode: with
// the trigger off it is not woken by notifications, and without a backlog
// it would sit idle and leave the whole machine to the producers. The
// "keeping up" cases start empty: the dispatcher claims what the
// producers commit as it comes (with the trigger off it only finds it at
// the fallback poll, so that mode is a bound, not a like-for-like figure).
func runBusy(ctx context.Context, e *env, run int) error {
	db, setup, err := e.queueDB(ctx, "busy", "p")
	if err != nil {
		return err
	}
	defer db.drop()
	defer setup.Close()
	type shape struct {
		producers int
		backlog   bool
	}
	// The backlog in front of the producers in the draining cases: more
	// than the dispatcher can claim in the producer duration, so that it
	// drains throughout, whether or not notifications wake it.
	backlog := e.p.busyBacklog
	modes := inRunOrder(run, busyModes)
	for _, s := range []shape{{8, true}, {32, true}, {32, false}} {
		for _, m := range modes {
			name := busyCase(s.producers, s.backlog, m.label)
			verb := "DISABLE"
			if m.trigger {
				verb = "ENABLE"
			}
			if _, err := setup.Exec(ctx, "ALTER TABLE queue_messages "+verb+" TRIGGER queue_messages_notify"); err != nil {
				return err
			}
			if _, err := setup.Exec(ctx, "TRUNCATE queue_messages"); err != nil {
				return err
			}
			n := 0
			if s.backlog {
				n = backlog
				if err := prefill(ctx, setup, []string{"p"}, n, 5000); err != nil {
					return fmt.Errorf("%s: prefill: %w", name, err)
				}
				if _, err := setup.Exec(ctx, "VACUUM ANALYZE queue_messages"); err != nil {
					return err
				}
			}
			// The prefill's WAL would otherwise bring a checkpoint, and its
			// full-page writes, into whichever case comes next.
			if err := e.checkpoint(ctx, setup, "busy", "before a case"); err != nil {
				return err
			}
			r, err := produceWhileDraining(ctx, e, db, setup, s.producers, m.disableMarks, s.backlog, e.evidenceRun(run))
			if err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			e.res.Add(Metric{Scenario: "busy", Case: name, Name: "enqueues/s (1 msg per transaction)", Unit: "msgs/s"}, rate(r.enqueued, r.elapsed))
			e.res.Add(Metric{Scenario: "busy", Case: name, Name: "acked while producing", Unit: "msgs/s"}, rate(int(r.acked), r.elapsed))
			if s.backlog {
				e.res.Add(Metric{Scenario: "busy", Case: name, Name: "backlog left when the producers stopped", Unit: "msgs"}, float64(r.left))
			}
			if e.evidenceRun(run) && s.producers == 32 {
				e.evidence.WaitEvents = append(e.evidence.WaitEvents, WaitSample{Case: "busy: " + name + " (evidence run), producers' sessions", Counts: r.waits})
			}
		}
	}
	if _, err := setup.Exec(ctx, "ALTER TABLE queue_messages ENABLE TRIGGER queue_messages_notify"); err != nil {
		return err
	}
	e.res.Note("busy", "one queue with a consumer served by a no-op Go handler (max in-flight 10) in a dispatcher in this process; producers as in scenario 6 for %s per case, each case after TRUNCATE (and the backlog, if any) and CHECKPOINT, the modes in reverse order in even runs; busy marks disabled with DispatcherConfig.DisableBusyMarks; the trigger disabled with ALTER TABLE ... DISABLE TRIGGER", e.p.producerDuration)
	e.res.Note("busy", "'acked while producing': the acks the dispatcher reported from the producers' start to the return of the last Enqueue, over that time, the window 'enqueues/s' is counted in")
	e.res.Note("busy", "'draining': %d messages enqueued (EnqueueMany, then VACUUM ANALYZE) before the dispatcher starts, so that it claims throughout in every mode; 'backlog left' counts those still there when the producers stop (0 would mean the dispatcher ran dry), counted right after the last Enqueue returns, while the dispatcher still runs, as the rows enqueued before the server's now() read just before the producers start (since 2026-12-07; before, after the dispatcher had stopped, against the client's clock). 'keeping up': no backlog; with the trigger off the dispatcher only finds messages at its fallback poll, so it does no work and that row is an upper bound", backlog)
	return nil
}

// drainRun is what produceWhileDraining measured.
type drainRun struct {
	enqueued int
	// acked is how many acks the dispatcher reported while the
	// producers ran: over elapsed, the window enqueued is counted in.
	acked   int64
	elapsed time.Duration
	// left is how much of the backlog was still queued as the last
	// producer returned (with a backlog only).
	left  int64
	waits map[string]int
}

// produceWhileDraining runs a dispatcher on db and p producers for the
// producer duration, and returns how many messages they enqueued. With
// backlog, it counts what is left of the backlog, on setup, right as the
// producers stop: the dispatcher drains on until it is stopped, which
// takes a while. sample samples the producers' wait events.
func produceWhileDraining(ctx context.Context, e *env, db *database, setup *pgxpool.Pool, p int, disableMarks, backlog, sample bool) (_ drainRun, err error) {
	obs := newObserver(0)
	d, err := e.startDispatcherWith(db.DSN, bellhop.DispatcherConfig{Resolver: every(noop), Observer: obs, DisableBusyMarks: disableMarks}, nil)
	if err != nil {
		return drainRun{}, err
	}
	defer d.stopInto(&err)
	if err := d.ready(ctx, 10*time.Second); err != nil {
		return drainRun{}, err
	}
	// The backlog's rows are those enqueued before the producers start,
	// by the server's clock, which set their enqueued_at: the client's
	// may differ from it (a DATABASE_URL on another host).
	var start time.Time
	var left int64
	var countLeft func() error
	if backlog {
		if err := setup.QueryRow(ctx, "SELECT now()").Scan(&start); err != nil {
			return drainRun{}, err
		}
		countLeft = func() (err error) {
			left, err = countBefore(ctx, setup, start)
			return err
		}
	}
	pr, err := produceFor(ctx, db, p, e.p.producerDuration, produceOpts{counter: obs.acked.Load, atEnd: countLeft, sampleWaits: sample})
	if err != nil {
		return drainRun{}, err
	}
	return drainRun{enqueued: pr.sent, acked: pr.counted, elapsed: pr.elapsed, left: left, waits: pr.waits}, nil
}

// countBefore counts the messages enqueued before t that are still queued.
func countBefore(ctx context.Context, pool *pgxpool.Pool, t time.Time) (int64, error) {
	var n int64
	err := pool.QueryRow(ctx, "SELECT count(*) FROM queue_messages WHERE enqueued_at < $1", t).Scan(&n)
	return n, err
}
