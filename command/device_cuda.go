//go:build cuda

package command

import (
	"fmt"
	"io"

	"github.com/abnconvert/abnconvert/cuda"
	"github.com/abnconvert/abnconvert/runtime"
)

// backendFor returns the runtime backend of a --device. This binary was
// built with the cuda tag: --device cuda runs on the first GPU. A machine
// without a GPU or driver fails at the first backend, with the driver's
// reason, which the commands print as one line (exit 2). The device found
// is named on progress, when not nil.
func backendFor(device string, progress io.Writer) (func() (runtime.Backend, error), error) {
	switch device {
	case "", "cpu":
		return func() (runtime.Backend, error) { return runtime.NewCPU(0), nil }, nil
	case "cuda":
		b, err := cuda.Open()
		if err != nil {
			return nil, fmt.Errorf("--device cuda: %w", err)
		}
		if progress != nil {
			fmt.Fprintf(progress, "device cuda: %s\n", b.Device())
		}
		b.Close()
		return func() (runtime.Backend, error) { return cuda.Open() }, nil
	}
	return nil, fmt.Errorf("--device %q: want cpu or cuda", device)
}
