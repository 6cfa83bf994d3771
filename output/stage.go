package output

import (
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"unicode/utf8"
)

// nameMax is the longest file name most Linux file systems accept (ext4,
// xfs, btrfs, tmpfs: NAME_MAX, 255 bytes).
const nameMax = 255

// tempSuffix is what a temporary name adds after the destination's
// (possibly shortened) base name: ".tmp-PID-RANDOM".
func tempSuffix(pid int, r uint32) string {
	return ".tmp-" + strconv.Itoa(pid) + "-" + strconv.FormatUint(uint64(r), 36)
}

// tempName is the temporary file's name for an output named base: a dot,
// base, and the process's PID, so that a later run can tell a dead
// process's leftovers (removeStale). An output name the file system
// accepts may be too long for that to fit in NAME_MAX: base is then
// shortened (at a UTF-8 boundary); the name is only ever used for the
// temporary file.
func tempName(base string, pid int, r uint32) string {
	suffix := tempSuffix(pid, r)
	room := nameMax - 1 - len(suffix)
	if len(base) > room {
		base = base[:room]
		for len(base) > 0 && !utf8.ValidString(base) {
			base = base[:len(base)-1]
		}
	}
	return "." + base + suffix
}

// createTemp creates the temporary file for path in dir, exclusively, and
// takes an advisory lock on it through a second open file (held, which
// the caller keeps until the file is renamed or removed, so that the
// file itself can be closed, with its error checked, before the rename).
// The lock, released by the kernel when the process dies however it
// dies, is how removeStale tells a leftover from a file a running
// abnconvert is writing.
func createTemp(dir, path string) (f, held *os.File, err error) {
	base := filepath.Base(path)
	for i := 0; i < 100; i++ {
		name := filepath.Join(dir, tempName(base, os.Getpid(), rand.Uint32()))
		f, err = os.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		if err != nil {
			return nil, nil, err
		}
		if held, lerr := os.Open(name); lerr == nil {
			if tryLockFile(held) {
				return f, held, nil
			}
			held.Close()
		}
		return f, nil, nil
	}
	return nil, nil, err
}

// staleName matches the temporary files createTemp names: the PID is the
// second-last field.
var staleName = regexp.MustCompile(`^\..*\.tmp-([0-9]+)-[0-9a-z]+$`)

// removeStale removes, from dir, the temporary files of abnconvert runs
// that died before they could remove them (a SIGKILL, a power loss, an
// out-of-memory kill), which would otherwise stay as hidden files as
// large as a checkpoint. A file is removed only when both say its writer
// is gone: the process of the PID in its name does not exist, and nobody
// holds the file's lock (a writer in another PID namespace sharing the
// directory, whose PID means nothing here, still holds its lock). Best
// effort: errors leave the file where it is.
func removeStale(dir string) (removed []string) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	self := os.Getpid()
	for _, e := range entries {
		if !e.Type().IsRegular() || !strings.HasPrefix(e.Name(), ".") {
			continue
		}
		m := staleName.FindStringSubmatch(e.Name())
		if m == nil {
			continue
		}
		pid, err := strconv.Atoi(m[1])
		if err != nil || pid == self || processExists(pid) {
			continue
		}
		name := filepath.Join(dir, e.Name())
		f, err := os.OpenFile(name, os.O_RDWR, 0)
		if err != nil {
			continue
		}
		if tryLockFile(f) && os.Remove(name) == nil {
			removed = append(removed, name)
		}
		f.Close()
	}
	return removed
}

// rename moves the finished temporary file into place. With force it
// replaces whatever is at path; without, it never does, even when a file
// appeared there after Create checked (another run, another program):
// the existence check and the rename are one step (renameNoReplace).
func rename(tmp, path string, force bool) error {
	if force {
		return os.Rename(tmp, path)
	}
	err := renameNoReplace(tmp, path)
	if errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("%w: it appeared while abnconvert was writing, and is left as it is (use --force to overwrite)", ErrExists)
	}
	return err
}
