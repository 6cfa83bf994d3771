//go:build linux && (amd64 || arm64)

// Command abnconvert rewrites the BatchNorm + activation layers of a trained
// convolutional network into InPlace-ABN, so that training keeps less memory.
//
// The command is a thin shell over package convert (the conversion itself)
// and package command (flags, help, exit codes); see README.md.
package main

import (
	"os"

	"github.com/abnconvert/abnconvert/command"
	"github.com/abnconvert/abnconvert/convert"
)

func main() {
	convert.ProcessEndsAfterRun()
	os.Exit(command.Main(os.Args, os.Stdout, os.Stderr))
}
