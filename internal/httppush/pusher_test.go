package httppush

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
)

const testSecret = "whsec-7f3a9c-DO-NOT-LEAK"

var testPayload = json.RawMessage(`{"card":"PAYLOAD-MARKER-4111"}`)

func newMessage(t testing.TB) *bellhop.Message {
	t.Helper()
	m := &bellhop.Message{
		App: "shop", Queue: "orders.created", Attempt: 2, MaxAttempts: 5,
		EnqueuedAt: time.Date(2025, 3, 4, 5, 6, 7, 890123456, time.FixedZone("X", 3600)),
		Payload:    testPayload,
	}
	rand.Read(m.ID[:])
	rand.Read(m.AppID[:])
	rand.Read(m.ConsumerID[:])
	return m
}

func consumerFor(url string) bellhop.Consumer {
	return bellhop.Consumer{URL: url, Secret: testSecret, VisibilityTimeout: 30 * time.Second}
}

// kind names what the dispatcher will do with a handler's result. The
// root package's error types are unexported, so they are recognised by
// comparing dynamic types along the wrap chain, the way its errors.As does.
func kind(err error) string {
	if err == nil {
		return "ack"
	}
	perm := fmt.Sprintf("%T", bellhop.Permanent(nil))
	retry := fmt.Sprintf("%T", bellhop.RetryAfter(0))
	found := "retry"
	var walk func(error)
	walk = func(e error) {
		if e == nil || found != "retry" {
			return
		}
		switch fmt.Sprintf("%T", e) {
		case perm:
			found = "permanent"
			return
		case retry:
			found = "retry-after"
			return
		}
		switch u := e.(type) {
		case interface{ Unwrap() error }:
			walk(u.Unwrap())
		case interface{ Unwrap() []error }:
			for _, x := range u.Unwrap() {
				walk(x)
			}
		}
	}
	walk(err)
	return found
}

// retryDelay extracts d from a RetryAfter(d) error.
func retryDelay(t *testing.T, err error) time.Duration {
	t.Helper()
	_, s, ok := strings.Cut(err.Error(), "retry after ")
	if !ok {
		t.Fatalf("not a RetryAfter error: %v", err)
	}
	d, perr := time.ParseDuration(s)
	if perr != nil {
		t.Fatalf("RetryAfter error %q: %v", err, perr)
	}
	return d
}

func deliver(t *testing.T, p *Pusher, c bellhop.Consumer) error {
	t.Helper()
	h, err := p.Handler(c)
	if err != nil {
		t.Fatalf("Handler: %v", err)
	}
	return h.Handle(context.Background(), newMessage(t))
}

func TestResponseMapping(t *testing.T) {
	now := time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)
	tests := []struct {
		name      string
		status    int
		header    map[string]string
		body      string
		want      string        // ack, permanent, retry-after, retry
		delay     time.Duration // for retry-after
		errSubstr string
		abandoned bool // retried no earlier than the lease's end
	}{
		{name: "200", status: 200, body: `{"ok":true}`, want: "ack"},
		{name: "204", status: 204, want: "ack"},
		{name: "202", status: 202, body: "queued", want: "ack"},
		{name: "400", status: 400, body: "bad\x1b[31m field\n\tname \u202e", want: "permanent",
			errSubstr: "consumer rejected the message: HTTP 400: bad?[31m field name ?"},
		{name: "404", status: 404, body: "no such hook", want: "permanent", errSubstr: "HTTP 404: no such hook"},
		{name: "410", status: 410, want: "permanent", errSubstr: "HTTP 410"},
		{name: "422", status: 422, body: "invalid", want: "permanent", errSubstr: "HTTP 422: invalid"},
		{name: "408", status: 408, want: "retry", errSubstr: "HTTP 408"},
		{name: "407 from a proxy", status: 407, want: "retry", errSubstr: "the proxy to the consumer wants credentials: HTTP 407"},
		{name: "429 Retry-After seconds", status: 429, header: map[string]string{"Retry-After": "120"},
			want: "retry-after", delay: 2 * time.Minute},
		// Now: the consumer's backoff, not a retry at once, an attempt
		// each time, as for a date already past.
		{name: "429 Retry-After 0", status: 429, header: map[string]string{"Retry-After": "0"},
			want: "retry", errSubstr: `Retry-After "0", which is now`},
		{name: "503 Retry-After 1", status: 503, header: map[string]string{"Retry-After": "1"},
			want: "retry-after", delay: time.Second},
		{name: "429 Retry-After huge is capped", status: 429, header: map[string]string{"Retry-After": "99999999999999999999999"},
			want: "retry-after", delay: MaxRetryAfter},
		{name: "429 Retry-After garbled", status: 429, header: map[string]string{"Retry-After": "soon"},
			want: "retry", errSubstr: `unparsable Retry-After "soon"`},
		{name: "429 Retry-After negative", status: 429, header: map[string]string{"Retry-After": "-5"}, want: "retry"},
		{name: "429 without Retry-After", status: 429, want: "retry", errSubstr: "HTTP 429"},
		{name: "503 Retry-After HTTP-date", status: 503,
			header: map[string]string{"Retry-After": now.Add(time.Hour).Format(http.TimeFormat), "Date": now.Format(http.TimeFormat)},
			want:   "retry-after", delay: time.Hour},
		// A date counts from the response's Date: the consumer's clock
		// an hour ahead of ours (or behind) asked for an hour and 30 s
		// (or for a time already past).
		{name: "503 Retry-After date, the consumer's clock ahead", status: 503,
			header: map[string]string{"Retry-After": now.Add(time.Hour + 30*time.Second).Format(http.TimeFormat), "Date": now.Add(time.Hour).Format(http.TimeFormat)},
			want:   "retry-after", delay: 30 * time.Second},
		{name: "503 Retry-After date, the consumer's clock behind", status: 503,
			header: map[string]string{"Retry-After": now.Add(-time.Hour + 30*time.Second).Format(http.TimeFormat), "Date": now.Add(-time.Hour).Format(http.TimeFormat)},
			want:   "retry-after", delay: 30 * time.Second},
		// Without a Date that parses, from our clock.
		{name: "503 Retry-After date, Date garbled", status: 503,
			header: map[string]string{"Retry-After": now.Add(time.Minute).Format(http.TimeFormat), "Date": "yesterday"},
			want:   "retry-after", delay: time.Minute},
		// A date already past (clocks apart): the consumer's backoff,
		// not a retry at once, an attempt each time.
		{name: "503 Retry-After date past", status: 503,
			header: map[string]string{"Retry-After": now.Add(-time.Hour).Format(http.TimeFormat), "Date": now.Format(http.TimeFormat)},
			want:   "retry", errSubstr: "already past"},
		{name: "429 Retry-After date now", status: 429,
			header: map[string]string{"Retry-After": now.Format(http.TimeFormat), "Date": now.Format(http.TimeFormat)},
			want:   "retry", errSubstr: "already past"},
		{name: "503 Retry-After date far", status: 503,
			header: map[string]string{"Retry-After": now.Add(72 * time.Hour).Format(http.TimeFormat), "Date": now.Format(http.TimeFormat)},
			want:   "retry-after", delay: MaxRetryAfter},
		{name: "503 without Retry-After", status: 503, body: "maintenance", want: "retry", errSubstr: "HTTP 503: maintenance"},
		{name: "500", status: 500, body: "boom", want: "retry", errSubstr: "consumer failed: HTTP 500: boom"},
		{name: "502", status: 502, want: "retry", errSubstr: "HTTP 502"},
		// A gateway stopped waiting; the consumer behind it may not have.
		{name: "504", status: 504, body: "upstream timed out", want: "retry", errSubstr: "HTTP 504: upstream timed out", abandoned: true},
		{name: "524 from Cloudflare", status: 524, body: "A timeout occurred", want: "retry", errSubstr: "HTTP 524: A timeout occurred", abandoned: true},
		{name: "522 nothing reached the consumer", status: 522, want: "retry", errSubstr: "consumer failed: HTTP 522"},
		{name: "500 Retry-After ignored", status: 500, header: map[string]string{"Retry-After": "60"}, want: "retry"},
		{name: "302 not followed", status: 302, want: "permanent", errSubstr: "HTTP 302: redirect not followed"},
		{name: "307 not followed", status: 307, want: "permanent", errSubstr: "HTTP 307: redirect not followed"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var redirected atomic.Int32
			target := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				redirected.Add(1)
			}))
			defer target.Close()
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				for k, v := range tt.header {
					w.Header().Set(k, v)
				}
				if tt.status >= 300 && tt.status < 400 {
					w.Header().Set("Location", target.URL+"/elsewhere")
				}
				w.WriteHeader(tt.status)
				io.WriteString(w, tt.body)
			}))
			defer srv.Close()

			p := New(Options{})
			p.now = func() time.Time { return now }
			err := deliver(t, p, consumerFor(srv.URL+"/hook"))
			if got := kind(err); got != tt.want {
				t.Fatalf("result %v is %s, want %s", err, got, tt.want)
			}
			if got := errors.Is(err, bellhop.ErrAbandoned); got != tt.abandoned {
				t.Errorf("result %v: marked abandoned %t, want %t", err, got, tt.abandoned)
			}
			if tt.want == "retry-after" {
				if d := retryDelay(t, err); d != tt.delay {
					t.Errorf("retry after %s, want %s", d, tt.delay)
				}
			}
			if tt.errSubstr != "" && !strings.Contains(err.Error(), tt.errSubstr) {
				t.Errorf("error %q does not contain %q", err, tt.errSubstr)
			}
			// The body, which may echo the message, stays out of the
			// dispatcher's info and warn logs (LogText); the error, kept
			// with a dead letter, has it.
			var lt interface{ LogText() string }
			switch {
			case tt.body == "" || tt.want == "ack":
			case !errors.As(err, &lt):
				t.Errorf("error %q with a response body has no LogText", err)
			case strings.Contains(lt.LogText(), snippet([]byte(tt.body))) || !strings.Contains(lt.LogText(), fmt.Sprintf("HTTP %d", tt.status)):
				t.Errorf("LogText %q: want the status without the body %q", lt.LogText(), tt.body)
			}
			if redirected.Load() != 0 {
				t.Errorf("redirect target was hit %d times", redirected.Load())
			}
			if tt.status >= 300 && tt.status < 400 {
				if !strings.Contains(err.Error(), target.URL) {
					t.Errorf("error %q does not name the redirect's Location", err)
				}
				// A Location may carry a token: not in info and warn logs.
				if !errors.As(err, &lt) || strings.Contains(lt.LogText(), target.URL) {
					t.Errorf("the redirect's Location is in its log text (%v)", err)
				}
			}
		})
	}
}

func TestRedirectNotFollowedWithCallerClient(t *testing.T) {
	var redirected atomic.Int32
	target := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { redirected.Add(1) }))
	defer target.Close()
	// Every response sets a cookie; the requests' Cookie headers are kept.
	var (
		mu      sync.Mutex
		cookies []string
	)
	mux := http.NewServeMux()
	mux.HandleFunc("/redirect", func(w http.ResponseWriter, r *http.Request) {
		http.SetCookie(w, &http.Cookie{Name: "session", Value: "from-redirect"})
		http.Redirect(w, r, target.URL, http.StatusFound)
	})
	mux.HandleFunc("/ok", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		cookies = append(cookies, r.Header.Get("Cookie"))
		mu.Unlock()
		http.SetCookie(w, &http.Cookie{Name: "session", Value: "from-ok"})
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()

	// A client whose policy follows redirects and keeps cookies: New must
	// override both, on a copy, leaving the caller's client as it was.
	jar, err := cookiejar.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	jarClient := &http.Client{Jar: jar}
	p := New(Options{Client: jarClient})
	err = deliver(t, p, consumerFor(srv.URL+"/redirect"))
	if kind(err) != "permanent" || redirected.Load() != 0 {
		t.Fatalf("err %v (%s), redirect target hit %d times", err, kind(err), redirected.Load())
	}
	for i := 0; i < 2; i++ {
		if err := deliver(t, p, consumerFor(srv.URL+"/ok")); err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for i, c := range cookies {
		if c != "" {
			t.Errorf("request %d to /ok carried Cookie %q: cookies were kept", i+1, c)
		}
	}
	u, _ := url.Parse(srv.URL)
	if got := jar.Cookies(u); len(got) != 0 {
		t.Errorf("the caller's jar holds %v: the Pusher used it", got)
	}
	if jarClient.CheckRedirect != nil || jarClient.Jar != jar {
		t.Error("New modified the caller's client")
	}
}

func TestTimeout(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(hang))
	defer srv.Close()

	for _, tt := range []struct {
		name   string
		opts   Options
		c      func(bellhop.Consumer) bellhop.Consumer
		noConn bool
	}{
		{name: "consumer timeout", c: func(c bellhop.Consumer) bellhop.Consumer { c.Timeout = 150 * time.Millisecond; return c }},
		{name: "default timeout", opts: Options{Timeout: 150 * time.Millisecond}},
		{name: "consumer timeout wins", opts: Options{Timeout: time.Hour},
			c: func(c bellhop.Consumer) bellhop.Consumer { c.Timeout = 150 * time.Millisecond; return c }},
		{name: "visibility timeout", c: func(c bellhop.Consumer) bellhop.Consumer { c.VisibilityTimeout = 250 * time.Millisecond; return c }},
		// Nothing reached the consumer: its retry need not wait for the lease.
		{name: "no connection", opts: Options{Timeout: 150 * time.Millisecond, Client: stuckDialClient()}, noConn: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := consumerFor(srv.URL)
			if tt.c != nil {
				c = tt.c(c)
			}
			start := time.Now()
			err := deliver(t, New(tt.opts), c)
			elapsed := time.Since(start)
			if kind(err) != "retry" || !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, bellhop.ErrAbandoned) != !tt.noConn {
				t.Fatalf("err %v (%s), want an ordinary timeout error, marked abandoned unless no connection was made", err, kind(err))
			}
			want := "no response within"
			if tt.noConn {
				want = "no connection within"
			}
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not say %q", err, want)
			}
			if elapsed < 100*time.Millisecond || elapsed > 3*time.Second {
				t.Errorf("returned after %s", elapsed)
			}
		})
	}
}

// TestConnectionLost: a connection that fails after the whole request was
// written, with no answer, leaves a consumer that may be working on the
// request (a proxy cut it, or the consumer closed it and works on), so the
// retry waits for the lease, as after a timeout; it used to come after
// the backoff alone. A connection refused sent nothing: an ordinary retry.
func TestConnectionLost(t *testing.T) {
	cut := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body) // the whole request arrived
		conn, _, err := w.(http.Hijacker).Hijack()
		if err != nil {
			t.Error(err)
			return
		}
		conn.Close()
	}))
	defer cut.Close()
	refused := httptest.NewServer(http.HandlerFunc(hang))
	refused.Close()
	for _, tt := range []struct {
		name      string
		url       string
		abandoned bool
	}{
		{"closed after the request", cut.URL, true},
		{"refused", refused.URL, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := deliver(t, New(Options{}), consumerFor(tt.url))
			if kind(err) != "retry" || errors.Is(err, bellhop.ErrAbandoned) != tt.abandoned {
				t.Fatalf("err %v (%s), want a retry, marked abandoned: %t", err, kind(err), tt.abandoned)
			}
		})
	}
}

// TestKeepAliveClosedAsSent: a consumer that closes a kept-alive
// connection just as the next push is written to it (its idle timeout
// ran out) never read that push; it is sent again on a new connection
// and acked. It was reported as a connection lost after the request was
// sent: abandoned, an attempt spent and the retry held to the lease's end
// (28 of 200 pushes, 50 ms apart, to a server with a 50 ms idle timeout).
// A connection closed after a request on a new one stays abandoned
// (TestConnectionLost).
func TestKeepAliveClosedAsSent(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	var conns, answered atomic.Int32
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			first := conns.Add(1) == 1
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				for {
					if first && answered.Load() == 1 {
						// The next request has begun to arrive: close as
						// an idle timeout would, without reading it.
						br.Peek(1)
						return
					}
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					io.Copy(io.Discard, req.Body)
					answered.Add(1)
					io.WriteString(c, "HTTP/1.1 204 No Content\r\n\r\n")
				}
			}()
		}
	}()
	h, err := New(Options{}).Handler(consumerFor("http://" + l.Addr().String() + "/hook"))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if err := h.Handle(context.Background(), newMessage(t)); err != nil {
			t.Fatalf("push %d: %v (%s), want an ack", i+1, err, kind(err))
		}
	}
	if n, c := answered.Load(), conns.Load(); n != 2 || c != 2 {
		t.Errorf("%d requests answered on %d connections, want 2 on 2 (the second sent again on a new one)", n, c)
	}
}

// TestResponseHeadersTooLarge: a consumer whose response headers exceed
// the limit did answer, but its status was never read. It is reported as
// such, not as a lost connection, and abandoned: retried no earlier than
// the lease's end.
func TestResponseHeadersTooLarge(t *testing.T) {
	// HTTP/1: one header over the limit.
	h1 := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("X-Pad", strings.Repeat("a", maxHeaderBytes+1024))
	}))
	defer h1.Close()
	// HTTP/2: many copies of one small header, which HPACK sends as
	// one-byte references, so the list overruns the client's limit within
	// a frame (a list overrunning it by a frame or more ends the
	// connection with a bare PROTOCOL_ERROR instead).
	h2 := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		pad := make([]string, 2*maxHeaderBytes/64)
		for i := range pad {
			pad[i] = "0123456789abcdef0123456789abcdef"
		}
		w.Header()["X-Pad"] = pad
	}))
	h2.EnableHTTP2 = true
	h2.StartTLS()
	defer h2.Close()
	h2Client := h2.Client()
	h2Client.Transport.(*http.Transport).MaxResponseHeaderBytes = maxHeaderBytes

	for _, tt := range []struct {
		name, url string
		opts      Options
	}{
		{"HTTP/1", h1.URL, Options{}},
		{"HTTP/2", h2.URL, Options{Client: h2Client}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := deliver(t, New(tt.opts), consumerFor(tt.url))
			if kind(err) != "retry" || !errors.Is(err, bellhop.ErrAbandoned) {
				t.Fatalf("err %v (%s), want a retry marked abandoned", err, kind(err))
			}
			if !strings.Contains(err.Error(), "response headers too large (abandoned)") || strings.Contains(err.Error(), "connection") {
				t.Errorf("error %q: want it to say the response headers were too large", err)
			}
		})
	}
}

// hang answers only when the client gives up. It reads the body first:
// the server notices a closed connection only once the body is consumed.
func hang(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	<-r.Context().Done()
}

func TestRequestTimeout(t *testing.T) {
	for _, tt := range []struct {
		consumer, def, vt, want time.Duration
	}{
		{consumer: 2 * time.Second, def: 3 * time.Second, vt: 30 * time.Second, want: 2 * time.Second},
		{def: 3 * time.Second, vt: 30 * time.Second, want: 3 * time.Second},
		{vt: 30 * time.Second, want: 25 * time.Second},
		{vt: 10 * time.Second, want: 8 * time.Second},
		{vt: time.Second, want: 800 * time.Millisecond},
		{vt: 12 * time.Hour, want: 12*time.Hour - 5*time.Second},
		{want: bellhop.DefaultVisibilityTimeout - 5*time.Second},
		// Never past the lease (a consumer stored before registration
		// refused that, or a default longer than a consumer's lease).
		{consumer: 2 * time.Minute, vt: 30 * time.Second, want: 25 * time.Second},
		{def: time.Minute, vt: 10 * time.Second, want: 8 * time.Second},
	} {
		c := bellhop.Consumer{Timeout: tt.consumer, VisibilityTimeout: tt.vt}
		if got := requestTimeout(c, tt.def); got != tt.want {
			t.Errorf("requestTimeout(consumer %s, default %s, vt %s) = %s, want %s", tt.consumer, tt.def, tt.vt, got, tt.want)
		}
	}
}

// TestHandlerContextEnds: when the handler's context ends (the lease runs
// short, or the dispatcher stops) the error carries its cause, and is
// marked abandoned if the request may have reached the consumer, which
// may still be working on it; not if no connection was made.
func TestHandlerContextEnds(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(hang))
	defer srv.Close()
	for _, tt := range []struct {
		name          string
		cause         error
		client        *http.Client
		wantAbandoned bool
	}{
		{name: "lease runs short", cause: bellhop.ErrLeaseLost, wantAbandoned: true},
		{name: "dispatcher stops", cause: context.Canceled, wantAbandoned: true},
		{name: "dispatcher stops while dialling", cause: context.Canceled, client: stuckDialClient()},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h, err := New(Options{Client: tt.client}).Handler(consumerFor(srv.URL))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancelCause(context.Background())
			time.AfterFunc(100*time.Millisecond, func() { cancel(tt.cause) })
			start := time.Now()
			err = h.Handle(ctx, newMessage(t))
			if kind(err) != "retry" || !errors.Is(err, tt.cause) {
				t.Fatalf("err %v (%s), want an ordinary error wrapping %v", err, kind(err), tt.cause)
			}
			if got := errors.Is(err, bellhop.ErrAbandoned); got != tt.wantAbandoned {
				t.Errorf("err %v: marked abandoned %v, want %v", err, got, tt.wantAbandoned)
			}
			if d := time.Since(start); d > 3*time.Second {
				t.Errorf("returned after %s", d)
			}
		})
	}
}

// TestSwitchingProtocolsAndSilence: a consumer that answers 101 Switching
// Protocols and then says nothing must not hold the delivery past the
// request's timeout. net/http hands over the raw connection as the body of
// a 101 and stops watching the request's context, so an unbounded read of
// that body waited for the consumer for ever, holding an in-flight slot and
// blocking a clean stop.
func TestSwitchingProtocolsAndSilence(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	quiet := make(chan struct{})
	defer close(quiet)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		req, err := http.ReadRequest(bufio.NewReader(c))
		if err != nil {
			return
		}
		req.Body.Close()
		c.Write([]byte("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: x\r\n\r\n"))
		<-quiet
	}()
	c := consumerFor("http://" + ln.Addr().String() + "/hook")
	c.Timeout = 200 * time.Millisecond
	h, err := New(Options{}).Handler(c)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- h.Handle(context.Background(), newMessage(t)) }()
	select {
	case err := <-done:
		if kind(err) != "retry" || !strings.Contains(err.Error(), "HTTP 101") {
			t.Errorf("err %v (%s), want a retry naming HTTP 101", err, kind(err))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Handle still running 10s after its 200ms request timeout: a 101 then silence holds the delivery")
	}
}

// stuckDialClient's connections never connect: its dial waits for the
// request's context to end, as one to a host that drops packets does.
func stuckDialClient() *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			<-ctx.Done()
			return nil, ctx.Err()
		},
	}}
}

func TestConnectionRefused(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	err = deliver(t, New(Options{}), consumerFor("http://"+addr+"/hook?token=QUERY-TOKEN"))
	if kind(err) != "retry" || errors.Is(err, bellhop.ErrAbandoned) {
		t.Fatalf("err %v (%s), want an ordinary error, not marked abandoned (nothing was sent)", err, kind(err))
	}
	if strings.Contains(err.Error(), "QUERY-TOKEN") || strings.Contains(err.Error(), "/hook") {
		t.Errorf("error %q shows the URL's path or query", err)
	}
	if !strings.Contains(err.Error(), addr) {
		t.Errorf("error %q does not name the host", err)
	}
}

// TestUnreadableResponse: net/http quotes what a consumer that is no HTTP
// server sends back in its error. That text is the consumer's, like a
// response body: out of the info log text, cut to a snippet, and with the
// URL's query blanked, since a service that echoes its input sends back
// the request line. It used to be all in the log, up to 64 KiB of it.
func TestUnreadableResponse(t *testing.T) {
	for _, tt := range []struct {
		name  string
		reply func(requestLine string) string
		shown string // in the error text, not in the log text
	}{
		{"echo of the request line", func(line string) string { return line }, "malformed HTTP status code"},
		{"a long line", func(string) string { return strings.Repeat("X", 60_000) + "\r\n" }, "XXXX..."},
		{"a bad header line", func(string) string { return "HTTP/1.1 200 OK\r\nno colon here\r\n\r\n" }, "no colon here"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			addr := rawServer(t, tt.reply)
			err := deliver(t, New(Options{}), consumerFor("http://"+addr+"/hook?token=QUERY-TOKEN"))
			if kind(err) != "retry" {
				t.Fatalf("err %v (%s), want a retry", err, kind(err))
			}
			var lt interface{ LogText() string }
			if !errors.As(err, &lt) {
				t.Fatalf("error %q has no LogText", err)
			}
			if want := "push to http://" + addr + ": unreadable response"; !strings.HasPrefix(lt.LogText(), want) {
				t.Errorf("LogText %q does not start %q", lt.LogText(), want)
			}
			if strings.Contains(lt.LogText(), tt.shown) || strings.Contains(lt.LogText(), "XXX") {
				t.Errorf("LogText %q shows what the consumer sent", lt.LogText())
			}
			if !strings.Contains(err.Error(), tt.shown) {
				t.Errorf("error %q lacks %q", err, tt.shown)
			}
			if strings.Contains(err.Error(), "QUERY-TOKEN") {
				t.Errorf("error %q shows the URL's query", err)
			}
			if n := len(err.Error()); n > 400 {
				t.Errorf("error is %d bytes, want it cut to a snippet", n)
			}
		})
	}
}

// TestPlainErrorShown: an error that quotes nothing the consumer sent (a
// TLS failure, a plain HTTP server behind an https URL) is logged whole at
// info level: it is what an operator needs.
func TestPlainErrorShown(t *testing.T) {
	tlsSrv := httptest.NewUnstartedServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	tlsSrv.Config.ErrorLog = log.New(io.Discard, "", 0) // the refused handshake
	tlsSrv.StartTLS()
	defer tlsSrv.Close()
	plain := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer plain.Close()
	for _, tt := range []struct{ name, url, want string }{
		{"untrusted certificate", tlsSrv.URL + "/hook", "certificate"},
		{"https to a plain HTTP server", strings.Replace(plain.URL, "http://", "https://", 1) + "/hook", "server gave HTTP response to HTTPS client"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := deliver(t, New(Options{}), consumerFor(tt.url))
			var lt interface{ LogText() string }
			if kind(err) != "retry" || errors.As(err, &lt) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err %v (%s), want a retry whose whole text, naming %q, is logged", err, kind(err), tt.want)
			}
		})
	}
}

// rawServer answers each connection's request line with reply(line) and
// closes it: a service that is no HTTP server.
func rawServer(t *testing.T, reply func(requestLine string) string) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				line, err := bufio.NewReader(c).ReadString('\n')
				if err != nil {
					return
				}
				io.WriteString(c, reply(line))
			}()
		}
	}()
	return l.Addr().String()
}

func TestCheckProxyEnv(t *testing.T) {
	for _, tt := range []struct {
		name string
		env  map[string]string
		want string // "" for no error
	}{
		{"none", nil, ""},
		{"plain", map[string]string{"HTTP_PROXY": "http://proxy.example:3128"}, ""},
		{"no scheme", map[string]string{"HTTPS_PROXY": "proxy.example:3128"}, ""},
		{"escaped password", map[string]string{"HTTPS_PROXY": "http://u:50%25off@proxy.example:3128"}, ""},
		{"bad escape", map[string]string{"HTTP_PROXY": "http://u:50%off@proxy.example:3128"}, "HTTP_PROXY does not parse"},
		{"bad escape without scheme", map[string]string{"HTTPS_PROXY": "u:50%off@proxy.example:3128"}, "HTTPS_PROXY names no proxy host"},
		{"credentials without scheme", map[string]string{"HTTPS_PROXY": "u:pw@proxy.example:3128"}, ""},
		{"socks5", map[string]string{"HTTPS_PROXY": "socks5://proxy.example:1080"}, ""},
		{"ftp", map[string]string{"HTTP_PROXY": "ftp://proxy.example:21"}, "HTTP_PROXY: a proxy's scheme must be"},
		{"lower case", map[string]string{"http_proxy": "http://u:50%off@proxy.example"}, "http_proxy does not parse"},
		// net/http reads the upper-case name first, and only it.
		{"lower case shadowed", map[string]string{"HTTP_PROXY": "http://proxy.example", "http_proxy": "http://u:50%off@proxy.example"}, ""},
		{"control character", map[string]string{"HTTPS_PROXY": "http://proxy.example\n:3128"}, "HTTPS_PROXY does not parse"},
		// A port and no host name: net/http would dial this machine.
		{"port only", map[string]string{"HTTPS_PROXY": "http://:8080"}, "HTTPS_PROXY names no proxy host"},
		{"port only without scheme", map[string]string{"HTTP_PROXY": ":8080"}, "HTTP_PROXY names no proxy host"},
		{"no host, no port", map[string]string{"HTTP_PROXY": "://bad"}, "HTTP_PROXY names no proxy host"},
		{"IPv6 host", map[string]string{"HTTPS_PROXY": "http://[::1]:3128"}, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := CheckProxyEnv(func(k string) string { return tt.env[k] })
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("error %v, want none", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Fatalf("error %v, want one containing %q", err, tt.want)
			case err != nil && strings.Contains(err.Error(), "50%off"):
				t.Errorf("error %q shows the value", err)
			}
		})
	}
}

// countingTransport counts the response body bytes the client reads.
type countingTransport struct {
	base http.RoundTripper
	read atomic.Int64
}

func (c *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := c.base.RoundTrip(r)
	if err == nil {
		resp.Body = &countingBody{ReadCloser: resp.Body, n: &c.read}
	}
	return resp, err
}

type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (b *countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	return n, err
}

func TestBodyCap(t *testing.T) {
	const huge = 10 << 20
	for _, tt := range []struct {
		name   string
		status int
		limit  int64
		want   string
	}{
		{name: "200 default cap", status: 200, want: "ack"},
		{name: "500 default cap", status: 500, want: "retry"},
		{name: "400 small cap", status: 400, limit: 1000, want: "permanent"},
		{name: "cap below snippet", status: 500, limit: 10, want: "retry"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Length", strconv.Itoa(huge))
				w.WriteHeader(tt.status)
				chunk := bytes.Repeat([]byte("x"), 32<<10)
				for sent := 0; sent < huge; sent += len(chunk) {
					if _, err := w.Write(chunk); err != nil {
						return // the client hung up, as it should
					}
				}
			}))
			defer srv.Close()
			ct := &countingTransport{base: http.DefaultTransport.(*http.Transport).Clone()}
			p := New(Options{Client: &http.Client{Transport: ct}, MaxResponseBody: tt.limit})
			start := time.Now()
			err := deliver(t, p, consumerFor(srv.URL))
			if kind(err) != tt.want {
				t.Fatalf("err %v (%s), want %s", err, kind(err), tt.want)
			}
			limit := tt.limit
			if limit == 0 {
				limit = DefaultMaxResponseBody
			}
			if n := ct.read.Load(); n > limit {
				t.Errorf("read %d body bytes, cap is %d", n, limit)
			}
			if d := time.Since(start); d > 3*time.Second {
				t.Errorf("took %s", d)
			}
			if err != nil && len(err.Error()) > 400 {
				t.Errorf("error is %d bytes long", len(err.Error()))
			}
			if tt.limit == 10 && !strings.HasSuffix(err.Error(), ": xxxxxxxxxx") {
				t.Errorf("error %q: snippet should hold the 10 bytes read", err)
			}
		})
	}
}

func TestConnectionReuse(t *testing.T) {
	responses := []struct {
		status int
		header map[string]string
		body   string
	}{
		{200, nil, `{"ok":true}`},
		{204, nil, ""},
		{500, nil, strings.Repeat("e", 5000)}, // longer than the snippet, shorter than the cap
		{404, nil, "not here"},
		{429, map[string]string{"Retry-After": "3"}, "slow down"},
		{200, nil, ""},
	}
	var mu sync.Mutex
	next := 0
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		resp := responses[next]
		next++
		mu.Unlock()
		for k, v := range resp.header {
			w.Header().Set(k, v)
		}
		w.WriteHeader(resp.status)
		io.WriteString(w, resp.body)
	}))
	var conns atomic.Int32
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	defer srv.Close()

	h, err := New(Options{}).Handler(consumerFor(srv.URL))
	if err != nil {
		t.Fatal(err)
	}
	for i := range responses {
		h.Handle(context.Background(), newMessage(t))
		if n := conns.Load(); n != 1 {
			t.Fatalf("after delivery %d (HTTP %d): %d connections, want 1", i+1, responses[i].status, n)
		}
	}
}

func TestAllowList(t *testing.T) {
	allowed := []string{"hooks.example.com", "*.svc.example.net", "EXACT.Example.ORG.", "10.0.0.1", "[::1]"}
	tests := []struct {
		url     string
		allowed []string // nil: the list above
		ok      bool
	}{
		{url: "https://hooks.example.com/x", ok: true},
		{url: "https://HOOKS.Example.com:8443/x", ok: true},
		{url: "https://hooks.example.com./x", ok: true},
		{url: "https://exact.example.org/", ok: true},
		{url: "https://example.com/x"},
		{url: "https://api.hooks.example.com/x"},
		{url: "https://hooks.example.com.evil.net/x"},
		{url: "https://evilhooks.example.com/x"},
		{url: "https://a.svc.example.net/x", ok: true},
		{url: "https://a.b.svc.example.net/x", ok: true},
		{url: "https://A.SVC.EXAMPLE.NET/x", ok: true},
		{url: "https://svc.example.net/x"},
		{url: "https://evilsvc.example.net/x"},
		{url: "https://a.svc.example.net.evil/x"},
		{url: "http://10.0.0.1:8080/x", ok: true},
		{url: "http://10.0.0.2/x"},
		{url: "http://[::1]:9000/x", ok: true},
		{url: "http://anything.test/x", allowed: []string{}, ok: true},
		// Only blank entries (CheckAllowedHosts refuses them) fail closed.
		{url: "http://anything.test/x", allowed: []string{" ", ""}},
		// An entry that can never match (CheckAllowedHosts refuses it) does not.
		{url: "http://127.0.0.1:18282/x", allowed: []string{"127.0.0.1:18282"}},
		{url: "https://a.example.com/x", allowed: []string{"https://a.example.com"}},
		{url: "https://a.example.com/x", allowed: []string{"*"}},
		{url: "https://a.example.com/x", allowed: []string{" ", "a.example.com", ""}, ok: true},
		// Shape checks apply with or without a list.
		{url: "", allowed: []string{}},
		{url: "ftp://hooks.example.com/x"},
		{url: "hooks.example.com/x", allowed: []string{}},
		{url: "https:///x", allowed: []string{}},
		{url: "https://user:pw@hooks.example.com/x"},
		// Unparsable, with a password: the error must not show it.
		{url: "http://user:pw@host:bad/", allowed: []string{}},
		{url: "http://[::1/x", allowed: []string{}},
	}
	for _, tt := range tests {
		list := tt.allowed
		if list == nil {
			list = allowed
		}
		p := New(Options{AllowedHosts: list})
		err := p.CheckURL(tt.url)
		if (err == nil) != tt.ok {
			t.Errorf("CheckURL(%q) with %q = %v, want ok=%v", tt.url, list, err, tt.ok)
		}
		c := consumerFor(tt.url)
		h, herr := p.Handler(c)
		if (herr == nil) != tt.ok || (h == nil) == tt.ok {
			t.Errorf("Handler(%q) with %q = %v, want ok=%v", tt.url, list, herr, tt.ok)
		}
		if err != nil && strings.Contains(err.Error(), "pw@") {
			t.Errorf("error %q shows URL credentials", err)
		}
	}
}

// TestCheckAllowedHosts: an allow-list entry that can never match a URL's
// hostname, and a list of only blank entries, are refused, naming the
// entry; every entry form that does match is accepted.
func TestCheckAllowedHosts(t *testing.T) {
	tests := []struct {
		hosts []string
		want  string // in the error; "" for none
	}{
		{hosts: nil},
		{hosts: []string{}},
		{hosts: []string{"hooks.example.com", "*.svc.example.net", "EXACT.Example.ORG.", "10.0.0.1", "::1", "[::1]", "consumer", "my_consumer", "xn--bcher-kva.example"}},
		{hosts: []string{"bücher.example"}, want: `"bücher.example": is not ASCII`},
		// Refused though they lower-case to ASCII (İ to i, the Kelvin sign
		// to k): checked as folded, they would pass as service.com and
		// key.example.
		{hosts: []string{"serv\u0130ce.com"}, want: "\"serv\u0130ce.com\": is not ASCII"},
		{hosts: []string{"*.\u212Aey.example"}, want: "\"*.\u212Aey.example\": is not ASCII"},
		{hosts: []string{"a.example.com", " ", ""}},
		{hosts: []string{" b.example.com "}},
		{hosts: []string{""}, want: "only blank entries"},
		{hosts: []string{" ", " "}, want: "only blank entries"},
		{hosts: []string{"127.0.0.1:18282"}, want: `allowed host "127.0.0.1:18282": is not a bare hostname`},
		{hosts: []string{"a.example.com:443"}, want: `"a.example.com:443": is not a bare hostname`},
		{hosts: []string{"[::1]:80"}, want: `"[::1]:80": is not a bare hostname`},
		{hosts: []string{"ok.example.com", "https://a.example.com"}, want: `allowed host "https://a.example.com": is a URL`},
		{hosts: []string{"a.example.com/hook"}, want: `"a.example.com/hook": is not a bare hostname`},
		{hosts: []string{"*"}, want: `allowed host "*": a wildcard matches only as a leading "*."`},
		{hosts: []string{"*."}, want: `allowed host "*."`},
		{hosts: []string{"a.*.example.com"}, want: `"a.*.example.com": a wildcard`},
		{hosts: []string{"*.*.example.com"}, want: `"*.*.example.com": a wildcard`},
		{hosts: []string{"*example.com"}, want: `"*example.com": a wildcard`},
		{hosts: []string{"a..example.com"}, want: `"a..example.com": is not a hostname`},
		{hosts: []string{".example.com"}, want: `".example.com": is not a hostname`},
		{hosts: []string{"exa mple.com"}, want: `"exa mple.com": is not a hostname`},
		{hosts: []string{"u@example.com"}, want: `"u@example.com": is not a hostname`},
		{hosts: []string{"a,b.example.com"}, want: `"a,b.example.com": is not a hostname`},
		{hosts: []string{strings.Repeat("a", 64) + ".example.com"}, want: "longer than 63 bytes"},
	}
	for _, tt := range tests {
		err := CheckAllowedHosts(tt.hosts)
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("CheckAllowedHosts(%q) = %v, want nil", tt.hosts, err)
		case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
			t.Errorf("CheckAllowedHosts(%q) = %v, want an error with %q", tt.hosts, err, tt.want)
		}
		if err != nil && strings.Contains(err.Error(), "\n") {
			t.Errorf("CheckAllowedHosts(%q): error %q is not one line", tt.hosts, err)
		}
	}
}

// TestHandlerErrorsHideThePath: the daemon logs why it does not serve a
// consumer, and a stored URL's path may hold a token (a chat service's
// webhook URL does). Its errors show the scheme and host only, as push
// errors do; CheckURL, for an operator typing the URL, shows more. Rows
// written by SQL reach Handler unchecked: the error quoted the whole path.
func TestHandlerErrorsHideThePath(t *testing.T) {
	for _, tt := range []struct{ url, want string }{
		{"https://u:pw@hooks.example.com/services/T0/B0/SECRETPATH?t=SECRETQ", `"https://hooks.example.com" carries credentials`},
		{"https://hooks.example.com:99999/services/SECRETPATH", `"https://hooks.example.com:99999": port "99999" is outside 1..65535`},
		{"gopher://hooks.example.com/SECRETPATH", `"gopher://hooks.example.com": scheme must be http or https`},
		{"https://hooks.example.com/%zzSECRETPATH", "(not shown: see its consumer)"},
	} {
		c := consumerFor(tt.url)
		_, err := New(Options{}).Handler(c)
		if err == nil || !strings.Contains(err.Error(), tt.want) || strings.Contains(err.Error(), "SECRET") || !strings.Contains(err.Error(), c.ID.String()) {
			t.Errorf("Handler(%q): %v; want an error naming the consumer and %s, without the path", tt.url, err, tt.want)
		}
	}
	if err := New(Options{}).CheckURL("https://hooks.example.com:99999/services/x"); err == nil || !strings.Contains(err.Error(), "/services/x") {
		t.Errorf("CheckURL: %v, want the URL as typed, path and all", err)
	}
}

func TestHandlerNeedsSecret(t *testing.T) {
	c := consumerFor("https://hooks.example.com/")
	c.Secret = ""
	if _, err := New(Options{}).Handler(c); err == nil {
		t.Fatal("Handler accepted a consumer without a secret")
	}
}

// TestRequestSignedWithPreviousSecret: while a rotation keeps the previous
// secret signing, a request carries a v1 signature under each, the new
// one first, so that a receiver holding either accepts it; from
// PreviousSecretUntil on, only the new one's.
func TestRequestSignedWithPreviousSecret(t *testing.T) {
	const previous = "whsec-previous-DO-NOT-LEAK"
	until := time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)
	tests := []struct {
		name string
		now  time.Time
		// wantPrevious: the previous secret's signature is sent.
		wantPrevious bool
	}{
		{"an hour before its end", until.Add(-time.Hour), true},
		{"a second before its end", until.Add(-time.Second), true},
		{"at its end", until, false},
		{"after its end", until.Add(time.Hour), false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var (
				got     http.Header
				gotBody []byte
			)
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				got = r.Header.Clone()
				gotBody, _ = io.ReadAll(r.Body)
			}))
			defer srv.Close()
			p := New(Options{})
			p.now = func() time.Time { return tc.now }
			c := consumerFor(srv.URL)
			c.PreviousSecret, c.PreviousSecretUntil = previous, until
			h, err := p.Handler(c)
			if err != nil {
				t.Fatal(err)
			}
			if err := h.Handle(context.Background(), newMessage(t)); err != nil {
				t.Fatal(err)
			}
			ts := tc.now.Unix()
			want := bellhop.SignPush(testSecret, ts, gotBody)
			if tc.wantPrevious {
				want += "," + bellhop.SignPush(previous, ts, gotBody)
			}
			if v := got.Values(bellhop.HeaderSignature); len(v) != 1 || v[0] != want {
				t.Errorf("%s = %q, want %q", bellhop.HeaderSignature, v, want)
			}
			if err := bellhop.VerifyPush(testSecret, got, gotBody, tc.now, 0); err != nil {
				t.Errorf("the new secret does not verify: %v", err)
			}
			err = bellhop.VerifyPush(previous, got, gotBody, tc.now, 0)
			if tc.wantPrevious && err != nil {
				t.Errorf("the previous secret does not verify: %v", err)
			}
			if !tc.wantPrevious && !errors.Is(err, bellhop.ErrBadSignature) {
				t.Errorf("the previous secret, past its end: %v, want %v", err, bellhop.ErrBadSignature)
			}
			for name, vs := range got {
				for _, v := range vs {
					if strings.Contains(v, previous) || strings.Contains(v, testSecret) {
						t.Errorf("header %s carries a secret", name)
					}
				}
			}
		})
	}
}

func TestRequest(t *testing.T) {
	now := time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)
	var (
		got     *http.Request
		gotBody []byte
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got = r
		gotBody, _ = io.ReadAll(r.Body)
	}))
	defer srv.Close()

	p := New(Options{UserAgent: "bellhop-test/9"})
	p.now = func() time.Time { return now }
	h, err := p.Handler(consumerFor(srv.URL + "/hooks/orders?x=1"))
	if err != nil {
		t.Fatal(err)
	}
	m := newMessage(t)
	if err := h.Handle(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	if got.Method != http.MethodPost || got.URL.Path != "/hooks/orders" || got.URL.RawQuery != "x=1" {
		t.Errorf("request %s %s", got.Method, got.URL)
	}
	if !bytes.Equal(gotBody, m.Payload) {
		t.Errorf("body %q, want %q", gotBody, m.Payload)
	}
	for name, want := range map[string]string{
		"Content-Type":            "application/json",
		"User-Agent":              "bellhop-test/9",
		bellhop.HeaderMessageID:   m.ID.String(),
		bellhop.HeaderApp:         "shop",
		bellhop.HeaderQueue:       "orders.created",
		bellhop.HeaderAttempt:     "2",
		bellhop.HeaderMaxAttempts: "5",
		bellhop.HeaderEnqueuedAt:  "2025-03-04T04:06:07.890123456Z",
		bellhop.HeaderConsumerID:  m.ConsumerID.String(),
		bellhop.HeaderSource:      "queue",
		bellhop.HeaderTimestamp:   strconv.FormatInt(now.Unix(), 10),
		bellhop.HeaderSignature:   bellhop.SignPush(testSecret, now.Unix(), m.Payload),
		"Content-Length":          strconv.Itoa(len(m.Payload)),
		"Bellhop-Message-ID":      m.ID.String(), // header names are case-insensitive
	} {
		if v := got.Header.Values(name); len(v) != 1 || v[0] != want {
			t.Errorf("header %s = %q, want %q", name, v, want)
		}
	}
	if err := bellhop.VerifyPush(testSecret, got.Header, gotBody, now.Add(time.Minute), 0); err != nil {
		t.Errorf("Verify: %v", err)
	}
	for name, vs := range got.Header {
		for _, v := range vs {
			if strings.Contains(v, testSecret) {
				t.Errorf("header %s carries the secret", name)
			}
		}
	}
	if c := got.Header.Get("Cookie"); c != "" {
		t.Errorf("Cookie %q", c)
	}
	// Idempotency-Key is new on every request: the message id, the same
	// on every attempt, would have idempotency middleware answer a retry
	// with the first attempt's answer.
	first := got.Header.Get("Idempotency-Key")
	if k, err := uuid.Parse(first); err != nil || k == m.ID {
		t.Errorf("Idempotency-Key %q: want a UUID other than the message id", first)
	}
	if err := h.Handle(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	if again := got.Header.Get("Idempotency-Key"); again == first || again == "" {
		t.Errorf("Idempotency-Key %q on the message's next push, want a new one (the first was %q)", again, first)
	}
	// The README lists exactly the Bellhop- headers a consumer receives.
	var sent []string
	for name := range got.Header {
		if strings.HasPrefix(name, "Bellhop-") {
			sent = append(sent, name)
		}
	}
	if listed := readmePushHeaders(t); !slices.Equal(listed, slices.Sorted(slices.Values(sent))) {
		t.Errorf("README.md lists the push headers %q; a request carries %q", listed, slices.Sorted(slices.Values(sent)))
	}

	// An InvokeAsync delivery says so.
	inv := newMessage(t)
	inv.Invoked = true
	if err := h.Handle(context.Background(), inv); err != nil {
		t.Fatal(err)
	}
	if v := got.Header.Values(bellhop.HeaderSource); len(v) != 1 || v[0] != "invoke" {
		t.Errorf("invoke delivery: header %s = %q, want \"invoke\"", bellhop.HeaderSource, v)
	}
}

// readmePushHeaders returns the Bellhop- headers that README.md's
// sentence "... and these headers: ..." names, canonicalised and sorted.
func readmePushHeaders(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, found := strings.Cut(string(b), "these headers:")
	if !found {
		t.Fatal(`README.md has no "these headers:" list`)
	}
	sentence, _, _ := strings.Cut(rest, ".\n")
	var names []string
	for _, m := range regexp.MustCompile("`(Bellhop-[A-Za-z-]+)`").FindAllStringSubmatch(sentence, -1) {
		names = append(names, http.CanonicalHeaderKey(m[1]))
	}
	if len(names) == 0 {
		t.Fatalf("README.md's header list names no Bellhop- header: %q", sentence)
	}
	slices.Sort(names)
	return names
}

func TestDefaultUserAgent(t *testing.T) {
	var ua atomic.Value
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { ua.Store(r.UserAgent()) }))
	defer srv.Close()
	if err := deliver(t, New(Options{}), consumerFor(srv.URL)); err != nil {
		t.Fatal(err)
	}
	if ua.Load() != DefaultUserAgent {
		t.Errorf("User-Agent %q", ua.Load())
	}
}

func TestNoSecretOrPayloadLeaks(t *testing.T) {
	var logs bytes.Buffer
	log := zerolog.New(&logs).Level(zerolog.DebugLevel)
	mux := http.NewServeMux()
	mux.HandleFunc("/400", func(w http.ResponseWriter, r *http.Request) { http.Error(w, "bad", 400) })
	mux.HandleFunc("/500", func(w http.ResponseWriter, r *http.Request) { http.Error(w, "boom", 500) })
	mux.HandleFunc("/429", func(w http.ResponseWriter, r *http.Request) { w.Header().Set("Retry-After", "x"); w.WriteHeader(429) })
	mux.HandleFunc("/slow", hang)
	mux.HandleFunc("/302", func(w http.ResponseWriter, r *http.Request) { http.Redirect(w, r, "/200", http.StatusFound) })
	mux.HandleFunc("/200", func(w http.ResponseWriter, r *http.Request) {})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	refused := "http://" + l.Addr().String()
	l.Close()

	p := New(Options{Logger: log, Timeout: 100 * time.Millisecond})
	var errs []string
	for _, u := range []string{srv.URL + "/400", srv.URL + "/500", srv.URL + "/429", srv.URL + "/slow",
		srv.URL + "/302", srv.URL + "/200", refused + "/x"} {
		h, err := p.Handler(consumerFor(u + "?token=QUERY-TOKEN"))
		if err != nil {
			t.Fatal(err)
		}
		m := newMessage(t)
		if err := h.Handle(context.Background(), m); err != nil {
			errs = append(errs, err.Error())
		}
		if !strings.Contains(logs.String(), m.ID.String()) {
			t.Errorf("%s: no log line for message %s", u, m.ID)
		}
	}
	if len(errs) != 6 {
		t.Errorf("%d errors, want 6: %q", len(errs), errs)
	}
	all := strings.Join(errs, "\n") + "\n" + logs.String()
	for _, secret := range []string{testSecret, "PAYLOAD-MARKER", "QUERY-TOKEN"} {
		if strings.Contains(all, secret) {
			t.Errorf("%q appears in errors or logs:\n%s", secret, all)
		}
	}
	for _, field := range []string{`"app_id"`, `"queue":"orders.created"`, `"message_id"`, `"attempt":2`, `"status":500`, `"duration":"`, `"level":"debug"`} {
		if !strings.Contains(logs.String(), field) {
			t.Errorf("logs lack %s:\n%s", field, logs.String())
		}
	}
}

func TestParseRetryAfter(t *testing.T) {
	now := time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)
	for _, tt := range []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"0", 0, true},
		{"5", 5 * time.Second, true},
		{" 5 ", 5 * time.Second, true},
		{"43199", 43199 * time.Second, true},
		{"43200", MaxRetryAfter, true},
		{"9223372036854775808", MaxRetryAfter, true},
		{now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second, true},
		{"Sunday, 01-Jun-25 12:01:00 GMT", time.Minute, true}, // RFC 850
		{"Sun Jun  1 12:01:00 2025", time.Minute, true},       // asctime
		{now.Format(http.TimeFormat), -1, true},
		{now.Add(-time.Hour).Format(http.TimeFormat), -1, true},
		{"", 0, false},
		{"-1", 0, false},
		{"1.5", 0, false},
		{"5s", 0, false},
		{"tomorrow", 0, false},
	} {
		got, ok := parseRetryAfter(tt.in, now)
		if got != tt.want || ok != tt.ok {
			t.Errorf("parseRetryAfter(%q) = %s, %v; want %s, %v", tt.in, got, ok, tt.want, tt.ok)
		}
	}
}

func TestSnippet(t *testing.T) {
	long := strings.Repeat("a", 300)
	wide := strings.Repeat("é", 150) // 300 bytes
	for _, tt := range []struct{ in, want string }{
		{"", ""},
		{"  \n\t ", ""},
		{"plain text", "plain text"},
		{"a\r\nb\tc   d", "a b c d"},
		{"esc\x1b[0m nul\x00 del\x7f", "esc?[0m nul? del?"},
		{"bidi \u202eevil", "bidi ?evil"},
		{"bad \xff\xfe utf8", "bad ?? utf8"},
		{"ünïcødé ok", "ünïcødé ok"},
		{long, long[:197] + "..."},
		{strings.Repeat("b", 200), strings.Repeat("b", 200)},
		{wide, strings.Repeat("é", 98) + "..."},
	} {
		got := snippet([]byte(tt.in))
		if got != tt.want {
			t.Errorf("snippet(%q) = %q, want %q", tt.in, got, tt.want)
		}
		if len(got) > maxSnippet || !utf8.ValidString(got) {
			t.Errorf("snippet(%q) = %q: %d bytes, valid UTF-8 %v", tt.in, got, len(got), utf8.ValidString(got))
		}
	}
}
