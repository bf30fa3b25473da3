package timeout_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/bellhopq/bellhop/internal/timeout"
)

func TestBound(t *testing.T) {
	failed := errors.New("read failed")
	for _, tc := range []struct {
		name     string
		d        time.Duration
		end      func(cancelParent, cancel context.CancelFunc)
		stopping bool
		want     string // Explain(failed)
	}{
		{"bound ran out", time.Millisecond, func(context.CancelFunc, context.CancelFunc) {}, false,
			"no answer within 1ms, cancelled: read failed"},
		{"caller stopped", time.Hour, func(cancelParent, _ context.CancelFunc) { cancelParent() }, true, "read failed"},
		{"cancelled after the answer", time.Hour, func(_, cancel context.CancelFunc) { cancel() }, true, "read failed"},
		{"no bound", 0, func(cancelParent, _ context.CancelFunc) { cancelParent() }, true, "read failed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			parent, cancelParent := context.WithCancel(context.Background())
			defer cancelParent()
			ctx, cancel := timeout.Bound(parent, tc.d)
			defer cancel()
			if tc.d <= 0 {
				if _, ok := ctx.Deadline(); ok {
					t.Fatal("a deadline with no bound")
				}
			}
			tc.end(cancelParent, cancel)
			select {
			case <-ctx.Done():
			case <-time.After(5 * time.Second):
				t.Fatal("the context did not end within 5s")
			}
			if got := timeout.Stopping(ctx); got != tc.stopping {
				t.Errorf("Stopping = %v, want %v", got, tc.stopping)
			}
			err := timeout.Explain(ctx, failed)
			if err.Error() != tc.want || !errors.Is(err, failed) {
				t.Errorf("Explain = %q, want %q wrapping the error", err, tc.want)
			}
			if got := timeout.Expired(err); got == tc.stopping {
				t.Errorf("Expired = %v, want %v", got, !tc.stopping)
			}
			if timeout.Explain(ctx, nil) != nil {
				t.Error("Explain(nil) is not nil")
			}
		})
	}
}
