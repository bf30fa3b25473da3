// Package httppush is the HTTP push consumer of the bellhop run daemon: a
// consumer registered with a URL has each message POSTed there, and the
// response status decides the message's fate.
//
// # Protocol
//
// Each delivery is POST <url> with the message payload as the body
// (Content-Type: application/json) and these headers:
//
//	Bellhop-Message-Id    message id (the same on every attempt: dedupe on it; not signed)
//	Idempotency-Key       a new UUID for each request (see below; not for dedupe)
//	Bellhop-App           app name
//	Bellhop-Queue         queue name
//	Bellhop-Attempt       1 on the first delivery
//	Bellhop-Max-Attempts  attempts before the message is dead-lettered
//	Bellhop-Enqueued-At   RFC 3339 UTC, trailing zeros of the fraction dropped
//	Bellhop-Consumer-Id   consumer id
//	Bellhop-Source        "queue", or "invoke" for Client.InvokeAsync deliveries
//	Bellhop-Timestamp     unix seconds when this request was signed
//	Bellhop-Signature     v1=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>, and
//	                      ",v1=" and the same under the previous secret while
//	                      a rotation keeps it signing (Client.RotateConsumerSecret)
//
// Consumers check the signature and timestamp with bellhop.VerifyPush (or
// its equivalent in their language). The response decides:
//
//	2xx                          ack: the message is deleted
//	429, 503 with Retry-After    retry after that long (capped at 12h); 0
//	                             or a date already past is ignored; a
//	                             date counts from the response's Date
//	407, 408, 429, 503, 5xx      retry with the consumer's backoff
//	other 4xx, and 3xx           dead-letter at once: retrying cannot help
//	timeout, connection error    retry with the consumer's backoff
//
// A request that may have reached the consumer but got no answer is
// retried no earlier than the end of the message's lease, however short
// the backoff: the consumer may still be working on it. Such are a
// timeout, a 504 from a gateway in front of the consumer or Cloudflare's
// 524, a connection lost or a response that cannot be read after the
// whole request was written, a response whose headers exceed 64 KiB,
// and the dispatcher stopping or its lease running short. A kept-alive
// connection that the consumer closed just as the request was written to
// it, with no byte of an answer, is not among them: the Idempotency-Key
// header lets net/http send the request again at once on a new connection,
// as it would a GET, since the consumer most likely closed the connection
// for being idle and never read the request. (A consumer that did read it
// and then closed the connection without answering gets it a second time
// at once: delivery is at least once, and the message id is the same.)
//
// Requests go through the proxy that HTTP_PROXY, HTTPS_PROXY and NO_PROXY
// name (net/http's ProxyFromEnvironment), unless Options.Client says
// otherwise. A 407 can only be the proxy's, so it is retried.
//
// Redirects are never followed: the allow-list is checked against the
// registered URL only, so following a redirect would let a consumer send
// signed payloads to a host the operator never allowed.
package httppush

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/logthrottle"
	"github.com/bellhopq/bellhop/internal/printable"
	"github.com/bellhopq/bellhop/internal/validate"
)

const (
	// DefaultMaxResponseBody is how much of a response body is read when
	// Options.MaxResponseBody is 0: enough for any error message worth
	// showing, little enough that a misbehaving consumer cannot make the
	// daemon read without end.
	DefaultMaxResponseBody = 64 << 10
	// DefaultUserAgent is sent when Options.UserAgent is "", so consumers
	// can tell Bellhop's requests apart in their access logs.
	DefaultUserAgent = "bellhop-push/1"
	// MaxRetryAfter caps a consumer's Retry-After: a consumer asking for
	// days would otherwise park a message far past any sensible horizon.
	MaxRetryAfter = 12 * time.Hour
	// maxSnippet bounds the response excerpt in error messages, which end
	// up in logs and in the dead-letter table.
	maxSnippet = 200
	// maxIdlePerHost keeps enough warm connections for a consumer with a
	// high max-in-flight, where the default of 2 would churn connections.
	maxIdlePerHost = 64
	// maxHeaderBytes bounds a response's headers (the default transport's
	// only; a caller's Options.Client sets its own).
	maxHeaderBytes = 64 << 10
)

// Options configures a Pusher. The zero value works.
type Options struct {
	// Timeout is the per-request timeout for consumers whose own Timeout
	// is 0. If it is 0 too, a request gets the consumer's visibility
	// timeout minus the lease margin; that is also the most any request
	// gets. Whatever its timeout, a request ends a moment before its
	// handler's context does (bellhop.Message.LeaseDeadline), so that a
	// request the lease would cut short times out instead: without a
	// connection it is an ordinary retry, not one held to the lease's end.
	// One that starts within that moment is sent all the same, bounded by
	// the handler's context.
	Timeout time.Duration
	// AllowedHosts, if not empty, limits the hosts a consumer URL may
	// name. An entry is a hostname without port, matched against the URL's
	// hostname case-insensitively: "example.com" matches exactly that
	// host, "*.example.com" matches any subdomain of it at any depth (but
	// not example.com itself; list both to allow both). IP literals match
	// as written ("10.0.0.1", "::1"). Entries and hostnames must be ASCII
	// (an internationalised name in its xn-- form): net/http dials the
	// IDNA form of a name, which need not be what it lower-cases to.
	// Matching is by name only: it is a
	// guard against typos and misuse of the CLI, not against DNS that
	// points an allowed name at an internal address (BlockPrivate is).
	//
	// Blank entries are ignored. Check the list with CheckAllowedHosts
	// first: New does not, and fails closed instead, so an entry that is
	// no hostname (a URL, a host with a port, "*") matches nothing, and a
	// list of blank entries only allows no host at all.
	AllowedHosts []string
	// MaxResponseBody bounds how much of a response body is read; 0 (or
	// less) means DefaultMaxResponseBody. A longer body is cut off and its
	// connection closed rather than reused.
	MaxResponseBody int64
	// BlockPrivate, if set, refuses to connect to an address that is not
	// public: loopback, private (10/8, 172.16/12, 192.168/16, fc00::/7),
	// link-local (169.254/16, where clouds serve instance metadata, and
	// fe80::/10), shared (100.64/10), unspecified, "this network" (0/8)
	// or multicast, IPv4 also when mapped into IPv6. The check is on the
	// address dialled, after the name is resolved, so a name that
	// resolves to such an address is refused too, whatever AllowedHosts
	// says. Such a push fails as a connection refused would (retried with
	// backoff), its error naming the address. Through a proxy the address
	// dialled is the proxy's (CheckBlockPrivate). Without effect when
	// Client is set.
	BlockPrivate bool
	// Client, if set, replaces the Pusher's own client (for tests). Its
	// CheckRedirect and Jar are overridden on a copy: redirects are never
	// followed and cookies never kept, whatever the client says.
	Client *http.Client
	// Logger receives one debug line per request. It never sees secrets,
	// but its error may hold the start of the consumer's response, which
	// may echo the payload (as a dead letter's error does).
	Logger zerolog.Logger
	// UserAgent is the User-Agent header; "" means DefaultUserAgent.
	UserAgent string
}

// Pusher delivers messages to HTTP push consumers. One Pusher serves every
// consumer of a daemon so that they share one connection pool; it is safe
// for concurrent use.
type Pusher struct {
	client     *http.Client
	restricted bool     // Options.AllowedHosts was not empty
	allowed    []string // normalised: lower case, no trailing dot, no brackets
	timeout    time.Duration
	maxBody    int64
	log        zerolog.Logger
	userAgent  string
	now        func() time.Time // replaced in tests for deterministic dates
}

// New returns a Pusher configured by opts.
func New(opts Options) *Pusher {
	p := &Pusher{
		timeout:   opts.Timeout,
		maxBody:   opts.MaxResponseBody,
		log:       opts.Logger,
		userAgent: opts.UserAgent,
		now:       time.Now,
	}
	if p.maxBody <= 0 {
		p.maxBody = DefaultMaxResponseBody
	}
	if p.userAgent == "" {
		p.userAgent = DefaultUserAgent
	}
	p.restricted = len(opts.AllowedHosts) > 0
	for _, h := range opts.AllowedHosts {
		if h = normalizeHost(h); h != "" {
			p.allowed = append(p.allowed, h)
		}
	}
	var c http.Client
	if opts.Client != nil {
		c = *opts.Client
	} else {
		dialer := &net.Dialer{
			Timeout:   30 * time.Second,
			KeepAlive: 30 * time.Second,
		}
		if opts.BlockPrivate {
			blocked := logthrottle.New(1, time.Minute)
			log := opts.Logger
			dialer.Control = func(network, address string, c syscall.RawConn) error {
				err := refusePrivate(network, address, c)
				// A setting to fix, not a failure that a retry mends:
				// at warn, where the handler's retry is at info.
				if err != nil {
					if ok, held := blocked.Allow(); ok {
						log.Warn().Str("address", address).Int("held_back", held).Err(err).
							Msg("push blocked: a consumer's URL leads to an address that is not public (--block-private-addresses); the handler's retry line names the consumer; logged at most once a minute, held_back counts the others")
					}
				}
				return err
			}
		}
		c.Transport = &http.Transport{
			Proxy:                 http.ProxyFromEnvironment,
			DialContext:           dialer.DialContext,
			ForceAttemptHTTP2:     true,
			MaxIdleConns:          0, // no global cap; per host is what matters
			MaxIdleConnsPerHost:   maxIdlePerHost,
			IdleConnTimeout:       90 * time.Second,
			TLSHandshakeTimeout:   10 * time.Second,
			ExpectContinueTimeout: time.Second,
			// A consumer's response headers, like its body (maxBody), are
			// bounded: net/http's default is 10 MiB a response.
			MaxResponseHeaderBytes: maxHeaderBytes,
		}
	}
	// A 3xx is returned as is and mapped like any other 4xx (see the
	// package comment for why redirects are not followed).
	c.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	// Cookies would leak state between messages and consumers.
	c.Jar = nil
	p.client = &c
	return p
}

// CloseIdleConnections closes the pool's idle connections, for a daemon
// shutting down or dropping consumers.
func (p *Pusher) CloseIdleConnections() { p.client.CloseIdleConnections() }

// CheckURL returns an error if raw is not an absolute http or https URL
// with a host, or if its host is not allowed by Options.AllowedHosts. The
// CLI calls it at registration so that a URL the daemon would refuse is
// refused up front, not discovered when messages pile up. Its errors, and
// CheckAllowedHosts's, do not name this package: they reach users, whose
// callers prefix the input they checked (a flag, a setting).
func (p *Pusher) CheckURL(raw string) error {
	_, err := p.parseURL(raw, validate.ShownURL)
	return err
}

// parseURL checks raw as CheckURL says; its errors show raw as show
// does.
func (p *Pusher) parseURL(raw string, show func(string) string) (*url.URL, error) {
	if raw == "" {
		return nil, errors.New("consumer has no URL")
	}
	u, err := url.Parse(raw)
	shown := show(raw)
	switch {
	case err != nil:
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // its text repeats the URL
		}
		return nil, fmt.Errorf("invalid URL %s: %v", shown, err)
	case !utf8.ValidString(raw):
		return nil, fmt.Errorf("URL %s is not valid UTF-8", shown)
	case u.Scheme != "http" && u.Scheme != "https":
		return nil, fmt.Errorf("URL %s: scheme must be http or https", shown)
	case u.Hostname() == "":
		return nil, fmt.Errorf("URL %s has no host", shown)
	case u.User != nil:
		// The signature authenticates instead.
		return nil, fmt.Errorf("URL %s carries credentials", shown)
	}
	if why := validate.BadPort(u); why != "" {
		return nil, fmt.Errorf("URL %s: %s", shown, why)
	}
	if p.restricted && !isASCII(u.Hostname()) {
		// Compared as written, a name such as "servİce" would lower-case
		// to an allowed "service", while net/http dials its IDNA form, a
		// different domain.
		return nil, fmt.Errorf("host %s is not ASCII: with allowed hosts set, give an internationalised name in its xn-- form",
			quote(u.Hostname()))
	}
	if !p.hostAllowed(u.Hostname()) {
		return nil, fmt.Errorf("host %s is not in the allowed hosts", quote(u.Hostname()))
	}
	return u, nil
}

func (p *Pusher) hostAllowed(host string) bool {
	if !p.restricted {
		return true
	}
	host = normalizeHost(host)
	for _, a := range p.allowed {
		if suffix, ok := strings.CutPrefix(a, "*."); ok {
			if strings.HasSuffix(host, "."+suffix) {
				return true
			}
		} else if host == a {
			return true
		}
	}
	return false
}

// refusePrivate is the dialer's Control with Options.BlockPrivate: it
// runs for each address the dialer tries, after name resolution, before
// the connection is made.
func refusePrivate(_, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return fmt.Errorf("address %q does not parse, and pushes to addresses that are not public are blocked", address)
	}
	if kind := notPublic(ap.Addr()); kind != "" {
		return fmt.Errorf("address %s is %s, and pushes to addresses that are not public are blocked", ap.Addr(), kind)
	}
	return nil
}

// Ranges notPublic names that netip has no method for.
var (
	sharedSpace = netip.MustParsePrefix("100.64.0.0/10") // RFC 6598, carrier-grade NAT
	thisNetwork = netip.MustParsePrefix("0.0.0.0/8")     // RFC 1122
)

// notPublic says what kind of address a is if a push must not reach it
// with Options.BlockPrivate, or "" if it may.
func notPublic(a netip.Addr) string {
	a = a.Unmap()
	switch {
	case a.IsLoopback():
		return "loopback"
	case a.IsUnspecified():
		return "unspecified"
	case a.IsPrivate():
		return "private"
	case a.IsLinkLocalUnicast(), a.IsLinkLocalMulticast():
		return "link-local"
	case a.IsMulticast():
		return "multicast"
	case sharedSpace.Contains(a):
		return "shared (carrier-grade NAT)"
	case thisNetwork.Contains(a):
		return `in "this network"`
	}
	return ""
}

// CheckBlockPrivate refuses Options.BlockPrivate beside a proxy named by
// HTTP_PROXY or HTTPS_PROXY (getenv as for CheckProxyEnv): the address
// dialled would be the proxy's, so a proxy on a private address would
// fail every push, and one on a public address would reach private
// consumers for us. Restrict the targets at the proxy instead.
func CheckBlockPrivate(getenv func(string) string) error {
	for _, name := range []string{"HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"} {
		if getenv(name) != "" {
			return fmt.Errorf("blocking pushes to private addresses checks the address dialled, and with %s set that is the proxy's: restrict the targets at the proxy instead", name)
		}
	}
	return nil
}

// CheckAllowedHosts returns an error naming the first entry of hosts that
// can never match a URL's hostname (see Options.AllowedHosts): a URL, a
// host with a port, a wildcard other than a leading "*.", or anything else
// that is not a hostname or IP literal. A list with entries that are all
// blank is an error too: taken as "no list" it would allow every host,
// which is not what whoever set it meant. An empty list is fine.
func CheckAllowedHosts(hosts []string) error {
	blank := true
	for _, raw := range hosts {
		h := normalizeHost(raw)
		if h == "" {
			continue
		}
		blank = false
		if err := checkAllowedHost(h); err != nil {
			return fmt.Errorf("allowed host %s: %w", quote(strings.TrimSpace(raw)), err)
		}
	}
	if blank && len(hosts) > 0 {
		return fmt.Errorf("allowed hosts %q has only blank entries; to allow every host, give none", hosts)
	}
	return nil
}

// CheckProxyEnv returns an error naming the proxy variable, of those that
// New's client reads (HTTP_PROXY, HTTPS_PROXY, or their lower-case forms
// where the upper-case one is unset), whose value net/http cannot use:
//   - one that does not parse as a URL, even with "http://" put in front as
//     net/http tries: net/http ignores it without a word and connects
//     directly, which sends signed payloads past the proxy an operator set,
//     or fails every push, with an error that does not say why, where only
//     the proxy reaches out;
//   - one with no host (without "http://", "user:50%off@proxy" reads as
//     the scheme "user"), or a scheme other than http, https, socks5 and
//     socks5h: every push fails, dialling nothing or the wrong way.
//
// The error does not show the value, which may hold a password. getenv is
// os.Getenv, or a stand-in for tests.
func CheckProxyEnv(getenv func(string) string) error {
	for _, names := range [][2]string{{"HTTP_PROXY", "http_proxy"}, {"HTTPS_PROXY", "https_proxy"}} {
		name, v := names[0], getenv(names[0])
		if v == "" {
			name, v = names[1], getenv(names[1])
		}
		if v == "" {
			continue
		}
		// As net/http reads it (golang.org/x/net/http/httpproxy).
		u, err := url.Parse(v)
		if err != nil || u.Scheme == "" || u.Host == "" {
			if u2, err2 := url.Parse("http://" + v); err2 == nil {
				u, err = u2, nil
			}
		}
		switch {
		case err != nil:
			return fmt.Errorf("%s does not parse as a URL (is a reserved character in its user name or password not percent-encoded, such as %% as %%25?): "+
				"pushes would ignore it and bypass the proxy", name)
		case u.Hostname() == "":
			// Not u.Host: "http://:8080" has Host ":8080", and net/http
			// would dial that port on this machine.
			return fmt.Errorf("%s names no proxy host (give it as http://user:password@host:port)", name)
		}
		switch u.Scheme {
		case "http", "https", "socks5", "socks5h":
		default:
			return fmt.Errorf("%s: a proxy's scheme must be http, https, socks5 or socks5h", name)
		}
	}
	return nil
}

// checkAllowedHost checks one normalised entry.
func checkAllowedHost(h string) error {
	if _, err := netip.ParseAddr(h); err == nil {
		return nil
	}
	name, wild := strings.CutPrefix(h, "*.")
	switch {
	case strings.Contains(h, "://"):
		return errors.New("is a URL: give only its hostname")
	case strings.Contains(name, "*"):
		return errors.New(`a wildcard matches only as a leading "*.", as in *.example.com`)
	case strings.ContainsAny(h, ":/"):
		return errors.New("is not a bare hostname: give it without scheme, port or path (ports are not matched)")
	case wild && name == "":
		return errors.New(`"*." needs a domain after it`)
	}
	for _, label := range strings.Split(name, ".") {
		if label == "" || len(label) > 63 {
			return errors.New("is not a hostname: a label is empty or longer than 63 bytes")
		}
		for _, r := range label {
			switch {
			case r > unicode.MaxASCII:
				// Matched as written it could admit a look-alike (see
				// parseURL); net/http dials the IDNA form.
				return errors.New("is not ASCII: give an internationalised name in its xn-- form")
			case !(r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r)):
				return fmt.Errorf("is not a hostname: it contains %q", r)
			}
		}
	}
	return nil
}

// asciiLower lower-cases the ASCII letters of s and leaves every other
// byte as it is.
func asciiLower(s string) string {
	b := []byte(s)
	for i, c := range b {
		if 'A' <= c && c <= 'Z' {
			b[i] = c + 'a' - 'A'
		}
	}
	return string(b)
}

func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] > unicode.MaxASCII {
			return false
		}
	}
	return true
}

// normalizeHost makes hostnames comparable: lower case, without the
// trailing dot of a fully qualified name or the brackets of an IPv6
// literal. Only ASCII letters are folded, so that a name that is not ASCII
// stays so and is refused as such: strings.ToLower would turn 'İ' (U+0130)
// into 'i' and the Kelvin sign (U+212A) into 'k', and so an allowed host
// "servİce.com" into service.com, which it does not name.
func normalizeHost(h string) string {
	h = asciiLower(strings.TrimSpace(h))
	h = strings.TrimSuffix(strings.TrimPrefix(h, "["), "]")
	return strings.TrimSuffix(h, ".")
}

// Handler returns the bellhop.Handler that pushes c's messages to c.URL.
// It fails if c has no URL or no secret, or if the URL's host is not
// allowed: a consumer registered before the allow-list was tightened is
// refused here rather than delivered to.
func (p *Pusher) Handler(c bellhop.Consumer) (bellhop.Handler, error) {
	u, err := p.parseURL(c.URL, originShown)
	if err != nil {
		return nil, fmt.Errorf("consumer %s: httppush: %w", c.ID, err)
	}
	if c.Secret == "" {
		// Sending unsigned requests would teach consumers to accept them.
		return nil, fmt.Errorf("consumer %s: httppush: push consumer has no signing secret", c.ID)
	}
	return &handler{
		p:      p,
		url:    c.URL,
		host:   u.Scheme + "://" + u.Host,
		query:  u.RawQuery,
		secret: c.Secret,
		// Kept only while it signs: the dispatcher resolves consumers
		// again at its next reload, which may be long after.
		previous:      c.PreviousSecret,
		previousUntil: c.PreviousSecretUntil,
		timeout:       requestTimeout(c, p.timeout),
		slack:         leaseSlack(c),
	}, nil
}

// originShown is a stored URL as the daemon's errors about it show it:
// its scheme and host, as push errors show them, since they are logged
// and a path may hold a token (a chat service's webhook URL is one). Its
// consumer's id, which the errors also give, finds the whole URL. An
// operator typing a URL is shown more (CheckURL: validate.ShownURL).
func originShown(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return "(not shown: see its consumer)"
	}
	return quote(u.Scheme + "://" + u.Host)
}

// requestTimeout picks a request's timeout: the consumer's, else the
// daemon's default, else whatever fits inside the lease; never more than
// fits, since the handler's context ends there anyway and a timeout
// beyond it would only mislead the logs.
func requestTimeout(c bellhop.Consumer, def time.Duration) time.Duration {
	vt := c.VisibilityTimeout
	if vt <= 0 {
		vt = bellhop.DefaultVisibilityTimeout
	}
	limit := vt - leaseMargin(vt)
	switch {
	case c.Timeout > 0:
		return min(c.Timeout, limit)
	case def > 0:
		return min(def, limit)
	}
	return limit
}

// leaseMargin mirrors the unexported one in package bellhop (a fifth of the
// visibility timeout, at most 5s): the fallback timeout then matches when
// the handler context ends.
func leaseMargin(vt time.Duration) time.Duration { return min(vt/5, 5*time.Second) }

// leaseSlack is how long before the handler's context ends
// (bellhop.Message.LeaseDeadline) a request's own deadline falls: a
// quarter of the lease margin, at most 250ms. The request then ends by its
// timeout, whose outcome the push decides (no connection: nothing reached
// the consumer, an ordinary retry), and the handler returns before the
// dispatcher cancels its context, which would make the dispatcher hold the
// retry to the lease's end. Should the handler still return after that (a
// starved process), the retry is held: the safe side.
func leaseSlack(c bellhop.Consumer) time.Duration {
	vt := c.VisibilityTimeout
	if vt <= 0 {
		vt = bellhop.DefaultVisibilityTimeout
	}
	return min(leaseMargin(vt)/4, 250*time.Millisecond)
}

// handler pushes one consumer's messages. It is immutable, so safe for
// concurrent deliveries.
type handler struct {
	p      *Pusher
	url    string
	host   string // scheme://host[:port], for errors and logs: paths and queries may hold tokens
	query  string // the URL's raw query, kept out of error texts
	secret string
	// previous is the secret a rotation replaced, which signs too until
	// previousUntil (bellhop.Consumer.PreviousSecret).
	previous      string
	previousUntil time.Time
	timeout       time.Duration
	slack         time.Duration // see leaseSlack
}

// sign returns the Bellhop-Signature value for body sent at ts: the v1
// signature under the consumer's secret and, while a rotation's previous
// secret still signs, one under it after a comma, so that a receiver
// checking either accepts the request.
func (h *handler) sign(ts int64, body []byte) string {
	sig := bellhop.SignPush(h.secret, ts, body)
	if h.previous != "" && time.Unix(ts, 0).Before(h.previousUntil) {
		sig += "," + bellhop.SignPush(h.previous, ts, body)
	}
	return sig
}

// errRequestTimeout is the cause of a request's own timeout, to tell it
// apart from the handler context ending.
var errRequestTimeout = errors.New("push request timed out")

// Handle implements bellhop.Handler.
func (h *handler) Handle(ctx context.Context, m *bellhop.Message) error {
	start := time.Now()
	status, err := h.push(ctx, m)
	ev := h.p.log.Debug().
		Str("app_id", m.AppID.String()).Str("queue", m.Queue).
		Str("message_id", m.ID.String()).Int("attempt", m.Attempt).
		Str("consumer_id", m.ConsumerID.String()).Str("target", h.host).
		Int("status", status).Stringer("duration", time.Since(start))
	if err != nil {
		ev = ev.Err(err)
	}
	ev.Msg("push delivery")
	return err
}

// push sends m and maps the outcome; status is 0 if no response came.
func (h *handler) push(ctx context.Context, m *bellhop.Message) (int, error) {
	// The request's timeout counts from now, later than the lease's start,
	// so it is cut to end before the handler's context does: otherwise the
	// lease would end every request that outlasts it, and one that never
	// got a connection would be held to the lease's end as if it had
	// reached the consumer. Push handlers do not renew the lease, so its
	// deadline stays where it is read here.
	//
	// A push that starts within the slack (its delivery began late) is
	// sent all the same, until the handler's context ends: a consumer
	// that answers at once still gets it, as it did before the cut.
	// Refused unsent, it spent an attempt, and on the last one
	// dead-lettered a message no consumer had seen. If the handler's
	// context ends first, the push is treated as the lease cut it (its
	// retry held to the lease's end), the safe side. Either way the
	// request does not outlive the lease, even on a context without
	// that deadline.
	timeout := h.timeout
	if end := m.LeaseDeadline(); !end.IsZero() {
		left := time.Until(end.Add(-h.slack)).Truncate(time.Millisecond)
		if left <= 0 {
			left = max(time.Until(end).Truncate(time.Millisecond), time.Millisecond)
		}
		timeout = min(timeout, left)
	}
	rctx, cancel := context.WithTimeoutCause(ctx, timeout, errRequestTimeout)
	defer cancel()

	// Whether the request may have reached the consumer: once a
	// connection is ours, it is on its way, and a consumer that got it
	// may still be working on it after we stop waiting.
	var sent, wrote atomic.Bool
	tctx := httptrace.WithClientTrace(rctx, &httptrace.ClientTrace{
		GotConn: func(httptrace.GotConnInfo) { sent.Store(true) },
		// The whole request reached the consumer's socket: whatever then
		// ends the exchange without an answer, it may be working on it.
		WroteRequest: func(i httptrace.WroteRequestInfo) {
			if i.Err == nil {
				wrote.Store(true)
			}
		},
	})
	body := []byte(m.Payload)
	req, err := http.NewRequestWithContext(tctx, http.MethodPost, h.url, bytes.NewReader(body))
	if err != nil {
		return 0, fmt.Errorf("push to %s: %w", h.host, err)
	}
	ts := h.p.now().Unix()
	req.Header = http.Header{
		"Content-Type":          {"application/json"},
		"User-Agent":            {h.p.userAgent},
		bellhop.HeaderMessageID: {m.ID.String()},
		// Marks the POST as one that may be sent twice: net/http then
		// sends it again, on a new connection, when a kept-alive one was
		// closed as the request went out with no byte of an answer, as a
		// consumer's idle timeout does, rather than report that the
		// request may have arrived. A new key for each request, not the
		// message id: middleware in front of a consumer that stores
		// answers by this key (as its draft standard describes) would
		// answer every retry of the message with its first answer.
		"Idempotency-Key":         {uuid.NewString()},
		bellhop.HeaderApp:         {m.App},
		bellhop.HeaderQueue:       {m.Queue},
		bellhop.HeaderAttempt:     {strconv.Itoa(m.Attempt)},
		bellhop.HeaderMaxAttempts: {strconv.Itoa(m.MaxAttempts)},
		bellhop.HeaderEnqueuedAt:  {m.EnqueuedAt.UTC().Format(time.RFC3339Nano)},
		bellhop.HeaderConsumerID:  {m.ConsumerID.String()},
		bellhop.HeaderSource:      {source(m)},
		bellhop.HeaderTimestamp:   {strconv.FormatInt(ts, 10)},
		bellhop.HeaderSignature:   {h.sign(ts, body)},
	}

	resp, err := h.p.client.Do(req)
	if err != nil {
		return 0, h.transportError(rctx, timeout, err, sent.Load(), wrote.Load())
	}
	// Read (a bounded part of) the body whatever the status, so that the
	// connection goes back to the pool; its start becomes the snippet.
	// Closing the body when rctx ends bounds the read in time: for a 101
	// Switching Protocols, net/http hands over the raw connection as the
	// body and no longer watches the request's context, so a consumer that
	// then goes quiet would hold the delivery for ever.
	stop := context.AfterFunc(rctx, func() { resp.Body.Close() })
	head := readBody(resp.Body, h.p.maxBody)
	stop()
	resp.Body.Close()
	return resp.StatusCode, h.outcome(resp, head)
}

// transportError describes a request that got no response. It never
// wraps *url.Error, whose text holds the full URL. A request given up
// after it may have reached the consumer (sent: a connection was ours),
// or whose connection failed after the whole request was written (wrote:
// a proxy that cut it, a consumer that closed it and works on), or that
// got a response whose headers were too large to read, wraps
// bellhop.ErrAbandoned: the consumer may still be working on it, so its
// retry waits for the end of the lease. timeout is the request's own, as
// push cut it.
func (h *handler) transportError(rctx context.Context, timeout time.Duration, err error, sent, wrote bool) error {
	// rctx's cause is whatever ended it first: its own timeout, or the
	// handler's context (the lease run short, the dispatcher stopping),
	// whose cause it then carries.
	cause := context.Cause(rctx)
	switch {
	case errors.Is(cause, errRequestTimeout) && sent:
		return fmt.Errorf("push to %s: no response within %s (%w): %w", h.host, timeout, bellhop.ErrAbandoned, context.DeadlineExceeded)
	case errors.Is(cause, errRequestTimeout):
		return fmt.Errorf("push to %s: no connection within %s: %w", h.host, timeout, context.DeadlineExceeded)
	case rctx.Err() != nil && sent:
		// The handler context ended: report its cause, which the
		// dispatcher inspects.
		return fmt.Errorf("push to %s: stopped waiting for a response (%w): %w", h.host, bellhop.ErrAbandoned, cause)
	case rctx.Err() != nil:
		return fmt.Errorf("push to %s: stopped before the request was sent: %w", h.host, cause)
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	if big := headersTooLarge(err); big != nil {
		// The consumer answered, so it got the request, but its status
		// was never read: as for any unreadable response, its retry waits
		// for the lease's end. Not "connection lost": the connection was
		// fine, the answer was too big.
		return fmt.Errorf("push to %s: response headers too large (%w): %w", h.host, bellhop.ErrAbandoned, big)
	}
	if quotesPeer(err) {
		// net/http quotes what the consumer sent in the errors of a
		// response it cannot read (a malformed status line, a header line,
		// an HTTP/2 GOAWAY's debug data): up to 64 KiB that the consumer
		// controls, and, from a service that echoes what it was sent, the
		// URL's query. That text is handled like a response body.
		e := &bodyError{what: fmt.Sprintf("push to %s: unreadable response", h.host), body: snippet([]byte(h.scrub(err.Error())))}
		if wrote {
			e.what = fmt.Sprintf("push to %s: unreadable response after the request was sent (%v)", h.host, bellhop.ErrAbandoned)
			e.wrap = bellhop.ErrAbandoned
		}
		return e
	}
	if wrote {
		return fmt.Errorf("push to %s: connection lost after the request was sent (%w): %w", h.host, bellhop.ErrAbandoned, err)
	}
	return fmt.Errorf("push to %s: %w", h.host, err)
}

// headersTooLarge returns the error in err's chain (a request's error)
// that says the response's headers exceeded the transport's limit
// (maxHeaderBytes, or a caller client's MaxResponseHeaderBytes), or nil.
// net/http exports no sentinel or type for it, so its two texts are
// matched, each in full: HTTP/1's "net/http: server response headers
// exceeded N bytes; aborted" (which comes wrapped in "connection
// broken") and HTTP/2's stream error with the cause "http2: response
// header list larger than advertised limit". Should a Go release reword
// them, such a response is reported as a lost connection again (abandoned
// if the whole request was written), so only the wording suffers. An
// HTTP/2 response that overruns the limit by a whole frame or more ends
// the connection with a bare PROTOCOL_ERROR instead, which names no
// headers, and is reported as such.
func headersTooLarge(err error) error {
	for ; err != nil; err = errors.Unwrap(err) {
		text := err.Error()
		if rest, ok := strings.CutPrefix(text, "net/http: server response headers exceeded "); ok &&
			strings.HasSuffix(rest, " bytes; aborted") {
			return err
		}
		if strings.HasPrefix(text, "stream error: ") &&
			strings.HasSuffix(text, "; http2: response header list larger than advertised limit") {
			return err
		}
	}
	return nil
}

// quotesPeer reports whether err, a request's error, may quote what the
// consumer sent: net/http and net/textproto quote it with %q ("malformed
// HTTP status code \"...\""), and a proxy's refusal of a tunnel is its
// reason phrase as is, which can be long. Errors of the network and TLS
// layers name addresses, system errors and certificates, and other short
// texts without a quote are net/http's own ("http: server gave HTTP
// response to HTTPS client"): an operator reads those in the info log.
func quotesPeer(err error) bool {
	if fromNetwork(err) {
		return false
	}
	text := err.Error()
	return strings.ContainsRune(text, '"') || len(text) > maxSnippet
}

// fromNetwork reports whether err comes from the network or TLS layer.
func fromNetwork(err error) bool {
	var (
		ne net.Error // *net.OpError, *net.DNSError, net/http's own timeouts
		ce *tls.CertificateVerificationError
		ae tls.AlertError
		re tls.RecordHeaderError
	)
	return errors.As(err, &ne) || errors.As(err, &ce) || errors.As(err, &ae) || errors.As(err, &re) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		strings.HasPrefix(err.Error(), "tls: ") // crypto/tls's untyped handshake errors
}

// scrub replaces the URL's query, which may hold a token, in text.
func (h *handler) scrub(text string) string {
	if h.query == "" {
		return text
	}
	text = strings.ReplaceAll(text, h.query, "xxxxx")
	if q := strconv.Quote(h.query); q[1:len(q)-1] != h.query {
		text = strings.ReplaceAll(text, q[1:len(q)-1], "xxxxx") // as %q shows it
	}
	return text
}

// outcome maps a response to the handler's result (see the package
// comment).
func (h *handler) outcome(resp *http.Response, head []byte) error {
	code := resp.StatusCode
	switch {
	case code >= 200 && code <= 299:
		return nil
	case code == http.StatusTooManyRequests || code == http.StatusServiceUnavailable:
		ra := resp.Header.Get("Retry-After")
		if ra == "" {
			return responseError(fmt.Sprintf("consumer busy: HTTP %d", code), head)
		}
		// A date is the consumer's clock's: measured from its Date, as
		// RFC 9110 suggests, a consumer clock an hour ahead asks for 30
		// s, not an hour and 30 s (nor, an hour behind, a time past).
		now := h.p.now()
		if date, err := http.ParseTime(resp.Header.Get("Date")); err == nil {
			now = date
		}
		d, ok := parseRetryAfter(ra, now)
		if !ok {
			return responseError(fmt.Sprintf("consumer busy: HTTP %d with unparsable Retry-After %s", code, quote(ra)), head)
		}
		if d < 0 {
			// A date already past says the consumer's clock is behind
			// ours, not when to come back: retrying at once, an attempt
			// each time, would dead-letter the message within a second.
			return responseError(fmt.Sprintf("consumer busy: HTTP %d with Retry-After %s already past", code, quote(ra)), head)
		}
		if d == 0 {
			// "Now", which a busy consumer that keeps saying it would
			// turn into the same quick string of attempts: some rate
			// limiters in front of consumers send 0 when their window
			// has just rolled over.
			return responseError(fmt.Sprintf("consumer busy: HTTP %d with Retry-After %s, which is now", code, quote(ra)), head)
		}
		return fmt.Errorf("consumer busy: HTTP %d: %w", code, bellhop.RetryAfter(d))
	case code == http.StatusRequestTimeout:
		return responseError(fmt.Sprintf("consumer timed out reading the request: HTTP %d", code), head)
	case code == http.StatusProxyAuthRequired:
		// Only a proxy answers 407 (HTTP_PROXY and the like, see New):
		// the consumer never saw the message, so it is not rejected.
		return responseError(fmt.Sprintf("the proxy to the consumer wants credentials: HTTP %d", code), head)
	case code >= 300 && code <= 499:
		if code <= 399 {
			// The body of a redirect is rarely useful; where it points is.
			// A Location may carry a token (a signed URL), so it is kept
			// with the dead letter but, like a body, out of info and warn
			// logs.
			what := fmt.Sprintf("consumer rejected the message: HTTP %d: redirect not followed", code)
			loc := resp.Header.Get("Location")
			if loc == "" {
				return bellhop.Permanent(errors.New(what))
			}
			return bellhop.Permanent(&bodyError{what: what, body: "Location: " + snippet([]byte(loc))})
		}
		return bellhop.Permanent(responseError(fmt.Sprintf("consumer rejected the message: HTTP %d", code), head))
	}
	if code == http.StatusGatewayTimeout || code == statusOriginTimeout {
		// A gateway stopped waiting for the consumer, which may still be
		// working on the message, as after a timeout of our own.
		return &bodyError{what: fmt.Sprintf("consumer's gateway timed out: HTTP %d", code), body: snippet(head), wrap: bellhop.ErrAbandoned}
	}
	return responseError(fmt.Sprintf("consumer failed: HTTP %d", code), head)
}

// statusOriginTimeout is Cloudflare's 504: it reached the consumer, which
// then sent no answer in time (100 s by default).
const statusOriginTimeout = 524

// bodyError is a response the handler fails with: what happened, and the
// start of the consumer's response body (a snippet), which may echo the
// message. Its text, kept with a dead letter, has both; LogText, which
// the dispatcher logs at info and warn, leaves the body out.
type bodyError struct {
	what, body string
	wrap       error // what it wraps, if anything (bellhop.ErrAbandoned)
}

// responseError returns a bodyError with the snippet of head.
func responseError(what string, head []byte) error {
	return &bodyError{what: what, body: snippet(head)}
}

func (e *bodyError) Error() string {
	if e.body == "" {
		return e.what
	}
	return e.what + ": " + e.body
}

// LogText is the error without the response body.
func (e *bodyError) LogText() string { return e.what }

func (e *bodyError) Unwrap() error { return e.wrap }

// parseRetryAfter reads a Retry-After value, delta-seconds or HTTP-date,
// into a delay from now in [0, MaxRetryAfter], or -1 for a date not after
// now.
func parseRetryAfter(v string, now time.Time) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	if v[0] >= '0' && v[0] <= '9' {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			var ne *strconv.NumError
			if errors.As(err, &ne) && errors.Is(ne.Err, strconv.ErrRange) {
				return MaxRetryAfter, true // all digits, just huge
			}
			return 0, false
		}
		if n >= uint64(MaxRetryAfter/time.Second) {
			return MaxRetryAfter, true
		}
		return time.Duration(n) * time.Second, true
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return 0, false
	}
	if d := t.Sub(now); d > 0 {
		return min(d, MaxRetryAfter), true
	}
	return -1, true
}

// readBody reads at most limit bytes of body, discarding all but the first
// few hundred, which it returns for the snippet. Errors are ignored: the
// status has already decided the outcome.
func readBody(body io.Reader, limit int64) []byte {
	lr := io.LimitReader(body, limit)
	// Capture a little more than maxSnippet so that sanitising, which can
	// shrink the text, still has enough to fill the snippet.
	head := make([]byte, 2*maxSnippet)
	n, _ := io.ReadFull(lr, head)
	head = head[:n]
	if n == len(head) {
		io.Copy(io.Discard, lr)
	}
	return head
}

// snippet makes untrusted response text safe to log (printable.Line), at
// most maxSnippet bytes, ending in "..." if cut.
func snippet(b []byte) string {
	s := printable.Line(string(b))
	if len(s) <= maxSnippet {
		return s
	}
	const ellipsis = "..."
	cut := maxSnippet - len(ellipsis)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return strings.TrimRight(s[:cut], " ") + ellipsis
}

// quote prints untrusted input in an error message: quoted, escaped, cut.
func quote(s string) string {
	if len(s) > 64 {
		return fmt.Sprintf("%q... (%d bytes)", s[:64], len(s))
	}
	return fmt.Sprintf("%q", s)
}

// source names where a delivery comes from: "queue", or "invoke" for
// Client.InvokeAsync deliveries.
func source(m *bellhop.Message) string {
	if m.Invoked {
		return "invoke"
	}
	return "queue"
}
