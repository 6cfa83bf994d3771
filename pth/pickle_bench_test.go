package pth

import (
	"bufio"
	"bytes"
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

// BenchmarkScan scans the pickle of the checkpoint ABNCONVERT_BENCH_INPUT
// names, as Open does first, through a reader and read whole beforehand
// (scanPickleBytes, what Open's scan ahead of the directory does where
// the directory gives the pickle's size):
//
//	ABNCONVERT_BENCH_INPUT=/tmp/abn-bench/densenet201.trained.pth \
//	    go test ./pth -run X -bench Scan
func BenchmarkScan(b *testing.B) {
	in := os.Getenv("ABNCONVERT_BENCH_INPUT")
	if in == "" {
		b.Skip("ABNCONVERT_BENCH_INPUT names no checkpoint")
	}
	pkl := readPickleOf(b, in)
	b.Run("reader", func(b *testing.B) {
		b.SetBytes(int64(len(pkl)))
		for b.Loop() {
			if _, err := scanPickle(bufio.NewReader(bytes.NewReader(pkl)), int64(len(pkl))); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("memory", func(b *testing.B) {
		b.SetBytes(int64(len(pkl)))
		for b.Loop() {
			if _, err := scanPickleBytes(pkl); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// readPickleOf returns the data.pkl record of the zip checkpoint path.
func readPickleOf(b *testing.B, path string) []byte {
	f, err := os.ReadFile(path)
	if err != nil {
		b.Fatal(err)
	}
	pkl := dataPkl(f)
	if pkl == nil {
		b.Fatalf("%s: no data.pkl", path)
	}
	return pkl
}
