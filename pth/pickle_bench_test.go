package pth

import (
	"os"
	"testing"
)

// BenchmarkPickle re-pickles the object tree of the checkpoint
// ABNCONVERT_BENCH_INPUT names, as the early copy and Finish each do once
// per conversion (densenet201: 1,200 tensors):
//
//	ABNCONVERT_BENCH_INPUT=/tmp/abn-bench/densenet201.trained.pth \
//	    go test ./pth -run X -bench Pickle
func BenchmarkPickle(b *testing.B) {
	in := os.Getenv("ABNCONVERT_BENCH_INPUT")
	if in == "" {
		b.Skip("ABNCONVERT_BENCH_INPUT names no checkpoint")
	}
	c, err := Open(in)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	plan, err := c.plan()
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	var n int
	for b.Loop() {
		pkl, err := newPickler(plan).dump(c.Root)
		if err != nil {
			b.Fatal(err)
		}
		n = len(pkl)
	}
	b.ReportMetric(float64(n), "bytes")
}
