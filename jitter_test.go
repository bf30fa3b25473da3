package bellhop

import (
	"math"
	"testing"
	"time"
)

// TestJitter: a poll's wait stays within ±10% of PollInterval, and is never
// negative. A PollInterval near the largest Duration, as one meant to
// disable the fallback poll, wrapped to a negative wait in about half the
// draws, and the dispatcher polled at once instead of never.
func TestJitter(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		p        time.Duration
		low, top time.Duration
	}{
		{"the smallest PollInterval", 100 * time.Millisecond, 90 * time.Millisecond, 110 * time.Millisecond},
		{"the default", DefaultPollInterval, 54 * time.Second, 66 * time.Second},
		{"270 years", 270 * 365 * 24 * time.Hour, 243 * 365 * 24 * time.Hour, math.MaxInt64},
		{"the largest Duration", math.MaxInt64, math.MaxInt64 - math.MaxInt64/10, math.MaxInt64},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for range 10000 {
				if got := jitter(tc.p); got < tc.low || got > tc.top {
					t.Fatalf("jitter(%s) = %s; want %s to %s", tc.p, got, tc.low, tc.top)
				}
			}
		})
	}
}
