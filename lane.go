package bellhop

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/internal/backoff"
	"github.com/bellhopq/bellhop/internal/busylock"
	"github.com/bellhopq/bellhop/internal/logthrottle"
	"github.com/bellhopq/bellhop/internal/timeout"
)

// consumerState is a consumer's settings and handler, swapped atomically
// when the consumer changes.
type consumerState struct {
	Consumer
	handler Handler
}

// lane claims and delivers one source of one consumer: its queue, or its
// invoke_async deliveries. At most one goroutine claims at a time, and
// only while there is something to do: a wake-up starts it, and it exits
// when none is pending, so that ten thousand idle queues cost no
// goroutines. Each delivery runs on its own goroutine.
type lane struct {
	d      *Dispatcher
	target claim.Target
	state  atomic.Pointer[consumerState]
	wake   chan struct{} // capacity 1: wake-ups coalesce
	ctx    context.Context

	// runMu guards running and orders a goroutine's exit against a
	// concurrent poke; stop takes it to cancel ctx, so that no goroutine
	// starts after the dispatcher waits for them.
	runMu   sync.Mutex
	running bool
	tidy    bool // set by stop: the lane gives up its mark and offers
	// tidied is closed once a lane stopped with tidy has done so. after,
	// set before the lane first runs, is the stopped lane of the same
	// queue whose tidying this one waits for: they share the busy key
	// and mark.
	tidied chan struct{}
	after  *lane
	// timer wakes the lane at the time its last pass asked for; fired
	// tells the pass that it was started by the timer. due is the next
	// due time (a retry's, a delayed message's) the lane's last claim
	// read, kept until a pass finds it reached: a pass that finds no free
	// slot reads nothing, and arms the timer for due instead, or, once it
	// is reached, owes the other dispatchers a hand-over (handOff), as
	// does the pass afterNack asked for (renacked) unless a claim of it
	// reads the retry's due time. owed keeps the hand-over until a pass
	// that finds no free slot sends it, at most one each handOffEvery
	// (handedAt, the last), or until a claim reads the due times itself.
	// due, owed and handedAt are touched only by the lane's goroutine.
	timer    *time.Timer
	fired    atomic.Bool
	due      time.Time
	renacked atomic.Bool
	owed     bool
	handedAt time.Time
	// timed is set while the timer is armed for a due time, and nacked
	// once the lane has nacked a message (whose retry time only this lane
	// hears of): a stop hands such lanes over to the other dispatchers
	// (Dispatcher.handOver).
	timed  atomic.Bool
	nacked atomic.Bool
	// emptyTimerWakes counts timer wake-ups in a row that found nothing
	// due, failures claim statements in a row that failed, and
	// checkFailures settle checks in a row that failed, the next not
	// before checkAt; touched only by the lane's goroutine. The checks
	// count apart from the claims, which succeed meanwhile.
	emptyTimerWakes int
	failures        int
	checkFailures   int
	checkAt         time.Time
	// refusedAt is when the last claim failed with an error the server
	// answered (a privilege revoked, a trigger's exception), zero once one
	// succeeds or fails otherwise; timerAt is when the timer was last set
	// to fire. Touched only by the lane's goroutine (refusedWait).
	refusedAt time.Time
	timerAt   time.Time
	// msgLog bounds the lane's per-message log lines (msgEvent).
	msgLog *logthrottle.Throttle

	// inFlight counts the slots taken, shared with sibling, the
	// consumer's other lane (queue and invoke deliveries): MaxInFlight
	// bounds the consumer's deliveries from both.
	inFlight *atomic.Int32
	sibling  *lane
	// heir is set on a lane stopped because its consumer moved to another
	// queue (by SQL): the consumer's new lanes, which took over inFlight,
	// since this lane's deliveries still hold slots there. The slots they
	// free wake the heir's lanes as a sibling's would (freeSlots).
	heir atomic.Pointer[consumerLanes]
	// delivering counts this lane's own deliveries, started and not yet
	// finished (quiet).
	delivering atomic.Int32
	// backlog is set when the lane stopped claiming because all its
	// slots were busy; the next slot freed, by either lane, wakes it.
	backlog atomic.Bool
	// draining is set while the lane is inside a claim pass; passes
	// counts the lane's wake-ups, and watched mirrors watching or busy
	// below (producers may be silent then), so that the fallback poll can
	// tell a lane that was truly idle.
	draining atomic.Bool
	passes   atomic.Uint64
	watched  atomic.Bool

	// Busy-mark state (queue lanes only), touched only by the lane's
	// goroutine: there is at most one at a time, and each hands over to
	// the next through runMu. See docs/busy-marks.md for the protocol.
	busy     bool      // draining: passes set or refresh this dispatcher's mark
	marked   bool      // a mark of ours may be live in the database
	markedAt time.Time // when our mark's lease was last set (our clock, before sending)
	lastHit  time.Time // end of the last pass that claimed something
	settle   bool      // producers may have skipped announcing: confirm the lock, then claim once more
	tries    int       // passes in a row that left ready rows locked by another claim
	// settleTries counts failed lock confirmations in a row (their
	// backoff), from the start of the settle.
	settleTries int
	needFree    bool // our busy key was lost, not released: settle also waits until it is free
	keyHeld     bool // the last settle check found the queue lock free but, with needFree, the busy key held
	refused     bool // the last Hold found the busy key taken (a producer testing it, or another dispatcher)
	watching    bool // another dispatcher's mark was seen: settle once it is gone
	// watchHint is set by a "b" notification: another dispatcher marked
	// the queue, so this lane must watch it even if its next pass comes
	// too late to see the mark.
	watchHint atomic.Bool

	// Leasing at INSERT (offers.go). claimReq is set by poke: the next
	// wake-up claims; offerPoke wakes the lane only to offer again.
	// offered: a token of this lane is on offer. pending holds leased
	// messages waiting for a free slot.
	claimReq atomic.Bool
	offered  atomic.Bool
	pendMu   sync.Mutex
	pending  []*claim.Message
}

// newLane returns a lane taking its slots from inFlight.
func newLane(ctx context.Context, d *Dispatcher, st *consumerState, t claim.Target, inFlight *atomic.Int32) *lane {
	l := &lane{d: d, target: t, wake: make(chan struct{}, 1), ctx: ctx, tidied: make(chan struct{}), inFlight: inFlight,
		msgLog: logthrottle.New(msgLogBurst, msgLogInterval)}
	l.state.Store(st)
	l.timer = time.AfterFunc(time.Hour, func() {
		l.fired.Store(true)
		l.poke()
	})
	l.timer.Stop()
	return l
}

// poke wakes the lane for one more claim pass, starting its goroutine if
// it has none; it never blocks.
func (l *lane) poke() {
	l.claimReq.Store(true)
	l.offerPoke()
}

// reoffer wakes the lane to make an offer if it has none: a slot was
// freed, and a full lane makes none.
func (l *lane) reoffer() {
	if l.d.cfg.LeaseAtInsert && l.target.Source == claim.Queue && !l.offered.Load() {
		l.offerPoke()
	}
}

// offerPoke wakes the lane without asking for a claim pass: it makes an
// offer if it wants one (offers.go).
func (l *lane) offerPoke() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
	l.runMu.Lock()
	defer l.runMu.Unlock()
	if l.running || l.ctx.Err() != nil {
		return
	}
	l.running = true
	l.d.lanesRun.Add(1)
	go l.run()
}

// stop ends the lane's claiming: cancel must cancel its ctx. Once stop
// returns, no new goroutine starts, except that with tidy a lane that
// has no goroutine starts one to give up its busy mark and offers (tidy);
// a running one does that as it exits.
func (l *lane) stop(cancel context.CancelFunc, tidy bool) {
	l.runMu.Lock()
	cancel()
	l.tidy = tidy
	if tidy && !l.running {
		l.running = true
		l.d.lanesRun.Add(1)
		go func() {
			defer l.d.lanesRun.Done()
			l.tidyUp()
		}()
	}
	l.runMu.Unlock()
	l.timer.Stop()
}

// setTidy tells the lane's goroutine whether to tidy up as it exits
// stopped, ahead of stop: see consumerLanes.stop.
func (l *lane) setTidy(tidy bool) {
	l.runMu.Lock()
	l.tidy = tidy
	l.runMu.Unlock()
}

// tidyUp runs on the lane's goroutine once its consumer is gone while the
// dispatcher runs on: a busy key kept would silence the queue's producers
// for as long as the process lives, and a mark or offer would outlive
// the lane until its lease or TTL ran out.
func (l *lane) tidyUp() {
	// Swapped first, whatever the rest says: afterNack, finding it set,
	// would hand the nack over a second time.
	renacked := l.renacked.Swap(false)
	if renacked || l.timed.Load() || l.owed || !l.due.IsZero() {
		// Its timer may have been armed for a due time only it knew (a
		// retry it nacked), the pass a nack asked for never ran, or ran
		// and was stopped before it read the due time or handed it over
		// (owed, due: the lane's goroutine has ended, so they are ours to
		// read): the lane serving the queue or outbox here now looks for
		// it, or, if none does, the other dispatchers are woken for it.
		l.d.pokeServing(l.target)
	}
	if l.target.Source != claim.Queue {
		return
	}
	if l.after != nil {
		// Never ran, so it holds nothing; but a lane started after it
		// waits for it, and must still wait for the one it waited for.
		<-l.after.tidied
		l.d.tidied(l)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	l.dropMark(ctx)
	l.withdraw(ctx)
	cancel()
	if l.held() {
		// The release was not sent (its turn on the lock connection came
		// too late): once more, since the key would keep the queue's
		// producers silent for as long as the dispatcher runs.
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		l.release(ctx)
		cancel()
	}
	// The lane that replaces this one may start now: it takes the busy
	// key afresh if it needs it.
	l.d.tidied(l)
	if l.settle {
		l.settleGone()
	}
}

// settleGone finishes the settle of a lane stopped while producers may
// have skipped announcing (they saw its busy key): once every producer
// that did has committed (the queue lock is free), it wakes every
// dispatcher for the queue, so that whichever serves it now, here or
// elsewhere, finds what they committed. The lane serving the queue now
// may have started before those commits, and would not look again.
//
// It gives up when the dispatcher stops, which does not wait for its
// statements. After a lost key (needFree) the check also wants the key
// free: while another session holds it (a dispatcher that now serves the
// queue), the lane checks once a second. A hand-over as a watch was
// tried instead and dropped: a lane that started serving the queue after
// it, once the key was gone, missed the message of a producer that had
// seen the key.
func (l *lane) settleGone() {
	for tries := 0; ; tries++ {
		ctx, cancel := l.goneContext()
		c, err := claim.TryBusyLock(ctx, l.d.db, l.target, l.needFree)
		ok := c.Locked
		if ok {
			err = l.d.wake(ctx, []claim.Target{l.target})
		}
		cancel()
		if ok && err == nil {
			return
		}
		if err != nil {
			l.d.log.Debug().Err(err).Str("app_id", l.target.AppID.String()).Str("queue", l.target.Queue).
				Msg("settling a stopped lane's queue failed; trying again")
		}
		// As a lane's own settle, but backing off to a second: a stream
		// of producers may keep the lock taken for a while.
		t := time.NewTimer(doubling(tries, time.Second))
		select {
		case <-l.d.stopping:
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// goneContext is the context of one statement of settleGone: 5s at most,
// and ended by the dispatcher's stop, which waits for the lane's
// goroutine (Dispatcher.stopLanes).
func (l *lane) goneContext() (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	go func() {
		select {
		case <-l.d.stopping:
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel
}

// quiet reports whether the lane is idle with nothing to wait for:
// nothing of its own in flight or waiting for a slot, not stopped for want
// of one (the sibling lane may hold them all), not claiming, no wake-up
// pending, not busy, and not watching another dispatcher's busy mark
// (producers are silent by design then).
// It also returns the lane's pass count, to tell later whether the lane
// ran in between.
func (l *lane) quiet() (bool, uint64) {
	l.pendMu.Lock()
	waiting := len(l.pending)
	l.pendMu.Unlock()
	idle := l.delivering.Load() == 0 && waiting == 0 && !l.backlog.Load() && !l.draining.Load() &&
		len(l.wake) == 0 && !l.watched.Load()
	return idle, l.passes.Load()
}

// run claims while wake-ups are pending, then exits.
func (l *lane) run() {
	defer l.d.lanesRun.Done()
	ctx := l.ctx
	if l.after != nil {
		select {
		case <-l.after.tidied:
			l.after = nil
		case <-ctx.Done():
			l.exitStopped()
			return
		}
	}
	for {
		select {
		case <-ctx.Done():
			l.exitStopped()
			return
		case <-l.wake:
		default:
			// Exit, unless a poke came in since the select: poke sends
			// before it looks at running, both under runMu here.
			l.runMu.Lock()
			if ctx.Err() != nil {
				l.runMu.Unlock()
				l.exitStopped()
				return
			}
			if len(l.wake) == 0 {
				l.running = false
				l.runMu.Unlock()
				return
			}
			l.runMu.Unlock()
			continue
		}
		byTimer := l.fired.Swap(false)
		byNack := l.renacked.Swap(false)
		if l.claimReq.Swap(false) || byTimer || byNack {
			if wait := l.refusedWait(); wait > 0 && !byTimer && !byNack {
				// Heard, and held back: a fallback poll meanwhile must not
				// count the queue's work as missed (Dispatcher.poll).
				l.passes.Add(1)
				l.passIn(wait)
			} else {
				l.pass(ctx, byTimer, byNack)
			}
		}
		if l.wantsOffer() {
			l.makeOffer(ctx)
		}
	}
}

// exitStopped ends the goroutine of a stopped lane. running stays set,
// so that stop starts no second goroutine to tidy up.
func (l *lane) exitStopped() {
	l.runMu.Lock()
	tidy := l.tidy
	l.runMu.Unlock()
	if tidy {
		l.tidyUp()
	}
}

// pass runs one wake-up's claims and sets the timer. byTimer says that
// the timer started it, byNack that afterNack did.
func (l *lane) pass(ctx context.Context, byTimer, byNack bool) {
	l.draining.Store(true)
	l.passes.Add(1)
	if byNack {
		// Owed unless a claim reads the retry's due time.
		l.owed = true
	}
	next, claimed, full := l.drain(ctx)
	if full && !l.due.IsZero() {
		// No claim read the due times: keep the one we know. Once it is
		// reached with no slot free, it is the other dispatchers' to
		// claim, and only we may know of it.
		if l.due.After(time.Now()) {
			next = l.due
		} else {
			l.owed, l.due = true, time.Time{}
		}
	}
	if l.owed && full && ctx.Err() == nil {
		if wait := handOffEvery - time.Since(l.handedAt); wait > 0 {
			// Sent when the period ends, if the lane is still full
			// then and no claim has read the due times.
			next = earliest(next, time.Now().Add(wait))
		} else {
			l.handOff(ctx)
			l.owed, l.handedAt = false, time.Now()
		}
	}
	l.watched.Store(l.watching || l.busy)
	l.draining.Store(false)
	// A due time that has already passed by our clock but found
	// nothing ready means the database's clock is behind ours:
	// back off instead of spinning.
	if byTimer && !claimed && !next.IsZero() && !next.After(time.Now()) {
		l.emptyTimerWakes++
		next = time.Now().Add(doubling(l.emptyTimerWakes, time.Second))
	} else if claimed || byTimer {
		l.emptyTimerWakes = 0
	}
	l.timed.Store(!next.IsZero())
	if !next.IsZero() {
		l.timer.Reset(time.Until(next))
		l.timerAt = next
	}
}

// refusedEvery is the least time between a claim that the server refused
// and a pass that a notification asks for (refusedWait).
const refusedEvery = time.Second

// refusedWait is how long a pass that a notification (or a slot freed, a
// reload) asks for waits: while the server refuses the lane's claims with
// an error of its own, such passes come at most once every refusedEvery.
// A claim that failed so fails again until someone mends the cause (a
// privilege revoked, say), and the backoff's timer alone did not bound it:
// each message enqueued woke the lane for one more failed claim, whose
// statement, 74 lines, the server logged each time (the lifecycle review
// counted 870 in 20 s at 50 messages a second). A connection lost is not
// such a failure: the next notification may find the database back. Nor is
// a refusal alone: one that does not last (a lock timeout, a check that a
// concurrent change upset) should not make the next message wait, so the
// hold begins with the second in a row, which a lasting cause brings at
// the next notification (TestBusyLaneClaimFailureReleasesKey, in
// integration/, wants such a message claimed when it is heard).
func (l *lane) refusedWait() time.Duration {
	if l.failures < 2 || l.refusedAt.IsZero() {
		return 0
	}
	return refusedEvery - time.Since(l.refusedAt)
}

// refused reports whether err is a claim's refusal by the server that will
// last until someone mends its cause: an error the server answered on a
// connection that stays (a privilege, a trigger's exception, a constraint,
// a broken function), not one of a server starting up, full, shutting down
// or cancelling (classes 08, 40, 53, 55, 57 and 58), which may pass by the
// next notification, nor one of a connection that could not be made (a
// ConnectError carries the server's FATAL error) or was lost.
func refused(err error) bool {
	var pgErr *pgconn.PgError
	var connectErr *pgconn.ConnectError
	if !errors.As(err, &pgErr) || errors.As(err, &connectErr) || connLost(err) || len(pgErr.Code) < 2 {
		return false
	}
	switch pgErr.Code[:2] {
	case "08", "40", "53", "55", "57", "58":
		return false
	}
	return true
}

// passIn has the timer fire in wait, unless it is set to fire sooner, so
// that a pass refusedWait held back still comes.
func (l *lane) passIn(wait time.Duration) {
	at := time.Now().Add(wait)
	if l.timerAt.After(time.Now()) && l.timerAt.Before(at) {
		return
	}
	l.timer.Reset(wait)
	l.timerAt = at
}

// handOffEvery is the least time between two hand-overs of a lane (handOff).
const handOffEvery = time.Second

// settleQuickTries is how many failed settle checks a lane retries within
// 20 ms (the first 2, 4, 8 and 16 ms apart) before it backs off, doubling
// from 40 ms to a second: about 150 ms of quick tries.
const settleQuickTries = 10

// handOff wakes every dispatcher, this one included, for the lane's queue
// or invoke deliveries (sql/hand_over.sql), when the lane may be the only
// one to know of a due time it cannot serve: a pass found all the
// consumer's slots taken once the due time the lane's last claim read
// (due) was reached, or before any claim read the due time of a retry
// nacked since (afterNack). A nack sends no notification, so only this
// lane knows when
// the retry is due, and its slots can stay taken (by the consumer's other
// lane, or by messages leased to it at INSERT) while the other
// dispatchers' lanes, with slots to spare, never run a pass: the retry
// waited for a slot here or for their fallback poll, which counted it as
// a missed notification. Woken, each of them claims what is due or arms a
// timer of its own for it. This lane's pass on its own notification finds
// no free slot either, but the due time it handed over is forgotten and
// renacked is not set for it, so it hands nothing over again: one
// notification per due time reached or nack. A lane that stays full arms
// its timer for the due time it knows, if one is ahead, and for nothing
// else: its extra wake-ups run no statement, and the next slot freed
// wakes it (backlog), to claim and read the due times afresh.
// A lane hands over at most once each handOffEvery: under load, with a
// failing consumer and a backlog, nearly every nack's pass finds the slots
// taken (measured: 515 hand-overs for 3,000 nacks of 5 ms handlers at
// in-flight 10), while one hand-over is enough for the other dispatchers'
// lanes with free slots to arm timers of their own from then on. One owed
// meanwhile is sent by the first pass from the period's end that finds no
// free slot, unless a claim reads the due times first.
// Nacks do not notify at commit instead (nack.sql): every nack would then
// take the notification lock and wake a claim pass on every dispatcher,
// though the nacking lane nearly always has a slot for its own retry, and
// a failing consumer under load nacks at the rate it is delivered to.
func (l *lane) handOff(ctx context.Context) {
	bctx, cancel := l.d.bound(ctx)
	defer cancel()
	if err := l.d.wake(bctx, []claim.Target{l.target}); err != nil && !timeout.Stopping(bctx) {
		l.d.log.Debug().Err(timeout.Explain(bctx, err)).Str("app_id", l.target.AppID.String()).Str("queue", l.state.Load().Queue).
			Stringer("source", l.target.Source).Str("consumer_id", l.target.TriggerID.String()).
			Msg("could not hand a due time over to the other dispatchers; it waits for a free slot or their fallback poll")
	}
}

// drain claims until the lane's slots are full or nothing is ready. It
// returns when it wants to look again on its own (zero: only when woken):
// the next due time, the end of another dispatcher's busy mark, or a retry.
// claimed reports whether it claimed anything, full that it stopped
// because no slot was free. Each claim sets l.due to the next due time it
// read, and clears l.owed: it read the due times itself.
func (l *lane) drain(ctx context.Context) (next time.Time, claimed, full bool) {
	marks := l.target.Source == claim.Queue && !l.d.cfg.DisableBusyMarks
	for ctx.Err() == nil {
		st := l.state.Load()
		if !st.Enabled {
			l.dropMark(ctx)
			l.withdraw(ctx)
			l.releasePending()
			return time.Time{}, claimed, false
		}
		if l.inFlight.Load() > 0 {
			// Deliveries are finishing (one of them may have woken us):
			// let those that are ready to run finish first, so that
			// this pass claims for all the slots they free, not one.
			runtime.Gosched()
		}
		l.backlog.Store(true)
		free := st.MaxInFlight - int(l.inFlight.Load())
		if free <= 0 {
			// A finishing delivery pokes us. A busy lane keeps its key
			// meanwhile: other dispatchers' watch passes find what its
			// silent producers commit (docs/busy-marks.md, step 2). A due
			// time only we may know goes to the others (pass, handOff).
			return time.Time{}, claimed, true
		}
		l.backlog.Store(false)
		if !l.busy && l.held() {
			// A release that could not be sent left the key held
			// (busylock.Release): give it back before the check, which
			// cannot succeed while we hold it (needFree was set).
			l.release(ctx)
		}
		// Not while the lane is busy and holds the key again: the check
		// cannot succeed before it gives the key up (a lost key's settle
		// asks that no session hold it), and the unmark at the end of the
		// busy period checks anyway. Producers are not waited for
		// meanwhile: the busy lane's polls claim what they commit.
		if l.settle && !(l.busy && l.held()) && (l.checkFailures == 0 || !time.Now().Before(l.checkAt)) {
			bctx, cancel := l.d.bound(ctx)
			c, err := claim.TryBusyLock(bctx, l.d.db, l.target, l.needFree)
			cancel()
			err = timeout.Explain(bctx, err)
			l.keyHeld = c.KeyHeld
			if err != nil {
				// Claim all the same, as while producers still hold the
				// lock, and check again later, backing off on the
				// check's own count (the claims between succeed): a check
				// that keeps failing must not stop the queue.
				l.checkFailures++
				l.checkAt = l.retryAt(ctx, st, err, l.checkFailures)
			} else {
				l.checkFailures = 0
				if c.Locked {
					l.settle, l.tries, l.settleTries, l.needFree = false, 0, 0, false
				}
			}
		}
		if l.watchHint.Swap(false) {
			l.watching = true
		}
		// While busy, every pass sets the mark, except that a live one is
		// refreshed only once half its lease has gone: other dispatchers
		// read the row, and it need not change every millisecond.
		mark := l.busy && (!l.marked || time.Since(l.markedAt) >= l.d.cfg.BusyLease/2)
		switch {
		case mark:
			// The mark producers see; the row written by the pass is the
			// one other dispatchers see.
			l.hold(ctx)
		case l.refused && l.busy && !l.watching:
			// The key was refused at the mark: a producer was testing
			// it at that instant (another dispatcher's mark would have
			// been seen). Try again now, not at the mark's refresh, half
			// a lease away, while producers go on notifying: a stream
			// under load lost a second of them that way. (A Hold that
			// failed, as on a broken lock connection, waits for the
			// refresh: a connection attempt every pass would cost more.)
			l.hold(ctx)
		}
		// Take the free slots for the pass: a message leased to us at
		// INSERT meanwhile waits for one of those the pass leaves.
		if free = l.reserve(st.MaxInFlight); free == 0 {
			l.backlog.Store(true)
			if free = l.reserve(st.MaxInFlight); free == 0 {
				return time.Time{}, claimed, true
			}
			l.backlog.Store(false)
		}
		sent := time.Now()
		pass, err := l.claimPass(ctx, free, mark)
		if err != nil {
			l.freeSlots(free)
			if l.busy && ctx.Err() == nil {
				l.quitBusy(ctx)
			}
			return l.retry(ctx, st, err), claimed, false
		}
		if mark {
			l.marked, l.markedAt = true, sent
		}
		if ctx.Err() != nil {
			// Stopped while the claim ran: give its messages back now,
			// attempts refunded, rather than deliver after the stop. A
			// pass stopped before it was sent read no due time: the one
			// known, and a hand-over owed, stay for tidyUp.
			l.due = earliest(l.due, pass.NextDue)
			for i := range pass.Messages {
				l.d.complete.Submit(claim.Outcome{Message: &pass.Messages[i], Verdict: claim.Release})
			}
			l.freeSlots(free)
			return time.Time{}, claimed, false
		}
		l.failures, l.refusedAt = 0, time.Time{}
		l.due, l.owed = pass.NextDue, false
		// A reload while the claim ran (it may have waited long for a
		// connection, a lock or the combiner) applies to what it claimed:
		// the new handler delivers, and what a pause or a lower limit no
		// longer allows goes back, attempts refunded. Otherwise a consumer
		// paused, moved to another URL or limited, with the change already
		// loaded, would still get a pass's worth the old way.
		cut := false
		if cur := l.state.Load(); cur != st {
			st = cur
			keep := 0
			if st.Enabled {
				keep = max(0, st.MaxInFlight-(int(l.inFlight.Load())-free))
			}
			if keep < len(pass.Messages) {
				for i := keep; i < len(pass.Messages); i++ {
					l.d.complete.Submit(claim.Outcome{Message: &pass.Messages[i], Verdict: claim.Release})
				}
				pass.Messages, cut = pass.Messages[:keep], true
			}
		}
		now := time.Now()
		// A steady stream: this pass found messages soon after the last
		// one that did.
		stream := len(pass.Messages) > 0 && now.Sub(l.lastHit) < l.d.cfg.BusyWindow
		if len(pass.Messages) > 0 {
			l.lastHit = now
		}
		if !pass.ForeignLease.IsZero() {
			l.watching = true
		}
		msgs := pass.Messages
		if len(msgs) > 0 {
			claimed = true
			l.d.reclaim.Observe(msgs[0].LeasedAt.Add(leaseTimeout(st, &msgs[0])))
			l.d.fired(st.ID)
		}
		orphans := 0
		for i := range msgs {
			if msgs[i].VisibilityTimeout == 0 {
				// Our consumer no longer serves the queue (removed or
				// replaced since the lane loaded it): nothing measures
				// the lease. Give it back; the reload stops this lane.
				l.d.complete.Submit(claim.Outcome{Message: &msgs[i], Verdict: claim.Release})
				orphans++
				continue
			}
			l.d.inFlight.Add(1)
			l.delivering.Add(1)
			go l.deliver(st, &msgs[i])
		}
		l.freeSlots(free - len(msgs) + orphans)
		if orphans > 0 {
			return time.Time{}, claimed, false
		}
		if cut {
			continue // the next round sees the pause, or the full slots
		}
		if len(msgs) == free {
			if marks {
				// A backlog: mark the queue from the next pass on, so that
				// producers stop announcing what we will find anyway.
				l.busy = true
			}
			continue
		}
		// Ready rows left behind by a claim that did not fill its slots
		// were locked by another claim; if that one dies, nobody announces
		// them again, so look again shortly. Another dispatcher's claim
		// ends in milliseconds; a lock held for longer (an operator's
		// transaction) is looked at less and less often, up to once a
		// second, rather than fifty times a second for as long as it lasts.
		next = pass.NextDue
		if pass.ReadyLeft {
			l.tries++
			next = earliest(next, time.Now().Add(doubling(l.tries, time.Second)))
		}
		if marks && stream {
			// Mark the queue from the next pass on.
			l.busy = true
		}
		// Not l.busy without marks; but such a lane still watches the
		// marks of the other dispatchers on the database, whose
		// producers stay silent while they last.
		switch {
		case l.busy && now.Sub(l.lastHit) < l.d.cfg.BusyWindow:
			// Producers are not announcing while we are marked (or soon
			// will not be): look again shortly, until the queue has been
			// empty for a whole window.
			if !pass.ReadyLeft {
				l.tries = 0
			}
			return earliest(next, now.Add(l.d.cfg.BusyWindow/4)), claimed, false
		case l.busy:
			// Drained. Drop the mark; the lock then tells us when every
			// producer that read it has committed, and one more pass
			// finds what they did not announce.
			l.busy = false
			l.release(ctx)
			bctx, cancel := l.d.bound(ctx)
			c, err := claim.Unmark(bctx, l.d.db, l.target, l.d.owner, l.needFree)
			cancel()
			l.keyHeld = c.KeyHeld
			if err != nil {
				err = timeout.Explain(bctx, err)
				l.settle = true
				return l.retry(ctx, st, err), claimed, false
			}
			// The check in Unmark answered: the next one need not wait.
			l.marked, l.checkFailures, l.checkAt = false, 0, time.Time{}
			if c.Locked {
				// Also a settle left pending from before this busy
				// period: the check is the same.
				l.settle, l.tries, l.settleTries, l.needFree = false, 0, 0, false
			} else {
				// Its backoff starts from the quick tries.
				l.settle, l.settleTries = true, 0
			}
			if !l.settle {
				continue
			}
		}
		if !pass.ForeignLease.IsZero() {
			// Another dispatcher is draining this queue and producers are
			// not announcing: look again when its mark's lease ends, in
			// case it died or stopped.
			next = earliest(next, pass.ForeignLease.Add(time.Millisecond))
		}
		if l.settle {
			if l.checkFailures > 0 {
				return earliest(next, l.checkAt), claimed, false
			}
			// A producer that read a mark has not committed yet: it
			// commits in milliseconds, as a rule. One that keeps its
			// transaction open (an import, a request that enqueues and
			// then calls something slow) would keep the check failing
			// for as long, and a try every 20 ms is two round trips
			// each on a dispatcher with nothing to do: after the first
			// tries, back off to once a second. Only the messages of
			// producers that saw the mark and commit after the quick
			// tries wait for the backoff: a second at most, and about
			// as long again as the settle has lasted if that is
			// shorter. One that did not see the mark announces itself
			// and wakes the lane.
			l.settleTries++
			wait := 20 * time.Millisecond
			if l.settleTries > settleQuickTries {
				wait = min(time.Second, wait<<min(l.settleTries-settleQuickTries, 6))
			}
			if l.keyHeld && !pass.ForeignLease.IsZero() {
				// Only the busy key, lost by us and asked to be free,
				// is in the way, and another session holds it: our old
				// backend, or another dispatcher that took it once
				// producers notified again, which may keep it for hours.
				// Watch it as another dispatcher's mark (next), backing
				// off from the first tries that catch an old backend
				// on its way out. needFree stays until a check
				// succeeds (docs/busy-marks.md, step 3).
				wait = l.d.cfg.BusyLease
			}
			return earliest(next, time.Now().Add(doubling(l.settleTries, wait))), claimed, false
		}
		if pass.ForeignLease.IsZero() && l.watching {
			// The mark we watched is gone or expired; its producers may
			// not have announced. Settle as if it had been ours.
			l.watching, l.settle, l.settleTries = false, true, 0
			continue
		}
		if !pass.ReadyLeft {
			l.tries = 0
		}
		return next, claimed, false
	}
	return time.Time{}, claimed, false
}

// quitBusy ends a busy period whose claim failed, before the lane backs
// off (retry): a busy lane is woken by its own polls, not by producers,
// and holding the key through the backoff, up to 10s, kept them silent
// with nobody polling, though a notification would have woken the lane
// at once. It releases the key, so that producers announce again, and
// settles at the next pass as a drained lane does: producers that saw the
// key may commit after the release without announcing, and the lock check
// waits for them. The row stays until its lease ends, or a later busy
// period's mark refreshes it: deleting it costs a statement on the pool
// that just failed, and only other dispatchers read it, who watch it
// until it is gone.
func (l *lane) quitBusy(ctx context.Context) {
	l.busy = false
	l.release(ctx)
	l.settle, l.settleTries = true, 0
	// The next busy period takes the key at its first pass, not once
	// half the lease of the row written before has gone.
	l.markedAt = time.Time{}
}

// claimPass runs one claim pass, combined with other lanes' if theirs
// are waiting (claim.Combiner, which also says what a stop does to it).
func (l *lane) claimPass(ctx context.Context, free int, mark bool) (claim.Pass, error) {
	return l.d.claims.Pass(ctx, claim.Request{Target: l.target, Max: free,
		Busy: claim.Busy{Owner: l.d.owner, Mark: mark, Lease: l.d.cfg.BusyLease, Held: l.held()}})
}

// retry logs a failed statement and says when to try again: backing off
// from 0.5 – 1 s to 5 – 10 s (laneRetryCeiling) while the failures last, so that every queue with work
// does not keep claiming from a database that is away (a notification, or
// the scan after the listener reconnects, still wakes the lane at once,
// or within a second of a claim the server refused: refusedWait;
// a busy lane whose claim failed has released its busy key first, so that
// its producers notify: quitBusy).
// No more than 10s: when only the pool failed and the listener stayed,
// nothing else wakes a queue whose messages are already there.
// The line is the dispatcher's to throttle, since a failure of the
// database is every lane's.
// A first failure on a connection lost under the claim is retried at once
// (Dispatcher.retryWait).
func (l *lane) retry(ctx context.Context, st *consumerState, err error) time.Time {
	l.failures++
	l.refusedAt = time.Time{}
	if refused(err) {
		l.refusedAt = time.Now()
	}
	return l.retryIn(ctx, st, err, l.d.retryWait(err, l.failures, laneRetryCeiling))
}

// laneRetryCeiling bounds a lane's backoff after failed statements.
const laneRetryCeiling = 10 * time.Second

// retryAt is retry after the failures-th failure in a row.
func (l *lane) retryAt(ctx context.Context, st *consumerState, err error, failures int) time.Time {
	return l.retryIn(ctx, st, err, backoff.Delay(failures, time.Second, laneRetryCeiling))
}

// retryIn logs the failure and says when to try again: wait from now.
func (l *lane) retryIn(ctx context.Context, st *consumerState, err error, wait time.Duration) time.Time {
	if ctx.Err() == nil {
		l.d.failed(OpClaim)
		if ok, held := l.d.claimFailLog.Allow(); ok {
			l.d.log.Warn().Err(err).Str("app_id", l.target.AppID.String()).Str("queue", st.Queue).
				Stringer("retry_in", wait).Int("held_back", held).
				Msg("claim failed (logged at most once every 10s for every queue; held_back counts the others)")
		}
	}
	return time.Now().Add(wait)
}

// Per-message log lines (a failed delivery, a dead letter): a lane writes
// msgLogBurst at once, then one every msgLogInterval; the others go to the
// debug level and the next line written counts them.
const (
	msgLogBurst    = 10
	msgLogInterval = time.Second
)

// msgEvent starts a per-message line at level, or at debug level when the
// lane has written its share of them (msgLog).
func (l *lane) msgEvent(log *zerolog.Logger, level zerolog.Level) *zerolog.Event {
	return l.msgLog.Event(log, level, 1)
}

// dropMark deletes the lane's busy mark, if any, when it stops serving
// (paused, or its consumer gone): producers announce again at once
// instead of when the lease ends. Producers that saw the busy key before
// that may still commit without announcing; settle is left set when they
// can exist, so that the next pass (after a resume) or settleGone (for a
// lane gone) waits for them first.
func (l *lane) dropMark(ctx context.Context) {
	silenced := l.busy || l.marked || l.held() || l.settle || l.watching || l.needFree
	l.release(ctx)
	if l.marked {
		bctx, cancel := l.d.bound(ctx)
		if _, err := claim.Unmark(bctx, l.d.db, l.target, l.d.owner, false); err == nil {
			l.marked = false
		}
		cancel()
	}
	l.busy, l.watching = false, false
	l.settle = silenced
	if !silenced {
		l.needFree = false
	}
}

// busyKey names the lane's queue to the busy-lock holder.
func (l *lane) busyKey() busylock.Key {
	return busylock.Key{AppID: l.target.AppID, Queue: l.target.Queue}
}

// hold takes the queue's busy key, so that producers stop announcing. A
// failure only leaves them announcing: it is logged, not returned.
func (l *lane) hold(ctx context.Context) {
	if l.d.marks == nil {
		return
	}
	bctx, cancel := l.d.bound(ctx)
	defer cancel()
	held, err := l.d.marks.Hold(bctx, l.busyKey())
	l.refused = err == nil && !held
	if err != nil && !timeout.Stopping(bctx) {
		l.d.log.Debug().Err(timeout.Explain(bctx, err)).Str("app_id", l.target.AppID.String()).Str("queue", l.target.Queue).
			Msg("could not take the busy lock; producers keep notifying")
	}
}

// held reports whether this dispatcher holds the queue's busy key.
func (l *lane) held() bool {
	return l.d.marks != nil && l.d.marks.Held(l.busyKey())
}

// release gives back the queue's busy key before the lane settles. If the
// key was lost with its session rather than released, or the release
// failed, the old session may hold it a moment longer: the lane's settle
// then also waits until the key is free.
func (l *lane) release(ctx context.Context) {
	if l.d.marks == nil {
		return
	}
	bctx, cancel := l.d.bound(ctx)
	defer cancel()
	confirmed, err := l.d.marks.Release(bctx, l.busyKey())
	if err != nil && !timeout.Stopping(bctx) {
		msg := "could not release the busy lock; dropped its connection instead"
		if l.held() {
			msg = "could not release the busy lock; nothing was sent, so the lane gives it back at its next pass"
		}
		l.d.log.Warn().Err(timeout.Explain(bctx, err)).Str("app_id", l.target.AppID.String()).Str("queue", l.target.Queue).
			Msg(msg)
	}
	if !confirmed {
		l.needFree = true
	}
}

// doubling is the lanes' look-again delay after n tries in a row: 1ms,
// doubled per try, at most ceiling.
func doubling(n int, ceiling time.Duration) time.Duration {
	return min(ceiling, time.Millisecond<<min(n, 30))
}

// earliest is the earlier of two times, ignoring zero ones.
func earliest(a, b time.Time) time.Time {
	if a.IsZero() || (!b.IsZero() && b.Before(a)) {
		return b
	}
	return a
}

// leaseTimeout is the visibility timeout cm's lease is measured with: the
// consumer's as the transaction that took the lease read it (or, for a
// lease found by its token, as the lookup read it), which the reclaimer
// honours even if the timeout is lowered or the consumer removed later
// (migration 0047). The dispatcher's loaded copy may be one reload behind
// a change, so it only stands in should a message carry none.
func leaseTimeout(st *consumerState, cm *claim.Message) time.Duration {
	if cm.VisibilityTimeout > 0 {
		return cm.VisibilityTimeout
	}
	return st.VisibilityTimeout
}

// deliver runs the handler on one message and submits its outcome.
func (l *lane) deliver(st *consumerState, cm *claim.Message) {
	defer l.d.inFlight.Done()
	defer l.delivering.Add(-1)
	vt := leaseTimeout(st, cm)
	if !time.Now().Before(startBy(cm, vt)) {
		l.releaseUnstarted(st, cm, vt)
		return
	}
	m := &Message{
		ID: cm.ID, AppID: st.AppID, App: st.App, Queue: st.Queue, ConsumerID: st.ID,
		Invoked: cm.Source == claim.Invoke, Payload: cm.Payload, EnqueuedAt: cm.EnqueuedAt,
		Attempt: cm.Attempt, MaxAttempts: cm.MaxAttempts, EnqueuedBy: cm.EnqueuedBy, Principal: st.PrincipalID,
	}
	hctx, cancel := context.WithCancelCause(l.d.handlers)
	m.lease = newLease(l.d.db, cm, vt, cancel)
	obs := l.d.cfg.Observer
	if obs != nil {
		obs.Delivered(m)
	}
	// A lane whose offer this message took (or that was full) offers
	// again, now that nothing is left to do before the handler starts.
	l.reoffer()
	start := time.Now()
	returned := false
	defer func() {
		if !returned {
			// The handler called runtime.Goexit (t.FailNow, say), which
			// recover does not catch: its goroutine ends once this
			// returns, so settle the message here, as a failure.
			l.finish(st, m, cm, hctx, cancel, start, errGoexit)
		}
	}()
	err := safeHandle(hctx, st.handler, m)
	returned = true
	l.finish(st, m, cm, hctx, cancel, start, err)
}

// errGoexit is the result of a handler that ended its goroutine with
// runtime.Goexit instead of returning.
var errGoexit = errors.New("handler exited its goroutine (runtime.Goexit) without returning")

// finish settles a delivery once its handler has returned err: it ends
// the lease's renewals and the handler's context, submits the outcome,
// and frees the slot.
func (l *lane) finish(st *consumerState, m *Message, cm *claim.Message, hctx context.Context,
	cancel context.CancelCauseFunc, start time.Time, err error) {
	obs := l.d.cfg.Observer
	handled := time.Since(start)
	m.lease.stop()
	cause := context.Cause(hctx)
	cancel(nil)

	out := l.decide(st, m, err, cause)
	log := l.d.log.With().Str("app_id", m.AppID.String()).Str("queue", m.Queue).
		Stringer("source", cm.Source).Str("consumer_id", m.ConsumerID.String()).
		Str("message_id", m.ID.String()).Int("attempt", m.Attempt).Logger()
	out.Message = cm
	out.Done = func(applied bool, werr error) {
		// Every delivery is reported, also one whose outcome was not
		// written: the settled counts and the handler durations would
		// otherwise leave out the deliveries that went wrong.
		settled := outcomeOf(out.Verdict)
		switch {
		case errors.Is(werr, claim.ErrWriteFailed) && !errors.Is(werr, claim.ErrOutcomeUnknown):
			// No try got a connection to send it on.
			l.msgEvent(&log, zerolog.ErrorLevel).Err(werr).Str("outcome", out.Verdict.String()).
				Msg("could not record outcome; the message will be delivered again after its lease")
			settled = WriteFailed
		case errors.Is(werr, claim.ErrWriteFailed):
			// A try may have committed before its answer was lost: the
			// outcome is unknown too.
			l.msgEvent(&log, zerolog.ErrorLevel).Err(werr).Str("outcome", out.Verdict.String()).
				Msg("could not record outcome; unless a try did, the message will be delivered again after its lease")
			if out.Verdict == claim.Nack {
				l.afterNack() // if recorded, the retry is due then
			}
			settled = WriteFailed
		case werr != nil:
			l.msgEvent(&log, zerolog.WarnLevel).Str("outcome", out.Verdict.String()).Msg(retriedGone[cm.Source])
			if out.Verdict == claim.Nack {
				l.afterNack()
			}
			settled = LeaseLost
		case !applied:
			l.msgEvent(&log, zerolog.WarnLevel).Str("outcome", out.Verdict.String()).Msg(notApplied[cm.Source])
			settled = LeaseLost
		default:
			if out.Verdict == claim.DeadLetter {
				text := logText(out.Error, err)
				l.msgEvent(&log, zerolog.WarnLevel).Str("error", text).Msg("message dead-lettered")
				if text != out.Error {
					log.Debug().Str("error", out.Error).Msg("the dead letter's error in full")
				}
			}
			if out.Verdict == claim.Nack {
				l.afterNack()
			}
		}
		if obs != nil {
			obs.Settled(m, settled, handled)
		}
	}
	if err != nil && (out.Verdict == claim.Nack || out.Verdict == claim.Release) {
		retryIn := out.Delay
		if out.HoldLease > 0 {
			retryIn = max(retryIn, time.Until(m.lease.deadline().Add(leaseMargin(out.HoldLease))))
		}
		msg := "handler failed; will retry"
		if out.Verdict == claim.Release {
			msg = "handler cancelled by the stop; message released, attempt refunded"
		}
		text := logText(err.Error(), err)
		l.msgEvent(&log, zerolog.InfoLevel).Str("error", text).Stringer("retry_in", retryIn).Msg(msg)
		if text != err.Error() {
			log.Debug().Err(err).Msg("the handler's error in full")
		}
	}
	l.d.complete.Submit(out)

	if obs != nil {
		obs.Finished(m)
	}
	l.slotDone()
}

// The warnings of an outcome that matched no row (LeaseLost), by source.
// An invoke delivery's row may also be gone because RemoveConsumer deleted
// it with its consumer, and then nothing delivers it again. The ack does
// not tell that from a lost lease: it matches by id and token, and a
// reclaimed delivery may be gone too, acked after its redelivery.
var (
	notApplied = map[claim.Source]string{
		claim.Queue:  "lease was lost before the outcome was recorded; the message may be delivered again",
		claim.Invoke: "the lease was lost, or the delivery was removed with its consumer, before the outcome was recorded; unless it was removed, it may be delivered again",
	}
	retriedGone = map[claim.Source]string{
		claim.Queue: "the outcome's write was retried and found the lease gone: the first try may have recorded it; the message may be delivered again",
		claim.Invoke: "the outcome's write was retried and found the lease gone: the first try may have recorded it, or the delivery was removed with its consumer; " +
			"unless either, it may be delivered again",
	}
)

// afterNack has the queue's new deliver_after read once a nack is
// written. A nack sends no notification, and the lane's timer was set
// before the message's new deliver_after existed: a claim pass now reads
// it (as the next due time) and arms the timer, or claims at once if it
// is due. If that pass finds every slot taken, it reads nothing, and it
// wakes the other dispatchers instead (handOff). A lane stopped by a
// reload meanwhile cannot: the one serving the queue now does, or, if no
// lane here does, the other dispatchers are woken (pokeServing).
func (l *lane) afterNack() {
	l.nacked.Store(true)
	if l.ctx.Err() == nil {
		l.renacked.Store(true)
		l.poke()
		if l.ctx.Err() == nil || !l.renacked.CompareAndSwap(true, false) {
			// The lane's pass takes the nack, or, stopped meanwhile, its
			// tidying up does (tidyUp): not both, not twice.
			return
		}
	}
	l.d.pokeServing(l.target)
}

// slotDone gives back a delivery's slot. When the sibling lane was waiting
// for a slot too, the sibling has this one, and this lane waits for the
// next one the sibling frees (when its delivery ends, or its pass leaves
// the slot unused): each lane hands the slots its deliveries free to the
// other. Otherwise the lane that freed the slot, woken last, won nearly
// every race for it, and at MaxInFlight 1 a queue's backlog held its
// consumer's invoke deliveries back until it was drained, or the reverse.
func (l *lane) slotDone() {
	handed := l.freeSlots(1)
	l.reoffer()
	if !handed && l.backlog.Swap(false) {
		l.poke()
	}
}

// releaseUnstarted gives back a message whose claim came back so late (a
// stalled or frozen database) that its lease, as this dispatcher measures
// it, had run out before delivery could start. Delivering it would start
// the handler with its context already ended: the attempt would be spent
// without the consumer seeing the message, and a message on its last
// attempt would be dead-lettered without ever being delivered. Release
// refunds the attempt and makes the message claimable at once (and wakes
// the dispatchers); the claim token fences it as usual. No Observer event:
// nothing was delivered.
func (l *lane) releaseUnstarted(st *consumerState, cm *claim.Message, vt time.Duration) {
	log := l.d.log.With().Str("app_id", st.AppID.String()).Str("queue", st.Queue).
		Stringer("source", cm.Source).Str("consumer_id", st.ID.String()).
		Str("message_id", cm.ID.String()).Int("attempt", cm.Attempt).Logger()
	l.msgEvent(&log, zerolog.WarnLevel).Stringer("claim_took", time.Since(cm.LeasedAt)).Stringer("visibility_timeout", vt).
		Msg("the claim returned after the lease had run out; releasing the message undelivered")
	l.d.complete.Submit(claim.Outcome{Message: cm, Verdict: claim.Release, Done: func(_ bool, err error) {
		// Not when a retry found it released, or reclaimed.
		if errors.Is(err, claim.ErrWriteFailed) {
			log.Warn().Err(err).Msg("could not release an undelivered message; it comes back after its lease")
		}
	}})
	l.slotDone()
}

func outcomeOf(v claim.Verdict) Outcome {
	switch v {
	case claim.Ack:
		return Acked
	case claim.Nack:
		return Nacked
	case claim.DeadLetter:
		return DeadLettered
	}
	return Released
}

// decide turns a handler's result into an outcome.
func (l *lane) decide(st *consumerState, m *Message, err, cause error) claim.Outcome {
	var perm *permanentError
	var retry *retryAfterError
	switch {
	case err == nil:
		return claim.Outcome{Verdict: claim.Ack}
	case l.d.handlers.Err() != nil && !errors.Is(cause, ErrLeaseLost):
		// Cancelled by a stop whose grace ran out: not the message's
		// fault, so its attempt is refunded, whatever the handler made of
		// the cancellation (a Permanent(ctx.Err()) too: another
		// dispatcher's try will tell a real one). It is claimable at once,
		// unless the handler gave up on work that may still run (an HTTP
		// push cut short): then, as below, not before its lease's end.
		out := claim.Outcome{Verdict: claim.Release}
		if errors.Is(err, ErrAbandoned) {
			out.HoldLease = m.lease.timeout()
		}
		return out
	case errors.As(err, &perm):
		return claim.Outcome{Verdict: claim.DeadLetter, Error: err.Error(), Queue: st.Queue}
	}
	// A handler abandoned when its lease ran short, or one that gave up on
	// work that may still run, may still be running (an HTTP consumer does
	// not see that we stopped waiting): the retry waits for the end of the
	// lease it was given, not only its delay.
	var hold time.Duration
	if errors.Is(cause, ErrLeaseLost) {
		err = fmt.Errorf("handler ran past its lease (%s visibility timeout): %w", m.lease.timeout(), err)
	}
	if errors.Is(cause, ErrLeaseLost) || errors.Is(err, ErrAbandoned) {
		hold = m.lease.timeout()
	}
	if m.Attempt >= m.MaxAttempts {
		// The hold goes with the dead letter: a redrive must not hand the
		// message to another consumer while this work may still run.
		return claim.Outcome{Verdict: claim.DeadLetter, Queue: st.Queue, HoldLease: hold,
			Error: fmt.Sprintf("attempts exhausted (%d of %d): %v", m.Attempt, m.MaxAttempts, err)}
	}
	delay := backoff.Delay(m.Attempt, st.BackoffBase, st.BackoffCap)
	if errors.As(err, &retry) {
		delay = retry.d
	}
	return claim.Outcome{Verdict: claim.Nack, Delay: delay, HoldLease: hold}
}

// safeHandle runs h, turning a panic into an error.
func safeHandle(ctx context.Context, h Handler, m *Message) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = &panicError{value: r, stack: debug.Stack()}
		}
	}()
	return checkedError(h.Handle(ctx, m))
}

// checkedError returns a handler's err, unless its methods panic, as
// those of a nil pointer of the handler's own error type do (a non-nil
// error holding a nil *T). The dispatcher reads err outside any recover
// (decide, finish's logs), so such an error, which would crash the
// process, is replaced by one that says what it was: a failure, retried.
func checkedError(err error) (out error) {
	if err == nil {
		return nil
	}
	if p, ok := err.(*permanentError); ok && p != nil {
		// Permanent of a broken error is still permanent.
		return &permanentError{err: checkedError(p.err)}
	}
	defer func() {
		if r := recover(); r != nil {
			out = &brokenError{typ: fmt.Sprintf("%T", err), value: r}
		}
	}()
	// What decide and finish ask of it.
	_ = err.Error()
	var perm *permanentError
	var retry *retryAfterError
	_ = errors.As(err, &perm)
	_ = errors.As(err, &retry)
	_ = errors.Is(err, ErrAbandoned)
	_ = logText("", err)
	return err
}

// brokenError replaces a handler's error whose methods panicked.
type brokenError struct {
	typ   string
	value any
}

func (e *brokenError) Error() string {
	return fmt.Sprintf("handler returned an error of type %s whose methods panicked (a nil pointer in a non-nil error?): %v", e.typ, e.value)
}

// panicError is a handler's panic: its value and stack. The stack is kept
// with a dead letter; LogText leaves it out of info and warn logs.
type panicError struct {
	value any
	stack []byte
}

func (e *panicError) Error() string   { return fmt.Sprintf("handler panicked: %v\n%s", e.value, e.stack) }
func (e *panicError) LogText() string { return fmt.Sprintf("handler panicked: %v", e.value) }

// logText is text, a handler's error err or a dead letter's text made
// from it, as info- and warn-level logs show it: the text of an error in
// err's chain that has a LogText method (an HTTP push's response body, a
// panic's stack) is replaced by what that returns. The response body may
// echo the message's payload, which stays out of those logs; the dead
// letter keeps the whole text, and the debug log has it too.
func logText(text string, err error) string {
	var lt interface {
		error
		LogText() string
	}
	if err == nil || !errors.As(err, &lt) {
		return text
	}
	return strings.Replace(text, lt.Error(), lt.LogText(), 1)
}
