package runtime

import "github.com/abnconvert/abnconvert/graph"

// fault is a training-only error put into the layers a conversion brings
// in (the ABN family, never BatchNorm2d, so only a converted network is
// affected), for tests that show verify refusing what only a training step
// reveals: eval outputs stay exact. Only the runtime's own tests set it
// (export_test.go), so a built binary always runs with the zero value,
// which injects nothing.
var fault struct {
	// abnWeightGrad, when not 0, multiplies InPlace-ABN's weight gradient.
	abnWeightGrad float64
	// runningVar, when not 0, multiplies the batch variance folded into
	// the running variance: (1-m)*running + m*runningVar*unbiased.
	runningVar float64
	// momentum, when not 0, replaces the momentum of the running update.
	momentum float64
}

// faulty reports whether the fault applies to nd.
func faulty(nd *graph.Node) bool { return nd.Op.IsBNFamily() && nd.Op != graph.OpBatchNorm }

// scaleOnHost multiplies t by s through the host: slow, but only a test's
// fault runs it, and it works on every backend.
func (e *Executor) scaleOnHost(t Tensor, s float64, add Tensor, addScale float64) error {
	if t == nil || !e.b.Executes() {
		return nil
	}
	v := make([]float32, numel(t.Shape()))
	if err := e.b.Download(t, v); err != nil {
		return err
	}
	var a []float32
	if add != nil {
		a = make([]float32, len(v))
		if err := e.b.Download(add, a); err != nil {
			return err
		}
	}
	for k := range v {
		x := s * float64(v[k])
		if a != nil {
			x += addScale * float64(a[k])
		}
		v[k] = float32(x)
	}
	return e.b.Upload(t, v)
}
