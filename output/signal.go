package output

import (
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// The one signal handler of the process's outputs. While any Set is open a
// goroutine waits for SIGINT, SIGTERM or SIGHUP; on one it removes every
// open set's temporary files (a Commit in progress finishes first: the
// handler waits for the registry's lock, which Commit holds across its
// renames), then delivers the signal again with Go's default action, so
// the process still ends as the signal demands. With no set open the
// handler is not installed and signals have their usual effect at once.
var reg struct {
	mu   sync.Mutex
	sets map[*Set]bool
	ch   chan os.Signal
	quit chan struct{}
}

var signals = []os.Signal{os.Interrupt, syscall.SIGTERM, syscall.SIGHUP}

// caught is set once the handler has a signal: the outputs are being
// removed and the signal is about to be delivered again.
var caught atomic.Bool

// Interrupted reports whether the handler caught a signal: every open
// set's temporary files are being (or have been) removed, which fails the
// writes still going on, and the signal is delivered again with Go's
// default action, so that the process ends as the signal demands.
func Interrupted() bool { return caught.Load() }

// AwaitInterrupt, where a signal was caught (Interrupted), gives the
// handler the time to deliver it again, which ends the process, and
// returns only if that does not end it (a program with a handler of its
// own): a command whose write failed because the handler removed its file
// calls it before it reports the failure, so that it ends as interrupted
// (by the signal, exit 130 in a shell), not with an error about a closed
// file that raced the signal.
func AwaitInterrupt() {
	if !caught.Load() {
		return
	}
	time.Sleep(2 * time.Second)
}

func lock()   { reg.mu.Lock() }
func unlock() { reg.mu.Unlock() }

func register(s *Set) {
	lock()
	defer unlock()
	if reg.sets == nil {
		reg.sets = map[*Set]bool{}
	}
	if len(reg.sets) == 0 {
		reg.ch = make(chan os.Signal, 1)
		reg.quit = make(chan struct{})
		// A signal the process was started ignoring (SIGHUP under nohup,
		// SIGINT in a background job) stays ignored: catching it would
		// abort the outputs of a run that was meant to survive it.
		for _, sig := range signals {
			if !signal.Ignored(sig) {
				signal.Notify(reg.ch, sig)
			}
		}
		go watch(reg.ch, reg.quit)
	}
	reg.sets[s] = true
}

// unregisterLocked drops s; the last set out uninstalls the handler.
func unregisterLocked(s *Set) {
	if !reg.sets[s] {
		return
	}
	delete(reg.sets, s)
	if len(reg.sets) == 0 {
		signal.Stop(reg.ch)
		close(reg.quit)
	}
}

func watch(ch chan os.Signal, quit chan struct{}) {
	var sig os.Signal
	select {
	case sig = <-ch:
	case <-quit:
		// A signal that arrived just before the handler was uninstalled
		// is still in the channel: it must not be lost.
		select {
		case sig = <-ch:
		default:
			return
		}
	}
	caught.Store(true)
	lock()
	for s := range reg.sets {
		s.undoLocked()
		s.state = interrupted
	}
	signal.Stop(ch)
	unlock()
	// With no channel left for the signal, Go's default action (ending the
	// process) applies to the signal sent again; a program with its own
	// handler gets it instead, and its open sets fail with "interrupted".
	if p, err := os.FindProcess(os.Getpid()); err == nil && p.Signal(sig) == nil {
		return
	}
	os.Exit(1)
}
