package pth

// Allowed reports whether torch.load(weights_only=True) accepts a global,
// spelled "module.name" as Scan lists it: torch 1.13's allowlist, plus what
// torch 2.x added that state-dict checkpoints use (see allowedExact).
// Modules torch blocks outright (os, posix, nt, sys) are refused whatever
// the name.
func Allowed(global string) bool { return allowedGlobal(global) }
