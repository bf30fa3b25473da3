package bellhop

import (
	"errors"
	"fmt"
	"strings"

	"github.com/bellhopq/bellhop/internal/validate"
)

// Errors returned by Client methods (and ErrInvalidOptions by
// NewDispatcher and Run too), except ErrLeaseLost and ErrNoConsumer,
// which Message.ExtendLease returns (ErrLeaseLost also ends a handler's
// context, as its cause). They are wrapped with context; test for them
// with errors.Is. A database without Bellhop's schema, or with an older
// one, is migrations.ErrNoSchema or migrations.ErrSchemaBehind (see
// NewClient).
var (
	// ErrInvalidQueueName: a queue name is 1 to 128 bytes of [A-Za-z0-9._:-].
	ErrInvalidQueueName = validate.ErrQueueName
	// ErrInvalidName: an app or principal name is 1 to 63 bytes of
	// [A-Za-z0-9._-], starting with a letter or digit.
	ErrInvalidName = validate.ErrName
	// ErrInvalidPayload: the payload is not one JSON value (or nests more
	// than 128 deep, a limit of this client's, which a plain INSERT or
	// enqueue() does not apply, or holds \u0000 or half of a surrogate
	// pair, which jsonb cannot store).
	ErrInvalidPayload = validate.ErrPayload
	// ErrPayloadTooLarge: the payload is over 1 MiB, as given or as the
	// database prints it (jsonb text).
	ErrPayloadTooLarge = validate.ErrTooLarge
	// ErrInvalidOptions: an option is out of range or contradicts another.
	ErrInvalidOptions = validate.ErrOption
	// ErrUnknownApp: no app has that name. A method that looks an app up
	// returns it too for a name that breaks the naming rules, and then
	// says so; CreateApp returns ErrInvalidName for one. An enqueue that
	// meets a deletion of its app in progress waits for it, and returns
	// ErrUnknownApp once it commits; one that comes first holds the
	// deletion off until its transaction ends.
	ErrUnknownApp = errors.New("unknown app")
	// ErrAppExists: an app with that name exists already.
	ErrAppExists = errors.New("app already exists")
	// ErrUnknownPrincipal: the principal does not exist in that app. A
	// method that looks a principal up returns it too for a name that
	// breaks the naming rules, and then says so; CreatePrincipal returns
	// ErrInvalidName for one.
	ErrUnknownPrincipal = errors.New("unknown principal")
	// ErrPrincipalExists: the app has a principal of that name already.
	ErrPrincipalExists = errors.New("principal already exists")
	// ErrConsumerExists: the queue has a consumer already; a queue has at
	// most one.
	ErrConsumerExists = errors.New("queue already has a consumer")
	// ErrUnknownConsumer: no consumer with that id in that app.
	ErrUnknownConsumer = errors.New("unknown consumer")
	// ErrForbidden: the Client acts as a principal of another app (an app
	// that does not exist is ErrUnknownApp, whoever asks).
	ErrForbidden = errors.New("forbidden")
	// ErrLeaseLost: the message's lease expired and it may be delivered
	// again, or, for an invoke delivery, it was removed with its consumer;
	// the handler's work on it no longer counts.
	ErrLeaseLost = errors.New("lease lost")
	// ErrNoConsumer: Message.ExtendLease found the queue message's
	// consumer removed, and left the lease to end when it would have.
	ErrNoConsumer = errors.New("the queue has no consumer; lease not renewed")
	// ErrUnknownMessage: no queue message with that id in that app: never
	// enqueued to it, or acked, dead-lettered or deleted since.
	ErrUnknownMessage = errors.New("unknown message")
	// ErrMessageInFlight: the message is being delivered (leased), and
	// is left to that delivery: DeleteMessage can delete it only once it
	// waits for delivery again (its delivery failed, to be retried).
	ErrMessageInFlight = errors.New("message in flight")
	// ErrNotRedriven: some of the dead letters a redrive selected could
	// not be moved back and are still dead letters; the error is a
	// *NotRedrivenError, which says how many and why.
	ErrNotRedriven = errors.New("not redriven")
)

// NotRedrivenError is Redrive's error for selected dead letters it left
// where they are. The others moved.
type NotRedrivenError struct {
	// ConsumerGone counts invoke dead letters whose consumer was removed:
	// there is nothing to deliver them to. Purge them.
	ConsumerGone int64
	// IDInUse counts dead letters whose id a live message (or invoke
	// delivery) has taken again: a producer reused it. Redrive them once
	// that message is gone, or purge them.
	IDInUse int64
}

// Error says how many dead letters stayed, and why, with what to do.
func (e *NotRedrivenError) Error() string {
	var why []string
	if e.ConsumerGone > 0 {
		why = append(why, fmt.Sprintf("%d invoke delivery(ies) whose consumer was removed (purge them)", e.ConsumerGone))
	}
	if e.IDInUse > 0 {
		why = append(why, fmt.Sprintf("%d whose id a live message has taken again (redrive once it is gone, or purge)", e.IDInUse))
	}
	return fmt.Sprintf("%d dead letter(s) not redriven: %s", e.ConsumerGone+e.IDInUse, strings.Join(why, "; "))
}

// Unwrap makes errors.Is(err, ErrNotRedriven) hold.
func (e *NotRedrivenError) Unwrap() error { return ErrNotRedriven }

// ErrAbandoned, wrapped in a handler's error, says that the handler gave up
// waiting for work that may still be running, as an HTTP push does when the
// consumer does not answer within its timeout, or when the handler's context
// ends before it answers. The retry then waits for the end of the message's
// lease as well as for its backoff, so that it cannot overlap that work;
// that holds, too, for a handler cancelled by a stopping dispatcher, whose
// message is otherwise released for another dispatcher at once. A handler
// whose lease ran short is treated the same way without it.
var ErrAbandoned = errors.New("abandoned")
