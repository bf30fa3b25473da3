package integration

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bellhopq/bellhop"
)

// TestFanOutFillsLockTable: a batch that enqueues to more distinct queues
// than the server's lock table holds (a lock per queue, until the
// transaction ends; here a cluster of 10 connections, whose table is
// small) fails whole, and its error says why and what to do:
// PostgreSQL's own text is a bare "out of shared memory", whose hint pgx's
// error text leaves out. Split into smaller batches, the same messages go through.
func TestFanOutFillsLockTable(t *testing.T) {
	e, _ := ownEnvWith(t, map[string]string{"max_locks_per_transaction": "64", "max_connections": "10"})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const queues = 20000
	msgs := make([]bellhop.NewMessage, queues)
	for i := range msgs {
		msgs[i] = bellhop.NewMessage{Queue: fmt.Sprintf("q%d", i), Payload: []byte(`{}`)}
	}
	_, err := e.client.EnqueueMany(ctx, "app", msgs)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "53200" {
		t.Fatalf("EnqueueMany to %d queues: %v; want out of shared memory (53200)", queues, err)
	}
	for _, want := range []string{"lock table is full", "20000 in this call", "max_locks_per_transaction"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not say %q: %v", want, err)
		}
	}
	if n := e.count(t, `SELECT count(*) FROM queue_messages`); n != 0 {
		t.Errorf("%d messages written by the failed batch, want none", n)
	}
	for i := 0; i < queues; i += 500 {
		if _, err := e.client.EnqueueMany(ctx, "app", msgs[i:i+500]); err != nil {
			t.Fatalf("EnqueueMany of queues %d to %d: %v", i, i+499, err)
		}
	}
	if n := e.count(t, `SELECT count(*) FROM queue_messages`); n != queues {
		t.Errorf("%d messages written in batches of 500, want %d", n, queues)
	}
}
