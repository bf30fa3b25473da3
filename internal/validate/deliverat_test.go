package validate

import (
	"errors"
	"strings"
	"testing"
	"time"
)

// TestDeliverAt: a delay or a time, not both; a delay up to MaxDelay, and
// a time up to MaxDelay ahead, each refused past it with the limit named
// in hours and years; a time long past means now.
func TestDeliverAt(t *testing.T) {
	now := time.Date(2026, 12, 7, 8, 0, 0, 0, time.UTC)
	tests := []struct {
		name    string
		at      time.Time
		delay   time.Duration
		want    time.Time
		wantErr string
	}{
		{name: "none", want: time.Time{}},
		{name: "a delay", delay: time.Minute, want: now.Add(time.Minute)},
		{name: "the longest delay", delay: MaxDelay, want: now.Add(MaxDelay)},
		{name: "a delay too long", delay: MaxDelay + time.Hour, wantErr: "delay 87601h0m0s is more than the limit, 87600h (10 years)"},
		{name: "a negative delay", delay: -time.Second, wantErr: "delay -1s is negative"},
		{name: "both", at: now, delay: time.Second, wantErr: "not both"},
		{name: "a time", at: now.Add(time.Hour), want: now.Add(time.Hour)},
		{name: "a time too far", at: now.Add(MaxDelay + time.Hour), wantErr: "is more than the limit, 87600h (10 years), ahead"},
		{name: "a time long past", at: time.Date(1900, 1, 1, 0, 0, 0, 0, time.UTC), want: time.Time{}},
	}
	if MaxDelay != 87600*time.Hour {
		t.Fatalf("MaxDelay is %s; the errors name 87600h (10 years)", MaxDelay)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := DeliverAt(now, tt.at, tt.delay)
			if tt.wantErr != "" {
				if !errors.Is(err, ErrOption) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err %v, want ErrOption with %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || !got.Equal(tt.want) {
				t.Fatalf("got %v, %v; want %v", got, err, tt.want)
			}
		})
	}
}
