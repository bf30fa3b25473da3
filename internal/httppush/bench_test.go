package httppush

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
)

// BenchmarkHandle pushes one message per op to a local server that
// answers 200 at once, over a reused connection: the pusher's own cost
// (signing, headers, the request's trace, reading the answer) plus a
// loopback round trip.
func BenchmarkHandle(b *testing.B) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
	}))
	defer srv.Close()
	h, err := New(Options{}).Handler(consumerFor(srv.URL))
	if err != nil {
		b.Fatal(err)
	}
	m := newMessage(b)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if err := h.Handle(ctx, m); err != nil {
			b.Fatal(err)
		}
	}
}
