package backoff

import (
	"testing"
	"time"
)

func TestDelay(t *testing.T) {
	tests := []struct {
		attempt    int
		base, cap_ time.Duration
		lo, hi     time.Duration
	}{
		{1, time.Second, time.Minute, 500 * time.Millisecond, time.Second},
		{2, time.Second, time.Minute, time.Second, 2 * time.Second},
		{4, time.Second, time.Minute, 4 * time.Second, 8 * time.Second},
		{7, time.Second, time.Minute, 30 * time.Second, time.Minute},  // 64s capped at 60s
		{60, time.Second, time.Minute, 30 * time.Second, time.Minute}, // no overflow
		{1, time.Nanosecond, time.Nanosecond, time.Nanosecond, time.Nanosecond},
	}
	for _, tt := range tests {
		seen := map[time.Duration]bool{}
		for range 200 {
			d := Delay(tt.attempt, tt.base, tt.cap_)
			if d < tt.lo || d > tt.hi {
				t.Fatalf("Delay(%d, %s, %s) = %s, want within [%s, %s]", tt.attempt, tt.base, tt.cap_, d, tt.lo, tt.hi)
			}
			seen[d] = true
		}
		if tt.hi > tt.lo && len(seen) < 2 {
			t.Errorf("Delay(%d, %s, %s) never varied: no jitter", tt.attempt, tt.base, tt.cap_)
		}
	}
}
