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

// TestFoldsSigns: the fixtures (trained-like, some gammas negative) have
// signs to fold, so their copy starts once those are settled; the same
// checkpoints with every gamma made positive have none, so it starts at
// once. Either way (every record copied from a map) the output is
// byte for byte the one the copy started the other way writes.
func TestFoldsSigns(t *testing.T) {
	defer func() { copyAfterSigns = foldsSigns }()
	defer pth.MapEverything()()
	for _, name := range fixtures {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			ck := open(t, fixture(name))
			if !foldsSigns(ck) {
				t.Fatal("no sign to fold in a checkpoint with negative gammas")
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
			if foldsSigns(open(t, positive)) {
				t.Fatal("signs to fold in a checkpoint whose gammas are all positive")
			}
			for _, in := range []string{fixture(name), positive} {
				var outs [2][]byte
				for i, after := range []bool{false, true} {
					copyAfterSigns = func(*pth.Checkpoint) bool { return after }
					out := filepath.Join(dir, "out.pth")
					os.Remove(out)
					if _, err := Run(Options{Input: in, Output: out}); err != nil {
						t.Fatal(err)
					}
					b, err := os.ReadFile(out)
					if err != nil {
						t.Fatal(err)
					}
					outs[i] = b
				}
				if !bytes.Equal(outs[0], outs[1]) {
					t.Errorf("%s: the copy started at once wrote %d bytes that differ from the %d it writes started after the signs", in, len(outs[0]), len(outs[1]))
				}
			}
		})
	}
}
