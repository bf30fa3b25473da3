package bellhop

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/bellhopq/bellhop/internal/validate"
	queries "github.com/bellhopq/bellhop/sql"
)

// PurgeBatch is how many messages one statement of PurgeQueue deletes at
// most.
const PurgeBatch = 1000

// DeleteMessage deletes one of app's queue messages (by the id Enqueue
// returned) that waits for delivery: ready, delayed, or waiting for a
// retry. It is gone for good, with no dead letter. A message being
// delivered is left to its delivery (ErrMessageInFlight): its handler
// may have done the work already, and will ack or nack it; one whose
// delivery fails waits for its retry and can be deleted then. A message
// id that names no queue message of app (never enqueued to it, or acked,
// dead-lettered or deleted since; invoke deliveries are not queue
// messages) is ErrUnknownMessage. An unknown app is ErrUnknownApp, and
// another app's principal ErrForbidden, as for every Client method.
func (c *Client) DeleteMessage(ctx context.Context, app string, id uuid.UUID) (err error) {
	defer c.schemaError(ctx, &err)
	fail := func(err error) error {
		return fmt.Errorf("delete message %s of app %s: %w", id, printable(app), err)
	}
	appID, err := c.resolveApp(ctx, c.db, app)
	if err != nil {
		return fail(err)
	}
	args := queries.Args{"app_id": appID, "id": id}
	// The delete and the lookup that says why it deleted nothing read
	// the row at two moments: one found waiting for delivery by the
	// lookup (its delivery failed in between, or its producer committed)
	// is deleted by a second try.
	for range 2 {
		var n int64
		if err := c.db.QueryRow(ctx, queries.MessageDelete, args).Scan(&n); err != nil {
			return fail(err)
		}
		if n == 1 {
			return nil
		}
		var claimedAt *time.Time
		switch err := c.db.QueryRow(ctx, queries.MessageFind, args).Scan(&claimedAt); {
		case errors.Is(err, pgx.ErrNoRows):
			return fail(ErrUnknownMessage)
		case err != nil:
			return fail(err)
		case claimedAt != nil:
			return fail(fmt.Errorf("%w: being delivered, under a lease taken or renewed at %s; it can be deleted if the delivery fails, while it waits for its retry",
				ErrMessageInFlight, claimedAt.UTC().Format(time.RFC3339)))
		}
	}
	return fail(fmt.Errorf("%w: it changed between being delivered and waiting for delivery while it was being deleted; try again", ErrMessageInFlight))
}

// QueuedMessage is a queue message as it stands in its queue, waiting
// for delivery or being delivered (Client.QueuedMessage).
type QueuedMessage struct {
	ID      uuid.UUID
	App     string
	Queue   string
	Payload json.RawMessage
	// EnqueuedAt is its enqueued_at: for the Go client and enqueue(),
	// the start of its producer's transaction (made unique within it);
	// for a redriven message, the redrive's.
	EnqueuedAt time.Time
	// DeliverAfter, if set, is when it was or will be due: a delayed
	// message's time, or a failed delivery's retry.
	DeliverAfter *time.Time
	// Attempt is the number of deliveries counted against MaxAttempts,
	// the one in progress included; one cut short by a dispatcher's stop
	// is given back.
	Attempt     int
	MaxAttempts int
	// EnqueuedBy is the principal recorded when it was enqueued (nil:
	// none was), as DeadLetter.EnqueuedBy: forensic only.
	EnqueuedBy *uuid.UUID
	// ClaimedAt, if set, is when the lease of the delivery in progress
	// was taken, or last renewed (Message.ExtendLease): the message is in
	// flight. Nil: it waits for delivery.
	ClaimedAt *time.Time
}

// QueuedMessage returns one of app's queue messages by id (the one
// Enqueue returned), payload included, whether it waits for delivery or
// is being delivered. ErrUnknownMessage: no queue message of app has the
// id (never enqueued to it, or acked, dead-lettered or deleted since:
// DeadLetters has the dead ones; invoke deliveries are not queue
// messages). An unknown app is ErrUnknownApp, and another app's
// principal ErrForbidden.
func (c *Client) QueuedMessage(ctx context.Context, app string, id uuid.UUID) (_ QueuedMessage, err error) {
	defer c.schemaError(ctx, &err)
	appID, err := c.resolveApp(ctx, c.db, app)
	if err == nil {
		var m QueuedMessage
		if m, err = c.queuedMessage(ctx, appID, id); err == nil {
			return m, nil
		}
	}
	return QueuedMessage{}, fmt.Errorf("message %s of app %s: %w", id, printable(app), err)
}

// queuedMessage reads message id of the app with id appID, or
// ErrUnknownMessage.
func (c *Client) queuedMessage(ctx context.Context, appID, id uuid.UUID) (QueuedMessage, error) {
	var m QueuedMessage
	// As bytes: pgx decodes jsonb into a json.RawMessage with
	// json.Unmarshal, which refuses one nested deeper than 10,000
	// levels, and plain SQL can store one (as DeadLetters reads them).
	var payload []byte
	err := c.db.QueryRow(ctx, queries.MessageGet, queries.Args{"app_id": appID, "id": id}).Scan(
		&m.ID, &m.App, &m.Queue, &payload, &m.EnqueuedAt, &m.DeliverAfter,
		&m.Attempt, &m.MaxAttempts, &m.EnqueuedBy, &m.ClaimedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return QueuedMessage{}, ErrUnknownMessage
	}
	m.Payload = payload
	return m, err
}

// PurgeQueue deletes the messages of app's queue that wait for delivery
// (ready, delayed, or waiting for a retry) and whose enqueued_at (the
// start of their producer's transaction) is no later than the purge's
// start, for good, with no dead letters, and returns how many it deleted.
// Messages being delivered are left to their delivery (acked, or retried
// and then left in the queue), as are those enqueued later, and the
// queue consumer's invoke deliveries (InvokeAsync), which are not queue
// messages. It deletes in batches of PurgeBatch, each its own
// transaction, oldest first: if one fails, the batches before it stay
// deleted, the count returned with the error says how many, and running
// the purge again deletes the rest. Claims skip the rows a batch holds,
// and take the ones after them; a batch waits for a claim statement in
// progress that holds one of its rows, and leaves the messages it
// leased. A transaction that holds a row of one locked (an UPDATE by
// hand) holds the purge up until it ends, or ctx does. A bad queue name
// is ErrInvalidQueueName; an unknown app ErrUnknownApp, another app's
// principal ErrForbidden.
func (c *Client) PurgeQueue(ctx context.Context, app, queue string) (_ int64, err error) {
	defer c.schemaError(ctx, &err)
	fail := func(deleted int64, err error) error {
		err = fmt.Errorf("purge queue %s/%s: %w", printable(app), printable(queue), err)
		if deleted > 0 {
			err = fmt.Errorf("%w (the batches before it deleted %d messages)", err, deleted)
		}
		return err
	}
	if err := validate.QueueName(queue); err != nil {
		return 0, fail(0, err)
	}
	appID, err := c.resolveApp(ctx, c.db, app)
	if err != nil {
		return 0, fail(0, err)
	}
	var deleted int64
	var before *time.Time
	for {
		var n int64
		args := queries.Args{"app_id": appID, "queue_name": queue, "before": before, "batch": PurgeBatch}
		if err := c.db.QueryRow(ctx, queries.QueuePurge, pgx.QueryExecModeExec, args).Scan(&n, &before); err != nil {
			return deleted, fail(deleted, err)
		}
		deleted += n
		if n < PurgeBatch {
			return deleted, nil
		}
	}
}
