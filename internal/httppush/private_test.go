package httppush

import (
	"bytes"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
)

// TestNotPublic: the addresses BlockPrivate refuses, IPv4 also when
// mapped into IPv6, and some it lets through.
func TestNotPublic(t *testing.T) {
	for _, tc := range []struct{ addr, want string }{
		{"127.0.0.1", "loopback"},
		{"127.8.9.10", "loopback"},
		{"::1", "loopback"},
		{"::ffff:127.0.0.1", "loopback"},
		{"0.0.0.0", "unspecified"},
		{"::", "unspecified"},
		{"10.1.2.3", "private"},
		{"172.16.0.1", "private"},
		{"172.31.255.255", "private"},
		{"192.168.1.1", "private"},
		{"::ffff:192.168.1.1", "private"},
		{"fd12:3456::1", "private"},
		{"169.254.169.254", "link-local"},
		{"fe80::1", "link-local"},
		{"224.0.0.1", "link-local"},
		{"239.1.2.3", "multicast"},
		{"ff05::1", "multicast"},
		{"100.64.0.1", "shared (carrier-grade NAT)"},
		{"100.127.255.255", "shared (carrier-grade NAT)"},
		{"0.1.2.3", `in "this network"`},
		{"8.8.8.8", ""},
		{"172.32.0.1", ""},
		{"100.128.0.1", ""},
		{"2001:4860:4860::8888", ""},
		{"::ffff:8.8.8.8", ""},
	} {
		if got := notPublic(netip.MustParseAddr(tc.addr)); got != tc.want {
			t.Errorf("notPublic(%s) = %q, want %q", tc.addr, got, tc.want)
		}
	}
}

// TestBlockPrivate: with BlockPrivate, a push to a consumer on a loopback
// address is refused before it connects, as a connection refused would be
// (an ordinary retry, not abandoned), its error naming the address; the
// consumer sees nothing. Without it the same push is acked. Nothing
// checked the address a consumer's name resolved to: only AllowedHosts,
// by name.
func TestBlockPrivate(t *testing.T) {
	var got atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got.Add(1)
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	var logged bytes.Buffer
	blocking := New(Options{BlockPrivate: true, Logger: zerolog.New(&logged).Level(zerolog.InfoLevel)})
	for _, host := range []string{srv.URL, strings.Replace(srv.URL, "127.0.0.1", "localhost", 1)} {
		err := deliver(t, blocking, consumerFor(host+"/hook"))
		if err == nil || kind(err) != "retry" || errors.Is(err, bellhop.ErrAbandoned) ||
			!strings.Contains(err.Error(), "is loopback, and pushes to addresses that are not public are blocked") {
			t.Errorf("push to %s with BlockPrivate: %v (%s); want an ordinary retry naming the loopback address", host, err, kind(err))
		}
	}
	if n := got.Load(); n != 0 {
		t.Fatalf("the consumer got %d requests through BlockPrivate", n)
	}
	// A setting to fix: said at warn, once a minute whatever the number
	// of pushes blocked (the handler's retry is logged at info).
	lines := strings.Split(strings.TrimSpace(logged.String()), "\n")
	if len(lines) != 1 || !strings.Contains(lines[0], `"level":"warn"`) || !strings.Contains(lines[0], `"address":"127.0.0.1:`) ||
		!strings.Contains(lines[0], "push blocked") {
		t.Errorf("BlockPrivate logged %q; want one warning naming the address", lines)
	}
	if err := deliver(t, New(Options{}), consumerFor(srv.URL+"/hook")); err != nil || got.Load() != 1 {
		t.Errorf("push without BlockPrivate: %v, %d requests; want an ack", err, got.Load())
	}
}

// TestCheckBlockPrivate: BlockPrivate beside a proxy is refused, since
// the address dialled would be the proxy's.
func TestCheckBlockPrivate(t *testing.T) {
	for _, tc := range []struct {
		env  map[string]string
		want string
	}{
		{nil, ""},
		{map[string]string{"NO_PROXY": "*"}, ""},
		{map[string]string{"HTTPS_PROXY": "http://proxy:3128"}, "with HTTPS_PROXY set"},
		{map[string]string{"http_proxy": "http://proxy:3128"}, "with http_proxy set"},
	} {
		err := CheckBlockPrivate(func(k string) string { return tc.env[k] })
		if (err == nil) != (tc.want == "") || err != nil && !strings.Contains(err.Error(), tc.want) {
			t.Errorf("CheckBlockPrivate(%v) = %v, want %q", tc.env, err, tc.want)
		}
	}
}
