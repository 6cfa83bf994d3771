package pth

import (
	"os"
	"os/signal"
	"syscall"
)

// removeOnSignal makes an interrupted Write (Ctrl-C, SIGTERM, SIGHUP while
// the temporary file is being written) remove that file before the process
// dies, so that an interrupted conversion leaves nothing behind, like a
// failed one. The signal is then delivered again with its usual effect, so
// the process still ends as the signal demands. stop undoes the
// arrangement; call it once the file is renamed or removed.
func removeOnSignal(name string) (stop func()) {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	done := make(chan struct{})
	go func() {
		select {
		case sig := <-ch:
			os.Remove(name)
			// With no channel left for the signal, Go's default action
			// (ending the process) applies to the signal sent again; a
			// program with its own handler gets it instead.
			signal.Stop(ch)
			if p, err := os.FindProcess(os.Getpid()); err == nil && p.Signal(sig) == nil {
				return
			}
			os.Exit(1)
		case <-done:
		}
	}()
	return func() {
		signal.Stop(ch)
		close(done)
	}
}
