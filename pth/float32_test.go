package pth

import (
	"math"
	"path/filepath"
	"testing"
)

// TestFloat32Values checks that Float32Values is Values rounded to float32
// on every tensor of the test files (every dtype, views with offsets and
// strides, shared storages, legacy and zip, optimizer state), on tensors
// negated by NegateChannels and replaced by SetValues, and that the fast
// path (contiguous float32, read as stored) is the one most tensors take.
func TestFloat32Values(t *testing.T) {
	files := []string{"dtypes.pth", "dtypes_legacy.pth", "views.pth", "views_legacy.pth", "shared.pth", "convbn_zip.pth", "convbn_legacy.pth", "nested.pth", "adam.pth"}
	fast := 0
	for _, name := range files {
		t.Run(name, func(t *testing.T) {
			c, err := Open(filepath.Join("testdata", name))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			check := func(key, what string) {
				t.Helper()
				want, err := c.Values(key)
				if err != nil {
					if _, err32 := c.Float32Values(key); err32 == nil {
						t.Errorf("%s (%s): Values fails (%v), Float32Values does not", key, what, err)
					}
					return
				}
				got, err := c.Float32Values(key)
				if err != nil {
					t.Fatalf("%s (%s): %v", key, what, err)
				}
				if len(got) != len(want) {
					t.Fatalf("%s (%s): %d values, want %d", key, what, len(got), len(want))
				}
				for i := range got {
					if math.Float32bits(got[i]) != math.Float32bits(float32(want[i])) && !(got[i] != got[i] && want[i] != want[i]) {
						t.Fatalf("%s (%s): value %d is %v, want %v", key, what, i, got[i], float32(want[i]))
					}
				}
			}
			for _, key := range c.Keys() {
				tn, _ := c.Tensor(key)
				if tn.DType() == Float32 && tn.Contiguous() && tn.Numel() > 0 {
					fast++
				}
				check(key, "as read")
				if shape, _ := c.Shape(key); len(shape) > 0 && shape[0] > 0 && isFloat(tn.DType()) {
					if _, err := c.NegateChannels(key, []int{0}); err != nil {
						t.Fatal(err)
					}
					check(key, "channel 0 negated")
					v, err := c.Values(key)
					if err != nil {
						t.Fatal(err)
					}
					for i := range v {
						v[i] = v[i]*3 + 0.1
					}
					if err := c.SetValues(key, v); err != nil {
						t.Fatal(err)
					}
					check(key, "set")
				}
			}
			if _, err := c.Float32Values("no such key"); err == nil {
				t.Error("Float32Values of a missing key: no error")
			}
		})
	}
	if fast == 0 {
		t.Error("no tensor took the contiguous float32 path")
	}
}
