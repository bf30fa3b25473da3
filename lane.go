package bellhop

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync/atomic"
	"time"

	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/internal/backoff"
)

// consumerState is a consumer's settings and handler, swapped atomically
// when the consumer changes.
type consumerState struct {
	Consumer
	handler Handler
}

// lane claims and delivers one source of one consumer: its queue, or its
// invoke_async deliveries. A single goroutine claims; each delivery runs
// on its own goroutine.
type lane struct {
	d      *Dispatcher
	target claim.Target
	state  atomic.Pointer[consumerState]
	wake   chan struct{} // capacity 1: wake-ups coalesce

	inFlight atomic.Int32
	// backlog is set when the lane stopped claiming because all its
	// slots were busy; the next finished delivery wakes it.
	backlog atomic.Bool
	// draining is set while the lane is inside a claim pass.
	draining atomic.Bool
}

func newLane(d *Dispatcher, st *consumerState, t claim.Target) *lane {
	l := &lane{d: d, target: t, wake: make(chan struct{}, 1)}
	l.state.Store(st)
	return l
}

// poke wakes the lane for one more claim pass; it never blocks.
func (l *lane) poke() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// wakeIfIdle pokes the lane and reports whether it was idle (nothing in
// flight, not claiming): ready work on an idle lane means a missed
// notification.
func (l *lane) wakeIfIdle() bool {
	idle := l.inFlight.Load() == 0 && !l.draining.Load() && len(l.wake) == 0
	l.poke()
	return idle
}

func (l *lane) run(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	var emptyTimerWakes int
	for {
		byTimer := false
		select {
		case <-ctx.Done():
			return
		case <-l.wake:
		case <-timer.C:
			byTimer = true
		}
		l.draining.Store(true)
		next, claimed := l.drain(ctx)
		l.draining.Store(false)
		// A due time that has already passed by our clock but found
		// nothing ready means the database's clock is behind ours:
		// back off instead of spinning.
		if byTimer && !claimed && !next.IsZero() && !next.After(time.Now()) {
			emptyTimerWakes++
			next = time.Now().Add(min(time.Second, time.Millisecond<<min(emptyTimerWakes, 10)))
		} else if claimed || byTimer {
			emptyTimerWakes = 0
		}
		if !next.IsZero() {
			timer.Reset(time.Until(next))
		}
	}
}

// drain claims until the lane's slots are full or nothing is ready. It
// returns the next future due time it learned (zero: none) and whether it
// claimed anything.
func (l *lane) drain(ctx context.Context) (next time.Time, claimed bool) {
	for ctx.Err() == nil {
		st := l.state.Load()
		if !st.Enabled {
			return time.Time{}, claimed
		}
		l.backlog.Store(true)
		free := st.MaxInFlight - int(l.inFlight.Load())
		if free <= 0 {
			return time.Time{}, claimed // a finishing delivery pokes us
		}
		l.backlog.Store(false)
		msgs, due, err := claim.Claim(ctx, l.d.db, l.target, free)
		if err != nil {
			if ctx.Err() == nil {
				l.d.log.Warn().Err(err).Str("app_id", l.target.AppID.String()).Str("queue", st.Queue).
					Msg("claim failed; retrying in 1s")
			}
			return time.Now().Add(time.Second), claimed
		}
		if len(msgs) > 0 {
			claimed = true
			l.d.reclaim.Observe(msgs[0].LeasedAt.Add(st.VisibilityTimeout))
			l.d.fired(st.ID)
		}
		for i := range msgs {
			l.inFlight.Add(1)
			l.d.inFlight.Add(1)
			go l.deliver(st, &msgs[i])
		}
		if len(msgs) < free {
			return due, claimed
		}
	}
	return time.Time{}, claimed
}

// deliver runs the handler on one message and submits its outcome.
func (l *lane) deliver(st *consumerState, cm *claim.Message) {
	defer l.d.inFlight.Done()
	m := &Message{
		ID: cm.ID, AppID: st.AppID, App: st.App, Queue: st.Queue, ConsumerID: st.ID,
		Invoked: cm.Source == claim.Invoke, Payload: cm.Payload, EnqueuedAt: cm.EnqueuedAt,
		Attempt: cm.Attempt, MaxAttempts: cm.MaxAttempts, EnqueuedBy: cm.EnqueuedBy, Principal: st.PrincipalID,
	}
	hctx, cancel := context.WithCancelCause(l.d.handlers)
	m.lease = newLease(l.d.db, cm, st.VisibilityTimeout, cancel)
	obs := l.d.cfg.Observer
	if obs != nil {
		obs.Delivered(m)
	}
	start := time.Now()
	err := safeHandle(hctx, st.handler, m)
	handled := time.Since(start)
	m.lease.stop()
	cause := context.Cause(hctx)
	cancel(nil)

	out := l.decide(st, m, err, cause)
	log := l.d.log.With().Str("app_id", m.AppID.String()).Str("queue", m.Queue).
		Str("message_id", m.ID.String()).Int("attempt", m.Attempt).Logger()
	out.Message = cm
	out.Done = func(applied bool, werr error) {
		switch {
		case werr != nil:
			log.Error().Err(werr).Str("outcome", out.Verdict.String()).
				Msg("could not record outcome; the message will be delivered again after its lease")
		case !applied:
			log.Warn().Str("outcome", out.Verdict.String()).
				Msg("lease was lost before the outcome was recorded; the message may be delivered again")
		default:
			if out.Verdict == claim.DeadLetter {
				log.Warn().Str("error", out.Error).Msg("message dead-lettered")
			}
			if out.Verdict == claim.Nack {
				// A nack sends no notification, and the lane's timer was
				// set before this message's new deliver_after existed: a
				// claim pass now reads it (as the next due time) and
				// arms the timer, or claims at once if it is due.
				l.poke()
			}
			if obs != nil {
				obs.Settled(m, outcomeOf(out.Verdict), handled)
			}
		}
	}
	if err != nil && out.Verdict == claim.Nack {
		log.Info().Err(err).Dur("retry_in", out.Delay).Msg("handler failed; will retry")
	}
	l.d.complete.Submit(out)

	if obs != nil {
		obs.Finished(m)
	}
	l.inFlight.Add(-1)
	if l.backlog.Swap(false) {
		l.poke()
	}
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
	case errors.As(err, &perm):
		return claim.Outcome{Verdict: claim.DeadLetter, Error: err.Error(), Queue: st.Queue}
	case l.d.handlers.Err() != nil && !errors.Is(cause, ErrLeaseLost):
		// Cancelled by a stop whose grace ran out: not the message's fault.
		return claim.Outcome{Verdict: claim.Release}
	}
	if errors.Is(cause, ErrLeaseLost) {
		err = fmt.Errorf("handler ran past its lease (%s visibility timeout): %w", st.VisibilityTimeout, err)
	}
	if m.Attempt >= m.MaxAttempts {
		return claim.Outcome{Verdict: claim.DeadLetter, Queue: st.Queue,
			Error: fmt.Sprintf("attempts exhausted (%d of %d): %v", m.Attempt, m.MaxAttempts, err)}
	}
	if errors.As(err, &retry) {
		return claim.Outcome{Verdict: claim.Nack, Delay: retry.d}
	}
	return claim.Outcome{Verdict: claim.Nack, Delay: backoff.Delay(m.Attempt, st.BackoffBase, st.BackoffCap)}
}

// safeHandle runs h, turning a panic into an error.
func safeHandle(ctx context.Context, h Handler, m *Message) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("handler panicked: %v\n%s", r, debug.Stack())
		}
	}()
	return h.Handle(ctx, m)
}
