package validate_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/bellhopq/bellhop/internal/httppush"
	"github.com/bellhopq/bellhop/internal/validate"
)

// TestPushURL: the library's check of a consumer URL agrees with the
// daemon's (httppush, without an allow-list), so that a URL accepted at
// registration is one the daemon serves, and the other way round.
func TestPushURL(t *testing.T) {
	tests := []struct {
		url  string
		want string // in PushURL's error; "" for none
		// Refused at registration only: a consumer stored before the rule
		// is still served.
		registrationOnly bool
	}{
		{url: "http://consumer:8080/hook"},
		{url: "https://hooks.example.com/x?token=1"},
		{url: "http://[::1]:9000/x"},
		{url: "http://10.0.0.1/"},
		{url: "http://:9/x", want: "has no host"},
		{url: "https://:443", want: "has no host"},
		{url: "http://[]:9/x", want: "invalid host"},
		{url: "https:///x", want: `URL "https:///x" has no host`},
		{url: "http://", want: `URL "http://" has no host`},
		{url: "https://x.example.com/\xff", want: "is not valid UTF-8"},
		{url: "https://x\xff.example.com/", want: "is not valid UTF-8"},
		{url: "hooks.example.com/x", want: "scheme must be http or https"},
		{url: "ftp://hooks.example.com/x", want: "scheme must be http or https"},
		{url: "", want: "scheme must be http or https"},
		{url: "http://u:pw@hooks.example.com/", want: "carries credentials"},
		{url: "http://[::1/x", want: "missing ']' in host"},
		{url: "http://a b.example.com/", want: "invalid character"},
		// Listings show the URL: nothing that reorders it, runs as a
		// terminal's escape, or shifts the columns.
		{url: "https://example.com/a  b", want: "holds a space or a character that is not printable", registrationOnly: true},
		{url: "https://example.com/\u202egpj.exe", want: `"https://example.com/\u202egpj.exe" holds a space`, registrationOnly: true},
		{url: "https://example.com/\u009b31m", want: "not printable", registrationOnly: true},
		{url: "https://example.com/\u200bx", want: "not printable", registrationOnly: true},
		{url: "https://example.com/caf\u00e9", want: ""},
		{url: "https://example.com/a%20b", want: ""},
		{url: "http://example.com:99999/hook", want: `port "99999" is outside 1..65535`},
		{url: "http://example.com:0/hook", want: `port "0" is outside 1..65535`},
		{url: "http://[::1]:65536/", want: `port "65536" is outside 1..65535`},
		{url: "http://example.com:65535/hook"},
		{url: "http://example.com:/hook"},
	}
	daemon := httppush.New(httppush.Options{})
	for _, tt := range tests {
		err := validate.PushURL(tt.url)
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("PushURL(%q) = %v, want nil", tt.url, err)
		case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
			t.Errorf("PushURL(%q) = %v, want an error with %q", tt.url, err, tt.want)
		case err != nil && !errors.Is(err, validate.ErrOption):
			t.Errorf("PushURL(%q) = %v, not an ErrOption", tt.url, err)
		}
		if derr := daemon.CheckURL(tt.url); (derr == nil) != (err == nil || tt.registrationOnly) {
			t.Errorf("%q: PushURL says %v, the daemon says %v", tt.url, err, derr)
		}
	}
	if err := validate.PushURL("https://a.example.com/" + strings.Repeat("x", 2048)); err == nil {
		t.Error("PushURL accepted a URL over 2048 bytes")
	}
	// The errors never show a credential, whatever else is wrong: a
	// password, a token given as the user name, or one in the query or
	// the fragment.
	for _, u := range []string{
		"http://u:s3cr3t-pw@hooks.example.com/",
		"ftp://u:s3cr3t-pw@hooks.example.com/",
		"http://u:s3cr3t-pw@[::1/x",
		"http://u:s3cr3t-pw@:9/x",
		"https://s3cr3t-tok@hooks.example.com/hook",
		"https://s3cr3t-tok:@hooks.example.com/hook",
		"ftp://hooks.example.com/hook?token=s3cr3t-tok",
		"ftp://hooks.example.com/hook#access_token=s3cr3t-tok",
		"http://:9/x?token=s3cr3t-tok",
		// Unparsable, and with no "@": shown, but not its query or
		// fragment.
		"https://h.example/%zz?token=s3cr3t-tok",
		"https://h.example/%zz#access_token=s3cr3t-tok",
		"http://[::1/x?token=s3cr3t-tok",
	} {
		if err := validate.PushURL(u); err == nil || strings.Contains(err.Error(), "s3cr3t") {
			t.Errorf("PushURL(%q) = %v, want an error without the credential", u, err)
		}
		if err := daemon.CheckURL(u); err == nil || strings.Contains(err.Error(), "s3cr3t") {
			t.Errorf("the daemon's CheckURL(%q) = %v, want an error without the credential", u, err)
		}
	}
}

// TestPushURLSchemeCase: an upper-case scheme, which url.Parse lowers but
// the table's constraint refuses, gets an error that says what to write.
func TestPushURLSchemeCase(t *testing.T) {
	t.Parallel()
	for _, u := range []string{"HTTP://example.com/x", "Https://example.com/x"} {
		// The URL as written: url.Parse's lowered scheme would hide what
		// is wrong.
		want := fmt.Sprintf("URL %q: write the scheme in lower case", u)
		if err := validate.PushURL(u); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("PushURL(%q) = %v, want an error with %q", u, err, want)
		}
	}
	if err := validate.PushURL("https://example.com/x"); err != nil {
		t.Errorf("PushURL of a lower-case https URL: %v", err)
	}
}

// TestShownURL: a URL is shown as written, with nothing of its user
// information, query or fragment; one whose "@" url.Parse does not read
// as user information (no "//" authority) is not shown at all, since the
// "@" may end a password.
func TestShownURL(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ url, want string }{
		{"HTTP://EXAMPLE.COM/", `"HTTP://EXAMPLE.COM/"`},
		{"http://", `"http://"`},
		{"https://h.example.com/users/@me", `"https://h.example.com/users/@me"`},
		{"HTTP://u:S3CRET@h.example.com/x", `"HTTP://xxxxx@h.example.com/x"`},
		{"https://h.example.com/x?token=S3CRET", `"https://h.example.com/x?xxxxx"`},
		{"https://h.example.com/x#S3CRET", `"https://h.example.com/x#xxxxx"`},
		{"http:user:S3CRET@h.example.com/x", "(not shown: it may carry credentials)"},
		{"https:/u:S3CRET@h.example.com/x", "(not shown: it may carry credentials)"},
		{"http://u:S3CRET@h.example.com:port/x", "(not shown: it may carry credentials)"},
	} {
		got := validate.ShownURL(tc.url)
		if got != tc.want || strings.Contains(got, "S3CRET") {
			t.Errorf("ShownURL(%q) = %s, want %s", tc.url, got, tc.want)
		}
	}
}
