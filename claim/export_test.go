package claim

// CombinerCounts reports how many passes c has sent and how many calls
// wait for one.
func CombinerCounts(c *Combiner) (sent int64, waiting int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.passes.Load(), len(c.waiting)
}

// Transient is transient: whether flush retries err until the leases end.
var Transient = transient
