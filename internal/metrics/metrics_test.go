package metrics

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/bellhopq/bellhop"
)

// TestDepthsWhenTheReadFails: a failed read of the queue depths reports no
// depths and bellhop_queue_depths_ok 0. The collector kept serving the
// last good read, so /metrics showed a queue's messages as ready while the
// database was down.
func TestDepthsWhenTheReadFails(t *testing.T) {
	fail := false
	c := &depthCollector{queues: func(context.Context) ([]bellhop.QueueInfo, error) {
		if fail {
			return nil, errors.New("database down")
		}
		return []bellhop.QueueInfo{{App: "shop", Queue: "orders", Ready: 3}}, nil
	}}
	collect := func() (ok float64, depths int) {
		ch := make(chan prometheus.Metric, 16)
		c.Collect(ch)
		close(ch)
		ok = -1
		for m := range ch {
			if m.Desc() == depthsOKDesc {
				var pb dto.Metric
				if err := m.Write(&pb); err != nil {
					t.Fatal(err)
				}
				ok = pb.GetGauge().GetValue()
				continue
			}
			depths++
		}
		return ok, depths
	}
	for _, step := range []struct {
		fail   bool
		ok     float64
		depths int // four states and the oldest ready age per queue
	}{
		{false, 1, 5},
		{true, 0, 0},
		{false, 1, 5},
	} {
		fail = step.fail
		c.mu.Lock()
		c.at = time.Time{} // read again now, not a second later
		c.mu.Unlock()
		if ok, depths := collect(); ok != step.ok || depths != step.depths {
			t.Errorf("read failing %v: bellhop_queue_depths_ok %v and %d depth series, want %v and %d", step.fail, ok, depths, step.ok, step.depths)
		}
	}
}
