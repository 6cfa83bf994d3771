package runtime

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// TestBroadcast checks the CPU backend's broadcasting ops and their
// backward against a plain multi-index implementation, over operand shapes
// of different ranks, broadcast on either side or both, and checks that
// the shape-only backend accepts and refuses the same shapes.
func TestBroadcast(t *testing.T) {
	cases := []struct{ a, b []int }{
		{[]int{2, 3, 4, 5}, []int{2, 3, 1, 1}}, // squeeze-and-excitation
		{[]int{2, 3, 1, 1}, []int{2, 3, 4, 5}},
		{[]int{2, 3, 4, 5}, []int{3, 1, 1}},    // lower rank
		{[]int{2, 1, 4, 1}, []int{1, 3, 1, 5}}, // both broadcast
		{[]int{2, 3, 4, 5}, []int{5}},
		{[]int{2, 3, 4, 5}, []int{2, 3, 4, 5}},
		{[]int{4, 1}, []int{}},
	}
	rng := rand.New(rand.NewPCG(1, 2))
	fill := func(shape []int, positive bool) []float32 {
		v := make([]float32, numel(shape))
		for i := range v {
			v[i] = float32(rng.NormFloat64())
			if positive {
				v[i] = 0.5 + float32(rng.Float64())
			}
		}
		return v
	}
	for _, c := range cases {
		for _, op := range []BinaryOp{BinaryAdd, BinarySub, BinaryMul, BinaryDiv} {
			t.Run(fmt.Sprintf("%v_%v_%s", c.a, c.b, op), func(t *testing.T) {
				out, err := BroadcastShape(c.a, c.b)
				if err != nil {
					t.Fatal(err)
				}
				av, bv, dyv := fill(c.a, false), fill(c.b, true), fill(out, false)
				wantY, wantDa, wantDb := naiveBinary(out, c.a, c.b, av, bv, dyv, op)
				cpu := NewCPU(1)
				bb := cpu.(Broadcasting)
				up := func(shape []int, v []float32) Tensor {
					tt, err := cpu.Alloc(shape, Float32)
					if err != nil {
						t.Fatal(err)
					}
					if v != nil {
						if err := cpu.Upload(tt, v); err != nil {
							t.Fatal(err)
						}
					}
					return tt
				}
				a, b, dy := up(c.a, av), up(c.b, bv), up(out, dyv)
				y, da, db := up(out, nil), up(c.a, nil), up(c.b, nil)
				if err := bb.Binary(y, a, b, op); err != nil {
					t.Fatal(err)
				}
				if err := bb.BinaryBackward(da, db, dy, a, b, op); err != nil {
					t.Fatal(err)
				}
				for _, r := range []struct {
					what string
					t    Tensor
					want []float64
				}{{"output", y, wantY}, {"gradient of a", da, wantDa}, {"gradient of b", db, wantDb}} {
					got := make([]float32, len(r.want))
					if err := cpu.Download(r.t, got); err != nil {
						t.Fatal(err)
					}
					for i := range got {
						if math.Abs(float64(got[i])-r.want[i]) > 1e-5*(1+math.Abs(r.want[i])) {
							t.Fatalf("%s[%d] = %g, want %g", r.what, i, got[i], r.want[i])
						}
					}
				}
				sh := NewShapes().(Broadcasting)
				s := NewShapes()
				mk := func(shape []int) Tensor { tt, _ := s.Alloc(shape, Float32); return tt }
				if err := sh.Binary(mk(out), mk(c.a), mk(c.b), op); err != nil {
					t.Errorf("shapes backend refuses: %v", err)
				}
				if err := sh.Binary(mk(append([]int{7}, out...)), mk(c.a), mk(c.b), op); err == nil {
					t.Error("shapes backend accepts a wrong output shape")
				}
			})
		}
	}
	if _, err := BroadcastShape([]int{2, 3}, []int{4, 3, 2}); err == nil {
		t.Error("(2, 3) and (4, 3, 2) broadcast")
	}
	cpu := NewCPU(1)
	x, _ := cpu.Alloc([]int{2, 3}, Float32)
	z, _ := cpu.Alloc([]int{3, 2}, Float32)
	if err := cpu.(Broadcasting).Binary(x, x, z, BinaryMul); err == nil {
		t.Error("cpu multiplies (2, 3) by (3, 2)")
	}
}

// naiveBinary computes y = a op b and the gradients of a and b from dy with
// explicit multi-indices, in float64.
func naiveBinary(out, as, bs []int, a, b, dy []float32, op BinaryOp) (y, da, db []float64) {
	y, da, db = make([]float64, numel(out)), make([]float64, numel(as)), make([]float64, numel(bs))
	at := func(shape, idx []int) int {
		off, k := 0, len(idx)-len(shape)
		for d, n := range shape {
			i := idx[k+d]
			if n == 1 {
				i = 0
			}
			off = off*n + i
		}
		return off
	}
	idx := make([]int, len(out))
	for o := range y {
		r := o
		for d := len(out) - 1; d >= 0; d-- {
			idx[d] = r % out[d]
			r /= out[d]
		}
		i, j := at(as, idx), at(bs, idx)
		x1, x2, g := float64(a[i]), float64(b[j]), float64(dy[o])
		switch op {
		case BinaryAdd:
			y[o], da[i], db[j] = x1+x2, da[i]+g, db[j]+g
		case BinarySub:
			y[o], da[i], db[j] = x1-x2, da[i]+g, db[j]-g
		case BinaryMul:
			y[o], da[i], db[j] = x1*x2, da[i]+g*x2, db[j]+g*x1
		case BinaryDiv:
			y[o], da[i], db[j] = x1/x2, da[i]+g/x2, db[j]-g*x1/(x2*x2)
		}
	}
	return y, da, db
}
