package bellhop

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	queries "github.com/bellhopq/bellhop/sql"
)

// QueueInfo is one row of the queue list: a queue that has messages, dead
// letters or a consumer. Its counts take in the invoke deliveries of its
// consumer (Client.InvokeAsync) with its messages.
type QueueInfo struct {
	App      string
	Queue    string
	Ready    int64 // claimable now
	Delayed  int64 // waiting for deliver_after
	InFlight int64 // leased to a consumer
	Dead     int64 // in dead_letters
	// OldestReady is how long the oldest ready message has been ready:
	// never negative (an enqueued_at ahead of the database's clock counts
	// as now), and at most the largest Duration, about 292 years (an
	// enqueued_at a producer's INSERT set to year 1, Go's zero time).
	OldestReady     time.Duration
	ConsumerID      *uuid.UUID
	ConsumerEnabled bool
}

// ageDuration converts an age in seconds to a Duration within
// [0, math.MaxInt64]: converting a float beyond int64's range gives
// whatever the platform does, -292 years here.
func ageDuration(secs float64) time.Duration {
	switch ns := secs * float64(time.Second); {
	case ns <= 0 || math.IsNaN(ns):
		return 0
	case ns >= math.MaxInt64:
		return math.MaxInt64
	default:
		return time.Duration(ns)
	}
}

// Queues lists the queues of app, or of every app when app is "" (of its
// principal's app, for a Client made with As). An app
// that does not exist is ErrUnknownApp (ErrForbidden, for a Client made
// with As, when it is another app), as in the methods that act on one.
func (c *Client) Queues(ctx context.Context, app string) (_ []QueueInfo, err error) {
	defer c.schemaError(ctx, &err)
	app, err = c.listApp(ctx, app)
	if err != nil {
		return nil, fmt.Errorf("list queues: %w", err)
	}
	if app != "" {
		if _, err := c.resolveApp(ctx, c.db, app); err != nil {
			return nil, fmt.Errorf("list queues: %w", err)
		}
	}
	rows, err := c.db.Query(ctx, queries.QueueList, queries.Args{"app_name": nullable(app)})
	if err != nil {
		return nil, fmt.Errorf("list queues: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (QueueInfo, error) {
		var q QueueInfo
		var age *float64
		var enabled *bool
		err := r.Scan(&q.App, &q.Queue, &q.Ready, &q.Delayed, &q.InFlight, &q.Dead, &age, &q.ConsumerID, &enabled)
		if age != nil {
			q.OldestReady = ageDuration(*age)
		}
		q.ConsumerEnabled = enabled != nil && *enabled
		return q, err
	})
	if err != nil {
		return nil, fmt.Errorf("list queues: %w", err)
	}
	return out, nil
}
