//go:build !cuda

package command

import (
	"fmt"
	"io"

	"github.com/abnconvert/abnconvert/runtime"
)

// backendFor returns the runtime backend of a --device. This binary was
// built without the cuda tag, so only the CPU is available.
func backendFor(device string, _ io.Writer) (func() (runtime.Backend, error), error) {
	switch device {
	case "", "cpu":
		return func() (runtime.Backend, error) { return runtime.NewCPU(0), nil }, nil
	case "cuda":
		return nil, fmt.Errorf("--device cuda: this abnconvert was built without CUDA; build it with `make cuda` (needs the CUDA toolkit: see README)")
	}
	return nil, fmt.Errorf("--device %q: want cpu or cuda", device)
}
