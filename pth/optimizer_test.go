package pth

import (
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// goldenTensor returns torch's values for the tensor at path.
func goldenTensor(t *testing.T, g *golden, path ...any) []float64 {
	t.Helper()
	for _, gt := range g.Tensors {
		if reflect.DeepEqual(gt.Path, path) {
			return append([]float64{}, gt.Values...)
		}
	}
	t.Fatalf("golden has no tensor at %v", path)
	return nil
}

// negated returns v with the given dim-0 channels negated (inner elements
// per channel).
func negated(v []float64, inner int, channels ...int) []float64 {
	out := append([]float64{}, v...)
	for _, c := range channels {
		for i := c * inner; i < (c+1)*inner; i++ {
			out[i] = -out[i]
		}
	}
	return out
}

func bufferAt(t *testing.T, c *Checkpoint, path ...any) []float64 {
	t.Helper()
	v, err := lookup(c.Root, path)
	if err != nil {
		t.Fatal(err)
	}
	tn, ok := v.(*Tensor)
	if !ok {
		t.Fatalf("%v is a %s", path, typeName(v))
	}
	vals, err := c.TensorValues(tn)
	if err != nil {
		t.Fatal(err)
	}
	return vals
}

// TestTransformSGD: momentum buffers of flipped channels are negated,
// everything else stays; torch loads the result and finds exactly that.
func TestTransformSGD(t *testing.T) {
	for _, name := range []string{"nested", "nested_legacy"} {
		t.Run(name, func(t *testing.T) {
			g := loadGolden(t, name)
			c := openFixture(t, name)
			flips := map[string][]int{"module.0.weight": {1, 3}, "module.0.bias": {1, 3}, "module.1.weight": {1}}
			changed := map[string]bool{"module.1.weight": true, "module.4.weight": true}
			warnings, err := c.TransformOptimizer(flips, changed)
			if err != nil || len(warnings) != 0 {
				t.Fatalf("warnings %q, err %v", warnings, err)
			}
			// Optimizer ids follow the state dict's parameters (buffers skipped).
			want := map[float64][]float64{
				0: negated(goldenTensor(t, g, "optimizer", "state", 0.0, "momentum_buffer"), 27, 1, 3),
				1: negated(goldenTensor(t, g, "optimizer", "state", 1.0, "momentum_buffer"), 1, 1, 3),
				2: negated(goldenTensor(t, g, "optimizer", "state", 2.0, "momentum_buffer"), 1, 1),
			}
			for id := 3.0; id < 7; id++ {
				want[id] = goldenTensor(t, g, "optimizer", "state", id, "momentum_buffer")
			}
			for id, w := range want {
				if got := bufferAt(t, c, "optimizer", "state", id, "momentum_buffer"); !reflect.DeepEqual(got, w) {
					t.Errorf("state %v momentum: %v\nwant %v", id, got, w)
				}
			}
			out := filepath.Join(t.TempDir(), "out.pth")
			if err := c.Write(out, WriteOptions{}); err != nil {
				t.Fatal(err)
			}
			verifyWithTorch(t, c, out)
		})
	}
}

// TestTransformAdam: exp_avg flips, exp_avg_sq, max_exp_avg_sq and step
// stay.
func TestTransformAdam(t *testing.T) {
	g := loadGolden(t, "adam")
	c := openFixture(t, "adam")
	warnings, err := c.TransformOptimizer(map[string][]int{"1.weight": {0, 2}, "3.weight": {1}}, map[string]bool{"1.weight": true})
	if err != nil || len(warnings) != 0 {
		t.Fatalf("warnings %q, err %v", warnings, err)
	}
	// Ids: 0.weight 0, 0.bias 1, 1.weight 2, 1.bias 3, 3.weight 4.
	check := func(id float64, buf string, want []float64) {
		t.Helper()
		if got := bufferAt(t, c, "optimizer", "state", id, buf); !reflect.DeepEqual(got, want) {
			t.Errorf("state %v %s: %v\nwant %v", id, buf, got, want)
		}
	}
	check(2, "exp_avg", negated(goldenTensor(t, g, "optimizer", "state", 2.0, "exp_avg"), 1, 0, 2))
	check(4, "exp_avg", negated(goldenTensor(t, g, "optimizer", "state", 4.0, "exp_avg"), 4, 1))
	for _, id := range []float64{2, 4} {
		for _, buf := range []string{"exp_avg_sq", "max_exp_avg_sq", "step"} {
			check(id, buf, goldenTensor(t, g, "optimizer", "state", id, buf))
		}
	}
	check(0, "exp_avg", goldenTensor(t, g, "optimizer", "state", 0.0, "exp_avg"))
	out := filepath.Join(t.TempDir(), "out.pth")
	if err := c.Write(out, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	verifyWithTorch(t, c, out)
}

// TestTransformDrops: buffers without a rule drop that parameter's state;
// a parameter count or shape that does not match drops the whole state.
func TestTransformDrops(t *testing.T) {
	stateOf := func(c *Checkpoint) *Dict {
		v, err := lookup(c.Root, []any{"optimizer", "state"})
		if err != nil {
			t.Fatal(err)
		}
		return v.(*Dict)
	}
	t.Run("rmsprop grad_avg", func(t *testing.T) {
		c := openFixture(t, "rmsprop")
		warnings, err := c.TransformOptimizer(map[string][]int{"0.weight": {0}}, map[string]bool{"4.weight": true})
		if err != nil {
			t.Fatal(err)
		}
		if len(warnings) != 2 || !strings.Contains(warnings[0], "0.weight") || !strings.Contains(warnings[0], "grad_avg") {
			t.Errorf("warnings %q", warnings)
		}
		st := stateOf(c)
		_, has0 := st.Get(int64(0))
		_, has1 := st.Get(int64(1))
		_, has5 := st.Get(int64(5))
		if has0 || !has1 || has5 || st.Len() != 5 {
			t.Errorf("state keys %v: want 0 (0.weight) and 5 (4.weight) dropped, the rest kept", st.Keys())
		}
		out := filepath.Join(t.TempDir(), "out.pth")
		if err := c.Write(out, WriteOptions{}); err != nil {
			t.Fatal(err)
		}
		verifyWithTorch(t, c, out)
	})
	t.Run("count mismatch", func(t *testing.T) {
		c := openFixture(t, "nested")
		groups, _ := lookup(c.Root, []any{"optimizer", "param_groups", 0.0, "params"})
		l := groups.(*List)
		l.Items = l.Items[:len(l.Items)-1]
		warnings, err := c.TransformOptimizer(map[string][]int{"module.0.weight": {0}}, nil)
		if err != nil || len(warnings) != 1 || !strings.Contains(warnings[0], "6 parameters, the state dict 7") {
			t.Fatalf("warnings %q, err %v", warnings, err)
		}
		if stateOf(c).Len() != 0 {
			t.Errorf("state not dropped")
		}
	})
	t.Run("shape mismatch", func(t *testing.T) {
		c := openFixture(t, "adam")
		st := stateOf(c)
		a, _ := st.Get(int64(0))
		b, _ := st.Get(int64(1))
		st.Set(int64(0), b)
		st.Set(int64(1), a)
		warnings, err := c.TransformOptimizer(nil, map[string]bool{"1.bias": true})
		if err != nil || len(warnings) != 1 || !strings.Contains(warnings[0], "shape") {
			t.Fatalf("warnings %q, err %v", warnings, err)
		}
		if stateOf(c).Len() != 0 {
			t.Errorf("state not dropped")
		}
	})
	t.Run("channel out of range", func(t *testing.T) {
		c := openFixture(t, "nested")
		if _, err := c.TransformOptimizer(map[string][]int{"module.0.bias": {4}}, nil); err == nil || !strings.Contains(err.Error(), "out of range") {
			t.Errorf("err %v, want out of range", err)
		}
	})
}
