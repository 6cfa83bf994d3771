//go:build linux && !amd64 && !arm64

package output

// sysRenameat2 is 0 where this package does not know renameat2's number:
// renameNoReplace then uses its hard-link way.
const sysRenameat2 = 0
