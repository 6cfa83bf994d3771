package cuda

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/runtime"
)

// mk allocates tensors on one backend, filled with values drawn from a
// fixed seed (the same values on every backend that runs the same case).
type mk struct {
	t *testing.T
	b runtime.Backend
	r *rand.Rand
	// made lists every tensor allocated, for comparing backends.
	made []runtime.Tensor
}

func newMk(t *testing.T, b runtime.Backend) *mk {
	return &mk{t: t, b: b, r: rand.New(rand.NewPCG(7, 11))}
}

func (m *mk) f(shape ...int) runtime.Tensor {
	m.t.Helper()
	x, err := m.b.Alloc(shape, runtime.Float32)
	if err != nil {
		m.t.Fatal(err)
	}
	m.made = append(m.made, x)
	v := make([]float32, numel(shape))
	for i := range v {
		v[i] = float32(m.r.NormFloat64())
	}
	if m.b.Executes() {
		if err := m.b.Upload(x, v); err != nil {
			m.t.Fatal(err)
		}
	}
	return x
}

// wide is f with values about N(0, 4²): past the kinks of ReLU6, Hardswish
// and Hardsigmoid at ±3 and 6.
func (m *mk) wide(shape ...int) runtime.Tensor {
	m.t.Helper()
	x := m.f(shape...)
	v := make([]float32, numel(shape))
	for i := range v {
		v[i] = 4 * float32(m.r.NormFloat64())
	}
	if err := m.b.Upload(x, v); err != nil {
		m.t.Fatal(err)
	}
	return x
}

// bc is the backend's broadcasting ops (the CPU and CUDA backends have them).
func (m *mk) bc() runtime.Broadcasting {
	m.t.Helper()
	bb, ok := m.b.(runtime.Broadcasting)
	if !ok {
		m.t.Fatalf("backend %s has no broadcasting ops", m.b.Name())
	}
	return bb
}

// pos is f with positive values (variances).
func (m *mk) pos(shape ...int) runtime.Tensor {
	m.t.Helper()
	x := m.f(shape...)
	v := make([]float32, numel(shape))
	for i := range v {
		v[i] = 0.25 + m.r.Float32()
	}
	if err := m.b.Upload(x, v); err != nil {
		m.t.Fatal(err)
	}
	return x
}

// sign is a ±1 vector.
func (m *mk) sign(c int) runtime.Tensor {
	m.t.Helper()
	x := m.f(c)
	v := make([]float32, c)
	for i := range v {
		v[i] = 1
		if m.r.IntN(2) == 0 {
			v[i] = -1
		}
	}
	if err := m.b.Upload(x, v); err != nil {
		m.t.Fatal(err)
	}
	return x
}

func (m *mk) i(shape ...int) runtime.Tensor {
	m.t.Helper()
	x, err := m.b.Alloc(shape, runtime.Int64)
	if err != nil {
		m.t.Fatal(err)
	}
	m.made = append(m.made, x)
	if err := m.b.Upload(x, make([]float32, numel(shape))); err != nil {
		m.t.Fatal(err)
	}
	return x
}

var (
	leaky = runtime.Act{Kind: runtime.ActLeakyReLU, Param: 0.01}
	elu   = runtime.Act{Kind: runtime.ActELU, Param: 1}
	conv3 = runtime.ConvParams{Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, Dilation: [2]int{1, 1}, Groups: 1}
	conv1 = runtime.ConvParams{Stride: [2]int{1, 1}, Dilation: [2]int{1, 1}, Groups: 1}
	// A strided, dilated, grouped, asymmetric one.
	convOdd = runtime.ConvParams{Stride: [2]int{2, 1}, Padding: [2]int{2, 0}, Dilation: [2]int{2, 1}, Groups: 2}
	pool3   = runtime.PoolParams{Kernel: [2]int{3, 3}, Stride: [2]int{2, 2}, Padding: [2]int{1, 1}}
	poolAvg = runtime.PoolParams{Kernel: [2]int{3, 2}, Stride: [2]int{2, 2}, Padding: [2]int{1, 0}, CeilMode: true}
	nLeaky  = runtime.NormParams{Eps: 1e-5, AbsWeight: true, Act: leaky}
	nPlain  = runtime.NormParams{Eps: 1e-5}
	// The activations InPlace-ABN cannot invert, with torch's parameters.
	relu6       = runtime.Act{Kind: runtime.ActHardtanh, Param: 0, Param2: 6}
	hardtanh    = runtime.Act{Kind: runtime.ActHardtanh, Param: -1, Param2: 1}
	sigmoid     = runtime.Act{Kind: runtime.ActSigmoid}
	silu        = runtime.Act{Kind: runtime.ActSiLU}
	hardsigmoid = runtime.Act{Kind: runtime.ActHardsigmoid, Param: 1.0 / 6, Param2: 0.5}
	hardswish   = runtime.Act{Kind: runtime.ActHardswish}
	gelu        = runtime.Act{Kind: runtime.ActGELU}
)

// smoothCases are forward and backward of every activation InPlace-ABN
// cannot invert, on shapes with a tail past the last float4 and without,
// in place and not. Sigmoid's backward reads its output, the others' their
// input (wide values, across every kink).
func smoothCases() []opCase {
	var out []opCase
	for _, c := range []struct {
		name string
		act  runtime.Act
	}{{"relu6", relu6}, {"hardtanh(-1, 1)", hardtanh}, {"sigmoid", sigmoid}, {"silu", silu},
		{"hardsigmoid", hardsigmoid}, {"hardswish", hardswish}, {"gelu", gelu}} {
		act := c.act
		out = append(out,
			opCase{c.name, func(m *mk) error { return m.b.Activation(m.f(3, 4, 7), m.wide(3, 4, 7), act) }, "ew_act"},
			opCase{c.name + " in place, float4", func(m *mk) error {
				x := m.wide(2, 8, 4, 4)
				return m.b.Activation(x, x, act)
			}, "ew_act"},
			opCase{c.name + " backward", func(m *mk) error {
				saved := m.wide(3, 5, 7)
				if act.Kind == runtime.ActSigmoid {
					saved = m.pos(3, 5, 7) // an output, in (0, 1) up to 0.25
				}
				return m.b.ActivationBackward(m.f(3, 5, 7), m.f(3, 5, 7), saved, act, act.Kind == runtime.ActSigmoid)
			}, "ew_act_bwd"},
			opCase{c.name + " backward in place, float4", func(m *mk) error {
				g := m.f(2, 8, 4, 4)
				return m.b.ActivationBackward(g, g, m.wide(2, 8, 4, 4), act, false)
			}, "ew_act_bwd"},
		)
	}
	return out
}

// broadcastCases are every binary op, forward and backward, on operand
// shapes broadcast on either side, on both, at lower rank, to a scalar and
// not at all. The kernels: a sum per broadcast operand's gradient, then
// one elementwise pass for the others.
func broadcastCases() []opCase {
	var out []opCase
	for _, c := range []struct {
		a, b []int
		bwd  string
	}{
		{[]int{2, 8, 4, 4}, []int{2, 8, 1, 1}, "bc_binary_sum bc_binary_bwd"}, // squeeze-and-excitation
		{[]int{2, 3, 1, 1}, []int{2, 3, 4, 5}, "bc_binary_sum bc_binary_bwd"},
		{[]int{2, 3, 4, 5}, []int{3, 1, 1}, "bc_binary_sum bc_binary_bwd"},
		{[]int{2, 1, 4, 1}, []int{1, 3, 1, 5}, "bc_binary_sum bc_binary_sum"},
		{[]int{2, 3, 4, 5}, []int{5}, "bc_binary_sum bc_binary_bwd"},
		{[]int{3, 1, 5}, []int{2, 3, 4, 1}, "bc_binary_sum bc_binary_sum"},
		{[]int{2, 3, 4, 5}, []int{2, 3, 4, 5}, "bc_binary_bwd"},
		{[]int{4, 1}, []int{}, "bc_binary_sum bc_binary_bwd"},
	} {
		ys, err := runtime.BroadcastShape(c.a, c.b)
		if err != nil {
			panic(err)
		}
		for _, op := range []runtime.BinaryOp{runtime.BinaryAdd, runtime.BinarySub, runtime.BinaryMul, runtime.BinaryDiv} {
			name := fmt.Sprintf("%s %v %v", op, c.a, c.b)
			out = append(out,
				opCase{name, func(m *mk) error { return m.bc().Binary(m.f(ys...), m.f(c.a...), m.pos(c.b...), op) }, "bc_binary"},
				opCase{name + " backward", func(m *mk) error {
					da, db, dy := m.f(c.a...), m.f(c.b...), m.f(ys...)
					var a, b runtime.Tensor
					if op == runtime.BinaryMul || op == runtime.BinaryDiv {
						a, b = m.f(c.a...), m.pos(c.b...)
					}
					return m.bc().BinaryBackward(da, db, dy, a, b, op)
				}, c.bwd},
			)
		}
	}
	return out
}

// layoutOps are the optional layout ops, which the CPU and CUDA backends
// have; a case on a backend without them skips.
type layoutOps = runtime.Layout

var errNoLayout = errors.New("backend without the layout ops")

// lay is the backend's layout ops, checked before a case allocates, so that
// both backends make the same tensors.
func (m *mk) lay() (layoutOps, error) {
	l, ok := m.b.(layoutOps)
	if !ok {
		return nil, fmt.Errorf("%s: %w", m.b.Name(), errNoLayout)
	}
	return l, nil
}

// layoutCases: Transpose (channel shuffle, NCHW to NHWC, a matrix), the
// boxes of Slice, Pad (its fill is a memset, no kernel), Concat along any
// axis and their accumulating backward, and Resize, nearest and bilinear
// with and without align_corners, up, down and by ratios that are not
// integers, forward and backward.
func layoutCases() []opCase {
	l := func(f func(l layoutOps, m *mk) error) func(m *mk) error {
		return func(m *mk) error {
			lo, err := m.lay()
			if err != nil {
				return err
			}
			return f(lo, m)
		}
	}
	out := []opCase{
		{"fill", l(func(lo layoutOps, m *mk) error { return lo.Fill(m.f(3, 5), 1.5) }), ""},
		{"permute, channel shuffle", l(func(lo layoutOps, m *mk) error {
			return lo.Permute(m.f(2, 4, 2, 3, 3), m.f(2, 2, 4, 3, 3), []int{0, 2, 1, 3, 4})
		}), "lay_copy"},
		{"permute NCHW to NHWC", l(func(lo layoutOps, m *mk) error {
			return lo.Permute(m.f(2, 3, 4, 5), m.f(2, 5, 3, 4), []int{0, 2, 3, 1})
		}), "lay_copy"},
		{"permute a matrix", l(func(lo layoutOps, m *mk) error { return lo.Permute(m.f(7, 3), m.f(3, 7), []int{1, 0}) }), "lay_copy"},
		{"copy box, slice of channels", l(func(lo layoutOps, m *mk) error {
			return lo.CopyBox(m.f(2, 3, 4, 5), m.f(2, 8, 4, 5), []int{0, 0, 0, 0}, []int{0, 2, 0, 0}, []int{2, 3, 4, 5}, false)
		}), "lay_copy"},
		{"copy box, padded", l(func(lo layoutOps, m *mk) error {
			return lo.CopyBox(m.f(2, 3, 7, 8), m.f(2, 3, 4, 5), []int{0, 0, 1, 2}, []int{0, 0, 0, 0}, []int{2, 3, 4, 5}, false)
		}), "lay_copy"},
		{"copy box, accumulated", l(func(lo layoutOps, m *mk) error {
			return lo.CopyBox(m.f(2, 3, 4, 5), m.f(2, 3, 7, 8), []int{0, 0, 0, 0}, []int{0, 0, 1, 2}, []int{2, 3, 4, 5}, true)
		}), "lay_copy"},
		{"copy box, concat along rows, rank 3", l(func(lo layoutOps, m *mk) error {
			return lo.CopyBox(m.f(3, 9, 4), m.f(3, 2, 4), []int{0, 5, 0}, []int{0, 0, 0}, []int{3, 2, 4}, false)
		}), "lay_copy"},
		{"copy box, empty", l(func(lo layoutOps, m *mk) error {
			return lo.CopyBox(m.f(3, 9, 4), m.f(3, 2, 4), []int{0, 5, 0}, []int{0, 0, 0}, []int{3, 0, 4}, false)
		}), ""},
	}
	for _, c := range []struct {
		name     string
		x, y     []int
		bilinear bool
		align    bool
		scale    [2]float64
	}{
		{"nearest up", []int{2, 3, 4, 5}, []int{2, 3, 8, 10}, false, false, [2]float64{}},
		{"nearest down", []int{2, 3, 7, 5}, []int{2, 3, 3, 2}, false, false, [2]float64{}},
		{"bilinear up", []int{2, 3, 3, 4}, []int{2, 3, 7, 9}, true, false, [2]float64{}},
		{"bilinear up, align corners", []int{2, 3, 3, 4}, []int{2, 3, 7, 9}, true, true, [2]float64{}},
		{"bilinear down", []int{2, 3, 9, 7}, []int{2, 3, 4, 3}, true, false, [2]float64{}},
		{"bilinear 1x1, align corners", []int{2, 3, 3, 4}, []int{2, 3, 1, 1}, true, true, [2]float64{}},
		// By a scale factor: torch steps by 1/scale, and nearest_idx's
		// special cases (5 by 2.1 is 10) apply backward, and forward for
		// one channel.
		{"nearest by 1.5x0.6", []int{2, 3, 5, 7}, []int{2, 3, 7, 4}, false, false, [2]float64{1.5, 0.6}},
		{"nearest by 2.1", []int{2, 3, 5, 4}, []int{2, 3, 10, 8}, false, false, [2]float64{2.1, 2.1}},
		{"nearest by 2.1, one channel", []int{2, 1, 5, 4}, []int{2, 1, 10, 8}, false, false, [2]float64{2.1, 2.1}},
		{"bilinear by 1.5", []int{2, 3, 5, 7}, []int{2, 3, 7, 10}, true, false, [2]float64{1.5, 1.5}},
		{"bilinear by 0.5", []int{2, 3, 5, 7}, []int{2, 3, 2, 3}, true, false, [2]float64{0.5, 0.5}},
		{"bilinear by 1.5, align corners", []int{2, 3, 5, 7}, []int{2, 3, 7, 10}, true, true, [2]float64{1.5, 1.5}},
	} {
		how := runtime.Interp{Bilinear: c.bilinear, AlignCorners: c.align, Scale: c.scale}
		out = append(out,
			opCase{"resize " + c.name, l(func(lo layoutOps, m *mk) error {
				return lo.Resize(m.f(c.y...), m.f(c.x...), how)
			}), "lay_resize"},
			opCase{"resize " + c.name + " backward", l(func(lo layoutOps, m *mk) error {
				return lo.ResizeBackward(m.f(c.x...), m.f(c.y...), how)
			}), "lay_resize_bwd"})
	}
	return out
}

func init() {
	opCases = append(append(append(opCases, smoothCases()...), broadcastCases()...), layoutCases()...)
}

// opCase is one backend call. ops lists the kernels the CUDA backend
// launches for it, in order.
type opCase struct {
	name string
	run  func(m *mk) error
	ops  string
}

// opCases covers every op of runtime.Backend, on shapes with float4-able
// planes and without, strided and grouped convolutions, the sign vector,
// nil weights, biases and outputs. The emulator tests run the same cases
// and compare values with the CPU backend.
var opCases = []opCase{
	{"copy", func(m *mk) error { return m.b.Copy(m.f(2, 3, 5), m.f(2, 3, 5)) }, ""},
	{"sum of three", func(m *mk) error { return m.b.Sum(m.f(2, 3, 5, 5), m.f(2, 3, 5, 5), m.f(2, 3, 5, 5), m.f(2, 3, 5, 5)) }, "ew_add ew_acc"},
	{"sum of two, float4", func(m *mk) error { return m.b.Sum(m.f(2, 8, 4, 4), m.f(2, 8, 4, 4), m.f(2, 8, 4, 4)) }, "ew_add"},
	{"sum of one", func(m *mk) error { return m.b.Sum(m.f(7), m.f(7)) }, ""},
	{"accumulate", func(m *mk) error { return m.b.Accumulate(m.f(1031), m.f(1031)) }, "ew_acc"},
	{"mul", func(m *mk) error { return m.b.Mul(m.f(2, 3, 3), m.f(2, 3, 3), m.f(2, 3, 3)) }, "ew_mul"},
	{"leaky relu", func(m *mk) error { return m.b.Activation(m.f(3, 4, 7), m.f(3, 4, 7), leaky) }, "ew_act"},
	{"relu in place", func(m *mk) error {
		x := m.f(2, 16, 4, 4)
		return m.b.Activation(x, x, runtime.Act{Kind: runtime.ActReLU})
	}, "ew_act"},
	{"elu", func(m *mk) error { return m.b.Activation(m.f(9), m.f(9), elu) }, "ew_act"},
	{"relu backward", func(m *mk) error {
		return m.b.ActivationBackward(m.f(2, 5, 3), m.f(2, 5, 3), m.f(2, 5, 3), runtime.Act{Kind: runtime.ActReLU}, false)
	}, "ew_act_bwd"},
	{"elu backward from output", func(m *mk) error { return m.b.ActivationBackward(m.f(4, 8), m.f(4, 8), m.f(4, 8), elu, true) }, "ew_act_bwd"},
	{"elu backward from input", func(m *mk) error { return m.b.ActivationBackward(m.f(4, 9), m.f(4, 9), m.f(4, 9), elu, false) }, "ew_act_bwd"},
	{"leaky backward in place", func(m *mk) error {
		g := m.f(2, 8, 4, 4)
		return m.b.ActivationBackward(g, g, m.f(2, 8, 4, 4), leaky, true)
	}, "ew_act_bwd"},
	{"dropout", func(m *mk) error { return m.b.DropoutMask(m.f(3, 1001), 0.3, 12345) }, "ew_dropout"},
	{"dropout p=1", func(m *mk) error { return m.b.DropoutMask(m.f(3, 11), 1, 1) }, ""},
	{"concat", func(m *mk) error { return m.b.Concat(m.f(2, 8, 4, 4), m.f(2, 3, 4, 4), m.f(2, 5, 4, 4)) }, "ew_slices ew_slices"},
	{"concat, odd planes", func(m *mk) error {
		return m.b.Concat(m.f(3, 7, 3, 3), m.f(3, 3, 3, 3), m.f(3, 1, 3, 3), m.f(3, 3, 3, 3))
	}, "ew_slices ew_slices ew_slices"},
	{"split", func(m *mk) error { return m.b.Split(m.f(2, 8, 4, 4), m.f(2, 3, 4, 4), m.f(2, 5, 4, 4)) }, "ew_slices ew_slices"},
	{"conv 3x3 with bias", func(m *mk) error { return m.b.Conv2d(m.f(2, 5, 6, 7), m.f(2, 3, 6, 7), m.f(5, 3, 3, 3), m.f(5), conv3) }, "im2col sgemm bias_add"},
	{"conv 1x1", func(m *mk) error { return m.b.Conv2d(m.f(2, 4, 5, 5), m.f(2, 6, 5, 5), m.f(4, 6, 1, 1), nil, conv1) }, "sgemm"},
	{"conv grouped, strided, dilated", func(m *mk) error {
		return m.b.Conv2d(m.f(2, 6, 5, 7), m.f(2, 4, 9, 8), m.f(6, 2, 3, 2), nil, convOdd)
	}, "im2col sgemm im2col sgemm"},
	{"conv backward", func(m *mk) error {
		return m.b.Conv2dBackward(m.f(2, 3, 6, 7), m.f(5, 3, 3, 3), m.f(5), m.f(2, 5, 6, 7), m.f(2, 3, 6, 7), m.f(5, 3, 3, 3), conv3)
	}, "chan_sum im2col sgemm batch_sum sgemm col2im"},
	{"conv backward grouped", func(m *mk) error {
		return m.b.Conv2dBackward(m.f(2, 4, 9, 8), m.f(6, 2, 3, 2), nil, m.f(2, 6, 5, 7), m.f(2, 4, 9, 8), m.f(6, 2, 3, 2), convOdd)
	}, "im2col sgemm batch_sum sgemm col2im im2col sgemm batch_sum sgemm col2im"},
	{"conv backward 1x1", func(m *mk) error {
		return m.b.Conv2dBackward(m.f(2, 6, 5, 5), m.f(4, 6, 1, 1), nil, m.f(2, 4, 5, 5), m.f(2, 6, 5, 5), m.f(4, 6, 1, 1), conv1)
	}, "sgemm batch_sum sgemm"},
	{"conv backward, input gradient only", func(m *mk) error {
		return m.b.Conv2dBackward(m.f(2, 3, 6, 7), nil, nil, m.f(2, 5, 6, 7), m.f(2, 3, 6, 7), m.f(5, 3, 3, 3), conv3)
	}, "sgemm col2im"},
	{"linear", func(m *mk) error { return m.b.Linear(m.f(3, 10), m.f(3, 70), m.f(10, 70), m.f(10)) }, "sgemm bias_add"},
	{"linear backward", func(m *mk) error {
		return m.b.LinearBackward(m.f(3, 70), m.f(10, 70), m.f(10), m.f(3, 10), m.f(3, 70), m.f(10, 70))
	}, "sgemm sgemm chan_sum"},
	{"batch stats", func(m *mk) error { return m.b.BatchStats(m.f(6), m.f(6), m.f(3, 6, 5, 4), nil) }, "bn_stats bn_stats_final"},
	{"batch stats, sign, odd planes", func(m *mk) error { return m.b.BatchStats(m.f(6), m.f(6), m.f(3, 6, 5, 3), m.sign(6)) }, "bn_stats bn_stats_final"},
	{"update running", func(m *mk) error { return m.b.UpdateRunning(m.f(6), m.pos(6), m.f(6), m.pos(6), 0.1, 60) }, "bn_update_running"},
	{"normalize", func(m *mk) error {
		return m.b.Normalize(m.f(2, 6, 4, 4), m.f(2, 6, 4, 4), nil, m.f(6), m.pos(6), m.f(6), m.f(6), nPlain)
	}, "bn_coeffs bn_apply"},
	{"inplace abn forward", func(m *mk) error {
		x := m.f(2, 6, 3, 5)
		return m.b.Normalize(x, x, m.sign(6), m.f(6), m.pos(6), m.f(6), m.f(6), nLeaky)
	}, "bn_coeffs bn_apply"},
	{"normalize without affine", func(m *mk) error {
		return m.b.Normalize(m.f(2, 6, 4, 4), m.f(2, 6, 4, 4), nil, m.f(6), m.pos(6), nil, nil, runtime.NormParams{Eps: 1e-3, Act: runtime.Act{Kind: runtime.ActReLU}})
	}, "bn_coeffs bn_apply"},
	{"normalize backward, training", func(m *mk) error {
		return m.b.NormalizeBackward(m.f(2, 6, 4, 4), m.f(6), m.f(6), m.f(2, 6, 4, 4), m.f(2, 6, 4, 4), nil, m.f(6), m.pos(6), m.f(6), nPlain, true)
	}, "bn_bwd_reduce bn_bwd_final bn_bwd_apply"},
	{"normalize backward, eval, sign, abs weight", func(m *mk) error {
		return m.b.NormalizeBackward(m.f(2, 6, 5, 3), m.f(6), m.f(6), m.f(2, 6, 5, 3), m.f(2, 6, 5, 3), m.sign(6), m.f(6), m.pos(6), m.f(6),
			runtime.NormParams{Eps: 1e-5, AbsWeight: true}, false)
	}, "bn_bwd_reduce bn_bwd_final bn_bwd_apply"},
	{"normalize backward, parameters only", func(m *mk) error {
		return m.b.NormalizeBackward(nil, m.f(6), m.f(6), m.f(2, 6, 4, 4), m.f(2, 6, 4, 4), nil, m.f(6), m.pos(6), m.f(6), nPlain, true)
	}, "bn_bwd_reduce bn_bwd_final"},
	{"inplace abn backward", func(m *mk) error {
		dz := m.f(2, 6, 4, 4)
		return m.b.NormalizeBackwardFromOutput(dz, m.f(6), m.f(6), dz, m.f(2, 6, 4, 4), m.sign(6), m.pos(6), m.f(6), m.f(6), nLeaky, true)
	}, "bn_bwd_reduce bn_bwd_final bn_bwd_apply"},
	{"inplace abn backward, elu, odd planes, eval", func(m *mk) error {
		return m.b.NormalizeBackwardFromOutput(m.f(3, 6, 3, 3), m.f(6), m.f(6), m.f(3, 6, 3, 3), m.f(3, 6, 3, 3), nil, m.pos(6), m.f(6), nil,
			runtime.NormParams{Eps: 1e-5, AbsWeight: true, Act: elu}, false)
	}, "bn_bwd_reduce bn_bwd_final bn_bwd_apply"},
	// BatchNorm1d's (N, C): planes of one value.
	{"batch stats (N, C)", func(m *mk) error { return m.b.BatchStats(m.f(6), m.f(6), m.f(5, 6), nil) }, "bn_stats bn_stats_final"},
	{"normalize (N, C)", func(m *mk) error {
		return m.b.Normalize(m.f(5, 6), m.f(5, 6), nil, m.f(6), m.pos(6), m.f(6), m.f(6), nPlain)
	}, "bn_coeffs bn_apply"},
	{"normalize backward (N, C), training", func(m *mk) error {
		return m.b.NormalizeBackward(m.f(5, 6), m.f(6), m.f(6), m.f(5, 6), m.f(5, 6), nil, m.f(6), m.pos(6), m.f(6), nPlain, true)
	}, "bn_bwd_reduce bn_bwd_final bn_bwd_apply"},
	{"inplace abn backward (N, C)", func(m *mk) error {
		return m.b.NormalizeBackwardFromOutput(m.f(5, 6), m.f(6), m.f(6), m.f(5, 6), m.f(5, 6), m.sign(6), m.pos(6), m.f(6), m.f(6), nLeaky, true)
	}, "bn_bwd_reduce bn_bwd_final bn_bwd_apply"},
	{"max pool", func(m *mk) error { return m.b.MaxPool(m.f(2, 3, 4, 5), m.i(2, 3, 4, 5), m.f(2, 3, 7, 9), pool3) }, "maxpool"},
	{"max pool without indices", func(m *mk) error { return m.b.MaxPool(m.f(2, 3, 4, 5), nil, m.f(2, 3, 7, 9), pool3) }, "maxpool"},
	{"max pool backward", func(m *mk) error {
		idx := m.i(2, 3, 4, 5)
		if err := m.b.MaxPool(m.f(2, 3, 4, 5), idx, m.f(2, 3, 7, 9), pool3); err != nil {
			return err
		}
		return m.b.MaxPoolBackward(m.f(2, 3, 7, 9), m.f(2, 3, 4, 5), idx)
	}, "maxpool maxpool_bwd"},
	{"avg pool", func(m *mk) error { return m.b.AvgPool(m.f(2, 3, 5, 4), m.f(2, 3, 8, 7), poolAvg) }, "avgpool"},
	{"avg pool backward", func(m *mk) error { return m.b.AvgPoolBackward(m.f(2, 3, 8, 7), m.f(2, 3, 5, 4), poolAvg) }, "avgpool_bwd"},
	{"avg pool with pad counted", func(m *mk) error {
		p := poolAvg
		p.CountIncludePad = true
		return m.b.AvgPool(m.f(2, 3, 5, 4), m.f(2, 3, 8, 7), p)
	}, "avgpool"},
	{"adaptive pool", func(m *mk) error { return m.b.AdaptiveAvgPool(m.f(2, 3, 3, 2), m.f(2, 3, 7, 5)) }, "adaptive_pool"},
	{"adaptive pool up", func(m *mk) error { return m.b.AdaptiveAvgPool(m.f(2, 3, 5, 4), m.f(2, 3, 3, 2)) }, "adaptive_pool"},
	{"adaptive pool backward", func(m *mk) error { return m.b.AdaptiveAvgPoolBackward(m.f(2, 3, 7, 5), m.f(2, 3, 3, 2)) }, "adaptive_pool_bwd"},
	{"global pool backward", func(m *mk) error { return m.b.AdaptiveAvgPoolBackward(m.f(2, 3, 7, 5), m.f(2, 3, 1, 1)) }, "adaptive_pool_bwd"},
}

// TestOpsLaunch runs every case on the fake device: each returns no error
// and launches the kernels it should, each launch checked by the fake.
func TestOpsLaunch(t *testing.T) {
	for _, c := range opCases {
		t.Run(c.name, func(t *testing.T) {
			b, dev := newFakeBackend(t)
			m := newMk(t, b)
			dev.reset()
			if err := c.run(m); err != nil {
				t.Fatal(err)
			}
			if got := strings.Join(dev.names(), " "); got != c.ops {
				t.Errorf("launched %q, want %q", got, c.ops)
			}
		})
	}
}

// TestOpErrors: calls the CPU backend refuses, the CUDA backend refuses
// too, with an error rather than a launch.
func TestOpErrors(t *testing.T) {
	cases := []struct {
		name string
		run  func(m *mk) error
	}{
		{"copy lengths", func(m *mk) error { return m.b.Copy(m.f(3), m.f(4)) }},
		{"accumulate lengths", func(m *mk) error { return m.b.Accumulate(m.f(3), m.f(4)) }},
		{"activation lengths", func(m *mk) error { return m.b.Activation(m.f(3), m.f(4), leaky) }},
		{"conv output size", func(m *mk) error { return m.b.Conv2d(m.f(2, 5, 5, 7), m.f(2, 3, 6, 7), m.f(5, 3, 3, 3), nil, conv3) }},
		{"conv groups", func(m *mk) error {
			p := conv3
			p.Groups = 2
			return m.b.Conv2d(m.f(2, 5, 6, 7), m.f(2, 3, 6, 7), m.f(5, 3, 3, 3), nil, p)
		}},
		{"conv bias", func(m *mk) error { return m.b.Conv2d(m.f(2, 5, 6, 7), m.f(2, 3, 6, 7), m.f(5, 3, 3, 3), m.f(4), conv3) }},
		{"conv backward gradient shape", func(m *mk) error {
			return m.b.Conv2dBackward(m.f(2, 3, 6, 6), nil, nil, m.f(2, 5, 6, 7), m.f(2, 3, 6, 7), m.f(5, 3, 3, 3), conv3)
		}},
		{"linear shapes", func(m *mk) error { return m.b.Linear(m.f(3, 10), m.f(3, 70), m.f(10, 71), nil) }},
		{"linear bias", func(m *mk) error { return m.b.Linear(m.f(3, 10), m.f(3, 70), m.f(10, 70), m.f(9)) }},
		{"normalize vector length", func(m *mk) error {
			return m.b.Normalize(m.f(2, 6, 4, 4), m.f(2, 6, 4, 4), nil, m.f(5), m.pos(6), nil, nil, nPlain)
		}},
		{"normalize without channels", func(m *mk) error { return m.b.BatchStats(m.f(1), m.f(1), m.f(6), nil) }},
		{"running variance from one value", func(m *mk) error { return m.b.UpdateRunning(m.f(6), m.f(6), m.f(6), m.f(6), 0.1, 1) }},
		{"backward from input with an activation", func(m *mk) error {
			return m.b.NormalizeBackward(m.f(2, 6, 4, 4), nil, nil, m.f(2, 6, 4, 4), m.f(2, 6, 4, 4), nil, m.f(6), m.pos(6), nil, nLeaky, true)
		}},
		{"inplace abn backward through relu", func(m *mk) error {
			return m.b.NormalizeBackwardFromOutput(m.f(2, 6, 4, 4), nil, nil, m.f(2, 6, 4, 4), m.f(2, 6, 4, 4), nil, m.pos(6), nil, nil,
				runtime.NormParams{Eps: 1e-5, Act: runtime.Act{Kind: runtime.ActReLU}}, true)
		}},
		{"inplace abn backward, slope 0", func(m *mk) error {
			return m.b.NormalizeBackwardFromOutput(m.f(2, 6, 4, 4), nil, nil, m.f(2, 6, 4, 4), m.f(2, 6, 4, 4), nil, m.pos(6), nil, nil,
				runtime.NormParams{Eps: 1e-5, Act: runtime.Act{Kind: runtime.ActLeakyReLU}}, true)
		}},
		{"max pool index type", func(m *mk) error { return m.b.MaxPool(m.f(2, 3, 4, 5), m.f(2, 3, 4, 5), m.f(2, 3, 7, 9), pool3) }},
		{"max pool backward index count", func(m *mk) error { return m.b.MaxPoolBackward(m.f(2, 3, 7, 9), m.f(2, 3, 4, 5), m.i(2, 3, 4, 4)) }},
		{"pool of 3-d tensors", func(m *mk) error { return m.b.AvgPool(m.f(3, 4, 5), m.f(3, 8, 7), poolAvg) }},
		{"pool planes", func(m *mk) error { return m.b.AdaptiveAvgPool(m.f(2, 4, 1, 1), m.f(2, 3, 7, 5)) }},
		{"concat channels", func(m *mk) error { return m.b.Concat(m.f(2, 9, 4, 4), m.f(2, 3, 4, 4), m.f(2, 5, 4, 4)) }},
		{"concat planes", func(m *mk) error { return m.b.Concat(m.f(2, 8, 4, 4), m.f(2, 3, 4, 4), m.f(2, 5, 4, 3)) }},
		{"float32 op on int64", func(m *mk) error { return m.b.Activation(m.i(4), m.i(4), leaky) }},
		{"binary shapes", func(m *mk) error { return m.bc().Binary(m.f(2, 3), m.f(2, 3), m.f(3, 2), runtime.BinaryMul) }},
		{"binary output shape", func(m *mk) error { return m.bc().Binary(m.f(7, 2, 3), m.f(2, 3), m.f(3), runtime.BinaryAdd) }},
		{"mul backward without operands", func(m *mk) error {
			return m.bc().BinaryBackward(m.f(2, 3), m.f(3), m.f(2, 3), nil, nil, runtime.BinaryMul)
		}},
		{"div backward operand shapes", func(m *mk) error {
			return m.bc().BinaryBackward(m.f(2, 3), m.f(3), m.f(2, 3), m.f(2, 3), m.f(2, 3), runtime.BinaryDiv)
		}},
		{"binary backward gradient shapes", func(m *mk) error {
			return m.bc().BinaryBackward(m.f(2, 3), m.f(4), m.f(2, 3), nil, nil, runtime.BinaryAdd)
		}},
		{"binary backward nil gradient", func(m *mk) error {
			return m.bc().BinaryBackward(m.f(2, 3), nil, m.f(2, 3), nil, nil, runtime.BinarySub)
		}},
	}
	// Calls the CPU backend panics on rather than refusing (runtime's
	// planes() slices shape[2:] of a 1-d shape): not run there.
	cpuPanics := map[string]bool{"normalize without channels": true}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if cpuPanics[c.name] {
				// Not run on the CPU backend.
			} else if err := c.run(newMk(t, runtime.NewCPU(1))); err == nil {
				t.Fatalf("the CPU backend accepts it: fix the case")
			}
			b, dev := newFakeBackend(t)
			m := newMk(t, b)
			dev.reset()
			err := c.run(m)
			if err == nil {
				t.Fatal("accepted")
			}
			if n := len(dev.names()); n > 0 {
				t.Errorf("%v, after launching %v", err, dev.names())
			}
		})
	}
}

// TestCUDARefuses: what the CUDA backend refuses and the CPU backend runs,
// before any launch: an activation kind the kernels do not know (the CPU
// backend copies it), a smooth activation inside a batch norm (bn_apply
// computes InPlace-ABN's alone; the runtime puts them after an identity
// one), and broadcasts that alternate along more than four dimensions.
func TestCUDARefuses(t *testing.T) {
	cases := []struct {
		name string
		run  func(m *mk) error
	}{
		{"unknown activation", func(m *mk) error { return m.b.Activation(m.f(8), m.f(8), runtime.Act{Kind: runtime.ActGELU + 1}) }},
		{"unknown activation backward", func(m *mk) error {
			return m.b.ActivationBackward(m.f(8), m.f(8), m.f(8), runtime.Act{Kind: runtime.ActGELU + 1}, false)
		}},
		{"normalize with silu", func(m *mk) error {
			return m.b.Normalize(m.f(2, 6, 4, 4), m.f(2, 6, 4, 4), nil, m.f(6), m.pos(6), m.f(6), m.f(6), runtime.NormParams{Eps: 1e-5, Act: silu})
		}},
		{"inplace abn backward through hardsigmoid", func(m *mk) error {
			return m.b.NormalizeBackwardFromOutput(m.f(2, 6, 4, 4), nil, nil, m.f(2, 6, 4, 4), m.f(2, 6, 4, 4), nil, m.pos(6), nil, nil,
				runtime.NormParams{Eps: 1e-5, Act: hardsigmoid}, true)
		}},
		{"five alternating dimensions", func(m *mk) error {
			return m.bc().Binary(m.f(2, 3, 2, 3, 2), m.f(2, 1, 2, 1, 2), m.f(1, 3, 1, 3, 1), runtime.BinaryMul)
		}},
		{"five alternating dimensions, backward", func(m *mk) error {
			return m.bc().BinaryBackward(m.f(2, 1, 2, 1, 2), m.f(1, 3, 1, 3, 1), m.f(2, 3, 2, 3, 2), nil, nil, runtime.BinaryAdd)
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if err := c.run(newMk(t, runtime.NewCPU(1))); err != nil {
				t.Fatalf("the CPU backend refuses it too (%v): move the case to TestOpErrors", err)
			}
			b, dev := newFakeBackend(t)
			m := newMk(t, b)
			dev.reset()
			if err := c.run(m); err == nil {
				t.Fatal("accepted")
			}
			if n := len(dev.names()); n > 0 {
				t.Errorf("launched %v", dev.names())
			}
		})
	}
}

// TestCollapse: the broadcasts reduced to their fewest dimensions, with the
// strides of the result and both operands.
func TestCollapse(t *testing.T) {
	cases := []struct {
		out, a, b []int
		want      []bdim
	}{
		{[]int{2, 8, 4, 4}, []int{2, 8, 4, 4}, []int{2, 8, 1, 1}, []bdim{{16, 16, 16, 1}, {16, 1, 1, 0}}},
		{[]int{2, 3, 4, 5}, []int{2, 3, 4, 5}, []int{2, 3, 4, 5}, []bdim{{120, 1, 1, 1}}},
		{[]int{2, 3, 4, 5}, []int{2, 3, 4, 5}, []int{3, 1, 1}, []bdim{{2, 60, 60, 0}, {3, 20, 20, 1}, {20, 1, 1, 0}}},
		{[]int{2, 3, 4, 5}, []int{2, 1, 4, 1}, []int{1, 3, 1, 5}, []bdim{{2, 60, 4, 0}, {3, 20, 0, 5}, {4, 5, 1, 0}, {5, 1, 0, 1}}},
		{[]int{4, 1}, []int{4, 1}, []int{}, []bdim{{4, 1, 1, 0}}},
		{[]int{1, 6, 1}, []int{1, 6, 1}, []int{6, 1}, []bdim{{6, 1, 1, 1}}},
		{[]int{}, []int{}, []int{}, nil},
	}
	for _, c := range cases {
		if got := collapse(c.out, c.a, c.b); !reflect.DeepEqual(got, c.want) {
			t.Errorf("%v = %v op %v: %v, want %v", c.out, c.a, c.b, got, c.want)
		}
	}
}

// TestKernelConstants: the activation kinds and binary ops of
// kernels/common.cuh are runtime's.
func TestKernelConstants(t *testing.T) {
	src, err := os.ReadFile(filepath.Join("kernels", "common.cuh"))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int{
		"ACT_IDENTITY": int(runtime.ActIdentity), "ACT_RELU": int(runtime.ActReLU), "ACT_LEAKY": int(runtime.ActLeakyReLU),
		"ACT_ELU": int(runtime.ActELU), "ACT_HARDTANH": int(runtime.ActHardtanh), "ACT_SIGMOID": int(runtime.ActSigmoid),
		"ACT_SILU": int(runtime.ActSiLU), "ACT_HARDSIGMOID": int(runtime.ActHardsigmoid), "ACT_HARDSWISH": int(runtime.ActHardswish),
		"ACT_GELU": int(runtime.ActGELU), "BIN_ADD": int(runtime.BinaryAdd), "BIN_SUB": int(runtime.BinarySub),
		"BIN_MUL": int(runtime.BinaryMul), "BIN_DIV": int(runtime.BinaryDiv),
	}
	for _, m := range regexp.MustCompile(`(?m)^#define ((?:ACT|BIN)_\w+) (\d+)$`).FindAllStringSubmatch(string(src), -1) {
		v, _ := strconv.Atoi(m[2])
		w, ok := want[m[1]]
		if !ok {
			t.Errorf("common.cuh defines %s, which this test does not know", m[1])
			continue
		}
		if v != w {
			t.Errorf("%s is %d in common.cuh, %d in runtime", m[1], v, w)
		}
		delete(want, m[1])
	}
	for k := range want {
		t.Errorf("common.cuh does not define %s", k)
	}
}

// TestLayoutErrors: layout calls the CUDA backend refuses before any
// launch, and the CPU backend too where it has the layout ops.
func TestLayoutErrors(t *testing.T) {
	// The CPU backend panics on a perm that repeats a dimension
	// (runtime/cpu_layout.go; its executor checks perms first): not run
	// there.
	cpuPanics := map[string]bool{"permute, not a permutation": true}
	cases := []struct {
		name string
		run  func(lo layoutOps, m *mk) error
	}{
		{"permute, not a permutation", func(lo layoutOps, m *mk) error { return lo.Permute(m.f(3, 3), m.f(3, 3), []int{0, 0}) }},
		{"permute, wrong output shape", func(lo layoutOps, m *mk) error { return lo.Permute(m.f(3, 7), m.f(3, 7), []int{1, 0}) }},
		{"copy box out of bounds", func(lo layoutOps, m *mk) error {
			return lo.CopyBox(m.f(2, 3), m.f(2, 5), []int{0, 1}, []int{0, 0}, []int{2, 3}, false)
		}},
		{"copy box ranks", func(lo layoutOps, m *mk) error {
			return lo.CopyBox(m.f(2, 3), m.f(2, 3), []int{0}, []int{0, 0}, []int{2, 3}, false)
		}},
		{"resize of 3-d tensors", func(lo layoutOps, m *mk) error {
			return lo.Resize(m.f(2, 3, 8), m.f(2, 3, 4), runtime.Interp{Bilinear: true})
		}},
		{"resize across channels", func(lo layoutOps, m *mk) error {
			return lo.ResizeBackward(m.f(2, 3, 4, 4), m.f(2, 4, 8, 8), runtime.Interp{})
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cm := newMk(t, runtime.NewCPU(1))
			if lo, err := cm.lay(); err == nil && !cpuPanics[c.name] {
				if c.run(lo, cm) == nil {
					t.Fatal("the CPU backend accepts it: fix the case")
				}
			}
			b, dev := newFakeBackend(t)
			m := newMk(t, b)
			lo, err := m.lay()
			if err != nil {
				t.Fatal(err)
			}
			dev.reset()
			if err := c.run(lo, m); err == nil {
				t.Fatal("accepted")
			}
			if n := len(dev.names()); n > 0 {
				t.Errorf("launched %v", dev.names())
			}
		})
	}
}
