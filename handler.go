package bellhop

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/internal/validate"
)

// Handler handles one delivery, in the spirit of http.Handler.
//
//   - Returning nil acks: the message is deleted.
//   - Returning an error nacks: the message is retried after the
//     consumer's backoff, or dead-lettered once its attempts are used up.
//   - Returning RetryAfter(d) retries after d instead.
//   - Returning Permanent(err) dead-letters the message at once (unless a
//     stop's grace has already cut the handler off: see Dispatcher.Run).
//   - A panic nacks, with the panic as the error; so does ending the
//     goroutine with runtime.Goexit (t.FailNow in a test).
//
// ctx has no deadline, since a renewal moves the lease's end: it is
// cancelled, with cause ErrLeaseLost, at Message.LeaseDeadline, a fifth of
// the visibility timeout (at most 5s) before the lease ends, unless
// Message.ExtendLease renews the lease first; and when the dispatcher
// stops hard. Delivery is at least once: a handler must tolerate seeing a
// message again.
type Handler interface {
	Handle(ctx context.Context, m *Message) error
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(ctx context.Context, m *Message) error

// Handle calls f.
func (f HandlerFunc) Handle(ctx context.Context, m *Message) error { return f(ctx, m) }

// Message is one delivery.
type Message struct {
	ID    uuid.UUID
	AppID uuid.UUID
	App   string
	Queue string
	// ConsumerID is the consumer being delivered to.
	ConsumerID uuid.UUID
	// Invoked is true for InvokeAsync deliveries, false for queue messages.
	Invoked bool
	// Payload is the message's JSON as PostgreSQL's jsonb prints it, not
	// the bytes enqueued: object keys sorted (shorter first) and each
	// key's last value only, numbers rewritten ("1e2" as "100"), string
	// escapes rewritten ("\u0041" as "A"), a space after each ':' and ','.
	Payload     json.RawMessage
	EnqueuedAt  time.Time
	Attempt     int // 1 on the first delivery
	MaxAttempts int
	// EnqueuedBy is the principal recorded by the producer, if any; it is
	// forensic only and nothing in Bellhop decides on it. enqueue() and
	// the Go client record only a principal of the message's app, but a
	// plain INSERT's enqueued_by_principal is unchecked: whoever may
	// INSERT can name any UUID, another app's principal included.
	EnqueuedBy *uuid.UUID
	// Principal is the principal that registered the consumer: deliveries
	// act as it.
	Principal uuid.UUID

	lease *lease
}

// String describes m without its payload, which stays out of logs even
// when a handler prints or panics with m.
func (m Message) String() string {
	kind := "message"
	if m.Invoked {
		kind = "invoke delivery"
	}
	return fmt.Sprintf("%s %s of %s/%s, attempt %d of %d, %d payload bytes", kind, m.ID, m.App, m.Queue, m.Attempt, m.MaxAttempts, len(m.Payload))
}

// GoString is String, for %#v.
func (m Message) GoString() string { return m.String() }

// Format writes String for every verb (GoString for %#v), so that no verb
// prints the fields, payload included, as %d or %x on the struct would.
func (m Message) Format(f fmt.State, verb rune) { formatAs(f, verb, m) }

// formatAs writes v's String, or its GoString for %#v, as v's Format
// method for verb: quoted for %q, otherwise as %s, with the directive's
// flags, width and precision. No verb reaches v's fields.
func formatAs(f fmt.State, verb rune, v interface {
	fmt.Stringer
	fmt.GoStringer
}) {
	s := v.String()
	if verb == 'v' && f.Flag('#') {
		s = v.GoString()
	}
	if verb != 'q' {
		verb = 's'
	}
	_, _ = fmt.Fprintf(f, fmt.FormatString(f, verb), s)
}

// LeaseDeadline is when the handler's context ends unless the lease is
// extended.
func (m *Message) LeaseDeadline() time.Time {
	if m.lease == nil {
		return time.Time{}
	}
	return m.lease.deadline()
}

// ExtendLease renews the message's lease for another visibility timeout
// from now, and moves the handler context's end with it, for work that
// takes longer than one timeout (like SQS's ChangeMessageVisibility). The
// timeout is the consumer's as the renewal reads it, so a changed timeout
// applies from the next renewal on. It returns ErrLeaseLost if the lease
// already expired, if the handler's context has already ended for it, or
// once the handler has returned (a goroutine it left behind), and
// ErrNoConsumer, leaving the lease as it was, if the queue message's
// consumer has been removed. An invoke delivery (Invoked) is deleted with
// its consumer: its renewal returns ErrLeaseLost, and its outcome is
// written nowhere.
func (m *Message) ExtendLease(ctx context.Context) error {
	if m.lease == nil {
		return errors.New("bellhop: ExtendLease on a message not being delivered")
	}
	return m.lease.extend(ctx)
}

// lease tracks a delivery's lease and cancels its handler before the
// lease runs out.
type lease struct {
	db     *pgxpool.Pool
	msg    *claim.Message
	vt     time.Duration // under mu
	cancel context.CancelCauseFunc

	mu    sync.Mutex
	end   time.Time
	timer *time.Timer
	// lost is set when the timer fires: the handler's context has ended
	// for the lease, which no renewal takes back.
	lost atomic.Bool
	// finished is set once the handler has returned.
	finished atomic.Bool
}

// leaseMargin is how long before the lease ends the handler's context is
// cancelled: a fifth of the visibility timeout, at most five seconds, so
// that the handler's outcome is written while the lease still holds.
func leaseMargin(vt time.Duration) time.Duration { return min(vt/5, 5*time.Second) }

// startBy is the latest a delivery of cm, leased for vt, may start: its
// handler's context would end then (lane.releaseUnstarted). A slack before
// it, for an HTTP push to connect in, was tried and dropped: a claim path
// that always took that long released the message unstarted, its attempt
// refunded, for ever (a band of 250 ms under the lease's end).
func startBy(cm *claim.Message, vt time.Duration) time.Time {
	return cm.LeasedAt.Add(vt - leaseMargin(vt))
}

func newLease(db *pgxpool.Pool, m *claim.Message, vt time.Duration, cancel context.CancelCauseFunc) *lease {
	l := &lease{db: db, msg: m, vt: vt, cancel: cancel}
	l.end = m.LeasedAt.Add(vt - leaseMargin(vt))
	l.timer = time.AfterFunc(time.Until(l.end), func() {
		l.lost.Store(true)
		cancel(ErrLeaseLost)
	})
	return l
}

func (l *lease) deadline() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.end
}

func (l *lease) extend(ctx context.Context) error {
	// Checked first: a handler that renews with its own context, ended by
	// this, would otherwise get that context's error from the query.
	if l.lost.Load() {
		return fmt.Errorf("extend lease of %s: %w", l.msg.ID, ErrLeaseLost)
	}
	if l.finished.Load() {
		return fmt.Errorf("extend lease of %s: the handler has returned: %w", l.msg.ID, ErrLeaseLost)
	}
	start := time.Now()
	held, vt, err := claim.Extend(ctx, l.db, l.msg.ID, l.msg.Token)
	if err != nil {
		if l.lost.Load() {
			// Ended while the renewal waited (on a lock, a connection):
			// the query's error is most likely that of the handler's own
			// context, which this ended.
			return fmt.Errorf("extend lease of %s: %w (%w)", l.msg.ID, ErrLeaseLost, err)
		}
		return err
	}
	if !held {
		return fmt.Errorf("extend lease of %s: %w", l.msg.ID, ErrLeaseLost)
	}
	if vt <= 0 {
		return fmt.Errorf("extend lease of %s: %w", l.msg.ID, ErrNoConsumer)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.vt = vt
	l.end = start.Add(l.vt - leaseMargin(l.vt))
	if !l.timer.Stop() {
		// The handler's context has already ended (the timer fired while
		// the renewal ran, or before it): the dispatcher has given the
		// delivery up, and a renewal cannot take that back. The lease the
		// database now holds is what a retry waits for.
		return fmt.Errorf("extend lease of %s: %w", l.msg.ID, ErrLeaseLost)
	}
	l.timer.Reset(time.Until(l.end))
	return nil
}

// stop ends the lease's timer once the handler has returned; renewals
// from then on (a goroutine the handler left behind) fail at once, with
// no statement: the pool may be closed by then. It records the lease's
// end, renewals included, in the message, for the Completer's retries
// (claim.Message.LeaseEnd): under mu, so that a renewal still under way
// finds the timer stopped and changes nothing after it.
func (l *lease) stop() {
	l.finished.Store(true)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.timer.Stop()
	l.msg.LeaseEnd = l.end.Add(leaseMargin(l.vt))
}

// timeout is the visibility timeout the lease is measured with now.
func (l *lease) timeout() time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.vt
}

// RetryAfter makes a handler's delivery fail and be retried after d
// (counting as an attempt), instead of after the consumer's backoff. A
// negative d means at once, and d is cut to 10 years, the longest delay
// Enqueue takes.
func RetryAfter(d time.Duration) error {
	return &retryAfterError{d: min(max(d, 0), validate.MaxDelay)}
}

type retryAfterError struct{ d time.Duration }

func (e *retryAfterError) Error() string { return fmt.Sprintf("retry after %s", e.d) }

// Permanent wraps err to make the dispatcher dead-letter the message at
// once: retrying cannot help. A handler that a stop's grace has cut off
// has its message released instead, attempt refunded, whatever it
// returns but nil: its failure may be the cancellation's.
func Permanent(err error) error {
	if err == nil {
		err = errors.New("rejected")
	}
	return &permanentError{err: err}
}

type permanentError struct{ err error }

func (e *permanentError) Error() string { return "permanent: " + e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Resolver tells a dispatcher which Handler serves a consumer. A nil
// Handler means this dispatcher does not serve it; another may. A nil
// pointer or nil HandlerFunc in the Handler counts as nil. A Resolver
// that panics is logged and serves nothing. The dispatcher asks it for
// every consumer at each reload, one call at a time; a slow one delays
// the reload's changes, not the delivery of queues already served.
type Resolver interface {
	Resolve(c Consumer) Handler
}

// Mux is a Resolver that maps (app, queue) to Go handlers. It serves only
// consumers without a URL: a consumer with one is an HTTP endpoint's,
// which `bellhop run` pushes to, signed, and a Go handler that took its
// messages would compete with the daemon and bypass the endpoint.
type Mux struct {
	mu       sync.RWMutex
	handlers map[[2]string]Handler
}

// NewMux returns an empty Mux. The zero Mux is empty too, and ready to use.
func NewMux() *Mux { return &Mux{} }

// Handle serves app's queue with h. Call it before the dispatcher runs: a
// running dispatcher asks its Resolver again only when it reloads its
// consumers, which it does when a consumer is registered, changed,
// paused, resumed or removed, or its listener reconnects, and not on a
// timer. A second Handle of the same app and queue replaces the first.
// Like net/http's ServeMux, it panics if h is nil (or a nil
// HandlerFunc or pointer): that is a programming error, which would
// otherwise show only as the queue never being served.
func (m *Mux) Handle(app, queue string, h Handler) {
	if isNil(h) {
		panic("bellhop: Mux.Handle of " + app + "/" + queue + " with a nil handler")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.handlers == nil {
		m.handlers = map[[2]string]Handler{}
	}
	m.handlers[[2]string{app, queue}] = h
}

// Resolve implements Resolver: the handler of c's app and queue, or nil
// if c has a URL or none was registered.
func (m *Mux) Resolve(c Consumer) Handler {
	if c.URL != "" {
		return nil
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	return m.handlers[[2]string{c.App, c.Queue}]
}

// isNil reports whether v is nil or holds a nil pointer, func, map, slice
// or channel: a typed nil that an interface's nil check lets through, and
// that would panic when first called (a Handler, a Resolver).
func isNil(v any) bool {
	if v == nil {
		return true
	}
	switch r := reflect.ValueOf(v); r.Kind() {
	case reflect.Pointer, reflect.Func, reflect.Map, reflect.Slice, reflect.Chan:
		return r.IsNil()
	}
	return false
}
