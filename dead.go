package bellhop

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bellhopq/bellhop/internal/validate"
	queries "github.com/bellhopq/bellhop/sql"
)

// Dead letter listing limits: DeadFilter.Limit 0 means DefaultDeadLimit;
// otherwise it is 1 to MaxDeadLimit.
const (
	DefaultDeadLimit = 100
	MaxDeadLimit     = 10000
)

// DeadLetter is a message that used up its attempts or that its consumer
// rejected for good.
type DeadLetter struct {
	ID     uuid.UUID
	Source string // "queue", or "invoke" for invoke_async deliveries
	App    string
	Queue  string
	// ConsumerID is set for "invoke" dead letters: the consumer invoked.
	ConsumerID *uuid.UUID
	// Payload is the message's JSON, nil when listed with
	// DeadFilter.OmitPayload.
	Payload      json.RawMessage
	EnqueuedAt   time.Time
	DeliverAfter *time.Time
	// Attempt is the number of the last delivery attempt, of MaxAttempts.
	Attempt     int
	MaxAttempts int
	// EnqueuedBy is the principal recorded when the message was enqueued
	// (nil: none was). enqueue() and the Go client record only a
	// principal of the message's app; a plain INSERT's
	// enqueued_by_principal is whatever its author wrote, unchecked:
	// another app's principal, or one that does not exist. Forensic
	// only, as self-declared as the INSERT that set it.
	EnqueuedBy *uuid.UUID
	// LastError says why it died: its handler's last error (for an HTTP
	// consumer, with the start of the response body), as valid UTF-8 of
	// at most claim.MaxErrorBytes (16 KiB), or that its last lease ran
	// out.
	LastError string
	DiedAt    time.Time
	// RedriveAfter, if set, is when the last attempt's lease ends: its
	// handler gave up on work that may still be running (an HTTP push left
	// unanswered, a handler cut off at its lease's end). A redrive before
	// then enqueues the message to be delivered then, not at once, so that
	// no second consumer gets it while that lease holds.
	RedriveAfter *time.Time
}

// DeadFilter selects dead letters. Empty fields select everything: App ""
// means every app's (its principal's app's, for a Client made with As). A
// non-empty App must name an app, and Queue, if set, must be a valid queue
// name. Limit 0 means DefaultDeadLimit; otherwise it is 1 to MaxDeadLimit.
type DeadFilter struct {
	App   string
	Queue string
	ID    uuid.UUID
	Limit int
	// After continues a listing that stopped at its Limit: set it to the
	// last DeadLetter listed, and only those after it in the listing's
	// order (DiedAt newest first, then ID, then Source) are listed. Only
	// its DiedAt, ID and Source are read, so the listing goes on even if
	// that dead letter has been redriven or purged since. A dead letter
	// that dies meanwhile is listed only if its DiedAt, the start of the
	// transaction that killed it, is before After's: usually it is newer.
	// An After without an ID, a DiedAt or a Source of "queue" or "invoke"
	// is ErrInvalidOptions.
	After *DeadLetter
	// OmitPayload lists the dead letters without their payloads: each
	// DeadLetter's Payload is nil, and no payload is read from the
	// database. A listing that does not show payloads should set it: a
	// payload may be up to 1 MiB, and the listing holds every one it
	// returns (up to MaxDeadLimit) in memory at once. It also lets a role
	// that may not read dead_letters' payload column list them. Left
	// false, as before it existed, payloads are read.
	OmitPayload bool
}

func nullable[T comparable](v T) *T {
	var zero T
	if v == zero {
		return nil
	}
	return &v
}

// DeadLetters lists dead letters, newest first, with their payloads
// unless f.OmitPayload is set. Like Redrive, it fails
// with ErrUnknownApp for an f.App that names no app (ErrForbidden, for a
// Client made with As, for another app), with ErrInvalidQueueName for a
// bad f.Queue and with ErrInvalidOptions for a Limit out of range.
func (c *Client) DeadLetters(ctx context.Context, f DeadFilter) (_ []DeadLetter, err error) {
	defer c.schemaError(ctx, &err)
	if f.Limit == 0 {
		f.Limit = DefaultDeadLimit
	}
	if err := validate.Int("dead letter limit", f.Limit, 1, MaxDeadLimit); err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	if f.Queue != "" {
		if err := validate.QueueName(f.Queue); err != nil {
			return nil, fmt.Errorf("list dead letters: %w", err)
		}
	}
	app, err := c.listApp(ctx, f.App)
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	f.App = app
	if f.App != "" {
		if _, err := c.resolveApp(ctx, c.db, f.App); err != nil {
			return nil, fmt.Errorf("list dead letters: %w", err)
		}
	}
	args := queries.Args{
		"app_name": nullable(f.App), "queue_name": nullable(f.Queue), "id": nullable(f.ID), "max_rows": f.Limit,
		"after_id": nil, "after_died": nil, "after_source": nil,
	}
	if a := f.After; a != nil {
		if a.ID == uuid.Nil || a.DiedAt.IsZero() || (a.Source != "queue" && a.Source != "invoke") {
			return nil, fmt.Errorf("list dead letters: %w: After must be a dead letter a listing returned, with its ID, DiedAt and Source",
				ErrInvalidOptions)
		}
		args["after_id"], args["after_died"], args["after_source"] = a.ID, a.DiedAt, a.Source
	}
	sql := queries.DeadList
	if f.OmitPayload {
		sql = queries.DeadListBrief
	}
	rows, err := c.db.Query(ctx, sql, args)
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (DeadLetter, error) {
		var d DeadLetter
		// Scanned as bytes: into a json.RawMessage pgx would decode it,
		// and a payload nested deeper than encoding/json reads (10,000;
		// plain SQL may store deeper) failed the whole listing.
		// DeadListBrief's column is NULL: Payload stays nil.
		var payload []byte
		err := r.Scan(&d.ID, &d.Source, &d.App, &d.Queue, &d.ConsumerID, &payload, &d.EnqueuedAt,
			&d.DeliverAfter, &d.Attempt, &d.MaxAttempts, &d.EnqueuedBy, &d.LastError, &d.DiedAt, &d.RedriveAfter)
		d.Payload = payload
		return d, err
	})
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	return out, nil
}

// Redrive moves app's dead letters back to be delivered again: the one
// with id (when id is not uuid.Nil, and in queue too if queue is not ""),
// or all of queue (when queue is not ""), or every one of app's. Each
// starts again at attempt 0 and keeps its max_attempts, the limit it was
// enqueued with (perhaps its producer's own choice), not the consumer's
// MaxAttempts of now. It returns how many moved. Two kinds stay where they are: an invoke dead
// letter whose consumer was removed, and one whose id a live message has
// taken again (producers may choose ids); if the selection held any, the
// error is a *NotRedrivenError (errors.Is ErrNotRedriven) saying how many
// of each, beside the count of those that moved. An unknown app is
// ErrUnknownApp, and a queue that is not a valid queue name is
// ErrInvalidQueueName: neither could select anything.
//
// Dead letters move in batches of at most DeadBatch, newest first, each
// batch one statement that moves each of its dead letters or none, and a
// redrive takes only those that died before it began (not a redriven
// message that fails again meanwhile). A batch holds its locks only until
// it commits: among them, a lock on every queue it inserts into, which
// the server's lock table has room for only so many of. If a batch fails,
// the batches before it stay moved, and the count returned with the error
// says how many they moved; running the redrive again moves the rest. A
// batch that PostgreSQL ended for a concurrent change of the same dead
// letters (a deadlock, or a serialization failure in a session that
// defaults to a stricter isolation than read committed) moved nothing
// itself, and its error says to retry.
func (c *Client) Redrive(ctx context.Context, app, queue string, id uuid.UUID) (_ int64, err error) {
	defer c.schemaError(ctx, &err)
	if err := c.deadCheck(ctx, "redrive", app, queue); err != nil {
		return 0, err
	}
	var moved int64
	var left NotRedrivenError
	var b deadBatch
	for first := true; first || b.full(); first = false {
		var n int64
		var l NotRedrivenError
		err = c.db.QueryRow(ctx, queries.DeadRedrive, pgx.QueryExecModeExec, b.args(app, queue, id, first)).
			Scan(&n, &l.ConsumerGone, &l.IDInUse, &b.size, &b.before, &b.died, &b.id, &b.source)
		if err != nil {
			return moved, batchFailed("redrive", app, moved, err)
		}
		moved += n
		left.ConsumerGone += l.ConsumerGone
		left.IDInUse += l.IDInUse
	}
	if left.ConsumerGone+left.IDInUse > 0 {
		return moved, fmt.Errorf("redrive dead letters of %s: %w", printable(app), &left)
	}
	return moved, nil
}

// PurgeDead deletes app's dead letters for good, selected as in Redrive,
// in batches as there, and fails as Redrive does, except that it never
// leaves dead letters behind (no NotRedrivenError). As there, queue "" with
// uuid.Nil selects every dead letter of the app: an id from input whose
// parse error went unchecked is uuid.Nil, and purges them all (the CLI
// refuses an empty selection for that reason).
func (c *Client) PurgeDead(ctx context.Context, app, queue string, id uuid.UUID) (_ int64, err error) {
	defer c.schemaError(ctx, &err)
	if err := c.deadCheck(ctx, "purge", app, queue); err != nil {
		return 0, err
	}
	var deleted int64
	var b deadBatch
	for first := true; first || b.full(); first = false {
		var n int64
		err = c.db.QueryRow(ctx, queries.DeadPurge, pgx.QueryExecModeExec, b.args(app, queue, id, first)).
			Scan(&n, &b.size, &b.before, &b.died, &b.id, &b.source)
		if err != nil {
			return deleted, batchFailed("purge", app, deleted, err)
		}
		deleted += n
	}
	return deleted, nil
}

// DeadBatch is how many dead letters one statement of Redrive or
// PurgeDead moves or deletes at most.
const DeadBatch = 500

// deadBatch is where a batched redrive or purge is: the size of its last
// batch, the time it began (the database's), and the last batch's oldest
// dead letter, below which the next batch starts (nil before the first,
// and after an empty one).
type deadBatch struct {
	size   int64
	before time.Time
	died   *time.Time
	id     *uuid.UUID
	source *string
}

// args are the arguments of the next batch's statement.
func (b *deadBatch) args(app, queue string, id uuid.UUID, first bool) queries.Args {
	a := queries.Args{"app_name": app, "queue_name": nullable(queue), "id": nullable(id), "batch": DeadBatch}
	if !first {
		a["before"], a["after_died"], a["after_id"], a["after_source"] = b.before, b.died, b.id, b.source
	}
	return a
}

// full reports whether the last batch was full: there may be more.
func (b *deadBatch) full() bool { return b.size == DeadBatch }

// batchFailed is the error of a batch that failed after done dead
// letters were moved or deleted by the batches before it.
func batchFailed(verb, app string, done int64, err error) error {
	err = deadOpError(verb, app, err)
	if done > 0 {
		err = fmt.Errorf("%w (the batches before it did: %d dead letters)", err, done)
	}
	return err
}

// deadCheck refuses what could select no dead letter: a bad queue name,
// an unknown app, another app's for a Client made with As.
func (c *Client) deadCheck(ctx context.Context, verb, app, queue string) error {
	if queue != "" {
		if err := validate.QueueName(queue); err != nil {
			return fmt.Errorf("%s dead letters: %w", verb, err)
		}
	}
	if _, err := c.resolveApp(ctx, c.db, app); err != nil {
		return fmt.Errorf("%s dead letters: %w", verb, err)
	}
	return nil
}

// deadOpError is a failed redrive's or purge's error. One that PostgreSQL
// ended for a concurrent change of the same rows, a deadlock (40P01) or,
// in a session whose default isolation is repeatable read or
// serializable, a serialization failure (40001), says that the statement
// changed nothing and may be retried: it was one statement of its own.
// The server's error stays wrapped.
func deadOpError(verb, app string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "40P01" || pgErr.Code == "40001") {
		return fmt.Errorf("%s dead letters of %s: a concurrent change of the same dead letters ended it, "+
			"nothing changed; retry: %w", verb, printable(app), err)
	}
	return fmt.Errorf("%s dead letters of %s: %w", verb, printable(app), err)
}
