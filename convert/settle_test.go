package convert

import (
	"bytes"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/pth"
)

// TestCopyWhen: the fixtures (trained-like, some gammas negative) have
// signs to fold, so the copy leaves the records of some tensors until they
// are settled; the same checkpoints with every gamma made positive have
// none, so it writes every record at once. Either way (every record
// copied from a map) the output is byte for byte the one the copy writes
// with every record at once, or every one left until the signs settle,
// under either tiny-gamma policy.
func TestCopyWhen(t *testing.T) {
	real := copyWhen
	defer func() { copyWhen = real }()
	defer pth.MapEverything()()
	later := func(ck *pth.Checkpoint) (n int) {
		when := real(ck)
		for _, key := range ck.Keys() {
			shape, _ := ck.Shape(key)
			if when(key, shape) == pth.Settled {
				n++
			}
		}
		return n
	}
	for _, name := range fixtures {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			ck := open(t, fixture(name))
			if later(ck) == 0 {
				t.Fatal("no record left until the signs settle in a checkpoint with negative gammas")
			}
			for _, key := range ck.Keys() {
				if base, ok := strings.CutSuffix(key, ".weight"); ok {
					if _, ok := ck.Shape(base + ".running_var"); ok {
						v := values(t, ck, key)
						for i := range v {
							v[i] = math.Abs(v[i])
						}
						if err := ck.SetValues(key, v); err != nil {
							t.Fatal(err)
						}
					}
				}
			}
			positive := filepath.Join(dir, "positive.pth")
			if err := ck.Write(positive, pth.WriteOptions{}); err != nil {
				t.Fatal(err)
			}
			if n := later(open(t, positive)); n != 0 {
				t.Fatalf("%d records left until the signs settle in a checkpoint whose gammas are all positive", n)
			}
			// Both tiny-gamma policies: under exact (the default) the
			// fixtures' tiny-gamma sites fall back to ABN and move no sign,
			// which copyWhen does not know.
			for _, in := range []string{fixture(name), positive} {
				for _, tiny := range []string{"exact", "approx"} {
					var outs [3][]byte
					for i, w := range []func(*pth.Checkpoint) func(string, []int) pth.When{
						real,
						func(*pth.Checkpoint) func(string, []int) pth.When {
							return func(string, []int) pth.When { return pth.Now }
						},
						func(*pth.Checkpoint) func(string, []int) pth.When {
							return func(string, []int) pth.When { return pth.Settled }
						},
					} {
						copyWhen = w
						out := filepath.Join(dir, "out.pth")
						os.Remove(out)
						if _, err := Run(Options{Input: in, Output: out, TinyGamma: tiny}); err != nil {
							t.Fatal(err)
						}
						b, err := os.ReadFile(out)
						if err != nil {
							t.Fatal(err)
						}
						outs[i] = b
					}
					for i, how := range []string{"every record at once", "every record once the signs settle"} {
						if !bytes.Equal(outs[0], outs[i+1]) {
							t.Errorf("%s --tiny-gamma %s: the copy writing %s wrote %d bytes that differ from the %d it writes as copyWhen says", in, tiny, how, len(outs[i+1]), len(outs[0]))
						}
					}
				}
			}
		})
	}
}
