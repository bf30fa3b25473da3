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
}

// Target names what to claim from: a queue, or a consumer's invoke
// deliveries.
type Target struct {
	Source    Source
	AppID     uuid.UUID
	Queue     string    // Source Queue
	TriggerID uuid.UUID // Source Invoke
}

func (t Target) String() string {
	if t.Source == Invoke {
		return "invoke/" + t.TriggerID.String()
	}
	return t.AppID.String() + "/" + t.Queue
}

// Claim leases up to max ready messages of t, oldest first, and reports
// the next future deliver_after among t's unclaimed messages (zero if
// none). Both statements go in one round trip.
func Claim(ctx context.Context, db *pgxpool.Pool, t Target, max int) ([]Message, time.Time, error) {
	var claimSQL, dueSQL string
	var args pgx.NamedArgs
	if t.Source == Invoke {
		claimSQL, dueSQL = queries.ClaimInvoke, queries.NextDueInvoke
		args = pgx.NamedArgs{"trigger_id": t.TriggerID, "max_messages": max}
	} else {
		claimSQL, dueSQL = queries.ClaimQueue, queries.NextDueQueue
		args = pgx.NamedArgs{"app_id": t.AppID, "queue_name": t.Queue, "max_messages": max}
	}
	leasedAt := time.Now()
	b := &pgx.Batch{}
	b.Queue(claimSQL, args)
	b.Queue(dueSQL, args)
	br := db.SendBatch(ctx, b)
	defer br.Close()

	rows, err := br.Query()
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("claim %s: %w", t, err)
	}
	msgs := make([]Message, 0, max)
	for rows.Next() {
		m := Message{Source: t.Source, LeasedAt: leasedAt}
		if err := rows.Scan(&m.ID, &m.Payload, &m.EnqueuedAt, &m.Token, &m.Attempt, &m.MaxAttempts, &m.EnqueuedBy); err != nil {
			rows.Close()
			return nil, time.Time{}, fmt.Errorf("claim %s: scan: %w", t, err)
		}
		msgs = append(msgs, m)
	}
	if err := rows.Err(); err != nil {
		return nil, time.Time{}, fmt.Errorf("claim %s: %w", t, err)
	}
	var due *time.Time
	if err := br.QueryRow().Scan(&due); err != nil {
		return nil, time.Time{}, fmt.Errorf("claim %s: next due: %w", t, err)
	}
	// The batch is one implicit transaction that commits at its Sync:
	// until Close reports success the leases may not exist, and a message
	// delivered on an uncommitted lease could be claimed by another
	// dispatcher too. Such leases, if committed after all, expire and are
	// reclaimed.
	if err := br.Close(); err != nil {
		return nil, time.Time{}, fmt.Errorf("claim %s: %w", t, err)
	}
	var next time.Time
	if due != nil {
		next = *due
	}
	return sortByEnqueued(msgs), next, nil
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

// Extend renews one lease for another visibility timeout from now. It
// returns false if the lease was lost: the token no longer matches.
func Extend(ctx context.Context, db *pgxpool.Pool, id, token uuid.UUID) (bool, error) {
	var n int64
	err := db.QueryRow(ctx, queries.Extend, pgx.NamedArgs{"id": id, "token": token}).Scan(&n)
	if err != nil {
		return false, fmt.Errorf("extend lease of %s: %w", id, err)
	}
	return n > 0, nil
}
