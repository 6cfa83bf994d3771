//go:build cudaemu

package cuda

import "testing"

// The emulator tests run the kernels' C++ on the CPU (go test -tags cudaemu
// ./cuda/): the CUDA backend, over the emulated device, against the CPU
// backend, op by op and on whole networks.

func newEmuBackend(t testing.TB) *Backend {
	dev := newEmuDevice(2)
	b := newBackend(dev, newPool(dev), 0)
	t.Cleanup(func() {
		b.Close()
		b.pool.trim()
	})
	return b
}

func TestEmulatorHasEveryKernel(t *testing.T) {
	got := emuKernels()
	for _, s := range kernelSpecs {
		a, ok := got[s.name]
		if !ok {
			t.Errorf("%s is not registered in emu.cc", s.name)
			continue
		}
		if a != len(s.params) {
			t.Errorf("%s: the emulator's kernel takes %d arguments, the spec %d", s.name, a, len(s.params))
		}
		delete(got, s.name)
	}
	for name := range got {
		t.Errorf("emu.cc registers %s, which no spec names", name)
	}
}

// TestOpsMatchCPU runs every op case on the CPU backend and on the CUDA
// backend over the emulator, and compares every tensor the case made.
func TestOpsMatchCPU(t *testing.T) { compareOps(t, newEmuBackend) }

// TestNetworksMatchCPU: every fixture network, original and converted, one
// eval forward and one training step, on both backends.
func TestNetworksMatchCPU(t *testing.T) {
	compareNetworks(t, newEmuBackend, randomInput(1, 2, 3, 32, 32))
}
