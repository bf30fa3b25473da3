package main

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
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

// TestProbeMethods: /metrics, /healthz and /readyz answer GET and HEAD,
// and any other method 405 Method Not Allowed with an Allow header naming
// those two, without calling the endpoint's handler. Every method got 200:
// a POST to /metrics built a whole answer.
func TestProbeMethods(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	called := map[string]int{}
	stub := func(name string) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			mu.Lock()
			called[name]++
			mu.Unlock()
			fmt.Fprintln(w, name)
		})
	}
	srv := httptest.NewServer(probeMux(stub("metrics"), stub("ready")))
	defer srv.Close()
	for _, path := range []string{"/metrics", "/healthz", "/readyz"} {
		for _, tc := range []struct {
			method string
			want   int
		}{
			{http.MethodGet, http.StatusOK},
			{http.MethodHead, http.StatusOK},
			{http.MethodPost, http.StatusMethodNotAllowed},
			{http.MethodPut, http.StatusMethodNotAllowed},
			{http.MethodPatch, http.StatusMethodNotAllowed},
			{http.MethodDelete, http.StatusMethodNotAllowed},
			{http.MethodOptions, http.StatusMethodNotAllowed},
			{http.MethodTrace, http.StatusMethodNotAllowed},
		} {
			t.Run(tc.method+path, func(t *testing.T) {
				mu.Lock()
				before := called["metrics"] + called["ready"]
				mu.Unlock()
				req, err := http.NewRequest(tc.method, srv.URL+path, strings.NewReader("x"))
				if err != nil {
					t.Fatal(err)
				}
				resp, err := srv.Client().Do(req)
				if err != nil {
					t.Fatal(err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != tc.want {
					t.Fatalf("%s %s: %d %q, want %d", tc.method, path, resp.StatusCode, body, tc.want)
				}
				if tc.want != http.StatusMethodNotAllowed {
					if tc.method == http.MethodHead && len(body) != 0 {
						t.Errorf("HEAD %s: body %q, want none", path, body)
					}
					return
				}
				if allow := resp.Header.Get("Allow"); allow != "GET, HEAD" {
					t.Errorf("%s %s: Allow %q, want \"GET, HEAD\"", tc.method, path, allow)
				}
				mu.Lock()
				after := called["metrics"] + called["ready"]
				mu.Unlock()
				if after != before {
					t.Errorf("%s %s: the endpoint's handler was called", tc.method, path)
				}
			})
		}
	}
}
