package integration

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/notify"
)

type nopEvents struct{}

func (nopEvents) HandleEvent(notify.Event) {}
func (nopEvents) Connected()               {}

// TestListenerWatchdog: a listener that stops hearing its heartbeats is
// replaced within HeartbeatTimeout, even when heartbeats are sent more
// often than that (a fallback poll shorter than the timeout); one that
// hears them is left alone.
func TestListenerWatchdog(t *testing.T) {
	const (
		timeout = 500 * time.Millisecond
		every   = 100 * time.Millisecond // the poll's period: shorter than timeout
	)
	for _, c := range []struct {
		name        string
		beatsArrive bool
	}{
		{"heartbeats lost: replaced", false},
		{"heartbeats heard: kept", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			dsn := pgtest.ConnString(t)
			cc, err := pgx.ParseConfig(dsn)
			if err != nil {
				t.Fatal(err)
			}
			l := notify.New(notify.Config{
				ConnConfig: cc, Handler: nopEvents{}, Logger: testLogger(t),
				HeartbeatTimeout: timeout, ReconnectDelay: 50 * time.Millisecond,
			})
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- l.Run(ctx) }()
			defer func() {
				cancel()
				if err := <-done; err != nil {
					t.Errorf("Listener.Run: %v", err)
				}
			}()
			waitFor(t, 5*time.Second, "listener connected", l.Connected)

			conn, err := pgx.Connect(context.Background(), dsn)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(context.Background())
			// Play the dispatcher's poll: ask for a heartbeat every
			// period, and send it on the channel only if it is to arrive
			// (a listener that hears nothing is what a hung one looks like).
			tick := time.NewTicker(every)
			defer tick.Stop()
			end := time.Now().Add(4 * timeout)
			for time.Now().Before(end) && l.Stats().HungRestarts == 0 {
				token := l.ExpectHeartbeat()
				if c.beatsArrive {
					if _, err := conn.Exec(context.Background(), `SELECT pg_notify($1, $2)`, notify.Channel, "h:"+token); err != nil {
						t.Fatal(err)
					}
				}
				<-tick.C
			}
			restarts := l.Stats().HungRestarts
			if c.beatsArrive && restarts != 0 {
				t.Errorf("listener restarted %d times though every heartbeat arrived", restarts)
			}
			if !c.beatsArrive {
				if restarts == 0 {
					t.Fatalf("no restart in %s of lost heartbeats (timeout %s, asked every %s)", 4*timeout, timeout, every)
				}
				waitFor(t, 5*time.Second, "the listener reconnected", func() bool { return l.Stats().Connects >= 2 && l.Connected() })
			}
		})
	}
}
