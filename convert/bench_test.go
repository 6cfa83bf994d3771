package convert

import (
	"os"
	"path/filepath"
	"testing"
)

// BenchmarkRun converts the checkpoint ABNCONVERT_BENCH_INPUT names (a
// bench/trained_like.py checkpoint, too large to commit) as the CLI's
// `convert --input IN --output OUT` does, to profile the whole conversion:
//
//	ABNCONVERT_BENCH_INPUT=/tmp/densenet201.trained.pth \
//	    go test ./convert/ -run X -bench Run -cpuprofile cpu.out
func BenchmarkRun(b *testing.B) {
	in := os.Getenv("ABNCONVERT_BENCH_INPUT")
	if in == "" {
		b.Skip("ABNCONVERT_BENCH_INPUT names no checkpoint")
	}
	out := filepath.Join(b.TempDir(), "out.pth")
	for i := 0; i < b.N; i++ {
		if _, err := Run(Options{Input: in, Output: out}); err != nil {
			b.Fatal(err)
		}
		// Not timed: freeing the output's page cache is no part of a run.
		b.StopTimer()
		if err := os.Remove(out); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}
