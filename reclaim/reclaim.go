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
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.kick:
		}
		r.mu.Lock()
		r.next = time.Time{}
		r.mu.Unlock()
		next, err := r.Pass(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			r.log.Warn().Err(err).Msg("reclaim pass failed; retrying in 1s")
			r.Observe(time.Now().Add(time.Second))
			continue
		}
		// Leases still live are re-armed; one whose consumer's timeout
		// is longer than we knew comes back no sooner than 100ms, so the
		// timer cannot spin.
		if !next.IsZero() {
			r.Observe(later(next, time.Now().Add(100*time.Millisecond)))
		}
	}
}

// Pass returns expired leases now, and reports when the next live lease
// expires, on this process's clock (zero if none), in one round trip.
func (r *Reclaimer) Pass(ctx context.Context) (time.Time, error) {
	args := pgx.NamedArgs{"default_vt_secs": int(r.defaultVT / time.Second)}
	b := &pgx.Batch{}
	b.Queue(queries.Reclaim, args)
	b.Queue(queries.NextLeaseExpiry, args)
	br := r.db.SendBatch(ctx, b)
	defer br.Close()
	var res Result
	var woken, floorsStarted int64
	if err := br.QueryRow().Scan(&res.Released, &res.DeadLettered, &woken, &floorsStarted); err != nil {
		return time.Time{}, err
	}
	var next *time.Time
	var dbNow time.Time
	if err := br.QueryRow().Scan(&next, &dbNow); err != nil {
		return time.Time{}, err
	}
	if err := br.Close(); err != nil {
		return time.Time{}, err
	}
	if res.Released+res.DeadLettered > 0 {
		r.log.Info().Int64("released", res.Released).Int64("dead_lettered", res.DeadLettered).
			Msg("reclaimed expired leases")
		if r.onPass != nil {
			r.onPass(res)
		}
	}
	if next == nil {
		return time.Time{}, nil
	}
	return claim.LocalClock(dbNow)(*next), nil
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
