// Package backoff computes retry delays.
package backoff

import (
	"math/rand/v2"
	"time"
)

// Delay is the wait before the attempt after attempt number attempt
// (1-based): base doubled per earlier attempt, capped at ceiling, of
// which a random half is jitter so that messages that failed together do
// not all come back together.
func Delay(attempt int, base, ceiling time.Duration) time.Duration {
	d := base
	for i := 1; i < attempt && d < ceiling; i++ {
		d *= 2
	}
	d = min(d, ceiling)
	if d <= 1 {
		return d
	}
	half := d / 2
	return half + rand.N(d-half+1)
}
