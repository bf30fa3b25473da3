package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/urfave/cli/v3"
	"gopkg.in/yaml.v3"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgdsn"
	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/internal/validate"
	"github.com/bellhopq/bellhop/migrations"
)

// TestBadConfiguration: bad configuration, flags and input exit 2 with
// one line on stderr that names the problem, never a stack trace, and
// never echo a password.
func TestBadConfiguration(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	const garbled = "postgres://u:s3cretpw@host:notaport/db"
	add := []string{"consumer", "add", "--app", "shop", "--queue", "q", "--url", "http://127.0.0.1:9/hook"}
	enq := []string{"enqueue", "--app", "shop", "--queue", "orders"}
	const away = "host=/nonexistent port=1 user=postgres connect_timeout=2"

	tests := []struct {
		name string
		dsn  string   // DATABASE_URL; "-" for none
		env  []string // more environment
		args []string
		want string // in the message
	}{
		{"no DATABASE_URL", "-", nil, []string{"queues"}, "no database: set --database-url or DATABASE_URL"},
		{"no DATABASE_URL for run", "-", nil, []string{"run"}, "no database"},
		{"garbled DATABASE_URL", garbled, nil, []string{"queues"}, "--database-url: cannot parse"},
		{"garbled DATABASE_URL for run", garbled, nil, []string{"run"}, "--database-url: cannot parse"},
		{"garbled --database-url", "-", nil, []string{"--database-url", garbled, "migrate"}, "--database-url: cannot parse"},
		{"unknown flag", dsn, nil, []string{"queues", "--bogus"}, "flag provided but not defined: --bogus"},
		{"unknown global flag", dsn, nil, []string{"--bogus", "queues"}, "flag provided but not defined: --bogus"},
		{"unknown command", dsn, nil, []string{"bogus"}, `unknown command "bogus"`},
		{"unknown subcommand", dsn, nil, []string{"consumer", "bogus"}, `unknown command "bogus" (see bellhop consumer --help)`},
		// The library's own words were `Required flag "app" not set`,
		// the one message to name a flag without its dashes.
		{"missing required flag", dsn, nil, []string{"enqueue", "--queue", "orders", "{}"}, "bellhop: --app is required\n"},
		{"missing required flags", dsn, nil, []string{"setup-demo", "--app", "shop"}, "bellhop: --queue, --url and --secret-file are required\n"},
		{"example-consumer missing --secret-file", "-", nil, []string{"example-consumer", "--addr", "127.0.0.1:0"}, "bellhop: --secret-file is required\n"},
		{"bad --log-format", dsn, nil, []string{"--log-format", "xml", "run"}, `--log-format "xml": use json or console`},
		{"bad --log-format elsewhere", dsn, nil, []string{"--log-format", "xml", "queues"}, `--log-format "xml"`},
		// Named as the variable that set it, not as a flag never typed.
		{"bad BELLHOP_LOG_FORMAT", dsn, []string{"BELLHOP_LOG_FORMAT=xml"}, []string{"queues"}, `bellhop: BELLHOP_LOG_FORMAT "xml": use json or console`},
		{"bad --log-format over a good BELLHOP_LOG_FORMAT", dsn, []string{"BELLHOP_LOG_FORMAT=json"}, []string{"--log-format", "xml", "queues"}, `bellhop: --log-format "xml": use json or console`},
		{"bad --log-level", dsn, nil, []string{"--log-level", "loud", "run"}, `--log-level "loud"`},
		{"--log-level disabled", dsn, nil, []string{"--log-level", "disabled", "run"}, `--log-level "disabled": use debug, info, warn or error`},
		{"BELLHOP_LOG_LEVEL trace", dsn, []string{"BELLHOP_LOG_LEVEL=TRACE"}, []string{"queues"}, `bellhop: BELLHOP_LOG_LEVEL "TRACE": use debug, info, warn or error`},
		{"bad --log-level over a good BELLHOP_LOG_LEVEL", dsn, []string{"BELLHOP_LOG_LEVEL=debug"}, []string{"--log-level", "loud", "queues"}, `bellhop: --log-level "loud"`},
		// pgx ends the user info at the first '@', so the rest of such a
		// password became a host name, shown in connection errors.
		{"password with an unescaped @", "postgres://u:P@ss3cretpw@localhost:1/db", nil, []string{"queues"}, "the URL holds an '@' where pgx would read part of the user name or password as the host"},
		{"password with an unescaped @ for run", "postgres://u:P@ss3cretpw@localhost:1/db", nil, []string{"run"}, "an '@' there as %40"},
		// pgx ends the host at a password's unescaped '/': the rest of it
		// was sent as the database name and shown in connection errors.
		{"password with an unescaped /", "-", nil, []string{"--database-url", "postgres://app:2024/s3cretpw@db.internal:5432/bellhop", "migrate"}, "--database-url: the URL holds an '@' where pgx would read part of the user name or password as the host"},
		{"password with a leading / for run", "postgres://app:/s3cretpw@localhost:1/db", nil, []string{"run"}, "write a '/' in the user name or password as %2F"},
		{"bad duration", dsn, nil, append(add, "--visibility-timeout", "5x"), `invalid value "5x" for flag --visibility-timeout`},
		{"bad duration in env", dsn, []string{"BELLHOP_POLL_INTERVAL=5x"}, []string{"run"}, `BELLHOP_POLL_INTERVAL`},
		{"fractional visibility timeout", dsn, nil, append(add, "--visibility-timeout", "0.5s"), "--visibility-timeout 500ms is outside 1s..12h"},
		{"visibility timeout not whole seconds", dsn, nil, append(add, "--visibility-timeout", "1500ms"), "not a whole number of seconds"},
		{"zero max attempts", dsn, nil, append(add, "--max-attempts", "0"), "--max-attempts 0: must be 1 to 1000"},
		{"too many max attempts", dsn, nil, append(add, "--max-attempts", "1001"), "--max-attempts 1001: must be 1 to 1000"},
		{"too many max in flight on update", dsn, nil, []string{"consumer", "update", "--app", "shop", "--max-in-flight", "10001", "00000000-0000-0000-0000-000000000001"}, "--max-in-flight 10001: must be 1 to 10000"},
		{"zero max in flight", dsn, nil, append(add, "--max-in-flight", "0"), "--max-in-flight 0: must be 1 to 10000"},
		{"backoff cap below base", dsn, nil, append(add, "--backoff-min", "2s", "--backoff-max", "1s"), "--backoff-max 1s is below --backoff-min 2s"},
		{"zero max attempts on enqueue", dsn, nil, append(enq, "--max-attempts", "0", "{}"), "--max-attempts 0: must be 1 to 1000"},
		// The library's message would add "(0 means the default)", which
		// the flag refuses.
		{"too many max attempts on enqueue", dsn, nil, append(enq, "--max-attempts", "1001", "{}"), "--max-attempts 1001: must be 1 to 1000"},
		{"zero max attempts on update", dsn, nil, []string{"consumer", "update", "--app", "shop", "--max-attempts", "0", "00000000-0000-0000-0000-000000000001"}, "--max-attempts 0: must be 1 to 1000"},
		{"unusable --http-addr", dsn, nil, []string{"run", "--http-addr", "nonsense:99999"}, `--http-addr "nonsense:99999"`},
		// "parse error" alone did not say what a switch takes.
		{"bad switch value", dsn, nil, []string{"run", "--queue-depths=maybe"}, `invalid value "maybe" for flag --queue-depths: parse error: use true or false`},
		{"bad switch value in env", dsn, []string{"BELLHOP_LEASE_AT_INSERT=maybe"}, []string{"run"}, `for flag --lease-at-insert: parse error: use true or false`},
		{"short --poll-interval", dsn, nil, []string{"run", "--poll-interval", "10ms"}, "--poll-interval 10ms: must be at least 1s"},
		{"zero --shutdown-grace", dsn, nil, []string{"run", "--shutdown-grace", "0s"}, "--shutdown-grace 0s: must be positive"},
		{"short BELLHOP_POLL_INTERVAL", dsn, []string{"BELLHOP_POLL_INTERVAL=0.5s"}, []string{"run"}, "bellhop: BELLHOP_POLL_INTERVAL 500ms: must be at least 1s"},
		{"huge BELLHOP_SHUTDOWN_GRACE", dsn, []string{"BELLHOP_SHUTDOWN_GRACE=13h"}, []string{"run"}, "bellhop: BELLHOP_SHUTDOWN_GRACE 13h0m0s: must be at most 12h0m0s"},
		// Far past 12h, the stop's bound overflowed and every outcome
		// was given up at once.
		{"huge --shutdown-grace", dsn, nil, []string{"run", "--shutdown-grace", "2562047h"}, "--shutdown-grace 2562047h0m0s: must be at most 12h0m0s"},
		// ":" listened on a random port.
		{"--http-addr without a port", dsn, nil, []string{"run", "--http-addr", ":"}, `--http-addr ":" has no port`},
		{"BELLHOP_HTTP_ADDR without a port", dsn, []string{"BELLHOP_HTTP_ADDR=localhost:"}, []string{"run"}, `bellhop: BELLHOP_HTTP_ADDR "localhost:" has no port`},
		{"bad BELLHOP_HTTP_ADDR, no database", "-", []string{"BELLHOP_HTTP_ADDR=nonsense:99999"}, []string{"run"}, `bellhop: BELLHOP_HTTP_ADDR "nonsense:99999": address 99999: invalid port`},
		// An empty address used to listen on a random port.
		{"empty --http-addr", dsn, nil, []string{"run", "--http-addr", ""}, "--http-addr is empty"},
		{"empty BELLHOP_HTTP_ADDR", dsn, []string{"BELLHOP_HTTP_ADDR="}, []string{"run"}, "BELLHOP_HTTP_ADDR is set but empty"},
		// VerifyPush reads a window that is not positive as 5 minutes.
		{"example-consumer empty --addr", "-", nil, []string{"example-consumer", "--addr", "", "--secret-file", "/nonexistent"}, "--addr is empty"},
		{"example-consumer zero --replay-window", "-", nil, []string{"example-consumer", "--addr", "127.0.0.1:0", "--secret-file", "/nonexistent", "--replay-window", "0s"}, "--replay-window 0s: must be positive"},
		{"example-consumer negative --replay-window", "-", nil, []string{"example-consumer", "--addr", "127.0.0.1:0", "--secret-file", "/nonexistent", "--replay-window", "-1m"}, "--replay-window -1m0s: must be positive"},
		{"bad queue name", dsn, nil, []string{"enqueue", "--app", "shop", "--queue", "bad queue", "{}"}, `invalid queue name "bad queue"`},
		{"bad queue name on add", dsn, nil, []string{"consumer", "add", "--app", "shop", "--queue", "a/b", "--url", "http://127.0.0.1:9/"}, `invalid queue name "a/b"`},
		{"bad app name", dsn, nil, []string{"app", "create", "bad name"}, `app name "bad name"`},
		{"app name with a leading dot", dsn, nil, []string{"app", "create", ".hidden"}, `app name ".hidden"`},
		{"non-JSON enqueue", dsn, nil, append(enq, "{not json"), "invalid payload: not JSON"},
		{"empty enqueue", dsn, nil, append(enq, ""), "invalid payload: it is empty"},
		{"bad PGCONNECT_TIMEOUT", dsn, []string{"PGCONNECT_TIMEOUT=abc"}, []string{"queues"}, "also read from the environment: PGCONNECT_TIMEOUT"},
		{"upper-case URL scheme", dsn, nil, []string{"consumer", "add", "--app", "shop", "--queue", "q", "--url", "HTTP://EXAMPLE.COM/"}, `URL "HTTP://EXAMPLE.COM/": write the scheme in lower case, http://`},
		{"unknown app", dsn, nil, []string{"enqueue", "--app", "nope", "--queue", "orders", "{}"}, `unknown app "nope"`},
		{"unknown app for consumer", dsn, nil, []string{"consumer", "add", "--app", "nope", "--queue", "q", "--url", "http://127.0.0.1:9/"}, `unknown app "nope"`},
		{"unknown app for queues", dsn, nil, []string{"queues", "--app", "nope"}, `list queues: unknown app "nope"`},
		{"unknown app for queues --watch", dsn, nil, []string{"queues", "--watch", "--app", "nope"}, `list queues: unknown app "nope"`},
		{"unknown app for consumer ls", dsn, nil, []string{"consumer", "ls", "--app", "nope"}, `list consumers: unknown app "nope"`},
		{"unknown app from BELLHOP_APP for consumer ls", dsn, []string{"BELLHOP_APP=nope"}, []string{"consumer", "ls"}, `list consumers: unknown app "nope"`},
		{"unknown app for dead ls", dsn, nil, []string{"dead", "ls", "--app", "nope"}, `list dead letters: unknown app "nope"`},
		{"unknown app for dead show", dsn, nil, []string{"dead", "show", "--app", "nope", "00000000-0000-0000-0000-000000000001"}, `list dead letters: unknown app "nope"`},
		{"unknown app for dead purge", dsn, nil, []string{"dead", "purge", "--app", "nope", "--queue", "q"}, `purge dead letters: unknown app "nope"`},
		{"--delay and --at", dsn, nil, append(enq, "--delay", "1s", "--at", "2030-01-02T15:04:05Z", "{}"), "use --delay or --at, not both"},
		{"bad --at", dsn, nil, append(enq, "--at", "tomorrow", "{}"), `--at "tomorrow" is not an RFC 3339 time`},
		{"negative --delay", dsn, nil, append(enq, "--delay", "-1s", "{}"), "--delay -1s: must not be negative"},
		{"two payloads", dsn, nil, append(enq, "{}", "{}"), "bellhop: enqueue takes exactly one argument, JSON or - (see bellhop enqueue --help)"},
		{"non-http URL", dsn, nil, []string{"consumer", "add", "--app", "shop", "--queue", "q", "--url", "ftp://example.com/hook"}, `--url: invalid option: URL "ftp://example.com/hook": scheme must be http or https`},
		{"URL with credentials", dsn, nil, []string{"consumer", "add", "--app", "shop", "--queue", "q", "--url", "http://u:pw@example.com/"}, `--url: invalid option: URL "http://xxxxx@example.com/" carries credentials`},
		{"--allowed-hosts refuses", dsn, nil, []string{"consumer", "add", "--app", "shop", "--queue", "q", "--url", "http://evil.example.org/", "--allowed-hosts", "*.example.com"}, `--url: host "evil.example.org" is not in the allowed hosts (allowed hosts from --allowed-hosts)`},
		{"BELLHOP_ALLOWED_HOSTS refuses", dsn, []string{"BELLHOP_ALLOWED_HOSTS=example.com"}, []string{"consumer", "add", "--app", "shop", "--queue", "q", "--url", "http://127.0.0.1:9/"}, `--url: host "127.0.0.1" is not in the allowed hosts (allowed hosts from BELLHOP_ALLOWED_HOSTS)`},
		{"BELLHOP_ALLOWED_HOSTS refuses an update", "-", []string{"BELLHOP_ALLOWED_HOSTS=example.com"}, []string{"consumer", "update", "--app", "shop", "--url", "http://b.example.org/", "00000000-0000-0000-0000-000000000001"}, `--url: host "b.example.org" is not in the allowed hosts (allowed hosts from BELLHOP_ALLOWED_HOSTS)`},
		{"--allowed-hosts refuses an update", dsn, nil, []string{"consumer", "update", "--app", "shop", "--url", "http://evil.example.org/", "--allowed-hosts", "example.com", "00000000-0000-0000-0000-000000000001"}, `--url: host "evil.example.org" is not in the allowed hosts`},
		{"non-http URL on update", dsn, nil, []string{"consumer", "update", "--app", "shop", "--url", "ftp://example.com/hook", "00000000-0000-0000-0000-000000000001"}, `--url: invalid option: URL "ftp://example.com/hook": scheme must be http or https`},
		{"update without changes", dsn, nil, []string{"consumer", "update", "--app", "shop", "00000000-0000-0000-0000-000000000001"}, "nothing to update"},
		{"example-consumer bad --addr", "-", nil, []string{"example-consumer", "--addr", "nonsense:99999", "--secret-file", "/nonexistent"}, `--addr "nonsense:99999"`},
		{"example-consumer --addr without a port", "-", nil, []string{"example-consumer", "--addr", "127.0.0.1", "--secret-file", "/nonexistent"}, `--addr "127.0.0.1": address 127.0.0.1: missing port in address`},
		{"consumer id not a UUID", dsn, nil, []string{"consumer", "pause", "--app", "shop", "42"}, `consumer id "42" is not a UUID`},
		{"unknown consumer", dsn, nil, []string{"consumer", "resume", "--app", "shop", "00000000-0000-0000-0000-000000000001"}, "resume consumer 00000000-0000-0000-0000-000000000001 of app shop: unknown consumer"},
		{"unknown consumer to pause", dsn, nil, []string{"consumer", "pause", "--app", "shop", "00000000-0000-0000-0000-000000000001"}, "pause consumer 00000000-0000-0000-0000-000000000001 of app shop: unknown consumer"},
		{"dead redrive without selector", dsn, nil, []string{"dead", "redrive", "--app", "shop"}, "name a MESSAGE_ID or --queue"},
		{"dead redrive id and --queue", dsn, nil, []string{"dead", "redrive", "--app", "shop", "--queue", "q", "00000000-0000-0000-0000-000000000001"}, "give a MESSAGE_ID or --queue, not both"},
		{"dead purge id and --queue", dsn, nil, []string{"dead", "purge", "--app", "shop", "00000000-0000-0000-0000-000000000001", "--queue", "q"}, "give a MESSAGE_ID or --queue, not both"},
		{"dead show bad id", dsn, nil, []string{"dead", "show", "--app", "shop", "xyz"}, `message id "xyz" is not a UUID`},
		{"demo bad interval", "-", nil, []string{"demo", "--interval", "0s"}, "--interval 0s: must be at least 1ms"},
		{"dead ls --limit 0", dsn, nil, []string{"dead", "ls", "--app", "shop", "--limit", "0"}, "--limit 0: must be 1 to 10000"},
		{"dead ls --limit -1", dsn, nil, []string{"dead", "ls", "--app", "shop", "--limit", "-1"}, "--limit -1: must be 1 to 10000"},
		{"dead ls --limit too high", dsn, nil, []string{"dead", "ls", "--app", "shop", "--limit", "10001"}, "--limit 10001: must be 1 to 10000"},
		{"dead ls empty --app", dsn, nil, []string{"dead", "ls", "--app", ""}, "--app is empty"},
		{"dead show empty --app", dsn, nil, []string{"dead", "show", "--app", "", "00000000-0000-0000-0000-000000000001"}, "--app is empty"},
		{"dead purge bad queue name", dsn, nil, []string{"dead", "purge", "--app", "shop", "--queue", "bad q"}, `purge dead letters: invalid queue name "bad q"`},
		{"dead redrive bad queue name", dsn, nil, []string{"dead", "redrive", "--app", "shop", "--queue", "a/b"}, `redrive dead letters: invalid queue name "a/b"`},
		{"dead ls bad queue name", dsn, nil, []string{"dead", "ls", "--app", "shop", "--queue", "bad q"}, `list dead letters: invalid queue name "bad q"`},
		{"dead ls --after not an id", dsn, nil, []string{"dead", "ls", "--app", "shop", "--after", "last"}, `--after "last": not a dead letter, given as ID:SOURCE (SOURCE queue or invoke) or ID`},
		{"dead ls --after bad source", dsn, nil, []string{"dead", "ls", "--app", "shop", "--after", "6f1c7a52-95e4-4c3a-9d43-1d6f3f1e8a11:cron"}, `--after "6f1c7a52-95e4-4c3a-9d43-1d6f3f1e8a11:cron": not a dead letter`},
		{"dead ls --after no dead letter", dsn, nil, []string{"dead", "ls", "--app", "shop", "--after", "6f1c7a52-95e4-4c3a-9d43-1d6f3f1e8a11"},
			`--after: no dead letter 6f1c7a52-95e4-4c3a-9d43-1d6f3f1e8a11 in app "shop" (redriven or purged since it was listed?)`},
		// Input that is bad whatever the database holds is named even
		// when the database cannot be reached.
		{"bad app name, database away", away, nil, []string{"app", "create", "bad name"}, `create app: invalid name: app name "bad name"`},
		{"bad queue name on add, database away", away, nil, []string{"consumer", "add", "--app", "shop", "--queue", "a/b", "--url", "http://127.0.0.1:9/"}, `--queue: invalid queue name "a/b"`},
		{"bad queue name on enqueue, database away", away, nil, []string{"enqueue", "--app", "shop", "--queue", "a/b", "{}"}, `--queue: invalid queue name "a/b"`},
		{"non-JSON enqueue, database away", away, nil, []string{"enqueue", "--app", "shop", "--queue", "q", "{not json"}, "invalid payload: not JSON"},
		{"port out of range on add", away, nil, []string{"consumer", "add", "--app", "shop", "--queue", "q", "--url", "http://example.com:99999/hook"}, `port "99999" is outside 1..65535`},
		{"setup-demo empty --secret-file", dsn, nil, []string{"setup-demo", "--app", "shop", "--queue", "q", "--url", "http://127.0.0.1:9/", "--secret-file", ""}, `--secret-file "" names no file`},
		{"setup-demo --secret-file a directory path", dsn, nil, []string{"setup-demo", "--app", "shop", "--queue", "q", "--url", "http://127.0.0.1:9/", "--secret-file", "/tmp/"}, `--secret-file "/tmp/" names no file`},
		{"example-consumer empty --secret-file", "-", nil, []string{"example-consumer", "--addr", "127.0.0.1:0", "--secret-file", ""}, `--secret-file "" names no file`},
		// A directory can never become the secret: every request would get
		// a 503 and every message be retried until it is dead-lettered.
		{"example-consumer --secret-file a directory", "-", nil, []string{"example-consumer", "--addr", "127.0.0.1:0", "--secret-file", os.TempDir()}, fmt.Sprintf("--secret-file %q is a directory", os.TempDir())},
		{"setup-demo bad queue name", dsn, nil, []string{"setup-demo", "--app", "shop", "--queue", "bad q", "--url", "http://127.0.0.1:9/", "--secret-file", "/nonexistent/s"}, `--queue: invalid queue name "bad q"`},
		{"setup-demo bad app name", dsn, nil, []string{"setup-demo", "--app", "bad app", "--queue", "q", "--url", "http://127.0.0.1:9/", "--secret-file", "/nonexistent/s"}, `--app: invalid name: app name "bad app"`},
		{"--allowed-hosts entry with a port", dsn, nil, []string{"run", "--allowed-hosts", "example.com,127.0.0.1:18282"}, `--allowed-hosts: allowed host "127.0.0.1:18282": is not a bare hostname`},
		{"--allowed-hosts entry is a URL", dsn, nil, append(add, "--allowed-hosts", "https://a.example.com"), `allowed host "https://a.example.com": is a URL`},
		{"--allowed-hosts entry *", dsn, nil, []string{"consumer", "update", "--app", "shop", "--url", "http://a.example.com/", "--allowed-hosts", "*", "00000000-0000-0000-0000-000000000001"}, `allowed host "*": a wildcard`},
		{"--allowed-hosts blank", dsn, nil, append(add, "--allowed-hosts", " , "), "has only blank entries"},
		{"BELLHOP_ALLOWED_HOSTS blank", dsn, []string{"BELLHOP_ALLOWED_HOSTS= , "}, []string{"run", "--http-addr", "127.0.0.1:0"}, `BELLHOP_ALLOWED_HOSTS: allowed hosts [" " " "] has only blank entries`},
		{"BELLHOP_ALLOWED_HOSTS entry with a port", dsn, []string{"BELLHOP_ALLOWED_HOSTS=example.com, 127.0.0.1:18282"}, []string{"run", "--http-addr", "127.0.0.1:0"}, `bellhop: BELLHOP_ALLOWED_HOSTS: allowed host "127.0.0.1:18282": is not a bare hostname`},
		{"bad --allowed-hosts over a good BELLHOP_ALLOWED_HOSTS", dsn, []string{"BELLHOP_ALLOWED_HOSTS=example.com"}, append(add, "--allowed-hosts", "https://a.example.com"), `--allowed-hosts: allowed host "https://a.example.com": is a URL`},
		{"dead purge nil id", dsn, nil, []string{"dead", "purge", "--app", "shop", "00000000-0000-0000-0000-000000000000"}, "message id 00000000-0000-0000-0000-000000000000 is the nil UUID"},
		{"dead redrive nil id", dsn, nil, []string{"dead", "redrive", "--app", "shop", "--queue", "q", "00000000-0000-0000-0000-000000000000"}, "is the nil UUID"},
		{"dead show nil id", dsn, nil, []string{"dead", "show", "--app", "shop", "00000000-0000-0000-0000-000000000000"}, "is the nil UUID"},
		{"dead redrive unknown id", dsn, nil, []string{"dead", "redrive", "--app", "shop", "00000000-0000-0000-0000-000000000001"}, `no dead letter 00000000-0000-0000-0000-000000000001 in app "shop"`},
		{"dead purge unknown id", dsn, nil, []string{"dead", "purge", "--app", "shop", "00000000-0000-0000-0000-000000000001"}, "no dead letter"},
		// net/http ignores a proxy it cannot parse and pushes directly.
		{"malformed HTTP_PROXY", dsn, []string{"HTTP_PROXY=http://u:s3cretpw%zz@proxy.example:3128"}, []string{"run"}, "HTTP_PROXY does not parse as a URL"},
		{"malformed https_proxy", dsn, []string{"HTTPS_PROXY=", "https_proxy=u:s3cretpw%@proxy.example:3128"}, []string{"run"}, "https_proxy names no proxy host"},
		// The address dialled would be the proxy's.
		{"--block-private-addresses beside a proxy", dsn, []string{"HTTPS_PROXY=http://proxy.example:3128"}, []string{"run", "--block-private-addresses"},
			"--block-private-addresses: blocking pushes to private addresses checks the address dialled, and with HTTPS_PROXY set that is the proxy's"},
		{"BELLHOP_BLOCK_PRIVATE_ADDRESSES beside a proxy", dsn, []string{"HTTP_PROXY=http://proxy.example:3128", "BELLHOP_BLOCK_PRIVATE_ADDRESSES=1"}, []string{"run"},
			"BELLHOP_BLOCK_PRIVATE_ADDRESSES: blocking pushes to private addresses checks the address dialled, and with HTTP_PROXY set"},
		// Checked before connecting, as their error said.
		// Named as the flags, not as the library's options (delay,
		// deliver-after), which the user never typed.
		{"--delay too long, database away", away, nil, append(enq, "--delay", "87601h", "{}"), "bellhop: invalid option: --delay 87601h0m0s is more than the limit, 87600h (10 years)\n"},
		{"--at too far, database away", away, nil, append(enq, "--at", "2199-01-02T15:04:05Z", "{}"), "bellhop: invalid option: --at 2199-01-02T15:04:05Z is more than the limit, 87600h (10 years), ahead\n"},
		{"--delay too long from stdin", dsn, nil, append(enq, "--delay", "87601h", "-"), "bellhop: invalid option: --delay 87601h0m0s is more than the limit"},
		{"--at too far from stdin", dsn, nil, append(enq, "--at", "2199-01-02T15:04:05+02:00", "-"), "bellhop: invalid option: --at 2199-01-02T15:04:05+02:00 is more than the limit"},
		{"bad --app on enqueue, database away", away, nil, []string{"enqueue", "--app", "bad app", "--queue", "q", "{}"}, `--app: invalid name: app name "bad app"`},
		// A name the user never typed is blamed on the variable that
		// gave it.
		{"bad BELLHOP_APP on enqueue, database away", away, []string{"BELLHOP_APP=bad app"}, []string{"enqueue", "--queue", "q", "{}"}, `bellhop: BELLHOP_APP: invalid name: app name "bad app"`},
		{"bad BELLHOP_APP on setup-demo", "-", []string{"BELLHOP_APP=bad app"}, []string{"setup-demo", "--queue", "q", "--url", "http://127.0.0.1:9/", "--secret-file", "/nonexistent/s"}, `bellhop: BELLHOP_APP: invalid name: app name "bad app"`},
		{"bad BELLHOP_APP on consumer add", "-", []string{"BELLHOP_APP=bad app"}, []string{"consumer", "add", "--queue", "q", "--url", "http://127.0.0.1:9/"}, `bellhop: BELLHOP_APP: invalid name: app name "bad app"`},
		// A bad flag is named before the missing database.
		{"short --poll-interval, no database", "-", nil, []string{"run", "--poll-interval", "500ms"}, "bellhop: --poll-interval 500ms: must be at least 1s"},
		{"--http-addr without a port, no database", "-", nil, []string{"run", "--http-addr", ":"}, `bellhop: --http-addr ":" has no port`},
		{"--http-addr out of range, no database", "-", nil, []string{"run", "--http-addr", "nonsense:99999"}, `bellhop: --http-addr "nonsense:99999": address 99999: invalid port`},
		{"bad --app on consumer add, no database", "-", nil, []string{"consumer", "add", "--app", "bad app", "--queue", "q", "--url", "http://127.0.0.1:9/"}, `bellhop: --app: invalid name: app name "bad app"`},
		{"bad --principal on consumer add, no database", "-", nil, []string{"consumer", "add", "--app", "shop", "--principal", "bad p", "--queue", "q", "--url", "http://127.0.0.1:9/"}, `bellhop: --principal: invalid name: principal name "bad p"`},
		{"zero max attempts on update, no database", "-", nil, []string{"consumer", "update", "--app", "shop", "--max-attempts", "0", "00000000-0000-0000-0000-000000000001"}, "bellhop: --max-attempts 0: must be 1 to 1000"},
		{"negative --timeout on update, no database", "-", nil, []string{"consumer", "update", "--app", "shop", "--timeout", "-1s", "00000000-0000-0000-0000-000000000001"}, "bellhop: --timeout -1s: must not be negative"},
		{"bad --app on update, no database", "-", nil, []string{"consumer", "update", "--app", "bad app", "--max-attempts", "2", "00000000-0000-0000-0000-000000000001"}, `bellhop: --app: invalid name: app name "bad app"`},
		{"bad --app on rm, no database", "-", nil, []string{"consumer", "rm", "--app", "bad app", "00000000-0000-0000-0000-000000000001"}, `bellhop: --app: invalid name: app name "bad app"`},
		{"dead show unknown id", dsn, nil, []string{"dead", "show", "--app", "shop", "00000000-0000-0000-0000-000000000001"}, "no dead letter"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := append([]string(nil), tc.env...)
			if tc.dsn != "-" {
				env = append(env, "DATABASE_URL="+tc.dsn)
			}
			r := exeEnv(t, env, "", tc.args...)
			if r.code != 2 {
				t.Errorf("exit %d, want 2", r.code)
			}
			lines := strings.Split(strings.TrimRight(r.stderr, "\n"), "\n")
			if len(lines) != 1 || !strings.HasPrefix(lines[0], "bellhop: ") {
				t.Errorf("stderr is not one \"bellhop: \" line")
			}
			if !strings.Contains(r.stderr, tc.want) {
				t.Errorf("stderr lacks %q", tc.want)
			}
			for _, bad := range []string{"goroutine", "panic", "s3cretpw", "Incorrect Usage"} {
				if strings.Contains(r.stderr+r.stdout, bad) {
					t.Errorf("output contains %q", bad)
				}
			}
			if r.stdout != "" {
				t.Errorf("stdout is not empty")
			}
			if t.Failed() {
				t.Logf("bellhop %q\n%s", tc.args, r)
			}
		})
	}
	// None of the refused consumers was registered.
	if out := ok(t, dsn, "consumer", "ls"); strings.Count(strings.TrimSpace(out), "\n") != 0 {
		t.Errorf("consumers registered despite errors:\n%s", out)
	}
}

// TestDatabaseURLPasswordNeverShown: a connection string that does not
// parse is quoted in the error without its password, in every form that
// can carry one; so is one that parses but cannot connect.
func TestDatabaseURLPasswordNeverShown(t *testing.T) {
	t.Parallel()
	const secret = "S3CRETpw"
	tests := []struct {
		dsn  string
		code int
		want string // in the message
	}{
		{"host=x password=S3CRETpw port=abc", 2, "cannot parse `host=x password=xxxxx port=abc`: invalid port"},
		{"host=x password = S3CRETpw port=abc", 2, "cannot parse `host=x password = xxxxx port=abc`"},
		{"host=x password =S3CRETpw port=abc", 2, "password =xxxxx"},
		{"host=x password=\tS3CRETpw port=abc", 2, "invalid port"},
		{"host=x password='S3CRETpw x' port=abc", 2, "password=xxxxx port=abc"},
		{"host=x password = 'S3CRETpw \\' x' port=abc", 2, "invalid port"},
		{"host=x password=S3CRETpw\\ x port=abc", 2, "invalid port"},
		{"host=x password='S3CRETpw port=5", 2, "cannot parse"},
		{"host=x password S3CRETpw", 2, "cannot parse"},
		{"host=x sslpassword=S3CRETpw port=abc", 2, "sslpassword=xxxxx"},
		{"postgres://u:S3CRETpw@host:abc/db", 2, "cannot parse `postgres://u:xxxxx@host:abc/db`: invalid port"},
		{"postgresql://u:S3CRETpw@host/db?sslmode=bogus", 2, "cannot parse"},
		{"postgres://u:S3CRETpw%zz@host/db", 2, "cannot parse `postgres://u:xxxxx@host/db`"},
		{"postgres://u:S3CRET%70w@host:abc/db", 2, "invalid port"},
		{"postgres://u:S3CR/ETpw@host:abc/db", 2, "write a '/' in the user name or password as %2F"},
		{"postgres://u@host:abc/db?password=S3CRETpw", 2, "?password=xxxxx"},
		{"postgres://host/db?sslmode=disable&password=S3CRETpw&port=abc", 2, "password=xxxxx"},
		{"postgres://host:abc/db?pass%77ord=S3CRETpw", 2, "cannot parse"},
		{"POSTGRES://u:S3CRETpw@host/db", 2, `scheme "POSTGRES": use postgres:// or postgresql://`},
		{"mysql://u:S3CRETpw@host/db", 2, `scheme "mysql": use postgres:// or postgresql://`},
		// Neither a URL nor keyword/value settings: pgx's error hides it
		// all, so the message says what was expected.
		{"S3CRETpw", 2, "(give a postgres:// URL, or keyword/value settings such as host=db dbname=app)"},
		{"host=/nonexistent port=1 user=u password=S3CRETpw connect_timeout=2", 1, "connect to the database"},
		{"postgres://u:S3CRETpw@/db?host=/nonexistent&port=1&connect_timeout=2", 1, "connect to the database"},
		// An unescaped '/' in the password ended the host for pgx: the
		// user name became the host, the password's start its port, and
		// the rest the database name, which the connect error printed
		// ("database=S3CRETpw@db.internal:5432/bellhop"). Refused first.
		{"postgres://app:/S3CRETpw@db.internal:5432/bellhop", 2, "write a '/' in the user name or password as %2F"},
		{"postgres://app:Summer/S3CRETpw@db.internal:5432/bellhop", 2, "write a '/' in the user name or password as %2F"},
		{"postgres://app:2024/S3CRETpw@db.internal:5432/bellhop", 2, "write a '/' in the user name or password as %2F"},
		{"postgres://app:/S3CRETpw@/bellhop?host=/nonexistent&port=1&connect_timeout=2", 2, "the URL holds an '@'"},
		// An '@' and then a '/' in the password: the text between them
		// became the host, and the rest the database name.
		{"postgres://app:S3CRET@pw/2024@db.internal:5432/bellhop", 2, "write a '/' in the user name or password as %2F, an '@' there as %40"},
		{"postgres://app:S3CRET@pw/2024@/bellhop?host=/nonexistent&port=1&connect_timeout=2", 2, "the URL holds an '@'"},
		// An '@' and then a '?': the text between them became the host,
		// and the rest parameters sent to it.
		{"postgres://app:S3CRET@kP?q3=2024@db.internal:5432/bellhop", 2, "the URL holds an '@'"},
		{"postgres://app:S3CRET@Summer?2024@/bellhop?host=/nonexistent&port=1&connect_timeout=2", 2, "the URL holds an '@'"},
		// A '?' and then a '/', no '@' before them: the rest became a
		// parameter with no '=', which pgx's error quoted.
		{"postgres://app:S3CRET?Summer/2024@db.internal:5432/bellhop", 2, "the URL holds an '@'"},
		// A '/' and then a '?' with a pair, or a ',': the password's
		// pieces became the database name, a parameter or a host.
		{"postgres://app:2024/Summer?x=1@127.0.0.1:1/bellhop", 2, "the URL holds an '@'"},
		{"postgres://app:1,S3CRETpw?k=v/x@127.0.0.1:1/db", 2, "the URL holds an '@'"},
		// A query before any '/', with an '@' in it: pgx took the text
		// before the '@' for the user info, and the password for a host.
		{"postgres://127.0.0.1:1?user=u@srv&password=S3CRETpw&connect_timeout=2", 2, "the URL holds an '@'"},
		{"postgres://127.0.0.1:1?u@x=S3CRETpw", 2, "a host name holds '=', '&' or '?'"},
		// An '&' in a password in the query; a URL written user:password
		// with no '@' and no host.
		{"postgres://127.0.0.1:1/db?password=Summer&S3CRETpw&connect_timeout=2", 2, "missing key/value separator"},
		{"postgres://app:S3CRETpw", 2, "invalid port"},
		{"postgres://app:Summer?S3CRETpw", 2, "missing key/value separator"},
		{"postgres://app:Summer/S3CRETpw", 2, "invalid port"},
		{"postgres://127.0.0.1:1/db?password=Summer&S3CRETpw=x=y&connect_timeout=2", 2, "extra key/value separator"},
	}
	for _, tc := range tests {
		// queues stands for every command that connects; demo parses the
		// connection string on its own.
		for _, args := range [][]string{{"queues"}, {"demo"}} {
			t.Run(args[0]+" "+tc.dsn, func(t *testing.T) {
				t.Parallel()
				r := exe(t, tc.dsn, "", args...)
				if r.code != tc.code || !strings.Contains(r.stderr, tc.want) || strings.Count(strings.TrimRight(r.stderr, "\n"), "\n") != 0 {
					t.Errorf("want exit %d and one line with %q; got %s", tc.code, tc.want, r)
				}
				if strings.Contains(r.stdout+r.stderr, secret) || strings.Contains(r.stdout+r.stderr, "S3CRET") || strings.Contains(r.stdout+r.stderr, "Summer") || strings.Contains(r.stdout+r.stderr, "2024") {
					t.Errorf("the password is in the output:\n%s", r)
				}
			})
			if tc.code == 1 {
				break // connecting is the same for every command; once is enough
			}
		}
	}
}

// TestConsumerErrorsNameFlags: consumer add and update name a bad setting
// by its flag, as the user gave it, not by the library's name for it
// ("backoff base 0s is outside 1ms..24h0m0s"); a bad value from a
// variable names its flag with its dashes, as every other message does.
func TestConsumerErrorsNameFlags(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	id, _ := addConsumer(t, dsn, "--app", "shop", "--queue", "stored", "--url", "http://127.0.0.1:9/hook",
		"--backoff-min", "5s", "--backoff-max", "10s", "--visibility-timeout", "60s", "--timeout", "40s")
	add := []string{"consumer", "add", "--app", "shop", "--queue", "q", "--url", "http://127.0.0.1:9/hook"}
	update := []string{"consumer", "update", "--app", "shop", id}
	tests := []struct {
		name string
		env  []string
		args []string
		want string
	}{
		{"add --backoff-max below --backoff-min", nil, append(add, "--backoff-max", "1s", "--backoff-min", "5s"), "invalid option: --backoff-max 1s is below --backoff-min 5s"},
		{"add --timeout too short", nil, append(add, "--timeout", "50ms"), "invalid option: --timeout 50ms is outside 100ms..12h0m0s"},
		{"add --timeout past the lease", nil, append(add, "--timeout", "40s", "--visibility-timeout", "30s"), "invalid option: --timeout 40s does not fit the --visibility-timeout 30s"},
		{"add --backoff-min too long", nil, append(add, "--backoff-min", "25h"), "invalid option: --backoff-min 25h0m0s is outside 1ms..24h0m0s"},
		{"add --backoff-max not whole", nil, append(add, "--backoff-max", "1500us"), "invalid option: --backoff-max 1.5ms is not a whole number of milliseconds"},
		{"add --visibility-timeout too long", nil, append(add, "--visibility-timeout", "13h"), "invalid option: --visibility-timeout 13h0m0s is outside 1s..12h0m0s"},
		{"add --max-in-flight too many", nil, append(add, "--max-in-flight", "10001"), "--max-in-flight 10001: must be 1 to 10000"},
		{"add --max-attempts too many", nil, append(add, "--max-attempts", "1001"), "--max-attempts 1001: must be 1 to 1000"},
		{"update --backoff-min too long", nil, append(update, "--backoff-min", "25h"), "invalid option: --backoff-min 25h0m0s is outside 1ms..24h0m0s"},
		{"update --timeout too short", nil, append(update, "--timeout", "50ms"), "invalid option: --timeout 50ms is outside 100ms..12h0m0s"},
		{"update --max-attempts too many", nil, append(update, "--max-attempts", "1001"), "--max-attempts 1001: must be 1 to 1000"},
		// Checked against the consumer's stored settings.
		{"update --backoff-max below the stored --backoff-min", nil, append(update, "--backoff-max", "1s"), "--backoff-max 1s is below --backoff-min 5s"},
		{"update --visibility-timeout below the stored --timeout", nil, append(update, "--visibility-timeout", "30s"), "--timeout 40s does not fit the --visibility-timeout 30s"},
		{"bad BELLHOP_POLL_INTERVAL", []string{"BELLHOP_POLL_INTERVAL=5x"}, []string{"run"}, `from environment variable "BELLHOP_POLL_INTERVAL" for flag --poll-interval:`},
		{"bad BELLHOP_LEASE_AT_INSERT", []string{"BELLHOP_LEASE_AT_INSERT=maybe"}, []string{"run"}, `for flag --lease-at-insert:`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := exeEnv(t, append([]string{"DATABASE_URL=" + dsn}, tc.env...), "", tc.args...)
			if r.code != 2 || !strings.Contains(r.stderr, tc.want) {
				t.Errorf("bellhop %s: %s\nwant exit 2 and %q", strings.Join(tc.args, " "), r, tc.want)
			}
			for _, name := range []string{"backoff base", "backoff cap", "push timeout", " visibility timeout", "max attempts", "max in-flight", "flag poll", "flag lease"} {
				if strings.Contains(r.stderr, name) {
					t.Errorf("stderr names %q: %s", name, r.stderr)
				}
			}
		})
	}
}

// TestErrorsKeepWordsBesidePassword: a password that is also a word of
// the message, as docker-compose.yml's "bellhop" is, is hidden only where
// it could leak, not from the CLI's own wording or the database and user
// names the error prints on purpose; one the server echoes is hidden.
// Every copy was masked: database "xxxxx_..." does not exist, run
// `xxxxx migrate`.
func TestErrorsKeepWordsBesidePassword(t *testing.T) {
	t.Parallel()
	withPassword := func(dsn, pw string) string {
		t.Helper()
		u, err := url.Parse(dsn)
		if err != nil || u.Scheme != "postgres" && u.Scheme != "postgresql" {
			t.Skipf("the test server's connection string is not a postgres:// URL")
		}
		u.User = url.UserPassword(u.User.Username(), pw)
		return u.String()
	}
	empty := withPassword(emptyDatabase(t), "bellhop")
	missing, err := pgdsn.WithDatabase(empty, "bellhop_no_such_db")
	if err != nil {
		t.Fatal(err)
	}
	// A setting the server refuses, quoting its value: the password.
	echo := withPassword(pgtest.ConnString(t), "S3CRETpw")
	echo += "&options=-c%20statement_timeout%3DS3CRETpw"
	if !strings.Contains(echo, "?") {
		t.Skipf("the test server's connection string has no query")
	}
	tests := []struct {
		name, dsn string
		args      []string
		want      []string // in the message
	}{
		{"unmigrated", empty, []string{"run", "--http-addr", "127.0.0.1:0"}, []string{"run `bellhop migrate`"}},
		{"no such database", missing, []string{"queues"}, []string{`database "bellhop_no_such_db" does not exist`, "database=bellhop_no_such_db"}},
		{"echoed password", echo, []string{"queues"}, []string{`invalid value for parameter "statement_timeout": "xxxxx"`}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := exe(t, tc.dsn, "", tc.args...)
			if r.code == 0 {
				t.Fatalf("succeeded: %s", r)
			}
			for _, w := range tc.want {
				if !strings.Contains(r.stderr, w) {
					t.Errorf("stderr lacks %q: %s", w, r.stderr)
				}
			}
			if strings.Contains(r.stderr, "S3CRET") || strings.Contains(r.stderr, "xxxxx") != (tc.name == "echoed password") {
				t.Errorf("password masked where it should not be, or shown: %s", r.stderr)
			}
		})
	}
}

// TestOperationalErrorsExit1: failures that are not the caller's mistake
// (unreachable database, conflicts) exit 1, still as one line.
func TestOperationalErrorsExit1(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	addConsumer(t, dsn, "--app", "shop", "--queue", "orders", "--url", "http://127.0.0.1:9/hook")
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { busy.Close() })
	empty := emptyDatabase(t)
	// A database one migration behind this binary.
	behind := pgtest.ConnString(t)
	latest, err := migrations.Latest()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db(t, behind).Exec(context.Background(), "UPDATE "+migrations.VersionTable+" SET version = version - 1"); err != nil {
		t.Fatal(err)
	}
	// The server's error holds words of the CLI library's flag errors.
	flagWords, err := pgdsn.WithDatabase(dsn, "invalid value")
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		dsn  string
		args []string
		want string
	}{
		{"unreachable database", "host=/nonexistent port=1 user=postgres connect_timeout=2", []string{"queues"}, "connect to the database"},
		{"unreachable database for run", "host=/nonexistent port=1 user=postgres connect_timeout=2", []string{"run", "--http-addr", "127.0.0.1:0"}, "connect"},
		{"unknown database named like a flag error", flagWords, []string{"queues"}, `database "invalid value" does not exist`},
		{"app exists", dsn, []string{"app", "create", "shop"}, "app already exists"},
		{"consumer exists", dsn, []string{"consumer", "add", "--app", "shop", "--queue", "orders", "--url", "http://127.0.0.1:9/other"}, "queue already has a consumer"},
		{"--http-addr in use", dsn, []string{"run", "--http-addr", busy.Addr().String()}, "address already in use"},
		// It exited 2, as if the address were a mistake.
		{"example-consumer --addr in use", dsn, []string{"example-consumer", "--addr", busy.Addr().String(), "--secret-file", "/nonexistent"},
			fmt.Sprintf("--addr %q: listen tcp %s: bind: address already in use", busy.Addr(), busy.Addr())},
		{"database not migrated", empty, []string{"queues"}, "database has no Bellhop schema: run `bellhop migrate` (list queues: "},
		{"database not migrated for app create", empty, []string{"app", "create", "shop"}, "database has no Bellhop schema: run `bellhop migrate` (create app"},
		{"database not migrated for run", empty, []string{"run", "--http-addr", "127.0.0.1:0"}, "database has no Bellhop schema: run `bellhop migrate`"},
		{"database schema behind", behind, []string{"run", "--http-addr", "127.0.0.1:0"}, fmt.Sprintf("database schema at version %d, this code needs %d: run `bellhop migrate`", latest-1, latest)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := exe(t, tc.dsn, "", tc.args...)
			lines := strings.Split(strings.TrimRight(r.stderr, "\n"), "\n")
			if r.code != 1 || len(lines) != 1 || !strings.Contains(r.stderr, tc.want) || strings.Contains(r.stderr, "goroutine") {
				t.Errorf("want exit 1 and one line with %q; got %s", tc.want, r)
			}
			// The library's error says it; the CLI's own hint must not
			// say it again.
			if n := strings.Count(r.stderr, "bellhop migrate"); n > 1 {
				t.Errorf("the migrate advice is given %d times: %s", n, r)
			}
		})
	}
}

// TestOneLine: a multi-line error becomes one readable line. pgx's
// connect error used to read "...`:; \t127.0.0.1:1 ...", each attempt
// twice under sslmode=prefer.
func TestOneLine(t *testing.T) {
	t.Parallel()
	refused := "127.0.0.1:1 (localhost): dial error: dial tcp 127.0.0.1:1: connect: connection refused"
	other := "[::1]:1 (localhost): dial error: dial tcp [::1]:1: connect: connection refused"
	for _, tt := range []struct{ in, want string }{
		{"plain", "plain"},
		{"  padded \n", "padded"},
		{"a\nb", "a; b"},
		{"failed to connect to `user=u database=db`:\n\t" + refused + "\n\t" + refused,
			"failed to connect to `user=u database=db`: " + refused},
		{"failed:\n\t" + refused + "\n\t" + other + "\n\t" + refused,
			"failed: " + refused + "; " + other + "; " + refused},
		{"a\n\n\tb:\n c", "a; b: c"},
	} {
		if got := oneLine(errors.New(tt.in)); got != tt.want {
			t.Errorf("oneLine(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

// TestFlagsOverrideEnv: a flag wins over its environment variable, and
// the variable is read when the flag is absent.
func TestFlagsOverrideEnv(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	db := "DATABASE_URL=" + dsn

	// BELLHOP_APP names an app that does not exist: used without --app...
	r := exeEnv(t, []string{db, "BELLHOP_APP=nope"}, "", "enqueue", "--queue", "orders", "{}")
	if r.code != 2 || !strings.Contains(r.stderr, `unknown app "nope"`) {
		t.Errorf("BELLHOP_APP not read: %s", r)
	}
	// ...and overridden by it.
	if r := exeEnv(t, []string{db, "BELLHOP_APP=nope"}, "", "enqueue", "--app", "shop", "--queue", "orders", "{}"); r.code != 0 {
		t.Errorf("--app did not override BELLHOP_APP: %s", r)
	}
	// --database-url over DATABASE_URL.
	if r := exeEnv(t, []string{"DATABASE_URL=postgres://u:s3cretpw@host:notaport/db"}, "", "--database-url", dsn, "queues"); r.code != 0 {
		t.Errorf("--database-url did not override DATABASE_URL: %s", r)
	}
	// --log-format over BELLHOP_LOG_FORMAT: the bad variable is ignored,
	// so the next problem (no database) is what is reported.
	r = exeEnv(t, []string{"BELLHOP_LOG_FORMAT=xml"}, "", "--log-format", "console", "run")
	if r.code != 2 || !strings.Contains(r.stderr, "no database") {
		t.Errorf("--log-format did not override BELLHOP_LOG_FORMAT: %s", r)
	}
	// BELLHOP_APP for setup-demo, as for every --app.
	secret := filepath.Join(t.TempDir(), "secret")
	r = exeEnv(t, []string{db, "BELLHOP_APP=fromenv"}, "", "setup-demo", "--queue", "orders", "--url", "http://127.0.0.1:9/hook", "--secret-file", secret)
	if r.code != 0 || !strings.Contains(r.stdout, "registered for fromenv/orders") {
		t.Errorf("setup-demo did not read BELLHOP_APP: %s", r)
	}
	if out := ok(t, dsn, "consumer", "ls", "--app", "fromenv"); !strings.Contains(out, "orders") {
		t.Errorf("no consumer of fromenv/orders after setup-demo with BELLHOP_APP:\n%s", out)
	}
	// --allowed-hosts over BELLHOP_ALLOWED_HOSTS.
	r = exeEnv(t, []string{db, "BELLHOP_ALLOWED_HOSTS=example.com"}, "", "consumer", "add", "--app", "shop", "--queue", "q",
		"--url", "http://127.0.0.1:9/", "--allowed-hosts", "127.0.0.1")
	if r.code != 0 {
		t.Errorf("--allowed-hosts did not override BELLHOP_ALLOWED_HOSTS: %s", r)
	}
}

// TestErrorsNameEnvSource: an error that refuses a value quotes it with
// the BELLHOP_ variable it came from, wherever the error comes from (the
// library, the CLI), and only when the command line did not give it: the
// CLI review found `BELLHOP_APP=nope bellhop queues` saying only "unknown
// app", which sent the operator looking for an --app they never typed.
func TestErrorsNameEnvSource(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	const id = "00000000-0000-0000-0000-000000000001"
	long := strings.Repeat("a", 70)
	tests := []struct {
		name string
		env  string // BELLHOP_APP's value
		args []string
		want string // the whole line on stderr
	}{
		{"queues", "nope", []string{"queues"}, `bellhop: list queues: unknown app "nope" (from BELLHOP_APP)`},
		{"queues --watch", "nope", []string{"queues", "--watch"}, `bellhop: list queues: unknown app "nope" (from BELLHOP_APP)`},
		{"consumer ls", "nope", []string{"consumer", "ls"}, `bellhop: list consumers: unknown app "nope" (from BELLHOP_APP)`},
		{"dead ls", "nope", []string{"dead", "ls"}, `bellhop: list dead letters: unknown app "nope" (from BELLHOP_APP)`},
		{"dead show", "nope", []string{"dead", "show", id}, `bellhop: list dead letters: unknown app "nope" (from BELLHOP_APP)`},
		{"dead purge", "nope", []string{"dead", "purge", "--queue", "q"}, `bellhop: purge dead letters: unknown app "nope" (from BELLHOP_APP)`},
		{"dead redrive of none", "shop", []string{"dead", "redrive", id}, `bellhop: no dead letter ` + id + ` in app "shop" (from BELLHOP_APP)`},
		{"enqueue", "nope", []string{"enqueue", "--queue", "q", "{}"}, `bellhop: enqueue nope/q: unknown app "nope" (from BELLHOP_APP)`},
		{"enqueue -", "nope", []string{"enqueue", "--queue", "q", "-"}, `bellhop: enqueue to app nope: unknown app "nope" (from BELLHOP_APP); nothing was enqueued`},
		{"consumer add", "nope", []string{"consumer", "add", "--queue", "q", "--url", "http://127.0.0.1:9/"}, `bellhop: register consumer nope/q: unknown app "nope" (from BELLHOP_APP)`},
		{"invalid name in a listing", "bad app", []string{"queues"}, `bellhop: list queues: unknown app "bad app" (from BELLHOP_APP) (not a valid app name: ` + validate.NameRule + `)`},
		{"name cut in the error", long, []string{"consumer", "ls"}, `bellhop: list consumers: unknown app "` + long[:64] + `…" (from BELLHOP_APP) (not a valid app name: ` + validate.NameRule + `)`},
		// Checked by the CLI, which named the variable already.
		{"invalid name checked by the CLI", "bad app", []string{"consumer", "rm", id}, `bellhop: BELLHOP_APP: invalid name: app name "bad app": ` + validate.NameRule},
		// The same text given by another flag, on the command line: the
		// app's quotation is the variable's (found by review: the
		// principal's came first and was blamed).
		{"another flag's value alike", "shop", []string{"consumer", "add", "--queue", "q", "--url", "http://127.0.0.1:9/", "--principal", "shop"},
			`bellhop: register consumer shop/q: unknown principal "shop" in app "shop" (from BELLHOP_APP)`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := "DATABASE_URL=" + dsn
			r := exeEnv(t, []string{db, "BELLHOP_APP=" + tc.env}, "", tc.args...)
			if r.code != 2 || r.stderr != tc.want+"\n" {
				t.Errorf("BELLHOP_APP=%q bellhop %s: %s\nwant exit 2 and stderr %q", tc.env, strings.Join(tc.args, " "), r, tc.want)
			}
			// Given by --app, the same value is not blamed on the
			// variable, set to another app or not at all.
			for _, env := range [][]string{{db}, {db, "BELLHOP_APP=other"}} {
				r := exeEnv(t, env, "", slices.Concat(tc.args[:len(tc.args):len(tc.args)], []string{"--app", tc.env})...)
				if r.code != 2 || strings.Contains(r.stderr, "BELLHOP_APP") {
					t.Errorf("%q bellhop %s --app %q: %s\nwant exit 2, BELLHOP_APP not named", env[1:], strings.Join(tc.args, " "), tc.env, r)
				}
			}
		})
	}
	// A flag that reads no variable has none to blame, whatever is set
	// under its name (found by review: BELLHOP_QUEUE was named).
	r := exeEnv(t, []string{"DATABASE_URL=" + dsn, "BELLHOP_QUEUE=nope"}, "", "dead", "ls", "--app", "nope", "--queue", "nope")
	if want := "bellhop: list dead letters: unknown app \"nope\"\n"; r.code != 2 || r.stderr != want {
		t.Errorf("BELLHOP_QUEUE=nope bellhop dead ls --app nope --queue nope: %s\nwant exit 2 and stderr %q", r, want)
	}
}

// TestEmptyEnvRefused: a BELLHOP_ variable that is set but empty exits 2
// naming it, for every variable a flag reads, unless the command line
// gives the flag. The CLI library read an empty list, duration or number
// as unset, so BELLHOP_ALLOWED_HOSTS= silently allowed every host.
func TestEmptyEnvRefused(t *testing.T) {
	t.Parallel()
	const id = "00000000-0000-0000-0000-000000000001"
	tests := []struct {
		env  string
		cmd  string   // a command that reads env,
		args []string // with what else it needs
		flag []string // the flag given on the command line instead
	}{
		{"BELLHOP_ALLOWED_HOSTS", "run", nil, []string{"--allowed-hosts", "example.com"}},
		{"BELLHOP_ALLOWED_HOSTS", "consumer add", []string{"--app", "shop", "--queue", "q", "--url", "http://example.com/"}, []string{"--allowed-hosts", "example.com"}},
		{"BELLHOP_ALLOWED_HOSTS", "consumer update", []string{"--app", "shop", "--url", "http://example.com/", id}, []string{"--allowed-hosts", "example.com"}},
		{"BELLHOP_POLL_INTERVAL", "run", nil, []string{"--poll-interval", "1m"}},
		{"BELLHOP_SHUTDOWN_GRACE", "run", nil, []string{"--shutdown-grace", "10s"}},
		{"BELLHOP_HTTP_ADDR", "run", nil, []string{"--http-addr", "127.0.0.1:0"}},
		{"BELLHOP_LEASE_AT_INSERT", "run", nil, []string{"--lease-at-insert"}},
		{"BELLHOP_QUEUE_DEPTHS", "run", nil, []string{"--queue-depths=false"}},
		{"BELLHOP_BLOCK_PRIVATE_ADDRESSES", "run", nil, []string{"--block-private-addresses"}},
		{"BELLHOP_LOG_FORMAT", "queues", nil, []string{"--log-format", "json"}},
		{"BELLHOP_LOG_LEVEL", "queues", nil, []string{"--log-level", "info"}},
		{"BELLHOP_APP", "consumer ls", nil, []string{"--app", "shop"}},
		// A required flag: named rather than "--app is required".
		{"BELLHOP_APP", "enqueue", []string{"--queue", "q", "{}"}, []string{"--app", "shop"}},
	}
	// Every variable a flag reads is in the table.
	covered := map[string]bool{}
	for _, tc := range tests {
		covered[tc.env] = true
	}
	walk(newApp(strings.NewReader(""), io.Discard, io.Discard), nil, func(cmd *cli.Command, path []string) {
		for _, f := range cmd.Flags {
			for _, key := range envKeys(f) {
				if strings.HasPrefix(key, envPrefix) && !covered[key] {
					covered[key] = true
					t.Errorf("%s (bellhop %s --%s) is not tested", key, strings.Join(path, " "), f.Names()[0])
				}
			}
		}
	})
	for _, tc := range tests {
		t.Run(tc.env+" "+tc.cmd, func(t *testing.T) {
			t.Parallel()
			cmd := strings.Fields(tc.cmd)
			// No database: every refusal comes before connecting.
			r := exeEnv(t, []string{tc.env + "="}, "", append(cmd, tc.args...)...)
			if want := tc.env + " is set but empty; unset it"; r.code != 2 || !strings.Contains(r.stderr, want) {
				t.Errorf("%s= bellhop %s: %s\nwant exit 2 and %q", tc.env, tc.cmd, r, want)
			}
			// Given on the command line, the flag wins over the variable:
			// what stops the command now is the missing database.
			r = exeEnv(t, []string{tc.env + "="}, "", slices.Concat(cmd, tc.flag, tc.args)...)
			if r.code != 2 || !strings.Contains(r.stderr, "no database") {
				t.Errorf("%s= bellhop %s %s: %s\nwant exit 2 and \"no database\"", tc.env, tc.cmd, strings.Join(tc.flag, " "), r)
			}
		})
	}
	// The message for an empty allow-list says what it would have meant.
	r := exeEnv(t, []string{"BELLHOP_ALLOWED_HOSTS="}, "", "run")
	if want := "bellhop: BELLHOP_ALLOWED_HOSTS is set but empty; unset it to allow every host, or list the hosts\n"; r.stderr != want {
		t.Errorf("stderr %q, want %q", r.stderr, want)
	}
}

// walk calls f on every command of the tree with its path.
func walk(cmd *cli.Command, path []string, f func(cmd *cli.Command, path []string)) {
	f(cmd, path)
	for _, sub := range cmd.Commands {
		if sub.Name == "help" {
			continue
		}
		walk(sub, append(slices.Clone(path), sub.Name), f)
	}
}

// TestHelpDocumentsFlags: every command's --help (from the real binary)
// lists each of its flags with its usage and, where a variable sets it,
// the variable; the daemon's settings all have one; required flags say so.
func TestHelpDocumentsFlags(t *testing.T) {
	t.Parallel()
	root := newApp(strings.NewReader(""), io.Discard, io.Discard)
	checked := 0
	walk(root, nil, func(cmd *cli.Command, path []string) {
		r := exe(t, "", "", append(slices.Clone(path), "--help")...)
		if r.code != 0 {
			t.Errorf("bellhop %s --help: %s", strings.Join(path, " "), r)
			return
		}
		if cmd.Usage != "" && !strings.Contains(r.stdout, cmd.Usage) {
			t.Errorf("bellhop %s --help lacks the command's usage %q", strings.Join(path, " "), cmd.Usage)
		}
		for _, f := range cmd.Flags {
			name := f.Names()[0]
			var line string
			for l := range strings.SplitSeq(r.stdout, "\n") {
				if strings.HasPrefix(strings.TrimSpace(l), "--"+name+" ") || strings.TrimSpace(l) == "--"+name {
					line = l
				}
			}
			if line == "" {
				t.Errorf("bellhop %s --help does not list --%s", strings.Join(path, " "), name)
				continue
			}
			checked++
			if df, ok := f.(cli.DocGenerationFlag); !ok || df.GetUsage() == "" || !strings.Contains(line, df.GetUsage()[:min(20, len(df.GetUsage()))]) {
				t.Errorf("bellhop %s --help: --%s has no usage text: %q", strings.Join(path, " "), name, line)
			}
			for _, env := range envKeys(f) {
				if !strings.Contains(line, "$"+env) {
					t.Errorf("bellhop %s --help: --%s does not name $%s: %q", strings.Join(path, " "), name, env, line)
				}
			}
			// The README promises a variable for --app wherever it is taken.
			if name == "app" && !slices.Contains(envKeys(f), envPrefix+"APP") {
				t.Errorf("bellhop %s: --app has no %sAPP variable", strings.Join(path, " "), envPrefix)
			}
			// The daemon is configured by environment in containers: all
			// of its settings must be reachable that way.
			if (len(path) == 0 || path[0] == "run") && len(envKeys(f)) == 0 && name != "help" {
				t.Errorf("bellhop %s: --%s has no environment variable", strings.Join(path, " "), name)
			}
			// The CLI library does not mark required flags; their usage does.
			if rf, ok := f.(cli.RequiredFlag); ok && rf.IsRequired() && !strings.Contains(line, "(required)") {
				t.Errorf("bellhop %s --help: --%s is required but does not say so: %q", strings.Join(path, " "), name, line)
			}
			if strings.Count(line, "(default:") > 1 {
				t.Errorf("bellhop %s --help: --%s shows its default twice: %q", strings.Join(path, " "), name, line)
			}
		}
	})
	if checked < 30 {
		t.Errorf("checked only %d flags", checked)
	}
}

// TestNoArgumentCommandsRefuseArguments: every command that takes no
// arguments (one without ArgsUsage) refuses an extra one with exit 2,
// naming it, before it does anything; the CLI library would ignore it.
// No DATABASE_URL is set, so a command that went ahead would fail on
// that instead.
func TestNoArgumentCommandsRefuseArguments(t *testing.T) {
	t.Parallel()
	root := newApp(strings.NewReader(""), io.Discard, io.Discard)
	checked := 0
	walk(root, nil, func(cmd *cli.Command, path []string) {
		if len(cmd.Commands) > 0 || cmd.ArgsUsage != "" || len(path) == 0 {
			return
		}
		args := slices.Clone(path)
		for _, f := range cmd.Flags {
			if rf, ok := f.(cli.RequiredFlag); ok && rf.IsRequired() {
				args = append(args, "--"+f.Names()[0], "x")
			}
		}
		args = append(args, "extra-arg")
		checked++
		t.Run(strings.Join(path, " "), func(t *testing.T) {
			t.Parallel()
			r := exe(t, "", "", args...)
			want := fmt.Sprintf(`unexpected argument "extra-arg": bellhop %s takes no arguments`, strings.Join(path, " "))
			if r.code != 2 || r.stdout != "" || strings.Count(strings.TrimRight(r.stderr, "\n"), "\n") != 0 || !strings.Contains(r.stderr, want) {
				t.Errorf("bellhop %q: want exit 2 and one line with %q; got %s", args, want, r)
			}
		})
	})
	// migrate, run, app ls, consumer add, consumer ls, queues, dead ls,
	// demo, setup-demo, example-consumer.
	if checked < 10 {
		t.Errorf("checked only %d commands", checked)
	}
}

// TestStrayArgumentShownWithoutPassword: an argument where none belongs,
// or where a command or an id was expected, is quoted in the error as
// typed, unless it may carry a password: a connection string typed after
// `migrate` was echoed whole, password and all.
func TestStrayArgumentShownWithoutPassword(t *testing.T) {
	t.Parallel()
	const id = "00000000-0000-0000-0000-000000000001"
	tests := []struct {
		name string
		args []string
		want string // in the one line on stderr
	}{
		{"URL after migrate", []string{"migrate", "postgres://u:S3CRET@h/db"}, `unexpected argument "postgres://u:xxxxx@h/db": bellhop migrate takes no arguments`},
		{"postgresql URL after queues", []string{"queues", "postgresql://u:S3CRET@h/db?sslmode=disable"}, `unexpected argument "postgresql://u:xxxxx@h/db?sslmode=disable"`},
		{"keyword/value settings", []string{"migrate", "host=h password=S3CRET dbname=d"}, `unexpected argument "host=h password=xxxxx dbname=d"`},
		{"URL for a command", []string{"postgres://u:S3CRET@h/db"}, `unknown command "postgres://u:xxxxx@h/db" (see bellhop --help)`},
		{"URL for a subcommand", []string{"consumer", "postgres://u:S3CRET@h/db"}, `unknown command "postgres://u:xxxxx@h/db" (see bellhop consumer --help)`},
		{"URL for a consumer id", []string{"consumer", "rm", "--app", "shop", "postgres://u:S3CRET@h/db"}, `consumer id "postgres://u:xxxxx@h/db" is not a UUID`},
		{"URL for a message id", []string{"dead", "show", "--app", "shop", "postgres://u:S3CRET@h/db"}, `message id "postgres://u:xxxxx@h/db" is not a UUID`},
		{"other URL with credentials", []string{"migrate", "https://u:S3CRET@h/x"}, `unexpected argument "https://xxxxx@h/x"`},
		{"user:password@host", []string{"migrate", "u:S3CRET@h"}, `unexpected argument (not shown: it may carry credentials)`},
		{"URL for an app name", []string{"app", "create", "postgres://u:S3CRET@h/db"}, `app name "postgres://u:xxxxx@h/db"`},
		{"URL for --queue", []string{"consumer", "add", "--app", "shop", "--queue", "postgres://u:S3CRET@h/db", "--url", "http://h/x"}, `queue name "postgres://u:xxxxx@h/db"`},
		// Anything else is shown as typed: it is what the user looks for.
		{"plain word", []string{"migrate", "now"}, `unexpected argument "now": bellhop migrate takes no arguments`},
		{"words with spaces", []string{"migrate", "a b"}, `unexpected argument "a b"`},
		{"a setting", []string{"migrate", "dry=run"}, `unexpected argument "dry=run"`},
		{"URL without credentials", []string{"migrate", "http://h/x"}, `unexpected argument "http://h/x"`},
		{"unknown command", []string{"migrat"}, `unknown command "migrat" (see bellhop --help)`},
		{"not a UUID", []string{"consumer", "pause", "--app", "shop", id + "x"}, `consumer id "` + id + `x" is not a UUID`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := exe(t, "", "", tc.args...)
			if r.code != 2 || r.stdout != "" || strings.Count(strings.TrimRight(r.stderr, "\n"), "\n") != 0 || !strings.Contains(r.stderr, tc.want) {
				t.Errorf("bellhop %q: want exit 2 and one line with %q; got %s", tc.args, tc.want, r)
			}
			if strings.Contains(r.stderr, "S3CRET") {
				t.Errorf("bellhop %q: the password is in the output:\n%s", tc.args, r)
			}
		})
	}
}

// readmeCLI returns the README's "## CLI" section.
func readmeCLI(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, found := strings.Cut(string(b), "\n## CLI\n")
	if !found {
		t.Fatal("README.md has no \"## CLI\" section")
	}
	section, _, _ = strings.Cut(section, "\n## ")
	return section
}

// TestReadmeCLIDocumentsFlags: the README's CLI section names every
// command and every flag that --help shows.
func TestReadmeCLIDocumentsFlags(t *testing.T) {
	t.Parallel()
	section := readmeCLI(t)
	flag := func(name string) *regexp.Regexp {
		return regexp.MustCompile(`--` + regexp.QuoteMeta(name) + `\b`)
	}
	root := newApp(strings.NewReader(""), io.Discard, io.Discard)
	walk(root, nil, func(cmd *cli.Command, path []string) {
		if len(path) > 0 && !regexp.MustCompile(`\b`+regexp.QuoteMeta(cmd.Name)+`\b`).MatchString(section) {
			t.Errorf("the README's CLI section does not name bellhop %s", strings.Join(path, " "))
		}
		for _, f := range cmd.Flags {
			if name := f.Names()[0]; name != "help" && !flag(name).MatchString(section) {
				t.Errorf("the README's CLI section does not mention bellhop %s --%s", strings.Join(path, " "), name)
			}
		}
	})
	checkSynopsisDefaults(t, section, root)
}

// checkSynopsisDefaults: in the synopsis at the top of the README's CLI
// section, every optional flag given with a value ([--flag V]) has that
// value as its default, and one given with a placeholder ([--flag D]) has
// no default that --help shows.
func checkSynopsisDefaults(t *testing.T, section string, root *cli.Command) {
	t.Helper()
	_, block, _ := strings.Cut(section, "```\n")
	block, _, _ = strings.Cut(block, "```")
	var lines []string
	for l := range strings.SplitSeq(strings.TrimRight(block, "\n"), "\n") {
		if strings.HasPrefix(l, " ") && len(lines) > 0 {
			lines[len(lines)-1] += " " + strings.TrimSpace(l)
		} else {
			lines = append(lines, l)
		}
	}
	sub := func(c *cli.Command, name string) *cli.Command {
		for _, s := range c.Commands {
			if s.Name == name {
				return s
			}
		}
		return nil
	}
	// resolve walks the command names that start words from c.
	resolve := func(c *cli.Command, words []string) (*cli.Command, []string) {
		var path []string
		for _, w := range words {
			s := sub(c, strings.Split(w, "|")[0])
			if s == nil {
				break
			}
			c, path = s, append(path, s.Name)
		}
		return c, path
	}
	optional := regexp.MustCompile(`\[--([a-z-]+) ([^\]\s|]+)\]`)
	global := map[string]bool{}                          // the global flags the synopsis gives
	placeholder := regexp.MustCompile(`^[A-Z][A-Z_:]*$`) // ID:SOURCE too
	checked := 0
	for _, line := range lines {
		line, ok := strings.CutPrefix(line, "bellhop ")
		if !ok {
			t.Errorf("README CLI synopsis line %q does not start with bellhop", line)
			continue
		}
		if i := strings.Index(line, "   "); i >= 0 {
			line = line[:i] // the description column
		}
		var cur, parent *cli.Command
		var curPath, parentPath []string
		// "bellhop [--flag V] ... COMMAND" gives the global flags.
		if strings.HasPrefix(line, "[--") {
			cur = root
		}
		// "consumer ls ... | update ..." names update of consumer; a
		// bracket split by " | " ([--delay D | --at TIME]) continues
		// the command before it.
		for _, seg := range strings.Split(line, " | ") {
			words := strings.Fields(seg)
			c, p := root, []string(nil)
			if parent != nil {
				if c2, p2 := resolve(parent, words); len(p2) > 0 {
					c, p = c2, append(slices.Clone(parentPath), p2...)
				}
			}
			if len(p) == 0 {
				c, p = resolve(root, words)
			}
			if len(p) > 0 {
				cur, curPath = c, p
				parent, parentPath = root, nil
				for _, name := range p[:len(p)-1] {
					parent, parentPath = sub(parent, name), append(parentPath, name)
				}
			}
			if cur == nil {
				t.Errorf("README CLI synopsis %q names no command", seg)
				break
			}
			for _, m := range optional.FindAllStringSubmatch(seg, -1) {
				name, shown := m[1], m[2]
				var df cli.DocGenerationFlag
				for _, f := range cur.Flags {
					if slices.Contains(f.Names(), name) {
						df, _ = f.(cli.DocGenerationFlag)
					}
				}
				if df == nil {
					t.Errorf("README CLI synopsis gives bellhop %s --%s, which it does not take", strings.Join(curPath, " "), name)
					continue
				}
				if cur == root {
					global[name] = true
				}
				checked++
				def := df.GetValue()
				if u, err := strconv.Unquote(def); err == nil {
					def = u
				}
				if !df.IsDefaultVisible() || def == "0s" || def == "0" {
					def = ""
				}
				if placeholder.MatchString(shown) {
					if def != "" {
						t.Errorf("README CLI synopsis shows bellhop %s [--%s %s]; its default is %s", strings.Join(curPath, " "), name, shown, def)
					}
					continue
				}
				same := shown == def
				if a, err := time.ParseDuration(shown); err == nil {
					b, err := time.ParseDuration(def)
					same = err == nil && a == b
				}
				if !same {
					t.Errorf("README CLI synopsis shows bellhop %s [--%s %s]; its default is %q", strings.Join(curPath, " "), name, shown, def)
				}
			}
		}
	}
	if checked < 20 {
		t.Errorf("checked only %d optional flags of the README's CLI synopsis", checked)
	}
	// Every command takes them: the synopsis is where they are looked for.
	for _, f := range root.Flags {
		if name := f.Names()[0]; name != "help" && !global[name] {
			t.Errorf("README CLI synopsis does not give the global flag --%s", name)
		}
	}
}

// TestReadmeExitCodes: the README's CLI section says which failures exit
// 1, as isUsage decides: the conflicts among them, which it left out,
// naming only an unreachable database.
func TestReadmeExitCodes(t *testing.T) {
	t.Parallel()
	section := readmeCLI(t)
	// The clause on the exit statuses of failures in general (others
	// give a command's own), up to its "exits 1".
	text := strings.Join(strings.Fields(section), " ")
	_, clause, found := strings.Cut(text, "an operational failure")
	clause, _, found2 := strings.Cut(clause, " exits 1")
	if !found || !found2 {
		t.Fatal("the README's CLI section does not say which operational failures exit 1")
	}
	for _, err := range []error{bellhop.ErrAppExists, bellhop.ErrConsumerExists} {
		if isUsage(fmt.Errorf("wrapped: %w", err)) {
			t.Errorf("%v exits 2; this test expects conflicts to exit 1", err)
		}
		if !strings.Contains(clause, err.Error()) {
			t.Errorf("the README's account of exit status 1 (%q) does not name %q", strings.TrimSpace(clause), err)
		}
	}
	if !strings.Contains(clause, "unreachable") {
		t.Errorf("the README's account of exit status 1 (%q) does not name an unreachable database", strings.TrimSpace(clause))
	}
}

// TestReadmeQuickStart: the README's first command is the demo (which
// TestDemo runs).
func TestReadmeQuickStart(t *testing.T) {
	t.Parallel()
	f, err := os.Open("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	inQuickStart, inBlock := false, false
	var first string
	for sc.Scan() && first == "" {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "## "):
			inQuickStart = strings.TrimSpace(line) == "## Quick start"
		case inQuickStart && !inBlock && strings.TrimSpace(line) == "```sh":
			inBlock = true
		case inBlock && strings.HasPrefix(line, "```"):
			t.Fatal("the Quick start's first sh block has no command")
		case inBlock && strings.TrimSpace(line) != "" && !strings.HasPrefix(strings.TrimSpace(line), "#"):
			first = line
		}
	}
	if first == "" {
		t.Fatal("README.md has no ```sh block under \"## Quick start\"")
	}
	cmd, _, _ := strings.Cut(first, "#") // a trailing comment explains it
	if got := strings.Join(strings.Fields(cmd), " "); got != "go run ./cmd/bellhop demo" {
		t.Errorf("the Quick start's first command is %q, want \"go run ./cmd/bellhop demo\"", got)
	}
}

// TestReadmeEnqueueSQL runs the README's `enqueue()` example against a
// migrated database with an app named shop: it must enqueue one message,
// delayed by 5 minutes. It read a column apps does not have (app_id).
func TestReadmeEnqueueSQL(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	var example string
	for _, block := range regexp.MustCompile("(?s)```sql\n(.*?)```").FindAllStringSubmatch(string(b), -1) {
		if strings.Contains(block[1], "SELECT enqueue(") {
			example = strings.TrimSpace(block[1])
		}
	}
	if example == "" {
		t.Fatal("README.md has no ```sql block with SELECT enqueue(")
	}
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	pool := db(t, dsn)
	rows, err := pool.Query(context.Background(), example)
	if err != nil {
		t.Fatalf("the README's example %q: %v", example, err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		t.Fatalf("the README's example %q: %v", example, err)
	}
	if len(ids) != 1 {
		t.Fatalf("the README's example returned %d ids, want 1", len(ids))
	}
	if n := queryInt(t, pool, `SELECT count(*) FROM queue_messages m JOIN apps a ON a.id = m.app_id
		WHERE m.id = $1 AND a.name = 'shop' AND m.queue_name = 'orders'
		  AND m.deliver_after > now() + interval '4 minutes'`, ids[0]); n != 1 {
		t.Errorf("the README's example did not enqueue a delayed message to shop/orders")
	}
	// With a name that matches no app it fails, rather than enqueue
	// nothing without a word (as SELECT enqueue(id, …) FROM apps WHERE
	// name = … did).
	_, err = pool.Exec(context.Background(), strings.Replace(example, "'shop'", "'shpo'", 1))
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "BH001" || !strings.Contains(pe.Message, "unknown app NULL") {
		t.Errorf("the README's example for an unknown app: %v, want SQLSTATE BH001, unknown app NULL, as the README says", err)
	}
	// The signature the README gives: its parameters, in order.
	m := regexp.MustCompile("Its signature is `enqueue\\(([^`]*)\\)`").FindStringSubmatch(strings.Join(strings.Fields(string(b)), " "))
	if m == nil {
		t.Fatal("README.md does not give enqueue()'s signature")
	}
	var args string
	if err := pool.QueryRow(context.Background(), `SELECT pg_get_function_arguments('public.enqueue'::regproc)`).Scan(&args); err != nil {
		t.Fatal(err)
	}
	params := regexp.MustCompile(`\bp_\w+`)
	if got, want := params.FindAllString(m[1], -1), params.FindAllString(args, -1); !slices.Equal(got, want) {
		t.Errorf("the README gives enqueue()'s parameters as %q; the database has %q (%s)", got, want, args)
	}
}

// TestComposeUsesRealCommands checks docker-compose.yml against the CLI
// (it cannot run Docker here): each service built from this repo runs an
// existing subcommand with existing flags, and gets only environment
// variables that the CLI reads.
func TestComposeUsesRealCommands(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("../../docker-compose.yml")
	if err != nil {
		t.Fatal(err)
	}
	problems, ours, err := composeProblems(b)
	if err != nil {
		t.Fatalf("docker-compose.yml: %v", err)
	}
	for _, p := range problems {
		t.Error(p)
	}
	slices.Sort(ours)
	if want := []string{"bellhop", "consumer", "migrate", "setup"}; !slices.Equal(ours, want) {
		t.Errorf("services built from this repo: %v, want %v", ours, want)
	}

	// The Dockerfile's default command is a real one too.
	df, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^CMD \["([^"]+)"\]`).FindSubmatch(df)
	if m == nil {
		t.Fatal("Dockerfile has no CMD [\"...\"]")
	}
	if _, err := resolve(newApp(nil, io.Discard, io.Discard), []string{string(m[1])}); err != nil {
		t.Errorf("Dockerfile CMD: %v", err)
	}
}

// TestComposeChecker: the compose check catches what it is meant to.
func TestComposeChecker(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, service string
		want          string // in a problem; "" for none
	}{
		{"good", `{build: ., command: ["run"], environment: {DATABASE_URL: x, BELLHOP_HTTP_ADDR: ":9090"}}`, ""},
		{"string command", `{build: ., command: "setup-demo --app a --queue q --url http://c/ --secret-file /s"}`, ""},
		{"no command: the Dockerfile's run", `{build: {context: .}, environment: [BELLHOP_POLL_INTERVAL=1m]}`, ""},
		{"not built here", `{image: postgres:15, command: ["nonsense"], environment: {FOO: bar}}`, ""},
		{"unknown subcommand", `{build: ., command: ["serve"]}`, "subcommand serve"},
		{"unknown flag", `{build: ., command: ["run", "--port", "9090"]}`, "--port"},
		{"flag of another command", `{build: ., command: ["migrate", "--http-addr", ":9090"]}`, "--http-addr"},
		{"group without subcommand", `{build: ., command: ["consumer"]}`, "no subcommand"},
		{"missing required flag", `{build: ., command: ["example-consumer", "--addr", ":8080"]}`, "--secret-file"},
		{"variable nobody reads", `{build: ., command: ["run"], environment: {BELLHOP_PORT: "9090"}}`, "BELLHOP_PORT"},
		{"variable of another command", `{build: ., command: ["migrate"], environment: {BELLHOP_HTTP_ADDR: ":9090"}}`, "BELLHOP_HTTP_ADDR"},
		{"other entrypoint", `{build: ., entrypoint: ["/bin/sh"], command: ["run"]}`, "entrypoint"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			problems, _, err := composeProblems([]byte("services:\n  x: " + tc.service + "\n"))
			if err != nil {
				t.Fatal(err)
			}
			switch {
			case tc.want == "" && len(problems) > 0:
				t.Errorf("unexpected problems: %q", problems)
			case tc.want != "" && !slices.ContainsFunc(problems, func(p string) bool { return strings.Contains(p, tc.want) }):
				t.Errorf("problems %q lack %q", problems, tc.want)
			}
		})
	}
}

// composeProblems checks a compose file's services that are built from
// this repo against the command tree of newApp, and returns what is
// wrong and the names of those services.
func composeProblems(b []byte) (problems, ours []string, err error) {
	var compose struct {
		Services map[string]struct {
			Build       yaml.Node `yaml:"build"`
			Entrypoint  yaml.Node `yaml:"entrypoint"`
			Command     yaml.Node `yaml:"command"`
			Environment yaml.Node `yaml:"environment"`
		} `yaml:"services"`
	}
	if err := yaml.Unmarshal(b, &compose); err != nil {
		return nil, nil, err
	}
	root := newApp(nil, io.Discard, io.Discard)
	bad := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
	for name, svc := range compose.Services {
		here, err := builtHere(svc.Build)
		if err != nil {
			return nil, nil, err
		}
		if !here {
			continue
		}
		ours = append(ours, name)
		ep, err := strs(svc.Entrypoint)
		if err != nil {
			return nil, nil, err
		}
		if ep != nil && !slices.Equal(ep, []string{"/usr/local/bin/bellhop"}) {
			bad("service %s: entrypoint %q is not the bellhop binary", name, ep)
		}
		args, err := strs(svc.Command)
		if err != nil {
			return nil, nil, err
		}
		if args == nil {
			args = []string{"run"} // the Dockerfile's CMD
		}
		cmds, err := resolve(root, args)
		if err != nil {
			bad("service %s: command %q: %v", name, args, err)
			continue
		}
		// Variables: DATABASE_URL or one sourced by a flag of the
		// command or its ancestors.
		readable := map[string]bool{}
		for _, c := range cmds {
			for _, f := range c.Flags {
				for _, e := range envKeys(f) {
					readable[e] = true
				}
			}
		}
		env, err := envNames(svc.Environment)
		if err != nil {
			return nil, nil, err
		}
		for _, v := range env {
			if !readable[v] {
				bad("service %s: environment variable %s is read by no flag of %q", name, v, args)
			}
		}
		if m := missingRequired(cmds[len(cmds)-1], args, env); len(m) > 0 {
			bad("service %s: command %q lacks the required %v", name, args, m)
		}
	}
	return problems, ours, nil
}

// builtHere reports whether a compose build: entry builds this repo.
func builtHere(n yaml.Node) (bool, error) {
	switch n.Kind {
	case 0:
		return false, nil
	case yaml.AliasNode: // build: *anchor
		return builtHere(*n.Alias)
	case yaml.ScalarNode:
		return n.Value == "." || n.Value == "./", nil
	case yaml.MappingNode:
		var b struct{ Context string }
		if err := n.Decode(&b); err != nil {
			return false, err
		}
		return b.Context == "." || b.Context == "./", nil
	}
	return false, fmt.Errorf("build: unexpected YAML at line %d", n.Line)
}

// strs decodes a compose command or entrypoint: a list, or a string split
// on spaces; nil if absent.
func strs(n yaml.Node) ([]string, error) {
	switch n.Kind {
	case 0:
		return nil, nil
	case yaml.ScalarNode:
		return strings.Fields(n.Value), nil
	case yaml.SequenceNode:
		var out []string
		err := n.Decode(&out)
		return out, err
	}
	return nil, fmt.Errorf("unexpected YAML at line %d", n.Line)
}

// envNames returns the variable names of a compose environment: a map,
// or a list of NAME=value.
func envNames(n yaml.Node) ([]string, error) {
	var names []string
	switch n.Kind {
	case 0:
	case yaml.MappingNode:
		for i := 0; i < len(n.Content); i += 2 {
			names = append(names, n.Content[i].Value)
		}
	case yaml.SequenceNode:
		var list []string
		if err := n.Decode(&list); err != nil {
			return nil, err
		}
		for _, kv := range list {
			k, _, _ := strings.Cut(kv, "=")
			names = append(names, k)
		}
	default:
		return nil, fmt.Errorf("environment: unexpected YAML at line %d", n.Line)
	}
	return names, nil
}

// resolve checks args against the command tree as the CLI would parse
// them: subcommand names, then flags of that command or its ancestors
// (with their values). It returns the chain of commands, root first.
func resolve(root *cli.Command, args []string) ([]*cli.Command, error) {
	chain := []*cli.Command{root}
	findFlag := func(name string) cli.Flag {
		for i := len(chain) - 1; i >= 0; i-- {
			for _, f := range chain[i].Flags {
				if slices.Contains(f.Names(), name) {
					return f
				}
			}
		}
		return nil
	}
	for i := 0; i < len(args); i++ {
		a := args[i]
		cur := chain[len(chain)-1]
		if strings.HasPrefix(a, "-") {
			name, _, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
			f := findFlag(name)
			if f == nil {
				return nil, &flagError{cur.FullName(), a}
			}
			if df, ok := f.(cli.DocGenerationFlag); ok && df.TakesValue() && !hasValue {
				if i+1 == len(args) {
					return nil, &flagError{cur.FullName(), a + " (no value)"}
				}
				i++
			}
			continue
		}
		if len(cur.Commands) == 0 {
			if cur.Action == nil {
				return nil, &flagError{cur.FullName(), "argument " + a}
			}
			continue // a positional argument
		}
		sub := cur.Command(a)
		if sub == nil {
			return nil, &flagError{cur.FullName(), "subcommand " + a}
		}
		chain = append(chain, sub)
	}
	last := chain[len(chain)-1]
	if last == root || len(last.Commands) > 0 {
		return nil, &flagError{last.FullName(), "no subcommand"}
	}
	return chain, nil
}

// missingRequired returns the required flags of cmd that are neither in
// args nor set by one of the variables in env.
func missingRequired(cmd *cli.Command, args, env []string) []string {
	var missing []string
	for _, f := range cmd.Flags {
		rf, ok := f.(cli.RequiredFlag)
		if !ok || !rf.IsRequired() {
			continue
		}
		given := slices.ContainsFunc(args, func(a string) bool {
			n, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
			return strings.HasPrefix(a, "-") && slices.Contains(f.Names(), n)
		})
		for _, e := range envKeys(f) {
			given = given || slices.Contains(env, e)
		}
		if !given {
			missing = append(missing, "--"+f.Names()[0])
		}
	}
	return missing
}

type flagError struct{ cmd, what string }

func (e *flagError) Error() string { return e.cmd + ": unknown or bad " + e.what }

// TestLogSettingsAnyCase: a log level is read in any case, as it was
// before the list of levels was narrowed ("INFO" in a deployment's
// environment), and so is a log format: "JSON" was refused beside an
// accepted "INFO".
func TestLogSettingsAnyCase(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "migrate")
	tests := []struct {
		env  []string
		args []string
	}{
		{[]string{"BELLHOP_LOG_LEVEL=INFO"}, nil},
		{[]string{"BELLHOP_LOG_LEVEL=Warn"}, nil},
		{[]string{"BELLHOP_LOG_LEVEL=debug"}, nil},
		{[]string{"BELLHOP_LOG_FORMAT=JSON", "BELLHOP_LOG_LEVEL=INFO"}, nil},
		{[]string{"BELLHOP_LOG_FORMAT=Console"}, nil},
		{nil, []string{"--log-format", "CONSOLE"}},
		{nil, []string{"--log-format", "Json", "--log-level", "ERROR"}},
	}
	for _, tc := range tests {
		args := append(slices.Clone(tc.args), "queues")
		if r := exeEnv(t, append([]string{"DATABASE_URL=" + dsn}, tc.env...), "", args...); r.code != 0 {
			t.Errorf("%v bellhop %q: %s", tc.env, args, r)
		}
	}
}

// TestConsoleLogOffTerminal: --log-format console writes one plain line
// per event, dated, when its output is not a terminal (here a pipe, as in
// a file or a container's log, where docker-compose's demo sets console):
// it wrote colour escape codes everywhere, and the time without the date.
func TestConsoleLogOffTerminal(t *testing.T) {
	t.Parallel()
	// A stray variable draws a warning before the database is dialled;
	// nothing listens on port 1, so run then exits.
	r := exeEnv(t, []string{"DATABASE_URL=postgres://u@127.0.0.1:1/db", "BELLHOP_POLL_INTERVALL=1s"}, "",
		"--log-format", "console", "run", "--http-addr", "127.0.0.1:0")
	line := regexp.MustCompile(`(?m)^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{3} WRN BELLHOP_POLL_INTERVALL is set`)
	if r.code != 1 || !line.MatchString(r.stderr) {
		t.Errorf("want exit 1 and a dated console warning of BELLHOP_POLL_INTERVALL: %s", r)
	}
	if strings.Contains(r.stderr, "\x1b[") {
		t.Errorf("colour escape codes in a log that is not a terminal's: %q", r.stderr)
	}
}

// TestRunStrayEnvAndSettings: bellhop run warns of each BELLHOP_ variable
// it reads no flag from, naming it, saying whether another command reads
// it and suggesting the nearest name it reads; one it reads draws no
// warning. Once the database has answered, its settings line gives the
// values in force, the database without its password. A misspelled
// variable was silently ignored, its default applied, and nothing
// recorded the settings in force.
func TestRunStrayEnvAndSettings(t *testing.T) {
	t.Parallel()
	// The test server's connection string may be a URL or keyword/value
	// settings: the password goes into a URL built from what it names.
	pc, err := pgx.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	u := &url.URL{Scheme: "postgres", User: url.UserPassword(pc.User, "s3cret"), Path: "/" + pc.Database, // trust: never asked for
		RawQuery: url.Values{"host": {pc.Host}, "port": {strconv.Itoa(int(pc.Port))}}.Encode()}
	p := start(t, []string{"DATABASE_URL=" + u.String(),
		"BELLHOP_SHUTDOWN_GRAC=5s", "BELLHOP_APP=shop", "BELLHOP_NOTHING_LIKE_IT=1", "BELLHOP_POLL_INTERVAL=2s",
	}, "run", "--http-addr", "127.0.0.1:0")
	p.waitLine(true, servingRE, 30*time.Second)
	p.signal(syscall.SIGTERM)
	if code := p.wait(30 * time.Second); code != 0 {
		t.Fatalf("exit %d:\n%s", code, p.stderr())
	}
	stderr := p.stderr()
	if strings.Contains(stderr, "s3cret") {
		t.Errorf("the password is in the output:\n%s", stderr)
	}
	warned := map[string]string{}
	var settings map[string]any
	for line := range strings.Lines(stderr) {
		var l map[string]any
		if err := json.Unmarshal([]byte(line), &l); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if v, ok := l["variable"].(string); ok && l["level"] == "warn" {
			warned[v], _ = l["message"].(string)
		}
		if l["message"] == "settings" {
			settings = l
		}
	}
	for v, want := range map[string]string{
		"BELLHOP_SHUTDOWN_GRAC":   "no flag reads it: it has no effect (did you mean BELLHOP_SHUTDOWN_GRACE?)",
		"BELLHOP_APP":             "only other commands read it: bellhop run ignores it",
		"BELLHOP_NOTHING_LIKE_IT": "no flag reads it: it has no effect",
	} {
		if got, ok := warned[v]; !ok || !strings.HasSuffix(got, want) {
			t.Errorf("the warning for %s is %q, want one ending %q", v, got, want)
		}
	}
	if len(warned) != 3 {
		t.Errorf("warnings for %d variables (%v), want 3: not for BELLHOP_POLL_INTERVAL, which run reads", len(warned), warned)
	}
	if settings == nil {
		t.Fatalf("no settings line:\n%s", stderr)
	}
	db := fmt.Sprintf("%s@%s/%s", pc.User, net.JoinHostPort(pc.Host, strconv.Itoa(int(pc.Port))), pc.Database)
	for k, want := range map[string]any{
		"database": db, "poll_interval": "2s", "shutdown_grace": "10s",
		"lease_at_insert": false, "log_level": "info", "allowed_hosts": []any{},
	} {
		if got := settings[k]; fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("settings %s = %v, want %v", k, got, want)
		}
	}
	if a, _ := settings["http_addr"].(string); !strings.HasPrefix(a, "127.0.0.1:") || strings.HasSuffix(a, ":0") {
		t.Errorf("settings http_addr = %q, want the address listened on", a)
	}
}

// TestVersion: bellhop version names the build and the newest migration
// the binary knows, which the README's upgrade notes refer to, with no
// database; it takes no arguments.
func TestVersion(t *testing.T) {
	t.Parallel()
	latest, err := migrations.Latest()
	if err != nil {
		t.Fatal(err)
	}
	r := exeEnv(t, nil, "", "version")
	want := fmt.Sprintf("\nschema: version %d (%s)\n", latest, migrations.Name(latest))
	if r.code != 0 || !strings.HasPrefix(r.stdout, "bellhop ") || !strings.Contains(r.stdout, "\ncommit: ") ||
		!strings.Contains(r.stdout, "\ngo: go1.") || !strings.HasSuffix(r.stdout, want) {
		t.Errorf("bellhop version: %s; want the build's lines and %q", r, want)
	}
	if r := exeEnv(t, nil, "", "version", "extra"); r.code != 2 {
		t.Errorf("bellhop version extra: %s; want exit 2", r)
	}
	// The Dockerfile's build has no .git to record, and passes the
	// commit to the linker instead, from the compose file's build args.
	for file, wants := range map[string][]string{
		"../../Dockerfile":         {"ARG BELLHOP_COMMIT=", "-X main.buildCommit=${BELLHOP_COMMIT}"},
		"../../docker-compose.yml": {"BELLHOP_COMMIT: ${BELLHOP_COMMIT:-}"},
	} {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range wants {
			if !strings.Contains(string(b), want) {
				t.Errorf("%s lacks %q", file, want)
			}
		}
	}
	docker := filepath.Join(t.TempDir(), "bellhop")
	if err := goBuild(docker, "-buildvcs=false", "-ldflags=-X main.buildCommit=0123abcd"); err != nil {
		t.Fatalf("build as the Dockerfile does: %v", err)
	}
	out, err := exec.Command(docker, "version").Output()
	if err != nil || !strings.Contains(string(out), "\ncommit: 0123abcd (given at build)\n") {
		t.Errorf("bellhop version, built with -buildvcs=false and the commit given: %q, %v; want the commit given", out, err)
	}
}
