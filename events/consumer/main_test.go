package consumer

import (
	"os"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// TestMain lets BenchmarkConsumerThroughput run its NATS server in a
// process of its own (testenv.StartNATSProcess runs this binary again).
func TestMain(m *testing.M) {
	testenv.NATSProcessMain()
	os.Exit(m.Run())
}
