package bellhop

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/bellhopq/bellhop/internal/validate"
	queries "github.com/bellhopq/bellhop/sql"
)

// InvokeAsync asks for one delivery of payload to the consumer with id
// consumer, outside its queue: the delivery waits in the outbox and goes
// through the same claim, ack, retry and dead-letter path as a queue
// message. opts.Principal is ignored; MaxAttempts 0 takes the consumer's.
// A Client made with As may invoke only its own app's consumers; others
// are reported as unknown.
func (c *Client) InvokeAsync(ctx context.Context, consumer uuid.UUID, payload []byte, opts EnqueueOptions) (_ uuid.UUID, err error) {
	defer c.schemaError(ctx, &err)
	fail := func(err error) (uuid.UUID, error) {
		return uuid.Nil, fmt.Errorf("invoke consumer %s: %w", consumer, err)
	}
	if err := validate.Payload(payload); err != nil {
		return fail(err)
	}
	if err := validate.MaxAttemptsOption(opts.MaxAttempts); err != nil {
		return fail(err)
	}
	now := c.clock()
	if _, err := validate.DeliverAt(now, opts.DeliverAfter, opts.Delay); err != nil {
		return fail(err)
	}
	at, delay := deliverArgs(now, opts)
	id, err := uuid.NewV7()
	if err != nil {
		return fail(err)
	}
	var out uuid.UUID
	err = c.db.QueryRow(ctx, queries.Invoke, queries.Args{
		"id": id, "trigger_id": consumer, "payload": json.RawMessage(payload),
		"deliver_after": at, "delay_us": delay, "max_attempts": nullable(opts.MaxAttempts), "actor": c.principalArg(),
	}).Scan(&out)
	if errors.Is(err, pgx.ErrNoRows) {
		return fail(ErrUnknownConsumer)
	}
	if err != nil {
		return fail(constraintError(err))
	}
	return out, nil
}
