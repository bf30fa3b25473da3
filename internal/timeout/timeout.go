// Package timeout bounds a statement's wait for its answer, and says so in
// its error when the bound ran out: a statement on a connection whose
// server no longer answers would otherwise wait until the kernel gave up
// on the connection, a quarter of an hour for a server that vanished.
package timeout

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// noAnswer is the cause of a context that Bound ended.
type noAnswer time.Duration

func (n noAnswer) Error() string {
	return fmt.Sprintf("no answer within %s, cancelled", time.Duration(n))
}

// Bound returns ctx limited to d; with d zero or less, ctx unlimited.
func Bound(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	if d <= 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeoutCause(ctx, d, noAnswer(d))
}

// Stopping reports whether ctx has ended for any reason but its bound (its
// caller stopping): failures then need no log line.
func Stopping(ctx context.Context) bool {
	var n noAnswer
	return ctx.Err() != nil && !errors.As(context.Cause(ctx), &n)
}

// Expired reports whether err says, as Explain makes it, that a bound ran
// out.
func Expired(err error) bool {
	var n noAnswer
	return errors.As(err, &n)
}

// Explain says, in err, that ctx's bound ran out, if it did.
func Explain(ctx context.Context, err error) error {
	var n noAnswer
	if err != nil && errors.As(context.Cause(ctx), &n) {
		return fmt.Errorf("%w: %w", n, err)
	}
	return err
}
