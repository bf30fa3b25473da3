package bellhop

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net/http"
	"strconv"
	"testing"
	"time"
)

func signedHeader(secret string, ts int64, body []byte) http.Header {
	h := http.Header{}
	h.Set(HeaderTimestamp, strconv.FormatInt(ts, 10))
	h.Set(HeaderSignature, SignPush(secret, ts, body))
	return h
}

func TestSignFormat(t *testing.T) {
	// Recompute independently so that the documented wire format, not just
	// Sign's agreement with Verify, is pinned down.
	m := hmac.New(sha256.New, []byte("k"))
	m.Write([]byte(`1700000000.{"a":1}`))
	want := "v1=" + hex.EncodeToString(m.Sum(nil))
	if got := SignPush("k", 1700000000, []byte(`{"a":1}`)); got != want {
		t.Fatalf("Sign = %s, want %s", got, want)
	}
}

func TestVerify(t *testing.T) {
	const secret = "topsecret"
	now := time.Unix(1700000000, 0)
	ts := now.Unix()
	body := []byte(`{"order":42}`)
	good := SignPush(secret, ts, body)

	tests := []struct {
		name   string
		header func() http.Header
		body   []byte
		secret string
		window time.Duration
		want   error // nil: accepted
	}{
		{name: "round trip", header: func() http.Header { return signedHeader(secret, ts, body) }},
		{name: "tampered body", body: []byte(`{"order":43}`),
			header: func() http.Header { return signedHeader(secret, ts, body) }, want: ErrBadSignature},
		{name: "tampered timestamp", want: ErrBadSignature, header: func() http.Header {
			h := signedHeader(secret, ts, body)
			h.Set(HeaderTimestamp, strconv.FormatInt(ts+1, 10))
			return h
		}},
		{name: "wrong secret", header: func() http.Header { return signedHeader("other", ts, body) }, want: ErrBadSignature},
		{name: "empty verifying secret", secret: "-", header: func() http.Header { return signedHeader("", ts, body) }, want: ErrBadSignature},
		{name: "stale", header: func() http.Header { return signedHeader(secret, ts-301, body) }, want: ErrStaleSignature},
		{name: "from the future", header: func() http.Header { return signedHeader(secret, ts+301, body) }, want: ErrStaleSignature},
		{name: "edge of window", header: func() http.Header { return signedHeader(secret, ts-300, body) }},
		{name: "custom window", window: time.Second,
			header: func() http.Header { return signedHeader(secret, ts-2, body) }, want: ErrStaleSignature},
		{name: "no headers", header: func() http.Header { return http.Header{} }, want: ErrNoSignature},
		{name: "no signature", want: ErrNoSignature, header: func() http.Header {
			h := signedHeader(secret, ts, body)
			h.Del(HeaderSignature)
			return h
		}},
		{name: "no timestamp", want: ErrNoSignature, header: func() http.Header {
			h := signedHeader(secret, ts, body)
			h.Del(HeaderTimestamp)
			return h
		}},
		{name: "garbled timestamp", want: ErrBadSignature, header: func() http.Header {
			h := signedHeader(secret, ts, body)
			h.Set(HeaderTimestamp, "yesterday")
			return h
		}},
		{name: "non-canonical timestamp", want: ErrBadSignature, header: func() http.Header {
			h := signedHeader(secret, ts, body)
			h.Set(HeaderTimestamp, "+"+strconv.FormatInt(ts, 10))
			return h
		}},
		{name: "two timestamps", want: ErrBadSignature, header: func() http.Header {
			h := signedHeader(secret, ts, body)
			h.Add(HeaderTimestamp, strconv.FormatInt(ts, 10))
			return h
		}},
		{name: "garbled hex", want: ErrBadSignature, header: func() http.Header {
			h := signedHeader(secret, ts, body)
			h.Set(HeaderSignature, "v1=zz-not-hex")
			return h
		}},
		{name: "only another scheme", want: ErrNoSignature, header: func() http.Header {
			h := signedHeader(secret, ts, body)
			h.Set(HeaderSignature, "v2="+good[3:])
			return h
		}},
		{name: "rotation: second value matches", header: func() http.Header {
			h := signedHeader(secret, ts, body)
			h.Set(HeaderSignature, SignPush("old-secret", ts, body)+", "+good)
			return h
		}},
		{name: "rotation: garbled and foreign values are skipped", header: func() http.Header {
			h := signedHeader(secret, ts, body)
			h.Set(HeaderSignature, "v1=nothex,v0=abc,"+good)
			return h
		}},
		{name: "rotation: repeated header lines", header: func() http.Header {
			h := signedHeader(secret, ts, body)
			h.Set(HeaderSignature, SignPush("old-secret", ts, body))
			h.Add(HeaderSignature, good)
			return h
		}},
		{name: "rotation: none match", want: ErrBadSignature, header: func() http.Header {
			h := signedHeader(secret, ts, body)
			h.Set(HeaderSignature, SignPush("a", ts, body)+","+SignPush("b", ts, body))
			return h
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, s := body, secret
			if tt.body != nil {
				b = tt.body
			}
			if tt.secret == "-" {
				s = ""
			}
			err := VerifyPush(s, tt.header(), b, now, tt.window)
			if tt.want == nil {
				if err != nil {
					t.Fatalf("Verify: %v", err)
				}
				return
			}
			if !errors.Is(err, tt.want) {
				t.Fatalf("Verify = %v, want %v", err, tt.want)
			}
			for _, other := range []error{ErrNoSignature, ErrBadSignature, ErrStaleSignature} {
				if other != tt.want && errors.Is(err, other) {
					t.Errorf("error %v also wraps %v", err, other)
				}
			}
		})
	}
}
