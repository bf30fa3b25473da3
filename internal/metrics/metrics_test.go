package metrics

import (
	"context"
	"errors"
	"maps"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/notify"
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

// TestListenerMetrics: the listener's state and counters, as its Stats
// give them; a deaf listener (LISTEN through transaction pooling) shows as
// bellhop_listener_deaf 1, beside the heartbeats it missed.
func TestListenerMetrics(t *testing.T) {
	names := map[*prometheus.Desc]string{
		listenerConnected: "connected", listenerConnects: "reconnects", listenerNotes: "notifications",
		listenerGarbled: "garbled", listenerMissed: "missed", listenerDeaf: "deaf",
	}
	for _, tc := range []struct {
		name  string
		stats notify.Stats
		want  map[string]float64
	}{
		{"healthy", notify.Stats{Connected: true, Connects: 1, Notifications: 7},
			map[string]float64{"connected": 1, "reconnects": 0, "notifications": 7, "garbled": 0, "missed": 0, "deaf": 0}},
		{"deaf", notify.Stats{Connected: true, Connects: 3, HungRestarts: 2, Deaf: true, Garbled: 1},
			map[string]float64{"connected": 1, "reconnects": 2, "notifications": 0, "garbled": 1, "missed": 2, "deaf": 1}},
		{"reconnecting after a miss", notify.Stats{Connects: 2, HungRestarts: 1},
			map[string]float64{"connected": 0, "reconnects": 1, "notifications": 0, "garbled": 0, "missed": 1, "deaf": 0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &listenerCollector{stats: func() notify.Stats { return tc.stats }}
			ch := make(chan prometheus.Metric, 16)
			c.Collect(ch)
			close(ch)
			got := map[string]float64{}
			for m := range ch {
				var pb dto.Metric
				if err := m.Write(&pb); err != nil {
					t.Fatal(err)
				}
				v := pb.GetGauge().GetValue()
				if pb.Counter != nil {
					v = pb.GetCounter().GetValue()
				}
				got[names[m.Desc()]] = v
			}
			if !maps.Equal(got, tc.want) {
				t.Errorf("collected %v, want %v", got, tc.want)
			}
		})
	}
}
