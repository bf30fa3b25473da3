package bellhop_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/bellhopq/bellhop"
)

// TestPrincipals: Principals lists an app's principals, or every app's,
// by app and name, with their ids; refuses an unknown app or a name that
// can be no app's as the other listings do; and keeps a Client made with
// As to its own app.
func TestPrincipals(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	before := time.Now().Add(-time.Minute)
	shop, other := e.app("shop"), e.app("other")
	billing, err := e.client.CreatePrincipal(e.ctx, "shop", "billing")
	if err != nil {
		t.Fatal(err)
	}
	// What a listing shows of each principal.
	type row struct {
		id        uuid.UUID
		app, name string
	}
	otherDefault := row{other.DefaultPrincipal, "other", "default"}
	shopBilling := row{billing, "shop", "billing"}
	shopDefault := row{shop.DefaultPrincipal, "shop", "default"}
	tests := []struct {
		name     string
		client   *bellhop.Client
		app      string
		want     []row
		wantErr  error  // nil: success
		wantText string // in the error
	}{
		{name: "every app", client: e.client, app: "", want: []row{otherDefault, shopBilling, shopDefault}},
		{name: "one app", client: e.client, app: "shop", want: []row{shopBilling, shopDefault}},
		{name: "unknown app", client: e.client, app: "nosuch", wantErr: bellhop.ErrUnknownApp, wantText: `list principals: unknown app "nosuch"`},
		{name: "not an app name", client: e.client, app: "bad\x1bname", wantErr: bellhop.ErrUnknownApp, wantText: `unknown app "bad\x1bname" (not a valid app name`},
		{name: "its own app, as a principal", client: e.client.As(billing), app: "", want: []row{shopBilling, shopDefault}},
		{name: "another app, as a principal", client: e.client.As(billing), app: "other", wantErr: bellhop.ErrForbidden},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ps, err := tc.client.Principals(e.ctx, tc.app)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) || !strings.Contains(err.Error(), tc.wantText) || ps != nil {
					t.Errorf("got %v, %v; want an error wrapping %v that says %q", ps, err, tc.wantErr, tc.wantText)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var got []row
			for _, p := range ps {
				got = append(got, row{p.ID, p.App, p.Name})
				if p.CreatedAt.Before(before) || p.CreatedAt.After(time.Now().Add(time.Minute)) {
					t.Errorf("principal %s/%s CreatedAt %s, want about now", p.App, p.Name, p.CreatedAt)
				}
			}
			if len(got) != len(tc.want) {
				t.Fatalf("listed %v, want %v", got, tc.want)
			}
			for i := range got {
				if got[i] != tc.want[i] {
					t.Errorf("listed %v, want %v", got, tc.want)
					break
				}
			}
		})
	}
}
