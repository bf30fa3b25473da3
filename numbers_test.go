package bellhop_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/internal/validate"
)

// TestNumberTextMatchesServer: validate.NumberText, which the client's
// payload check adds up so as to refuse numbers that jsonb would write out
// to more than the size limit, agrees with the server on how long each
// number's text is and on which ones numeric cannot hold (SQLSTATE 22003).
func TestNumberTextMatchesServer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.NewPool(t)
	nums := []string{"0", "-0", "-0.0", "1.50", "1E+2", "1e-3", "0.00e2", "0.01e3", "12.5e-1",
		"1e131071", "0.1e131072", "1e131072", "0.1e131073", "1e-16383", "123.456e-16380", "1e-16384",
		"0e-16384", "0.0e-16383", "0e131073", "0e1073741822", "0e1073741824", "1e99999999999", "0e1073741823", "0e-1073741823"}
	// 0e1073741823: PostgreSQL 16 takes it, 14 and 15 do not; NumberText
	// refuses it (see below).
	// And random ones around the edges of the range.
	r := rand.New(rand.NewPCG(1, 2))
	digits := func(n int) string {
		var b strings.Builder
		for range n {
			b.WriteByte(byte('0' + r.IntN(10)))
		}
		return b.String()
	}
	for range 300 {
		num := strings.TrimLeft(digits(1+r.IntN(4)), "0") // JSON allows no leading zero
		if num == "" {
			num = "0"
		}
		if r.IntN(2) == 0 {
			num += "." + digits(1+r.IntN(4))
		}
		switch r.IntN(3) {
		case 0:
			num += fmt.Sprintf("e%d", 131060+r.IntN(20))
		case 1:
			num += fmt.Sprintf("e-%d", 16370+r.IntN(20))
		default:
			num += fmt.Sprintf("e%d", r.IntN(40)-20)
		}
		nums = append(nums, num)
	}
	for _, num := range nums {
		n, ok := validate.NumberText([]byte(num))
		var got int
		err := pool.QueryRow(ctx, `SELECT length(ltrim($1::jsonb::text, '-'))`, num).Scan(&got)
		var pe *pgconn.PgError
		switch {
		case err != nil && (!errors.As(err, &pe) || pe.Code != "22003"):
			t.Fatalf("%s: %v", num, err)
		case err != nil && ok:
			t.Errorf("NumberText(%s) = %d, in range; the server: %v", num, n, err)
		case err == nil && !ok && strings.HasSuffix(num, "e1073741823"):
			// The stricter bound of the versions supported.
		case err == nil && !ok:
			t.Errorf("NumberText(%s): beyond numeric's range; the server writes %d characters", num, got)
		case err == nil && n != got:
			t.Errorf("NumberText(%s) = %d; the server writes %d characters", num, n, got)
		}
	}
}

// TestEnqueueRefusesHugeNumbers: a payload of numbers that jsonb would
// write out to more than the size limit is refused as too large, and one
// that numeric cannot hold as invalid, before any statement: the server
// built the text of 90 KB of them to a gigabyte first, and failed with
// "out of memory". Nothing is written.
func TestEnqueueRefusesHugeNumbers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.NewPool(t)
	c := bellhop.NewClient(pool)
	if _, err := c.CreateApp(ctx, "shop"); err != nil {
		t.Fatal(err)
	}
	huge := "[" + strings.TrimSuffix(strings.Repeat("1e131071,", 10_000), ",") + "]"
	for _, tc := range []struct {
		payload string
		want    error
	}{
		{huge, bellhop.ErrPayloadTooLarge},
		{`{"n":1e131072}`, bellhop.ErrInvalidPayload},
	} {
		if _, err := c.Enqueue(ctx, "shop", "q", []byte(tc.payload), bellhop.EnqueueOptions{}); !errors.Is(err, tc.want) {
			t.Errorf("Enqueue(%.40s...): %v, want %v", tc.payload, err, tc.want)
		}
		if _, err := c.EnqueueMany(ctx, "shop", []bellhop.NewMessage{{Queue: "q", Payload: []byte(`{}`)}, {Queue: "q", Payload: []byte(tc.payload)}}); !errors.Is(err, tc.want) {
			t.Errorf("EnqueueMany(..., %.40s...): %v, want %v", tc.payload, err, tc.want)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM queue_messages`).Scan(&n); err != nil || n != 0 {
		t.Errorf("%d messages written (%v), want none", n, err)
	}
}
