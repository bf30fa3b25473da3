package bellhop

import "time"

// SetClock makes c read the time from now: a producer whose clock is off.
func SetClock(c *Client, now func() time.Time) { c.now = now }

// RemoveTries is how many times RemoveConsumer tries a removal that
// PostgreSQL ended for a deadlock or serialization failure.
const RemoveTries = removeTries
