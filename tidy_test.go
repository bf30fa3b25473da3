package bellhop

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/claim"
)

// stoppedLane is an invoke lane of a dispatcher that never runs, as a
// reload leaves it: its consumer's lanes stopped, none here serving it
// now. The dispatcher is marked stopping, so that hand-overs are kept in
// d.owed (handOverLater) instead of sent; tidyUp needs no database for an
// invoke lane. cancel stops the lane.
func stoppedLane(t *testing.T) (d *Dispatcher, l *lane, cancel context.CancelFunc) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig("postgres://nobody@localhost:1/none")
	if err != nil {
		t.Fatal(err)
	}
	d, err = NewDispatcher(cfg, DispatcherConfig{Resolver: resolverFunc(func(Consumer) Handler { return nil }), Logger: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	d.stopped = true
	ctx, cancel := context.WithCancel(context.Background())
	st := &consumerState{Consumer: Consumer{ID: uuid.New(), AppID: uuid.New(), Queue: "q", Enabled: true, MaxInFlight: 1}}
	l = newLane(ctx, d, st, claim.Target{Source: claim.Invoke, AppID: st.AppID, TriggerID: st.ID}, new(atomic.Int32))
	return d, l, cancel
}

// TestTidyUpHandsOverStoppedNackPass: a nack's pass (afterNack, the lane
// live) that a reload stops before it reads the retry's due time, or
// hands it over, leaves that to tidyUp: afterNack has returned, its
// wake-up taken by the lane. Found by review: neither did, and the retry
// waited for the other dispatchers' fallback poll.
func TestTidyUpHandsOverStoppedNackPass(t *testing.T) {
	d, l, cancel := stoppedLane(t)
	l.renacked.Store(true)           // afterNack, the lane live
	byNack := l.renacked.Swap(false) // the lane's run takes it
	cancel()                         // a reload stops the lane
	l.pass(l.ctx, false, byNack)     // which returns at once
	if l.renacked.Load() {
		t.Fatal("renacked set again: afterNack would hand over itself; the case is moot")
	}
	l.tidyUp()
	if len(d.owed) != 1 {
		t.Errorf("%d hand-overs for the stopped nack pass, want 1 (lane owed %t, timed %t)", len(d.owed), l.owed, l.timed.Load())
	}
}

// TestTidyUpTakesTheNackOnce: tidyUp of a lane whose timer was armed
// takes a pending nack's wake-up too (renacked), so that afterNack, which
// finds the lane stopped, does not hand it over a second time. It used
// to leave renacked set when the timer was.
func TestTidyUpTakesTheNackOnce(t *testing.T) {
	d, l, cancel := stoppedLane(t)
	l.timed.Store(true)
	l.renacked.Store(true) // afterNack, the lane live
	cancel()
	l.tidyUp()
	if len(d.owed) != 1 {
		t.Fatalf("%d hand-overs from tidyUp, want 1", len(d.owed))
	}
	if l.renacked.CompareAndSwap(true, false) { // afterNack, the lane stopped
		t.Error("renacked still set after tidyUp: afterNack hands the nack over again")
	}
}

// TestStoppedBeforeItsClaimKeepsTheHandOver: a nack's pass that a reload
// stops after it has begun but before its claim is sent (here as the
// busy lock's check before the claim tries to connect; as likely while
// the claim waits in the Combiner) gets an empty Pass, which reads no due
// time: the hand-over it owes stays for tidyUp. The empty Pass was taken
// for a claim that had read the due times: owed was cleared, and the
// retry waited for the other dispatchers' fallback poll.
func TestStoppedBeforeItsClaimKeepsTheHandOver(t *testing.T) {
	cfg, err := pgxpool.ParseConfig("postgres://nobody@localhost:1/none")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cfg.BeforeConnect = func(context.Context, *pgx.ConnConfig) error {
		cancel() // the reload stops the lane
		return errors.New("no connection (test)")
	}
	d, err := NewDispatcher(cfg, DispatcherConfig{Resolver: resolverFunc(func(Consumer) Handler { return nil }), Logger: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	// Hand-overs are kept in d.owed; the pool is Run's, which never runs
	// here.
	d.stopped = true
	if d.db, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.db.Close)
	d.claims = claim.NewCombiner(d.db, 1, 0)
	st := &consumerState{Consumer: Consumer{ID: uuid.New(), AppID: uuid.New(), Queue: "q", Enabled: true, MaxInFlight: 1}}
	l := newLane(ctx, d, st, claim.Target{Source: claim.Queue, AppID: st.AppID, Queue: "q"}, new(atomic.Int32))
	t.Cleanup(func() { l.timer.Stop() })
	l.settle = true // the check before the claim connects, which stops the lane
	l.pass(ctx, false, true)
	if ctx.Err() == nil {
		t.Fatal("the lane was not stopped during its pass; the case is moot")
	}
	if !l.owed {
		t.Error("owed cleared by a pass stopped before its claim was sent")
	}
	l.settle = false // settleGone would check the lock until it could, here for ever
	l.tidyUp()
	if len(d.owed) != 1 {
		t.Errorf("%d hand-overs for the stopped nack pass, want 1", len(d.owed))
	}
}

// TestStopTidiesALaneThatExitsAtTheFirstCancel: the two lanes of a
// consumer share one context, which stopping the queue lane cancels; the
// invoke lane's goroutine, seeing that, exits before its own stop is
// called, and must tidy up all the same. Found by review: it exited
// untidied and no goroutine was started for it, so the retry time only
// its timer knew was never handed over.
func TestStopTidiesALaneThatExitsAtTheFirstCancel(t *testing.T) {
	d, inv, cancel := stoppedLane(t)
	st := inv.state.Load()
	q := newLane(inv.ctx, d, st, claim.Target{Source: claim.Queue, AppID: st.AppID, Queue: st.Queue, TriggerID: st.ID}, new(atomic.Int32))
	q.running, inv.running = true, true // both goroutines in a pass
	inv.timed.Store(true)               // a nack's retry time only its timer knows
	var exited sync.Once
	cl := &consumerLanes{queue: q, invoke: inv, cancel: func() {
		cancel()
		exited.Do(inv.exitStopped) // the invoke goroutine sees it at once
	}}
	cl.stop(true)
	if len(d.owed) != 1 {
		t.Errorf("%d hand-overs from the stopped invoke lane, want 1", len(d.owed))
	}
}
