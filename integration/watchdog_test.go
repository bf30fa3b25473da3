package integration

import (
	"bytes"
	"context"
	"io"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
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
	// A second, not less: in the heard case every heartbeat must come
	// back in time on a loaded machine, as in TestDeafUntilHeard.
	const (
		timeout = time.Second
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
			// period, send it on the channel only if it is to arrive (a
			// listener that hears nothing is what a hung one looks like),
			// and report it sent either way.
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
				l.HeartbeatSent(token)
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

// TestPollFindsHungListener: a dispatcher whose listener connection stays
// up but hears nothing more (the server's bytes no longer reach it, as
// behind a stateful middlebox that lost the flow) finds out by the
// fallback poll's heartbeat, replaces the listener, and delivers again on
// notifications.
func TestPollFindsHungListener(t *testing.T) {
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	link, freeze := freezableListener(t, e.dsn)
	// A second, not less: the heartbeats before the freeze must come back
	// in time on a loaded machine.
	d := startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux,
		PollInterval: 200 * time.Millisecond, HeartbeatTimeout: time.Second}, link)
	waitFor(t, 5*time.Second, "a heartbeat heard", func() bool { return d.ListenerStats().Notifications >= 1 })
	restarts := d.ListenerStats().HungRestarts
	if n := freeze(); n == 0 {
		t.Fatal("no listener connection to freeze")
	}
	waitFor(t, 10*time.Second, "the hung listener replaced", func() bool {
		st := d.ListenerStats()
		return st.HungRestarts > restarts && st.Connects >= 2 && d.Ready(context.Background()) == nil
	})
	id := e.enqueue(t, "orders", 1, bellhop.EnqueueOptions{})
	waitFor(t, 5*time.Second, "the message delivered", func() bool {
		d := rec.deliveries()
		return len(d) == 1 && d[0].ID == id
	})
	if st := d.ListenerStats(); st.Deaf {
		t.Errorf("listener stats %+v: deaf, though it has heard heartbeats", st)
	}
}

// freezableListener returns a pool tweak that routes the pool's
// connections through a local proxy to dsn's server, and freeze, which
// holds back from then on everything the server sends to the listener
// connections open at the time, and returns how many there were. Other
// connections, and listener connections opened later, are left alone.
func freezableListener(t *testing.T, dsn string) (link func(*pgxpool.Config), freeze func() int) {
	listeners := &freezeSet{}
	link = proxyLink(t, dsn, time.Hour, func(client io.Reader) (io.Reader, func() bool) {
		s := &startupSniffer{r: client, found: listeners.add}
		return s, s.frozen.Load
	})
	return link, listeners.freeze
}

// freezeSet holds the frozen flags of proxied connections, to be set all
// at once.
type freezeSet struct {
	mu    sync.Mutex
	flags []*atomic.Bool
}

// add puts a connection's flag in the set.
func (s *freezeSet) add(frozen *atomic.Bool) {
	s.mu.Lock()
	s.flags = append(s.flags, frozen)
	s.mu.Unlock()
}

// freeze sets every flag in the set, empties it, and returns how many
// there were.
func (s *freezeSet) freeze() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, f := range s.flags {
		f.Store(true)
	}
	n := len(s.flags)
	s.flags = nil
	return n
}

// startupSniffer passes on what a client sends, and calls found once if
// its start-up message names the listener's application_name.
type startupSniffer struct {
	r      io.Reader
	found  func(*atomic.Bool)
	frozen atomic.Bool
	seen   []byte // the start of the stream, while it may hold the start-up message
	done   bool
}

func (s *startupSniffer) Read(b []byte) (int, error) {
	n, err := s.r.Read(b)
	if !s.done {
		s.seen = append(s.seen, b[:n]...)
		if bytes.Contains(s.seen, []byte("bellhop-listener")) {
			s.done = true
			s.found(&s.frozen)
		} else if len(s.seen) > 8192 {
			s.done = true
		}
	}
	return n, err
}
