package bellhop

import "time"

// SetClock makes c read the time from now: a producer whose clock is off.
func SetClock(c *Client, now func() time.Time) { c.now = now }

// LaneBacklogs reports whether c's queue lane and invoke lane have each
// stopped claiming for want of a free slot (lane.backlog), so that the
// next slot freed wakes them. Nothing outside the package shows it, and a
// test of the slots' hand-over must wait until both lanes wait.
func LaneBacklogs(d *Dispatcher, c Consumer) (queue, invoke bool) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	cl := d.lanes[c.ID]
	if cl == nil {
		return false, false
	}
	return cl.queue.backlog.Load(), cl.invoke.backlog.Load()
}
