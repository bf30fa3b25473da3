package claim_test

import (
	"testing"

	"github.com/bellhopq/bellhop/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }
