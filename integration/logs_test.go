package integration

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/httppush"
)

// pushOrMux serves URL consumers by HTTP push, the others from a Mux.
type pushOrMux struct {
	push *httppush.Pusher
	mux  *bellhop.Mux
}

func (r pushOrMux) Resolve(c bellhop.Consumer) bellhop.Handler {
	if c.URL == "" {
		return r.mux.Resolve(c)
	}
	h, err := r.push.Handler(c)
	if err != nil {
		return nil
	}
	return h
}

// TestLogsLeaveOutBodiesAndStacks: a failed delivery's info line ("will
// retry") and warn line ("dead-lettered") name what went wrong but leave
// out the consumer's response body, which here echoes the payload, and a
// panic's stack; the dead letter keeps both, and the debug log has them.
func TestLogsLeaveOutBodiesAndStacks(t *testing.T) {
	const secret = "payload-secret-5521"
	e := newEnv(t)
	echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusInternalServerError)
		w.Write(append([]byte("could not process "), body...))
	}))
	defer echo.Close()
	spec := bellhop.ConsumerSpec{MaxAttempts: 2, BackoffBase: time.Millisecond, BackoffCap: time.Millisecond}
	spec.Queue, spec.URL = "pushed", echo.URL
	e.consumer(t, spec)
	spec.Queue, spec.URL = "panics", ""
	e.consumer(t, spec)
	mux := bellhop.NewMux()
	mux.Handle("app", "panics", bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error {
		panic("kaboom-5521")
	}))

	for _, level := range []zerolog.Level{zerolog.InfoLevel, zerolog.DebugLevel} {
		t.Run(level.String(), func(t *testing.T) {
			logs := &syncBuffer{}
			pc, err := pgxpool.ParseConfig(e.dsn)
			if err != nil {
				t.Fatal(err)
			}
			d, err := bellhop.NewDispatcher(pc, bellhop.DispatcherConfig{
				Resolver: pushOrMux{httppush.New(httppush.Options{}), mux}, PollInterval: time.Hour,
				Logger: zerolog.New(io.MultiWriter(logs, zerolog.NewTestWriter(t))).Level(level),
			})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- d.Run(ctx) }()
			defer func() {
				cancel()
				if err := <-done; err != nil {
					t.Errorf("Run: %v", err)
				}
			}()
			waitFor(t, 10*time.Second, "dispatcher ready", func() bool { return d.Ready(ctx) == nil })

			pushed := e.enqueue(t, "pushed", map[string]string{"secret": secret}, bellhop.EnqueueOptions{})
			panicked := e.enqueue(t, "panics", map[string]string{"secret": secret}, bellhop.EnqueueOptions{})
			// The dead-letter lines are logged once the outcome is written.
			waitFor(t, 10*time.Second, "both dead-lettered and logged", func() bool {
				l := logs.String()
				return strings.Count(l, `"message":"message dead-lettered"`) == 2 &&
					(level != zerolog.DebugLevel || strings.Count(l, ` in full"`) >= 4)
			})
			// The dead letters keep the whole text.
			for id, want := range map[uuid.UUID]string{pushed: secret, panicked: "goroutine "} {
				if dl, _ := e.deadLetterOf(t, id); !strings.Contains(dl.LastError, want) {
					t.Errorf("dead letter %s: last_error %.80q… lacks %q", id, dl.LastError, want)
				}
			}

			want := map[string]string{ // info and warn lines about each message: what they must say
				pushed.String() + "/handler failed; will retry":   "consumer failed: HTTP 500",
				pushed.String() + "/message dead-lettered":        "attempts exhausted (2 of 2): consumer failed: HTTP 500",
				panicked.String() + "/handler failed; will retry": "handler panicked: kaboom-5521",
				panicked.String() + "/message dead-lettered":      "attempts exhausted (2 of 2): handler panicked: kaboom-5521",
			}
			seen := map[string]bool{}
			full := 0
			for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
				var l struct {
					Level, Message, Error string
					MessageID             string `json:"message_id"`
				}
				if err := json.Unmarshal([]byte(line), &l); err != nil {
					t.Fatalf("log line %q: %v", line, err)
				}
				if l.Level == "debug" {
					if strings.Contains(line, secret) || strings.Contains(line, "goroutine ") {
						full++
					}
					continue
				}
				if strings.Contains(line, secret) || strings.Contains(line, "goroutine ") {
					t.Errorf("a %s line carries the response body or a stack: %s", l.Level, line)
				}
				k := l.MessageID + "/" + l.Message
				if w, ok := want[k]; ok {
					seen[k] = true
					if l.Error != w {
						t.Errorf("%s: error %q, want %q", k, l.Error, w)
					}
				}
			}
			for k := range want {
				if !seen[k] {
					t.Errorf("no %q line", k)
				}
			}
			if level == zerolog.DebugLevel && full < 4 {
				t.Errorf("%d debug lines with the whole error, want at least 4 (two failures of each message)", full)
			}
		})
	}
}
