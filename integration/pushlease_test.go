package integration

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/httppush"
	"github.com/bellhopq/bellhop/internal/syncbuf"
)

// pushAttempt is one push, as a wrapper around the push handler saw it.
type pushAttempt struct {
	attempt    int
	start      time.Time
	end        time.Time
	deadline   time.Time // the handler context's end, Message.LeaseDeadline
	err        error
	ctxEndedBy error // the handler context's cause when the push returned
}

// TestPushTimeoutBeforeLease: with the default push timeout, which counts
// from the push's start (later than the lease's), a request ends by its
// own timeout a moment before the lease runs short, not by the handler's
// context. One that never got a connection reached nothing: it says "no
// connection within" the time it waited and is retried after its backoff.
// It used to be cut by the lease ("stopped before the request was sent:
// lease lost") and held to the lease's end as if the consumer had it. One
// that got a connection but no answer is still abandoned, its retry held
// to the lease's end.
//
// The request's own timeout comes 250ms before the handler's context
// ends (httppush's leaseSlack, at its most from vt 5s on), and the
// handler has that long to return. A process starved longer returns
// after its context ended although the request ended by its own timeout
// (its error says so: a context's cause is set when it ends, however late
// anyone looks), and the dispatcher then rightly holds the retry, the
// safe side. Such a try is inconclusive and the scenario runs again, with
// a new message; it fails if no try is conclusive, as it would if the
// handler always returned late.
func TestPushTimeoutBeforeLease(t *testing.T) {
	const vt = 5 * time.Second
	margin := vt / 5 // the dispatcher's lease margin for vt
	const tries = 3
	for _, c := range []struct {
		name   string
		noConn bool // the dial never connects
		want   string
	}{
		{name: "no connection", noConn: true, want: "no connection within"},
		{name: "no response", want: "no response within"},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t)
			var opts httppush.Options // no Timeout: the default
			url := "http://consumer.test/hook"
			if c.noConn {
				// A dial that never connects, as to a host that drops packets.
				opts.Client = &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
					<-ctx.Done()
					return nil, ctx.Err()
				}}}
			} else {
				quit := make(chan struct{})
				srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					select {
					case <-r.Context().Done():
					case <-quit:
					}
				}))
				t.Cleanup(srv.Close)
				t.Cleanup(func() { close(quit) }) // runs before srv.Close
				url = srv.URL + "/hook"
			}
			e.consumer(t, bellhop.ConsumerSpec{Queue: "q", URL: url, VisibilityTimeout: vt,
				BackoffBase: 10 * time.Millisecond, BackoffCap: 10 * time.Millisecond, MaxAttempts: 2})
			p := httppush.New(opts)
			var mu sync.Mutex
			attempts := map[uuid.UUID][]pushAttempt{} // by message, as they returned
			starts := map[uuid.UUID][]time.Time{}     // of each delivery, by message
			res := wrapPush(t, p, func(h bellhop.Handler) bellhop.HandlerFunc {
				return func(ctx context.Context, m *bellhop.Message) error {
					mu.Lock()
					starts[m.ID] = append(starts[m.ID], time.Now())
					mu.Unlock()
					a := pushAttempt{attempt: m.Attempt, start: time.Now(), deadline: m.LeaseDeadline()}
					a.err = h.Handle(ctx, m)
					a.ctxEndedBy, a.end = context.Cause(ctx), time.Now()
					mu.Lock()
					attempts[m.ID] = append(attempts[m.ID], a)
					mu.Unlock()
					return a.err
				}
			})
			var logs syncbuf.Buffer
			startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: res, PollInterval: time.Hour,
				ShutdownGrace: 100 * time.Millisecond, Logger: zerolog.New(&logs)}, nil)

			for try := 1; ; try++ {
				id := e.enqueue(t, "q", try, bellhop.EnqueueOptions{})
				waitFor(t, 3*vt, "attempt 2", func() bool {
					mu.Lock()
					defer mu.Unlock()
					return len(starts[id]) == 2
				})
				mu.Lock()
				first, started2 := attempts[id][0], starts[id][1]
				mu.Unlock()
				if first.attempt != 1 {
					t.Fatalf("the first push to return was attempt %d", first.attempt)
				}
				leaseEnd := first.deadline.Add(margin)
				t.Logf("try %d: attempt 1 returned %s after its start, %s before its handler's context ended: %v; attempt 2 started %s after attempt 1's lease end",
					try, first.end.Sub(first.start).Round(time.Millisecond), first.deadline.Sub(first.end).Round(time.Millisecond),
					first.err, started2.Sub(leaseEnd).Round(time.Millisecond))

				// The dispatcher's line about the failure: not cut by the
				// lease; held to its end only with a connection.
				type logLine struct {
					Message, Error string
					MessageID      string `json:"message_id"`
					RetryIn        string `json:"retry_in"`
				}
				var line logLine
				for _, l := range strings.Split(logs.String(), "\n") {
					if !strings.Contains(l, `"handler failed; will retry"`) {
						continue
					}
					var ll logLine
					if err := json.Unmarshal([]byte(l), &ll); err != nil {
						t.Fatalf("log line %q: %v", l, err)
					}
					if ll.MessageID == id.String() {
						line = ll
						break
					}
				}
				retryIn, err := time.ParseDuration(line.RetryIn)
				if err != nil {
					t.Fatalf("no \"handler failed\" line with a retry_in (%v) for %s in:\n%s", err, id, logs.String())
				}

				want := c.want
				ownTimeout := first.err != nil && strings.Contains(first.err.Error(), want)
				if ownTimeout && (first.ctxEndedBy != nil || strings.Contains(line.Error, "past its lease")) {
					if try == tries {
						t.Fatalf("inconclusive: in %d tries the handler never returned before its context ended, though each request ended by its own timeout", tries)
					}
					t.Logf("try %d inconclusive: the request ended by its own timeout, but the handler returned after its context ended (a starved process; the dispatcher logged %q)",
						try, line.Error)
					continue
				}

				if !ownTimeout {
					t.Errorf("attempt 1 failed with %v, want it to say %q", first.err, want)
				}
				if errors.Is(first.err, bellhop.ErrAbandoned) == c.noConn {
					t.Errorf("attempt 1's error %v: marked abandoned %t, want %t", first.err, !c.noConn, !c.noConn)
				}
				if first.ctxEndedBy != nil {
					t.Errorf("the handler's context had ended (%v) when the push returned: the lease cut it, not its timeout", first.ctxEndedBy)
				}
				if !strings.Contains(line.Error, want) || strings.Contains(line.Error, "lease lost") || strings.Contains(line.Error, "past its lease") {
					t.Errorf("logged error %q: want it to say %q, and not that the lease was lost", line.Error, want)
				}
				if c.noConn {
					if retryIn > 100*time.Millisecond {
						t.Errorf("retry in %s, want the backoff (10ms): nothing reached the consumer", retryIn)
					}
					if !started2.Before(leaseEnd) {
						t.Errorf("attempt 2 started %s after attempt 1's lease end, want after the 10ms backoff", started2.Sub(leaseEnd))
					}
				} else {
					if retryIn < margin/2 {
						t.Errorf("retry in %s, want it held to the lease's end (about %s)", retryIn, margin)
					}
					if started2.Before(leaseEnd) {
						t.Errorf("attempt 2 started %s before attempt 1's lease ended", leaseEnd.Sub(started2))
					}
				}
				return
			}
		})
	}
}

// TestLatePushStillSent: a push that starts within the slack the request
// keeps before the lease (its delivery began late) is sent all the same,
// and a consumer that answers gets it. It used to be refused unsent, an
// attempt spent: on the last attempt, a message no consumer had seen was
// dead-lettered. The push still ends when the lease runs short, also on a
// context that does not (a silent consumer). The push here runs on a
// context the lease does not end, so that the outcome does not hang on
// how late the machine wakes the test: only the request's own bounds
// apply.
//
// The push starts 240ms before the handler's context ends, inside the
// 250ms slack; a timer never fires early, but a loaded machine can fire
// it late, leaving the request no time to connect (its floor is 1ms). A
// try whose push started with less than minLeft to go is inconclusive,
// and another message is pushed; the test fails if no try is
// conclusive. Every conclusive push starts within the slack, where the
// old code refused it.
func TestLatePushStillSent(t *testing.T) {
	const (
		tries   = 3
		minLeft = 150 * time.Millisecond
	)
	for _, answers := range []bool{true, false} {
		name := map[bool]string{true: "answers", false: "silent"}[answers]
		t.Run(name, func(t *testing.T) {
			e := newEnv(t)
			var gotMu sync.Mutex
			got := map[string]int{} // requests, by message id
			quit := make(chan struct{})
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				gotMu.Lock()
				got[r.Header.Get(bellhop.HeaderMessageID)]++
				gotMu.Unlock()
				if !answers {
					select {
					case <-r.Context().Done():
					case <-quit:
					}
				}
			}))
			t.Cleanup(srv.Close)
			t.Cleanup(func() { close(quit) }) // runs before srv.Close
			const vt = 5 * time.Second
			e.consumer(t, bellhop.ConsumerSpec{Queue: "q", URL: srv.URL + "/hook", VisibilityTimeout: vt, MaxAttempts: 1})
			p := httppush.New(httppush.Options{})
			type result struct {
				id           uuid.UUID
				err          error
				left         time.Duration // of the handler's context, when the push started
				pastTheLease time.Duration
			}
			pushed := make(chan result, 1)
			res := wrapPush(t, p, func(h bellhop.Handler) bellhop.HandlerFunc {
				return func(ctx context.Context, m *bellhop.Message) error {
					// Within the last 250ms before the handler's context
					// ends (the slack, at vt 5s), as early in it as a
					// timer that never fires early allows: the push that
					// starts there has only until that end to connect,
					// send and be answered, and 100ms (as it was) is
					// little on a loaded machine under -race.
					<-time.After(time.Until(m.LeaseDeadline()) - 240*time.Millisecond)
					left := time.Until(m.LeaseDeadline())
					err := h.Handle(context.WithoutCancel(ctx), m)
					pushed <- result{m.ID, err, left, time.Since(m.LeaseDeadline())}
					return err
				}
			})
			startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: res, PollInterval: time.Hour}, nil)
			for try := 1; ; try++ {
				id := e.enqueue(t, "q", try, bellhop.EnqueueOptions{})
				var r result
				select {
				case r = <-pushed:
				case <-time.After(3 * vt):
					t.Fatal("the push did not return")
				}
				if r.id != id {
					t.Fatalf("pushed %s, want %s, the message just enqueued", r.id, id)
				}
				if r.left < minLeft {
					if try == tries {
						t.Fatalf("inconclusive: in %d tries no push started with %s or more left before the handler's context ended", tries, minLeft)
					}
					t.Logf("try %d inconclusive: the push started only %s before the handler's context ended (%v)", try, r.left.Round(time.Millisecond), r.err)
					continue
				}
				t.Logf("try %d: the push started %s before the handler's context ended", try, r.left.Round(time.Millisecond))
				gotMu.Lock()
				n := got[id.String()]
				gotMu.Unlock()
				if n != 1 {
					t.Errorf("the consumer got %d requests, want 1", n)
				}
				if answers && r.err != nil {
					t.Errorf("the late push failed: %v", r.err)
				}
				if !answers {
					t.Logf("the push to a silent consumer returned %s after the handler's context's end: %v", r.pastTheLease.Round(time.Millisecond), r.err)
					if r.err == nil || !errors.Is(r.err, bellhop.ErrAbandoned) {
						t.Errorf("the push to a silent consumer returned %v, want it abandoned", r.err)
					}
					if r.pastTheLease > 500*time.Millisecond {
						t.Errorf("the push returned %s after the handler's context's end, want it ended by then", r.pastTheLease)
					}
				}
				return
			}
		})
	}
}

// wrapPush resolves every consumer to p's push handler for it, wrapped by
// wrap.
func wrapPush(t *testing.T, p *httppush.Pusher, wrap func(bellhop.Handler) bellhop.HandlerFunc) bellhop.Resolver {
	return resolverFunc(func(cons bellhop.Consumer) bellhop.Handler {
		h, err := p.Handler(cons)
		if err != nil {
			t.Errorf("handler: %v", err)
			return nil
		}
		return wrap(h)
	})
}
