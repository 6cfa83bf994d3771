package runtime

// Fault is the training-only error that tests outside the package's
// internals (package runtime_test, which drives verify and the command
// line) put into the layers a conversion brings in; see fault.
type Fault struct {
	// ABNWeightGrad multiplies InPlace-ABN's weight gradient (0: no fault).
	ABNWeightGrad float64
	// RunningVar multiplies the batch variance folded into the running
	// variance of every ABN-family layer (0: no fault).
	RunningVar float64
	// Momentum replaces the momentum of their running update (0: no fault).
	Momentum float64
}

// SetFault injects f until the returned function restores what was there.
func SetFault(f Fault) (restore func()) {
	old := fault
	fault.abnWeightGrad, fault.runningVar, fault.momentum = f.ABNWeightGrad, f.RunningVar, f.Momentum
	return func() { fault = old }
}
