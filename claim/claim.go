// Package claim leases messages to a dispatcher and settles them: claim
// with FOR UPDATE SKIP LOCKED, then ack, nack, dead-letter or release,
// each fenced by the claim token. The statements live in ../sql; their
// comments say why each is safe under concurrency.
package claim

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	queries "github.com/bellhopq/bellhop/sql"
)

// Source says which table a claimed message lives in.
type Source uint8

const (
	// Queue messages live in queue_messages.
	Queue Source = iota
	// Invoke deliveries (invoke_async) live in outbox.
	Invoke
)

func (s Source) String() string {
	if s == Invoke {
		return "invoke"
	}
	return "queue"
}

// Message is one leased message.
type Message struct {
	Source      Source
	ID          uuid.UUID
	Token       uuid.UUID
	Payload     []byte
	EnqueuedAt  time.Time
	Attempt     int
	MaxAttempts int
	EnqueuedBy  *uuid.UUID
	// LeasedAt is the dispatcher's clock just before the claim was sent,
	// never later than the database's claimed_at, so a lease measured
	// from it ends no later than the reclaimer thinks it does.
	LeasedAt time.Time
	// VisibilityTimeout is the consumer's timeout as the transaction that
	// took the lease read it, which the reclaimer honours for this lease
	// even if the timeout is lowered or the consumer removed later (zero:
	// t.TriggerID no longer serves the queue; release the message).
	VisibilityTimeout time.Duration
}

// Target names what to claim from: a queue, or a consumer's invoke
// deliveries.
type Target struct {
	Source Source
	AppID  uuid.UUID
	Queue  string // Source Queue
	// TriggerID is the consumer: whose invoke deliveries to claim, or,
	// for a queue, whose visibility timeout the leases are measured with.
	TriggerID uuid.UUID
}

func (t Target) String() string {
	if t.Source == Invoke {
		return "invoke/" + t.TriggerID.String()
	}
	return t.AppID.String() + "/" + t.Queue
}

// Claim leases up to max ready messages of t, oldest first, and reports
// the next future deliver_after among t's unclaimed messages (zero if
// none). It is Pass without busy marks.
func Claim(ctx context.Context, db *pgxpool.Pool, t Target, max int) ([]Message, time.Time, error) {
	p, err := ClaimPass(ctx, db, t, max, Busy{})
	return p.Messages, p.NextDue, err
}

// Busy says how a claim pass treats busy marks (see
// migrations/0041_busy_marks.sql and 0042_busy_locks.sql).
type Busy struct {
	// Owner identifies this dispatcher's marks; its own are not reported
	// as foreign.
	Owner uuid.UUID
	// Mark sets or refreshes Owner's mark on the queue, with Lease, in the
	// same transaction as the claim.
	Mark  bool
	Lease time.Duration
	// Held says that this dispatcher holds the queue's busy key
	// (internal/busylock); otherwise a pass reports another session's
	// hold of it as a foreign mark whose lease ends Lease from now.
	Held bool
}

// Pass is the result of one claim pass.
type Pass struct {
	Messages []Message
	// NextDue is the next future deliver_after (zero: none), on this
	// process's clock (LocalClock).
	NextDue time.Time
	// ForeignLease is the latest lease of a live busy mark another
	// dispatcher holds on the queue, or Lease from now if another session
	// holds the queue's busy key (zero: neither), on this process's clock.
	ForeignLease time.Time
	// ReadyLeft reports that ready, unclaimed messages remained after the
	// claim: rows another claim had locked, or newly committed ones.
	ReadyLeft bool
}

// ClaimPass leases up to max ready messages of t, oldest first, and reads
// what the caller needs to sleep well: the next due time and other
// dispatchers' busy marks. With b.Mark it also sets b.Owner's mark. It is
// one round trip and one transaction, whose statements run with their
// generic plans (generic_plans.sql).
func ClaimPass(ctx context.Context, db *pgxpool.Pool, t Target, max int, b Busy) (Pass, error) {
	var claimSQL, infoSQL string
	var args queries.Args
	// Uuids go to pgx as [16]byte, here and below: for a uuid.UUID pgx
	// goes through its driver.Valuer (a string, a failed encode, then a
	// parse), a quarter of a claim pass's CPU in this process.
	if t.Source == Invoke {
		claimSQL, infoSQL = queries.ClaimInvoke, queries.NextDueInvoke
		args = queries.Args{"trigger_id": [16]byte(t.TriggerID), "max_messages": max}
	} else {
		claimSQL, infoSQL = queries.ClaimQueue, queries.NextDueQueue
		args = queries.Args{"app_id": [16]byte(t.AppID), "queue_name": t.Queue, "max_messages": max, "owner": [16]byte(b.Owner),
			"held": b.Held, "lease_ms": b.Lease.Milliseconds(), "consumer_id": [16]byte(t.TriggerID)}
	}
	leasedAt := time.Now()
	batch := &pgx.Batch{}
	batch.Queue(queries.GenericPlans)
	mark := b.Mark && t.Source == Queue
	if mark {
		batch.Queue(queries.BusyMark, queries.Args{
			"app_id": [16]byte(t.AppID), "queue_name": t.Queue, "owner": [16]byte(b.Owner), "lease_ms": b.Lease.Milliseconds(),
		})
	}
	batch.Queue(claimSQL, args)
	batch.Queue(infoSQL, args)
	br := db.SendBatch(ctx, batch)
	defer br.Close()

	fail := func(what string, err error) (Pass, error) {
		return Pass{}, fmt.Errorf("claim %s: %s%w", t, what, err)
	}
	if _, err := br.Exec(); err != nil {
		return fail("plan mode: ", err)
	}
	if mark {
		if _, err := br.Exec(); err != nil {
			return fail("busy mark: ", err)
		}
	}
	rows, err := br.Query()
	if err != nil {
		return fail("", err)
	}
	msgs := make([]Message, 0, max)
	for rows.Next() {
		m := Message{Source: t.Source, LeasedAt: leasedAt}
		if err := rows.Scan(&m.ID, &m.Payload, &m.EnqueuedAt, &m.Token, &m.Attempt, &m.MaxAttempts, &m.EnqueuedBy); err != nil {
			rows.Close()
			return fail("scan: ", err)
		}
		msgs = append(msgs, m)
	}
	if err := rows.Err(); err != nil {
		return fail("", err)
	}
	var due, foreign *time.Time
	var readyLeft bool
	var vtSecs *int32
	var dbNow time.Time
	if err := br.QueryRow().Scan(&due, &foreign, &readyLeft, &vtSecs, &dbNow); err != nil {
		return fail("next due: ", err)
	}
	local := LocalClock(dbNow)
	if vtSecs != nil {
		for i := range msgs {
			msgs[i].VisibilityTimeout = time.Duration(*vtSecs) * time.Second
		}
	}
	// The batch is one implicit transaction that commits at its Sync:
	// until Close reports success the leases may not exist, and a message
	// delivered on an uncommitted lease could be claimed by another
	// dispatcher too. Such leases, if committed after all, expire and are
	// reclaimed.
	if err := br.Close(); err != nil {
		return fail("", err)
	}
	p := Pass{Messages: sortByEnqueued(msgs), ReadyLeft: readyLeft}
	if due != nil {
		p.NextDue = local(*due)
	}
	if foreign != nil {
		p.ForeignLease = local(*foreign)
	}
	return p, nil
}

// LocalClock returns a function that turns a time read from the database
// into this process's clock, given the database's clock (dbNow) read in
// the same statement: timers armed on database times would fire early or
// late by the two clocks' difference. The result errs late by the time
// the answer took to arrive, never early.
func LocalClock(dbNow time.Time) func(time.Time) time.Time {
	now := time.Now()
	return func(t time.Time) time.Time { return now.Add(t.Sub(dbNow)) }
}

// Unmark deletes owner's busy mark on t's queue and then tries, once, to
// confirm that no producer that might have seen the queue marked is still
// uncommitted (busy_lock.sql); with needFree, also that no session holds
// the queue's busy key. It reports whether that was confirmed; if not,
// call TryBusyLock again shortly. Release the key (internal/busylock)
// before calling it.
func Unmark(ctx context.Context, db *pgxpool.Pool, t Target, owner uuid.UUID, needFree bool) (bool, error) {
	args := queries.Args{"app_id": [16]byte(t.AppID), "queue_name": t.Queue, "owner": [16]byte(owner), "need_free": needFree}
	batch := &pgx.Batch{}
	batch.Queue(queries.BusyUnmark, args)
	batch.Queue(queries.BusyLock, args)
	br := db.SendBatch(ctx, batch)
	defer br.Close()
	if _, err := br.Exec(); err != nil {
		return false, fmt.Errorf("unmark %s: %w", t, err)
	}
	var locked bool
	if err := br.QueryRow().Scan(&locked); err != nil {
		return false, fmt.Errorf("unmark %s: %w", t, err)
	}
	if err := br.Close(); err != nil {
		return false, fmt.Errorf("unmark %s: %w", t, err)
	}
	return locked, nil
}

// TryBusyLock is busy_lock.sql: true once no producer of t's queue holds
// the queue's advisory lock and, with needFree, no session holds its busy
// key.
func TryBusyLock(ctx context.Context, db *pgxpool.Pool, t Target, needFree bool) (bool, error) {
	var locked bool
	err := db.QueryRow(ctx, queries.BusyLock, queries.Args{
		"app_id": [16]byte(t.AppID), "queue_name": t.Queue, "need_free": needFree,
	}).Scan(&locked)
	if err != nil {
		return false, fmt.Errorf("busy lock %s: %w", t, err)
	}
	return locked, nil
}

// ClearMarks deletes every busy mark of owner.
func ClearMarks(ctx context.Context, db *pgxpool.Pool, owner uuid.UUID) error {
	if _, err := db.Exec(ctx, queries.BusyClear, queries.Args{"owner": [16]byte(owner)}); err != nil {
		return fmt.Errorf("clear busy marks: %w", err)
	}
	return nil
}

// sortByEnqueued restores enqueued_at order, which RETURNING does not
// promise. Batches are small, so insertion sort is enough.
func sortByEnqueued(ms []Message) []Message {
	for i := 1; i < len(ms); i++ {
		for j := i; j > 0 && ms[j].EnqueuedAt.Before(ms[j-1].EnqueuedAt); j-- {
			ms[j], ms[j-1] = ms[j-1], ms[j]
		}
	}
	return ms
}

// Extend renews one lease for another visibility timeout from now, the
// consumer's as the renewal reads it (vt). held is false if the lease was
// lost: the token no longer matches. A lease whose queue has no consumer
// any more is not renewed (held, vt zero): nothing would measure it.
func Extend(ctx context.Context, db *pgxpool.Pool, id, token uuid.UUID) (held bool, vt time.Duration, err error) {
	var vtSecs *int32
	err = db.QueryRow(ctx, queries.Extend, queries.Args{"id": [16]byte(id), "token": [16]byte(token)}).Scan(&held, &vtSecs)
	if err != nil {
		return false, 0, fmt.Errorf("extend lease of %s: %w", id, err)
	}
	if vtSecs != nil {
		vt = time.Duration(*vtSecs) * time.Second
	}
	return held, vt, nil
}
