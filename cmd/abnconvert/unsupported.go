//go:build !(linux && (amd64 || arm64))

package main

// abnconvert builds for 64-bit Linux only (amd64, arm64): its writers use
// Linux's system calls (madvise, writev, pwritev, renameat2, fallocate,
// flock) and its runtime sizes tensors in 64-bit ints. Elsewhere the
// build stops here, with this name in the error, rather than deep inside
// a package with an undefined syscall; build it on Linux, or in a Linux
// container (see README.md, "Set-up"). This file imports nothing, so
// that nothing else is compiled before it fails.
var _ = abnconvert_builds_only_on_64bit_linux_amd64_or_arm64
