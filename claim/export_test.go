package claim

import "time"

// CombinerCounts reports how many passes c has sent and how many calls
// wait for one.
func CombinerCounts(c *Combiner) (sent int64, waiting int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.passes.Load(), len(c.waiting)
}

// Transient is transient: whether flush retries err until the leases end.
var Transient = transient

// SetTryTimeout bounds each of c's tries by d instead of writeTimeout. It
// must be called before the first Submit.
func SetTryTimeout(c *Completer, d time.Duration) { c.tryTimeout = d }

// NoConn is err as Write returns it when it got no connection to send on.
func NoConn(err error) error { return &noConnError{err} }
