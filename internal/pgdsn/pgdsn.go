// Package pgdsn rewrites, checks and redacts PostgreSQL connection
// strings, in URL or keyword/value form: the rewriting is for the tools
// that create databases on a server (the test harness and the benchmark),
// the checks (CheckHosts, CheckURL) for a URL whose user name or password
// holds an unescaped '@' or '/', the redaction for every error message
// that would otherwise quote one.
package pgdsn

import (
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// masked replaces a password wherever one is hidden.
const masked = "xxxxx"

// WithDatabase returns dsn pointing at dbname instead of its own database,
// with everything else unchanged.
func WithDatabase(dsn, dbname string) (string, error) {
	// pgx lets a dbname/database query parameter override the path.
	return rewrite(dsn, "dbname", dbname, func(u *url.URL) {
		u.Path, u.RawPath = "/"+dbname, ""
	}, "dbname", "database")
}

// WithUser returns dsn connecting as user instead of its own user, with
// everything else unchanged (a password in the DSN is kept).
func WithUser(dsn, user string) (string, error) {
	return rewrite(dsn, "user", user, func(u *url.URL) {
		if pw, ok := u.User.Password(); ok {
			u.User = url.UserPassword(user, pw)
		} else {
			u.User = url.User(user)
		}
	}, "user")
}

// rewrite sets one connection parameter: in a URL with edit, dropping the
// query parameters named in drop that would override it; in keyword/value
// form by appending keyword=value, since the last occurrence wins.
func rewrite(dsn, keyword, value string, edit func(*url.URL), drop ...string) (string, error) {
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		if err != nil {
			return "", fmt.Errorf("parse connection string: %w", RedactError(err, dsn))
		}
		edit(u)
		q := u.Query()
		for _, k := range drop {
			q.Del(k)
		}
		u.RawQuery = q.Encode()
		return u.String(), nil
	}
	if _, err := pgconn.ParseConfig(dsn); err != nil {
		return "", fmt.Errorf("parse connection string: %w", RedactError(err, dsn))
	}
	return strings.TrimSpace(dsn + " " + keyword + "=" + quoteValue(value)), nil
}

func quoteValue(v string) string {
	if v != "" && !strings.ContainsAny(v, " \t\n\r\v\f'\\") {
		return v
	}
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(v) + "'"
}

// Redact returns dsn with every password in it replaced by xxxxx, for
// error messages. It works on text, not on a parse, because the strings
// that end up in errors are mostly the ones that do not parse; where
// their structure is ambiguous it hides too much rather than too little:
//
//   - in a URL, everything between the first ':' of the user info and the
//     last '@' of the string (pgx ends the user info at the first '@',
//     net/url at the last one before the path, and a password may hold
//     '/', '?' or an escape that does not decode), and the value of
//     every query parameter whose name holds "password" (sslpassword,
//     percent-encoded names); every malformed pair, name and value (no
//     '=', more than one, or a name that does not decode: the rest of a
//     password holding an '&'); and, in a URL with no user info, from
//     the first port that is not a port number to the end (a mistyped
//     postgres://user:password/...);
//   - in keyword/value form, the value of every keyword holding
//     "password", quoted or not, with or without spaces around the '=',
//     and the whole rest of the string from the first keyword/value pair
//     that is malformed.
func Redact(dsn string) string {
	out, _ := redact(dsn)
	return out
}

// redact is Redact that also returns the hidden values, raw and decoded,
// so that RedactError can find them in error text that quotes them.
func redact(dsn string) (string, []string) {
	lead := len(dsn) - len(strings.TrimLeft(dsn, spaces))
	lower := strings.ToLower(dsn[lead:])
	for _, scheme := range []string{"postgresql://", "postgres://"} {
		// Upper-case schemes are keyword/value strings to pgx, but a
		// reader still sees a URL: redact them as one.
		if strings.HasPrefix(lower, scheme) {
			n := lead + len(scheme)
			rest, secrets := redactURL(dsn[n:])
			return dsn[:n] + rest, secrets
		}
	}
	return redactKV(dsn)
}

// spaces are the white space characters of libpq's keyword/value syntax.
const spaces = " \t\n\r\v\f"

// redactURL redacts what follows a URL's scheme.
func redactURL(s string) (string, []string) {
	var secrets []string
	if at := strings.LastIndexByte(s, '@'); at >= 0 {
		if colon := strings.IndexByte(s[:at], ':'); colon >= 0 {
			secrets = appendSecret(secrets, s[colon+1:at], true)
			// A parser that ends the user info at the first '@' quotes
			// the rest of a password that holds one as part of the host
			// ("lookup ss3cret@host"), and one that ends it at the first
			// '/' quotes the rest of a password that holds a '/' as part
			// of the database ("database=ss3cret@host:5432/db"): each
			// part is hidden too.
			if pw := s[colon+1 : at]; strings.ContainsAny(pw, "@/") {
				for _, p := range strings.FieldsFunc(pw, func(r rune) bool { return r == '@' || r == '/' }) {
					secrets = appendSecret(secrets, p, true)
				}
			}
			s = s[:colon+1] + masked + s[at:]
		}
	} else {
		s, secrets = redactPorts(s, secrets)
	}
	q := strings.IndexByte(s, '?')
	if q < 0 {
		return s, secrets
	}
	pairs := strings.Split(s[q+1:], "&")
	for i, pair := range pairs {
		if pair == "" {
			continue
		}
		rawKey, value, found := strings.Cut(pair, "=")
		key, err := url.PathUnescape(rawKey)
		if !found || err != nil || strings.Contains(value, "=") {
			// Malformed, and pgx quotes it ("missing key/value
			// separator", "extra key/value separator", a bad escape):
			// the rest of a password that holds an '&'.
			secrets = appendSecret(secrets, pair, true)
			secrets = appendSecret(secrets, rawKey, true)
			pairs[i] = masked
			continue
		}
		if strings.Contains(strings.ToLower(key), "password") {
			secrets = appendSecret(secrets, value, true)
			pairs[i] = rawKey + "=" + masked
		}
	}
	return s[:q+1] + strings.Join(pairs, "&"), secrets
}

// redactPorts hides, in a URL with no user info, everything from the
// first port that is not a port number: a URL written user:password with
// its '@' and host left out reads as host:port to pgx, which quotes it
// ("invalid port"), and the rest of such a password as more hosts, the
// database name or parameters.
func redactPorts(s string, secrets []string) (string, []string) {
	end := strings.IndexAny(s, "/?")
	if end < 0 {
		end = len(s)
	}
	pos := 0
	for _, h := range strings.Split(s[:end], ",") {
		host, port, found := strings.Cut(h, ":")
		if found && !strings.HasPrefix(h, "[") && !isPort(port) {
			start := pos + len(host) + 1
			secrets = appendSecret(secrets, s[start:], true)
			// pgx may quote a piece of it: a parameter, a database name.
			for _, p := range strings.FieldsFunc(s[start:], func(r rune) bool { return strings.ContainsRune("/?&=,:#", r) }) {
				secrets = appendSecret(secrets, p, true)
			}
			return s[:start] + masked, secrets
		}
		pos += len(h) + 1
	}
	return s, secrets
}

// isPort reports whether a URL's port, as written, is empty or a port
// number (percent-encoding and spaces allowed, as pgx allows them).
func isPort(p string) bool {
	d, err := url.PathUnescape(p)
	if err != nil {
		return false
	}
	d = strings.TrimSpace(d)
	if d == "" {
		return true
	}
	n, err := strconv.Atoi(d)
	return err == nil && n > 0 && n <= 65535
}

// redactKV redacts a keyword/value string, tokenised as libpq does.
func redactKV(s string) (string, []string) {
	var (
		out     strings.Builder
		secrets []string
	)
	for {
		rest := strings.TrimLeft(s, spaces)
		out.WriteString(s[:len(s)-len(rest)])
		s = rest
		if s == "" {
			return out.String(), secrets
		}
		eq := strings.IndexByte(s, '=')
		if eq < 0 || strings.TrimSpace(s[:eq]) == "" || strings.ContainsAny(strings.TrimRight(s[:eq], spaces), spaces+"@") {
			// Malformed: whatever follows may be a mistyped password.
			secrets = appendSecret(secrets, s, false)
			out.WriteString(masked)
			return out.String(), secrets
		}
		key := strings.TrimRight(s[:eq], spaces)
		afterEq := s[eq+1:]
		value := strings.TrimLeft(afterEq, spaces)
		out.WriteString(s[:eq+1] + afterEq[:len(afterEq)-len(value)])
		end, ok := kvValueEnd(value)
		if !ok {
			secrets = appendSecret(secrets, value, false)
			out.WriteString(masked)
			return out.String(), secrets
		}
		if strings.Contains(strings.ToLower(key), "password") {
			secrets = appendSecret(secrets, value[:end], false)
			out.WriteString(masked)
		} else {
			out.WriteString(value[:end])
		}
		s = value[end:]
	}
}

// kvValueEnd returns the length of the keyword/value value at the start
// of s, quoted or not, and false if a quote is left open.
func kvValueEnd(s string) (int, bool) {
	if strings.HasPrefix(s, "'") {
		for i := 1; i < len(s); i++ {
			switch s[i] {
			case '\\':
				i++
			case '\'':
				return i + 1, true
			}
		}
		return 0, false
	}
	i := 0
	for ; i < len(s) && !strings.ContainsRune(spaces, rune(s[i])); i++ {
		if s[i] == '\\' {
			i++
		}
	}
	return min(i, len(s)), true
}

// appendSecret adds a hidden value to secrets together with its decoded
// form: percent-decoded for URL parts, unquoted and unescaped for
// keyword/value ones, as pgx would quote it.
func appendSecret(secrets []string, raw string, isURL bool) []string {
	if raw == "" {
		return secrets
	}
	secrets = append(secrets, raw)
	if isURL {
		if dec, err := url.PathUnescape(raw); err == nil && dec != raw {
			secrets = append(secrets, dec)
		}
		return secrets
	}
	dec := strings.TrimPrefix(raw, "'")
	if len(dec) < len(raw) {
		dec = strings.TrimSuffix(dec, "'")
	}
	var b strings.Builder
	for i := 0; i < len(dec); i++ {
		if dec[i] == '\\' && i+1 < len(dec) {
			i++
		}
		b.WriteByte(dec[i])
	}
	if b.String() != raw {
		secrets = append(secrets, b.String())
	}
	return secrets
}

// CheckHosts refuses a parsed connection string with a host name that
// holds '@': the sign of a URL whose password or user name holds an '@'
// that is not percent-encoded, which pgx takes for the end of the user
// info; or '=', '&' or '?', the sign of a query that pgx read as user
// info and a host. Connecting would fail, and its error would show the rest of the
// password as a host name, in the daemon's logs too.
func CheckHosts(cfg *pgconn.Config) error {
	hosts := []string{cfg.Host}
	for _, f := range cfg.Fallbacks {
		hosts = append(hosts, f.Host)
	}
	for _, h := range hosts {
		// A socket directory's path may hold '@'; a host name may not.
		if strings.HasPrefix(h, "/") {
			continue
		}
		if strings.ContainsRune(h, '@') {
			return errors.New("a host name holds '@': write an '@' in the user name or password as %40")
		}
		// Nor '=', '&' or '?': pgx took the start of a query for user
		// info (postgres://host:5432?u@x=...), and the rest for a host.
		if strings.ContainsAny(h, "=&?") {
			return errors.New("a host name holds '=', '&' or '?': write an '@' in a parameter as %40, and a '?' in the user name or password as %3F")
		}
	}
	return nil
}

// CheckURL refuses a URL-form connection string in which pgx might read
// part of the user name or password as a host, a port, a database name
// or a parameter: a URL with an unescaped '@' anywhere but at the end of
// its user info, or with user info that holds a query. pgx, like libpq,
// ends the user info at the first '@' before any '/' (a '?' does not stop
// it). So:
//   - an '@' and then a '/', '?' or ',' in a password
//     (postgres://u:p@ss/w@host/db, postgres://u:p@s?s@host/db) made the
//     text after the first '@' the host and the rest the database name
//     or parameters: refused for the second '@';
//   - a '/' in a password with no '@' before it (postgres://u:pa/ss@host/db,
//     postgres://u:p?a/ss@host/db, postgres://u:1,pa/ss@host/db) made the
//     user name the host and the password's pieces a port, another host,
//     the database name or parameters: refused for its '@', since a URL
//     without user info may hold none;
//   - a query before the first '/' and an '@' in it
//     (postgres://host:5432?user=u@srv&password=...) made the text before
//     the '@' the user info and the rest, password included, the host:
//     refused for a '?' followed by an '=' in the user info.
//
// An '@' that belongs in a database name or a parameter's value
// (?user=u@srv) must be written %40 then, and a '?' in a password that an
// '=' follows, %3F: the check cannot tell them from a password's
// fragments. A password may hold '?' and '#' otherwise. The error quotes
// nothing of dsn. Keyword/value strings, and URLs that pgx does not read
// as URLs, pass.
func CheckURL(dsn string) error {
	rest, ok := strings.CutPrefix(dsn, "postgresql://")
	if !ok {
		rest, ok = strings.CutPrefix(dsn, "postgres://")
	}
	if !ok {
		return nil
	}
	i := strings.IndexAny(rest, "@/")
	if i < 0 || rest[i] == '/' {
		if strings.ContainsRune(rest, '@') {
			return errMisreadUserInfo
		}
		return nil
	}
	userInfo := rest[:i]
	if strings.ContainsRune(rest[i+1:], '@') {
		return errMisreadUserInfo
	}
	if q := strings.IndexByte(userInfo, '?'); q >= 0 && strings.ContainsRune(userInfo[q:], '=') {
		return errMisreadUserInfo
	}
	return nil
}

var errMisreadUserInfo = errors.New("the URL holds an '@' where pgx would read part of the user name or password as the host, the database name or a parameter: " +
	"write a '/' in the user name or password as %2F, an '@' there as %40 (and a '?' that an '=' follows as %3F), and an '@' anywhere else in the URL as %40")

// minScrub is the shortest hidden value RedactError searches error text
// for: shorter strings turn up in any text by chance, and hiding them
// would garble the message without keeping anything secret.
const minScrub = 3

// RedactError returns err with dsn's passwords hidden from its text, for
// errors from parsing or connecting with dsn, or from the server it names.
// pgx redacts its own parse errors only on a best-effort basis (it misses
// "password = x", with spaces), and net/url quotes the whole URL: both are
// replaced by their Redact form. Then every remaining copy of a password,
// raw or decoded, is masked, wherever it is in the text: whichever package
// wrote it, and however the caller wrapped it.
//
// Except a copy that lies within one of the names the errors print on
// purpose: dsn's user, database and hosts, and the program's own name,
// "bellhop" (run `bellhop migrate`). Masking those garbled the message
// (database "xxxxx" does not exist, run `xxxxx migrate`, with
// docker-compose.yml's password, "bellhop", which is also its database's
// name). A password that is one of those names, or lies within one, is
// shown where the name is: it cannot be hidden without hiding which user
// or database the error is about, and it is no secret from whoever may
// read the name.
//
// The result unwraps to err, so errors.Is and errors.As still work; its
// text is safe to print, err's own may not be. nil stays nil.
func RedactError(err error, dsn string) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	_, secrets := redact(dsn)
	var pce *pgconn.ParseConfigError
	if errors.As(err, &pce) {
		clean := *pce
		var more []string
		clean.ConnString, more = redact(pce.ConnString)
		secrets = append(secrets, more...)
		msg = strings.ReplaceAll(msg, pce.Error(), clean.Error())
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		clean := *ue
		var more []string
		clean.URL, more = redact(ue.URL)
		secrets = append(secrets, more...)
		var esc url.EscapeError
		if errors.As(ue.Err, &esc) {
			// The bad escape it quotes may be part of a password.
			clean.Err = errors.New("invalid URL escape")
		}
		msg = strings.ReplaceAll(msg, ue.Error(), clean.Error())
	}
	return &redactedError{msg: mask(msg, secrets, append(printedNames(dsn), programName)), err: err}
}

// programName is the program's name as its messages print it.
const programName = "bellhop"

// printedNames are the names that dsn's errors print on purpose: its user,
// database and hosts, as pgx reads them. A host or database that holds
// '@' is left out: it is the rest of a password with an unescaped '@'
// (CheckHosts) or '/' (CheckURL).
// A dsn that does not parse has none: its errors are pgx's parse errors,
// whose quoted string is redacted as a whole.
func printedNames(dsn string) []string {
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		return nil
	}
	names := []string{cfg.User}
	if !strings.ContainsRune(cfg.Database, '@') {
		names = append(names, cfg.Database)
	}
	hosts := []string{cfg.Host}
	for _, f := range cfg.Fallbacks {
		hosts = append(hosts, f.Host)
	}
	for _, h := range hosts {
		if !strings.ContainsRune(h, '@') {
			names = append(names, h)
		}
	}
	return names
}

// mask replaces every copy in text of a secret at least minScrub bytes
// long with xxxxx, except a copy that lies within a copy of one of keep.
// Copies that overlap or touch are masked as one.
func mask(text string, secrets, keep []string) string {
	type span struct{ start, end int }
	find := func(s string, f func(span)) {
		for i := 0; i <= len(text); {
			j := strings.Index(text[i:], s)
			if j < 0 {
				return
			}
			f(span{i + j, i + j + len(s)})
			i += j + 1
		}
	}
	var kept []span
	for _, k := range keep {
		if k != "" {
			find(k, func(sp span) { kept = append(kept, sp) })
		}
	}
	hide := make([]bool, len(text))
	for _, s := range secrets {
		if len(s) < minScrub {
			continue
		}
		find(s, func(sp span) {
			for _, k := range kept {
				if k.start <= sp.start && sp.end <= k.end {
					return
				}
			}
			for i := sp.start; i < sp.end; i++ {
				hide[i] = true
			}
		})
	}
	var b strings.Builder
	for i := 0; i < len(text); i++ {
		if !hide[i] {
			b.WriteByte(text[i])
			continue
		}
		b.WriteString(masked)
		for i+1 < len(text) && hide[i+1] {
			i++
		}
	}
	return b.String()
}

// redactedError is an error whose text has been redacted.
type redactedError struct {
	msg string
	err error
}

func (e *redactedError) Error() string { return e.msg }
func (e *redactedError) Unwrap() error { return e.err }
