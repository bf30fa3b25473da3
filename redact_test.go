package bellhop_test

import (
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/bellhopq/bellhop"
)

// TestClientErrorsHidePasswords: a connection string, or another URL with
// credentials, passed to the Client where a name belongs is not repeated
// whole in its error, as the CLI's checks already made sure (found by the
// API review: the Client's errors quoted it, password and all, sometimes
// beside the redacted form).
func TestClientErrorsHidePasswords(t *testing.T) {
	e := fxNew(t)
	e.appConsumer("shop", "orders")
	for _, bad := range []string{
		"postgres://u:S3CRET@h/db",
		"host=h password=S3CRET dbname=d",
		"https://u:S3CRET@h/x",
		"u:S3CRET@h",
	} {
		for name, call := range map[string]func() error{
			"Enqueue app": func() error {
				_, err := e.client.Enqueue(e.ctx, bad, "orders", []byte(`{}`), bellhop.EnqueueOptions{})
				return err
			},
			"Enqueue queue": func() error {
				_, err := e.client.Enqueue(e.ctx, "shop", bad, []byte(`{}`), bellhop.EnqueueOptions{})
				return err
			},
			"EnqueueMany queue": func() error {
				_, err := e.client.EnqueueMany(e.ctx, "shop", []bellhop.NewMessage{
					{Queue: "orders", Payload: []byte(`{}`)}, {Queue: bad, Payload: []byte(`{}`)}})
				return err
			},
			"Queues": func() error {
				_, err := e.client.Queues(e.ctx, bad)
				return err
			},
			"RegisterConsumer principal": func() error {
				_, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "other", Principal: bad})
				return err
			},
			"ConsumerOf": func() error {
				_, err := e.client.ConsumerOf(e.ctx, "shop", bad)
				return err
			},
			"RemoveConsumer": func() error { return e.client.RemoveConsumer(e.ctx, bad, uuid.New()) },
			"DeadLetters": func() error {
				_, err := e.client.DeadLetters(e.ctx, bellhop.DeadFilter{App: bad})
				return err
			},
			"Redrive": func() error {
				_, err := e.client.Redrive(e.ctx, bad, "orders", uuid.Nil)
				return err
			},
			"CreatePrincipal": func() error {
				_, err := e.client.CreatePrincipal(e.ctx, "shop", bad)
				return err
			},
		} {
			err := call()
			if err == nil {
				t.Errorf("%s with %q: no error", name, bad)
			} else if strings.Contains(err.Error(), "S3CRET") {
				t.Errorf("%s with %q: the error shows the password: %v", name, bad, err)
			}
		}
	}
}
