// Package failure classifies errors into the few kinds that a script calling
// abnconvert can act on, each with its own exit code. An error is classified
// where its cause is known (a reader knows bad input, the runtime knows an op
// it lacks, a recovered panic is a bug) and the class survives wrapping with
// %w, so the command line maps any error to its code with Kind alone.
package failure

import (
	"errors"
	"fmt"
)

// Kind is an error's class; its value is the process exit code.
type Kind int

const (
	OK Kind = 0
	// Mismatch: verify found that the conversion changed the outputs.
	Mismatch Kind = 1
	// BadInput: the input file or the command line is wrong, or the
	// conversion was refused for a reason the user can fix. Unclassified
	// errors are bad input: every reader's errors name a file and a problem.
	BadInput Kind = 2
	// Internal: a bug in abnconvert (a recovered panic, a broken invariant).
	Internal Kind = 3
	// Unsupported: the network uses an op or module abnconvert does not
	// support yet. The input is valid; a later version may handle it.
	Unsupported Kind = 4
)

func (k Kind) String() string {
	switch k {
	case OK:
		return "ok"
	case Mismatch:
		return "mismatch"
	case BadInput:
		return "bad input"
	case Internal:
		return "internal error"
	case Unsupported:
		return "unsupported"
	}
	return fmt.Sprintf("kind %d", int(k))
}

// classified carries a Kind through wrapping.
type classified struct {
	kind Kind
	err  error
}

func (c *classified) Error() string { return c.err.Error() }
func (c *classified) Unwrap() error { return c.err }

// As gives err the class kind; nil stays nil. The outermost class wins when
// an error is classified twice, so a caller can reclassify.
func As(kind Kind, err error) error {
	if err == nil {
		return nil
	}
	return &classified{kind: kind, err: err}
}

// Unsupportedf is an error for an op or module abnconvert does not support.
func Unsupportedf(format string, args ...any) error {
	return As(Unsupported, fmt.Errorf(format, args...))
}

// Internalf is an error for a bug in abnconvert.
func Internalf(format string, args ...any) error {
	return As(Internal, fmt.Errorf(format, args...))
}

// Panic turns a recovered panic value into an internal error naming where.
func Panic(where string, r any) error {
	return As(Internal, fmt.Errorf("%s: internal error (please report it): %v", where, r))
}

// Of is err's class: the outermost classification, else BadInput; nil is OK.
func Of(err error) Kind {
	if err == nil {
		return OK
	}
	var c *classified
	if errors.As(err, &c) {
		return c.kind
	}
	return BadInput
}
