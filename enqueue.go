package bellhop

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/bellhopq/bellhop/internal/validate"
	queries "github.com/bellhopq/bellhop/sql"
)

// EnqueueOptions are the optional settings of one message. The zero value
// means: deliver now, the queue consumer's max attempts (3 if the queue
// has no consumer), no enqueuing principal recorded (the Client's own,
// for a Client made with As).
type EnqueueOptions struct {
	// DeliverAfter holds the message until then. Times in the past mean
	// now. At most ten years ahead. Exclusive with Delay.
	DeliverAfter time.Time
	// Delay holds the message for this long from now, as the database's
	// clock tells it. Exclusive with DeliverAfter.
	Delay time.Duration
	// MaxAttempts bounds deliveries, from 1 to 1000; 0 takes the default.
	MaxAttempts int
	// Principal records who enqueued, for forensics only; it must belong
	// to the app, which the client and enqueue() check (a plain INSERT's
	// enqueued_by_principal is not checked: see Message.EnqueuedBy).
	// uuid.Nil records nobody, or the Client's principal for a Client
	// made with As.
	Principal uuid.UUID
}

// NewMessage is one message of a batch.
type NewMessage struct {
	Queue   string
	Payload []byte // one JSON value, at most 1 MiB
	Options EnqueueOptions
}

// Enqueue adds one message to app's queue and returns its id. Payload must
// be one JSON value of at most 1 MiB.
func (c *Client) Enqueue(ctx context.Context, app, queue string, payload []byte, opts EnqueueOptions) (_ uuid.UUID, err error) {
	defer c.schemaError(ctx, &err)
	ids, err := c.enqueue(ctx, c.db, app, []NewMessage{{Queue: queue, Payload: payload, Options: opts}})
	if err != nil {
		return uuid.Nil, err
	}
	return ids[0], nil
}

// EnqueueTx is Enqueue inside the caller's transaction: the message exists,
// and its consumer is notified, only if tx commits. This is the
// transactional outbox: write your rows and the message together.
//
// The client's own checks (queue name, options, payload size as sent, JSON,
// UTF-8, lone surrogates, numbers beyond numeric's range or written out to
// more than 1 MiB) run before any statement and leave tx as it was. A
// rejection only the database can make (a payload whose jsonb text
// exceeds 1 MiB, which comes back as the same ErrPayloadTooLarge; or any
// other error of the server's, such as a full lock table, 53200) is a
// failed statement, and aborts tx, as in PostgreSQL any error does: roll
// it back, or wrap the call in a savepoint (tx.Begin) to go on without
// the message.
//
// The messages one transaction enqueues (EnqueueTx, EnqueueManyTx,
// enqueue() in SQL) are claimed in the order of its calls: each is
// enqueued a microsecond after the one before it.
func (c *Client) EnqueueTx(ctx context.Context, tx pgx.Tx, app, queue string, payload []byte, opts EnqueueOptions) (_ uuid.UUID, err error) {
	defer c.schemaError(ctx, &err)
	if isNil(tx) {
		return uuid.Nil, fmt.Errorf("bellhop: EnqueueTx: nil transaction: %w", ErrInvalidOptions)
	}
	ids, err := c.enqueue(ctx, tx, app, []NewMessage{{Queue: queue, Payload: payload, Options: opts}})
	if err != nil {
		return uuid.Nil, err
	}
	return ids[0], nil
}

// EnqueueMany adds a batch of messages to app's queues in one statement and
// returns their ids in order. If any message is invalid, none is written.
// A batch's messages are claimed in its order: each is enqueued a
// microsecond after the one before it. Their payloads may total at most
// 256 MiB.
// An empty batch writes nothing, and fails as a batch would for an unknown
// app or a principal that is not of app. In a batch of two or more, an
// error that one message caused names it ("message 3 of 10", from 1) and
// has a method Position() int, its index in msgs (from 0), which errors.As
// finds through an interface{ Position() int }; a batch of one names its
// queue instead.
func (c *Client) EnqueueMany(ctx context.Context, app string, msgs []NewMessage) (_ []uuid.UUID, err error) {
	defer c.schemaError(ctx, &err)
	return c.enqueue(ctx, c.db, app, msgs)
}

// EnqueueManyTx is EnqueueMany inside the caller's transaction. A
// rejection by the database aborts tx, as for EnqueueTx. The messages
// of one transaction are claimed in the order of its calls, as those of
// EnqueueTx.
func (c *Client) EnqueueManyTx(ctx context.Context, tx pgx.Tx, app string, msgs []NewMessage) (_ []uuid.UUID, err error) {
	defer c.schemaError(ctx, &err)
	if isNil(tx) {
		return nil, fmt.Errorf("bellhop: EnqueueManyTx: nil transaction: %w", ErrInvalidOptions)
	}
	return c.enqueue(ctx, tx, app, msgs)
}

func (c *Client) enqueue(ctx context.Context, q querier, app string, msgs []NewMessage) ([]uuid.UUID, error) {
	if validate.Name("app", app) != nil {
		return nil, enqueueError(app, msgs, -1, unknownApp(app))
	}
	if len(msgs) == 0 {
		// Nothing to write, but the answer is the one a batch would get:
		// an unknown app, or a principal of another app, is an error.
		if _, err := c.resolveApp(ctx, q, app); err != nil {
			return nil, enqueueError(app, msgs, -1, err)
		}
		return nil, nil
	}
	// Checked first: pgx refuses a statement of a gigabyte or more only
	// once every payload is checked and encoded, at several times the
	// batch's size in memory.
	var total int
	for _, m := range msgs {
		total += len(m.Payload)
	}
	if total > maxBatchBytes {
		return nil, enqueueError(app, msgs, -1, fmt.Errorf("%w: the batch's payloads total %d bytes, more than the %d bytes (%d MiB) one call may send: split the batch",
			ErrPayloadTooLarge, total, maxBatchBytes, maxBatchBytes>>20))
	}
	n := len(msgs)
	var (
		ids      = make([]uuid.UUID, n)
		queues   = make([]string, n)
		payloads = make([]json.RawMessage, n)
		deliver  = make([]*time.Time, n)
		delays   = make([]*int64, n)
		attempts = make([]*int32, n)
		// Ids go to pgx through queries.UUID, above all those in a slice.
		idArgs     = make([]pgtype.UUID, n)
		principals = make([]pgtype.UUID, n) // not Valid: none
		now        = c.clock()
	)
	for i, m := range msgs {
		if err := checkMessage(now, m); err != nil {
			return nil, enqueueError(app, msgs, i, err)
		}
		id, err := uuid.NewV7()
		if err != nil {
			return nil, fmt.Errorf("enqueue: make id: %w", err)
		}
		ids[i], idArgs[i], queues[i], payloads[i] = id, queries.UUID(id), m.Queue, json.RawMessage(m.Payload)
		deliver[i], delays[i] = deliverArgs(now, m.Options)
		if m.Options.MaxAttempts != 0 {
			v := int32(m.Options.MaxAttempts)
			attempts[i] = &v
		}
		p := m.Options.Principal
		if !c.operator {
			if p != uuid.Nil && p != c.actor {
				return nil, enqueueError(app, msgs, i, fmt.Errorf("%w: a client acting as principal %s cannot enqueue as %s", ErrForbidden, c.actor, p))
			}
			p = c.actor
		}
		if p != uuid.Nil || !c.operator {
			principals[i] = queries.UUID(p)
		}
	}
	var appFound bool
	var foreign, inserted int64
	var firstForeign *int64
	var row pgx.Row
	if n == 1 {
		row = q.QueryRow(ctx, queries.EnqueueOne, queries.Args{
			"app_name": app, "id": idArgs[0], "queue_name": queues[0], "payload": payloads[0],
			"deliver_after": deliver[0], "delay_us": delays[0], "max_attempts": attempts[0], "principal": principals[0],
		})
	} else {
		row = q.QueryRow(ctx, queries.Enqueue, queries.Args{
			"app_name": app, "ids": idArgs, "queue_names": queues, "payloads": payloads,
			"deliver_after": deliver, "delays_us": delays, "max_attempts": attempts, "principals": principals,
		})
	}
	err := row.Scan(&appFound, &foreign, &inserted, &firstForeign)
	switch {
	case err != nil:
		err = lockTableFull(constraintError(err), queues)
		return nil, enqueueError(app, msgs, c.oversized(ctx, err, payloads), err)
	case !appFound:
		return nil, enqueueError(app, msgs, -1, unknownApp(app))
	case foreign > 0 && !c.operator:
		return nil, enqueueError(app, msgs, -1, fmt.Errorf("%w: principal %s does not belong to app \"%s\"", ErrForbidden, c.actor, printable(app)))
	case foreign > 0:
		return nil, enqueueError(app, msgs, position(firstForeign), foreignPrincipal(app, msgs, position(firstForeign), foreign))
	case inserted != int64(n):
		return nil, enqueueError(app, msgs, -1, fmt.Errorf("inserted %d of %d messages", inserted, n))
	}
	return ids, nil
}

// lockTableFull explains PostgreSQL's "out of shared memory" (53200),
// whose hint pgx's error text leaves out: the insert trigger takes a lock
// per distinct queue (docs/busy-marks.md), held until the transaction
// ends, in a lock table the whole server shares, so a transaction that
// fans out to thousands of queues fills it, for itself or for the others.
// Other errors pass through, 53200's other causes included (the server
// out of memory, predicate locks), whose hint does not name
// max_locks_per_transaction.
func lockTableFull(err error, queues []string) error {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "53200" || !strings.Contains(pe.Hint, "max_locks_per_transaction") {
		return err
	}
	distinct := len(slices.Compact(slices.Sorted(slices.Values(queues))))
	return fmt.Errorf("%w (the server's lock table is full: a transaction holds a lock on each distinct queue it enqueues to, "+
		"%d in this call, until it ends; enqueue to fewer queues per transaction, end open transactions that did, "+
		"or raise max_locks_per_transaction)", err, distinct)
}

// deliverArgs is a message's time to deliver as the enqueue statements
// take it: a DeliverAfter as the time it names, and a Delay in
// microseconds, which the database adds to its own clock, so that a
// producer whose clock is off still delays by what it asked. now, the
// producer's clock, only turns past times into "now". Both nil: now.
func deliverArgs(now time.Time, o EnqueueOptions) (*time.Time, *int64) {
	if o.Delay > 0 {
		us := o.Delay.Microseconds()
		return nil, &us
	}
	if at, _ := validate.DeliverAt(now, o.DeliverAfter, 0); !at.IsZero() {
		return &at, nil
	}
	return nil, nil
}

func checkMessage(now time.Time, m NewMessage) error {
	if err := validate.QueueName(m.Queue); err != nil {
		return err
	}
	if err := validate.Payload(m.Payload); err != nil {
		return err
	}
	if err := validate.MaxAttemptsOption(m.Options.MaxAttempts); err != nil {
		return err
	}
	_, err := validate.DeliverAt(now, m.Options.DeliverAfter, m.Options.Delay)
	return err
}

// oversized finds the position of the batch's first payload that is over
// 1 MiB as jsonb text, after the table's constraint refused the batch for
// one (err), or returns -1.
func (c *Client) oversized(ctx context.Context, err error, payloads []json.RawMessage) int {
	if len(payloads) < 2 || !errors.Is(err, ErrPayloadTooLarge) {
		return -1
	}
	// On the pool, since an EnqueueTx's transaction is aborted by the
	// refusal; and only if the pool has a connection to spare, for a
	// bounded time: that transaction may hold the pool's last one, and the
	// position only adds to an error the caller has anyway. The bound
	// allows for parsing the batch again, over 1 MiB: about 0.3 s on an
	// idle 2-core machine, and more than 1 s (the bound until 2026-12-02,
	// which a loaded CI run exceeded) on a busy one.
	if st := c.db.Stat(); st.IdleConns() == 0 && st.TotalConns() >= st.MaxConns() {
		return -1
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var first *int64
	if c.db.QueryRow(ctx, queries.EnqueueOversized, queries.Args{"payloads": payloads}).Scan(&first) != nil {
		return -1
	}
	return position(first)
}

// position turns a statement's 1-based position into an index, -1 for
// none.
func position(p *int64) int {
	if p == nil || *p < 1 {
		return -1
	}
	return int(*p - 1)
}

// maxBatchBytes bounds the payloads of one EnqueueMany call: a statement
// of a gigabyte or more is refused (pgx and PostgreSQL both bound a
// message at 1 GiB), and building one takes several times its size in the
// client's memory and the server's.
const maxBatchBytes = 256 << 20

// foreignPrincipal is ErrUnknownPrincipal for a batch in which foreign
// messages name a principal that is not of app, the first at position i.
func foreignPrincipal(app string, msgs []NewMessage, i int, foreign int64) error {
	if i < 0 || i >= len(msgs) {
		return fmt.Errorf("%w: %d message(s) name a principal that does not belong to app \"%s\"", ErrUnknownPrincipal, foreign, printable(app))
	}
	var others string
	if foreign > 1 {
		others = fmt.Sprintf(" (%d messages of the batch name one that does not)", foreign)
	}
	return fmt.Errorf("%w: principal %s does not belong to app \"%s\"%s", ErrUnknownPrincipal, msgs[i].Options.Principal, printable(app), others)
}

// enqueueError adds the app, and the queue or batch position, to err.
func enqueueError(app string, msgs []NewMessage, i int, err error) error {
	switch {
	case len(msgs) == 0:
		return fmt.Errorf("enqueue to app %s: %w", printable(app), err)
	case len(msgs) == 1:
		return fmt.Errorf("enqueue %s/%s: %w", printable(app), printable(msgs[0].Queue), err)
	case i >= 0 && i < len(msgs):
		return &batchError{i: i, err: fmt.Errorf("enqueue to app %s: message %d of %d (queue %s): %w",
			printable(app), i+1, len(msgs), printable(msgs[i].Queue), err)}
	}
	return fmt.Errorf("enqueue %d messages to app %s: %w", len(msgs), printable(app), err)
}

// batchError is an error of a batch that one message of it caused.
type batchError struct {
	i   int
	err error
}

func (e *batchError) Error() string { return e.err.Error() }
func (e *batchError) Unwrap() error { return e.err }

// Position is the index, in the batch, of the message at fault. The CLI
// finds it with errors.As, to name the line.
func (e *batchError) Position() int { return e.i }

// unknownApp is ErrUnknownApp for app, saying why when app breaks the
// naming rules (which the apps table enforces).
func unknownApp(app string) error {
	return fmt.Errorf("%w \"%s\"%s", ErrUnknownApp, printable(app), nameHint("app", app))
}

// unknownPrincipal is ErrUnknownPrincipal for principal in app, saying why
// when principal breaks the naming rules.
func unknownPrincipal(principal, app string) error {
	return fmt.Errorf("%w \"%s\" in app \"%s\"%s", ErrUnknownPrincipal, printable(principal), printable(app), nameHint("principal", principal))
}

// nameHint is why name, of kind "app" or "principal", names nothing when
// it breaks the naming rules, and "" when it does not.
// Such a name is refused before any query: sent as a parameter, one that
// is not valid UTF-8 or holds a NUL fails with an encoding error, not a
// lookup miss.
func nameHint(kind, name string) string {
	if validate.Name(kind, name) != nil {
		return " (not a valid " + kind + " name: " + validate.NameRule + ")"
	}
	return ""
}

// printable keeps untrusted names short and free of control characters in
// error messages, and hides what may be credentials, as the CLI does
// (validate.Shown): a connection string passed where a name belongs was
// printed whole, password and all.
func printable(s string) string {
	s, ok := validate.Redact(s)
	if !ok {
		return "(not shown: it may carry credentials)"
	}
	if len(s) > 64 {
		s = s[:64] + "…"
	}
	q := fmt.Sprintf("%q", s)
	return q[1 : len(q)-1]
}
