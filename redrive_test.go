package bellhop_test

import (
	"errors"
	"testing"

	"github.com/google/uuid"

	"github.com/bellhopq/bellhop"
)

// TestRedriveLeavesWhatCannotMove: a redrive moves what it can and says why
// the rest stayed. An invoke dead letter whose consumer was removed was
// left silently (a redrive by its id reported "no such dead letter"), and
// one whose id a producer had reused for a live message failed the whole
// redrive with a bare unique violation, moving nothing.
func TestRedriveLeavesWhatCannotMove(t *testing.T) {
	e := fxNew(t)
	shop := e.app("shop")
	cons, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	dead := func(source string, trigger *uuid.UUID) uuid.UUID {
		t.Helper()
		id := uuid.New()
		e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, trigger_id, payload, enqueued_at, attempt, max_attempts, last_error)
			VALUES ($1, $2, $3, 'orders', $4, '{"n":1}', now(), 3, 3, 'boom')`, id, source, shop.ID, trigger)
		return id
	}
	plain := dead("queue", nil)
	reused := dead("queue", nil)
	orphan := dead("invoke", &cons.ID)
	// A producer reuses a dead message's id; the consumer goes.
	e.exec(`INSERT INTO queue_messages (id, app_id, queue_name, payload) VALUES ($1, $2, 'orders', '{"second":"life"}')`, reused, shop.ID)
	if err := e.client.RemoveConsumer(e.ctx, "shop", cons.ID); err != nil {
		t.Fatal(err)
	}

	for _, c := range []struct {
		name               string
		id                 uuid.UUID
		gone, inUse, moved int64
	}{
		{"by id, consumer gone", orphan, 1, 0, 0},
		{"by id, id in use", reused, 0, 1, 0},
		{"the queue", uuid.Nil, 1, 1, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			n, err := e.client.Redrive(e.ctx, "shop", "orders", c.id)
			var nr *bellhop.NotRedrivenError
			if !errors.Is(err, bellhop.ErrNotRedriven) || !errors.As(err, &nr) {
				t.Fatalf("Redrive: %d, %v; want ErrNotRedriven", n, err)
			}
			if n != c.moved || nr.ConsumerGone != c.gone || nr.IDInUse != c.inUse {
				t.Errorf("moved %d, left %+v; want moved %d, %d consumer gone, %d id in use (%v)", n, *nr, c.moved, c.gone, c.inUse, err)
			}
		})
	}
	// What stayed is intact; the live message is the producer's, untouched.
	if got := e.int64(`SELECT count(*) FROM dead_letters WHERE id IN ($1, $2)`, orphan, reused); got != 2 {
		t.Errorf("%d of the 2 dead letters that could not move are left", got)
	}
	if got := e.int64(`SELECT count(*) FROM dead_letters WHERE id = $1`, plain); got != 0 {
		t.Error("the movable dead letter was not redriven")
	}
	if got := e.int64(`SELECT count(*) FROM queue_messages WHERE id = $1 AND payload = '{"second":"life"}'`, reused); got != 1 {
		t.Error("the live message with the reused id changed")
	}
	if got := e.int64(`SELECT count(*) FROM queue_messages WHERE id = $1 AND attempt = 0 AND claim_token IS NULL`, plain); got != 1 {
		t.Error("the redriven message is not back in its queue, fresh")
	}
}
