package convert

import (
	"os"
	"runtime"
	"runtime/debug"
	"testing"
	"time"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/model"
	"github.com/abnconvert/abnconvert/rewrite"
)

// BenchmarkAnalysis runs what a conversion does before it writes (open,
// recognise, validate, rewrite) on the checkpoint ABNCONVERT_BENCH_INPUT
// names, and reports each phase's wall time per run, so that the analysis
// can be measured apart from the write, which is dominated by I/O:
//
//	ABNCONVERT_BENCH_INPUT=/tmp/densenet201.trained.pth \
//	    go test ./convert/ -run X -bench Analysis -cpuprofile cpu.out
func BenchmarkAnalysis(b *testing.B) {
	in := os.Getenv("ABNCONVERT_BENCH_INPUT")
	if in == "" {
		b.Skip("ABNCONVERT_BENCH_INPUT names no checkpoint")
	}
	var open, recognize, validate, rw time.Duration
	b.ReportAllocs()
	// As in a conversion (collectLate), no collection during a run: each
	// run's garbage is collected between runs, off the clock (a CPU
	// profile still shows that collection, under runtime.GC). With the
	// collector at its default pacing, densenet201 trained measured 24-28
	// ms a run where a conversion spends 16-19.
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		runtime.GC()
		b.StartTimer()
		t0 := time.Now()
		m, err := model.Open(in)
		if err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		g, _, err := arch.Recognize(m.Checkpoint, "auto")
		if err != nil {
			b.Fatal(err)
		}
		t2 := time.Now()
		if err := validateBN(g, m.Checkpoint); err != nil {
			b.Fatal(err)
		}
		t3 := time.Now()
		if _, err := rewrite.Run(g, m.Checkpoint, rewriteOptions(Options{ReLU: "leaky", Slope: 0.01})); err != nil {
			b.Fatal(err)
		}
		t4 := time.Now()
		m.Close()
		open += t1.Sub(t0)
		recognize += t2.Sub(t1)
		validate += t3.Sub(t2)
		rw += t4.Sub(t3)
	}
	n := float64(b.N)
	b.ReportMetric(float64(open.Microseconds())/n/1000, "open-ms/op")
	b.ReportMetric(float64(recognize.Microseconds())/n/1000, "recognize-ms/op")
	b.ReportMetric(float64(validate.Microseconds())/n/1000, "validate-ms/op")
	b.ReportMetric(float64(rw.Microseconds())/n/1000, "rewrite-ms/op")
}
