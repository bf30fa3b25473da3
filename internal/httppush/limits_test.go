package httppush

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestAllowedHostsRefuseNonASCII: with allowed hosts set, a hostname
// that is not ASCII is refused. "api.servİce.com" lower-cases to the
// allowed "api.service.com", but net/http dials its IDNA form,
// api.xn--service-bie.com, a domain anyone may register. Its xn-- form is
// matched as written.
func TestAllowedHostsRefuseNonASCII(t *testing.T) {
	p := New(Options{AllowedHosts: []string{"api.service.com", "xn--bcher-kva.example", "key.example"}})
	for _, tt := range []struct {
		url, want string // want: in the error; "" for none
	}{
		{"http://api.serv\u0130ce.com/hook", "is not ASCII"},
		{"http://\u212Aey.example/hook", "is not ASCII"}, // the Kelvin sign lower-cases to k
		{"http://bücher.example/hook", "is not ASCII"},
		{"http://xn--bcher-kva.example/hook", ""},
		{"https://API.service.com./hook", ""},
	} {
		err := p.CheckURL(tt.url)
		if _, herr := p.Handler(consumerFor(tt.url)); (herr == nil) != (err == nil) {
			t.Errorf("%s: CheckURL %v but Handler %v", tt.url, err, herr)
		}
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("CheckURL(%s) = %v, want nil", tt.url, err)
		case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
			t.Errorf("CheckURL(%s) = %v, want an error with %q", tt.url, err, tt.want)
		}
	}
	// An entry that is not ASCII matches nothing, though it lower-cases
	// to an ASCII name (İ to i, the Kelvin sign to k): New does not check
	// the list (CheckAllowedHosts refuses these), and fails closed.
	for _, tt := range []struct{ entry, url string }{
		{"serv\u0130ce.com", "https://service.com/hook"},
		{"SERV\u0130CE.COM", "https://service.com/hook"},
		{"\u212Aey.example", "https://key.example/hook"},
		{"*.\u212Aey.example", "https://a.key.example/hook"},
	} {
		if err := New(Options{AllowedHosts: []string{tt.entry}}).CheckURL(tt.url); err == nil {
			t.Errorf("allowed host %q admits %s", tt.entry, tt.url)
		}
	}
	// Without a list every host is allowed, so nothing is compared.
	if err := New(Options{}).CheckURL("http://bücher.example/hook"); err != nil {
		t.Errorf("without allowed hosts: %v", err)
	}
}

// TestResponseHeadersBounded: a consumer answering with megabytes of
// headers fails its push (a retry) instead of being read into memory.
func TestResponseHeadersBounded(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Junk", strings.Repeat("a", 1<<20))
	}))
	defer srv.Close()
	h, err := New(Options{}).Handler(consumerFor(srv.URL))
	if err != nil {
		t.Fatal(err)
	}
	err = h.Handle(context.Background(), newMessage(t))
	if err == nil || kind(err) != "retry" {
		t.Fatalf("a 1 MiB response header gave %v (%s), want a failed push, retried", err, kind(err))
	}
	if !strings.Contains(err.Error(), "header") {
		t.Errorf("error %q does not say the headers were too large", err)
	}
}
