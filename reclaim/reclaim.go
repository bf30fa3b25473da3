// Package reclaim returns expired leases. A message whose consumer died or
// hung past its visibility timeout is made claimable again, or
// dead-lettered when it has used all its attempts, and its queue is
// woken.
//
// The reclaimer is a timer, not a tick: it sleeps until the next lease it
// knows of can expire. It learns of leases from its own dispatcher's
// claims (Observe) and, for leases taken by other dispatchers, from the
// dispatcher's fallback poll (also Observe). It runs one pass at start-up
// and, after that, only when a lease it knows of can have expired: once
// nothing is in flight it runs no statement at all.
package reclaim

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/internal/backoff"
	queries "github.com/bellhopq/bellhop/sql"
)

// Result counts what one pass did.
type Result struct {
	Released     int64
	DeadLettered int64
}

// Reclaimer runs reclaim passes when leases can have expired.
type Reclaimer struct {
	db        *pgxpool.Pool
	log       zerolog.Logger
	defaultVT time.Duration
	onPass    func(Result)

	mu    sync.Mutex
	next  time.Time // zero: nothing known in flight
	timer *time.Timer
	kick  chan struct{}
}

// New returns a Reclaimer. defaultVT applies to messages of queues that
// have no consumer; onPass, if set, is called after every pass that
// changed something.
func New(db *pgxpool.Pool, log zerolog.Logger, defaultVT time.Duration, onPass func(Result)) *Reclaimer {
	r := &Reclaimer{db: db, log: log, defaultVT: defaultVT, onPass: onPass, kick: make(chan struct{}, 1)}
	r.timer = time.AfterFunc(time.Hour, r.fire)
	r.timer.Stop()
	return r
}

// Observe tells the reclaimer that some lease can expire at t. It arms the
// timer for t unless it is already armed for earlier.
func (r *Reclaimer) Observe(t time.Time) {
	if t.IsZero() {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.next.IsZero() && !t.Before(r.next) {
		return
	}
	r.next = t
	r.timer.Reset(time.Until(t))
}

func (r *Reclaimer) fire() {
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// Run performs passes when the timer fires, until ctx is done.
func (r *Reclaimer) Run(ctx context.Context) {
	defer r.timer.Stop()
	var failures, stuck int
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.kick:
		}
		r.mu.Lock()
		r.next = time.Time{}
		r.mu.Unlock()
		res, next, err := r.pass(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			// A failure that lasts (a revoked grant, a database away)
			// costs a statement and a log line at 1, 2, 4 ... 30s, not
			// every second for as long as it lasts.
			failures++
			wait := backoff.Delay(failures, time.Second, 30*time.Second)
			r.log.Warn().Err(err).Dur("retry_in", wait).Msg("reclaim pass failed")
			r.Observe(time.Now().Add(wait))
			continue
		}
		failures = 0
		if next.IsZero() {
			stuck = 0
			continue
		}
		// Leases still live are re-armed, no sooner than 100ms, so that
		// one whose consumer's timeout is longer than we knew cannot spin
		// the timer. A lease that has expired and yet was not reclaimed is
		// on a row another transaction holds locked (the pass skips locked
		// rows): it is looked at again backing off to once a second, not
		// ten times a second for as long as the lock lasts.
		now := time.Now()
		if res.Released+res.DeadLettered == 0 && !next.After(now) {
			stuck++
		} else {
			stuck = 0
		}
		r.Observe(later(next, now.Add(min(time.Second, 100*time.Millisecond<<min(stuck, 4)))))
	}
}

// Pass returns expired leases now, and reports when the next live lease
// expires, on this process's clock (zero if none), in one round trip.
func (r *Reclaimer) Pass(ctx context.Context) (time.Time, error) {
	_, next, err := r.pass(ctx)
	return next, err
}

func (r *Reclaimer) pass(ctx context.Context) (Result, time.Time, error) {
	args := queries.Args{"default_vt_secs": int(r.defaultVT / time.Second)}
	b := &pgx.Batch{}
	b.Queue(queries.Reclaim, args)
	b.Queue(queries.NextLeaseExpiry, args)
	br := r.db.SendBatch(ctx, b)
	defer br.Close()
	var res Result
	var woken, floorsStarted int64
	if err := br.QueryRow().Scan(&res.Released, &res.DeadLettered, &woken, &floorsStarted); err != nil {
		return res, time.Time{}, err
	}
	var next *time.Time
	var dbNow time.Time
	if err := br.QueryRow().Scan(&next, &dbNow); err != nil {
		return res, time.Time{}, err
	}
	if err := br.Close(); err != nil {
		return res, time.Time{}, err
	}
	if res.Released+res.DeadLettered > 0 {
		r.log.Info().Int64("released", res.Released).Int64("dead_lettered", res.DeadLettered).
			Msg("reclaimed expired leases")
		if r.onPass != nil {
			r.onPass(res)
		}
	}
	if next == nil {
		return res, time.Time{}, nil
	}
	return res, claim.LocalClock(dbNow)(*next), nil
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
