package main

import (
	"testing"
	"time"
)

// TestProbeServerDeadlines: the daemon's unauthenticated /metrics,
// /healthz and /readyz server bounds every read, write and idle
// connection. With only ReadHeaderTimeout set, net/http clears the read
// deadline between keep-alive requests, and a client could hold idle
// connections open for ever.
func TestProbeServerDeadlines(t *testing.T) {
	srv := probeServer(nil)
	for name, d := range map[string]time.Duration{
		"ReadHeaderTimeout": srv.ReadHeaderTimeout,
		"ReadTimeout":       srv.ReadTimeout,
		"WriteTimeout":      srv.WriteTimeout,
		"IdleTimeout":       srv.IdleTimeout,
	} {
		if d <= 0 {
			t.Errorf("%s is %v: no deadline", name, d)
		}
	}
}
