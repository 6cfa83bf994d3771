// Package output writes a command's output files all or nothing.
//
// Every file a command writes (a converted checkpoint in any format, the
// emitted module, the report, a plot) is staged in a Set: Create makes a
// temporary file beside its destination and hands the writer an io.Writer
// onto it, so that a large checkpoint streams to disk without being held
// in memory. Nothing is renamed into place until Commit, which runs once
// every output of the command is complete: a failure before then (an
// error in a later output, a full disk, a refused conversion) removes
// every temporary file and leaves the previous files byte for byte as they
// were. SIGINT, SIGTERM and SIGHUP do the same before the process dies of
// the signal, for every writer, through one handler.
package output

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
)

// Sentinel errors of Create, for errors.Is.
var (
	// ErrExists: the destination exists and Options.Force is not set.
	ErrExists = errors.New("already exists")
	// ErrInput: the destination is one of the command's inputs (Protect).
	ErrInput = errors.New("is an input of this command; abnconvert never overwrites its input")
)

// Options apply to every file of a Set.
type Options struct {
	// Force allows replacing existing files (never a protected input).
	Force bool
	// Sync flushes each file, and then its directory, to disk around the
	// rename, for durability against power loss. Without it the renames
	// still guarantee that no partial file is ever seen; syncing costs
	// about the time the disk needs to take the whole file.
	Sync bool
}

// Set is the outputs of one command. The zero value is not usable: call
// New, and defer Abort, which is a no-op once Commit has succeeded. A Set
// and its Files are used by one goroutine at a time.
type Set struct {
	opt     Options
	protect []protected
	files   []*File
	state   state
	// swept holds the directories whose dead runs' temporary files
	// Create has removed (removeStale), once a set.
	swept map[string]bool
}

type protected struct {
	path string
	fi   os.FileInfo
}

type state int

const (
	open state = iota
	committed
	aborted     // by Abort or a failed Commit
	interrupted // by a signal
)

// File is one staged output: writes go to its temporary file, buffered.
type File struct {
	set  *Set
	path string // destination
	tmp  string
	f    *os.File
	w    io.Writer     // bw, or the injected fault's writer
	bw   *bufio.Writer // nil under an injected fault
	err  error         // the first write error, returned again by every later one

	backup  string // a hard link to the previous file during Commit
	renamed bool
	// lock holds the temporary file's advisory lock until it is renamed
	// or removed (createTemp); nil where none could be taken.
	lock *os.File

	// wmu is held around every write system call (appended and
	// positioned alike). The kernel serialises writes to a file anyway
	// (ext4 takes the inode's lock), but a writer that finds the lock
	// taken spins on its core for as long as the holder writes (a
	// megabyte: about 100 µs): with a conversion's goroutines writing
	// records beside each other, 2% of its CPU (rwsem_spin_on_owner,
	// densenet201 trained). Waiting here lets the core run another
	// goroutine meanwhile.
	wmu sync.Mutex
}

// lockedWriter is the staged file's appending writes, under wmu.
type lockedWriter struct{ f *File }

func (w lockedWriter) Write(p []byte) (int, error) {
	w.f.wmu.Lock()
	defer w.f.wmu.Unlock()
	return w.f.f.Write(p)
}

// New starts a set of outputs. From now until Commit or Abort, a signal
// removes the set's temporary files before ending the process.
func New(opt Options) *Set {
	s := &Set{opt: opt}
	register(s)
	return s
}

// Protect names files that no output of the set may replace: the
// command's inputs (a hard link or a symbolic link to one counts as the
// file). A path that does not exist protects nothing.
func (s *Set) Protect(paths ...string) {
	for _, p := range paths {
		if fi, err := os.Stat(p); err == nil {
			s.protect = append(s.protect, protected{p, fi})
		}
	}
}

// Create stages the output path: it checks the destination (a regular
// file or nothing; an existing file only with Force; never a protected
// input), and creates the temporary file beside it, with the permissions
// of the file it replaces (0644 for a new one). Errors name path.
func (s *Set) Create(path string) (*File, error) {
	if st := s.current(); st != open {
		return nil, fmt.Errorf("%s: output set already %s", path, st)
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	for _, f := range s.files {
		if a, _ := filepath.Abs(f.path); a == abs {
			return nil, fmt.Errorf("%s: given as two outputs of one command", path)
		}
	}
	mode := fs.FileMode(0o644)
	if st, err := os.Stat(path); err == nil {
		for _, p := range s.protect {
			if os.SameFile(st, p.fi) {
				return nil, fmt.Errorf("%s: %w (it is %s)", path, ErrInput, p.path)
			}
		}
		if !st.Mode().IsRegular() {
			return nil, fmt.Errorf("%s: not a regular file", path)
		}
		if !s.opt.Force {
			return nil, fmt.Errorf("%s: %w (use --force to overwrite)", path, ErrExists)
		}
		mode = st.Mode().Perm()
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%s: %w", path, cause(err))
	}
	dir := filepath.Dir(path)
	lock()
	defer unlock()
	if s.state != open { // a signal came meanwhile
		return nil, fmt.Errorf("%s: interrupted", path)
	}
	if !s.swept[dir] {
		if s.swept == nil {
			s.swept = map[string]bool{}
		}
		s.swept[dir] = true
		removeStale(dir)
	}
	tmp, held, err := createTemp(dir, path)
	if err != nil {
		return nil, fmt.Errorf("%s: creating a temporary file in %s: %w", path, dir, cause(err))
	}
	f := &File{set: s, path: path, tmp: tmp.Name(), f: tmp, lock: held}
	if fw := withFault(path, lockedWriter{f}); fw != nil {
		// Unbuffered, so that the fault strikes within the writer's own
		// call, where a test expects it.
		f.w = fw
	} else {
		f.bw = bufio.NewWriterSize(lockedWriter{f}, 1<<16)
		f.w = f.bw
	}
	s.files = append(s.files, f) // from now on Abort and a signal remove it
	if err := tmp.Chmod(mode); err != nil {
		return nil, fmt.Errorf("%s: %w", path, cause(err))
	}
	return f, nil
}

// Write appends to the staged file. Its errors carry the cause alone
// ("no space left on device"), without the temporary file's name: the
// caller names the output. After an error every later Write fails too.
func (f *File) Write(p []byte) (int, error) {
	if f.err != nil {
		return 0, f.err
	}
	n, err := f.w.Write(p)
	if err != nil {
		f.err = cause(err)
	}
	return n, f.err
}

// WriteVec appends bufs in order, as Write of each would, in as few
// writev(2) calls as the kernel allows: a copy that interleaves bytes
// mapped from its input with bytes it changed hands the kernel both
// without first gathering them into one buffer. Under an injected fault it
// is Write of each.
func (f *File) WriteVec(bufs [][]byte) (int, error) {
	if f.err != nil {
		return 0, f.err
	}
	if f.bw == nil {
		total := 0
		for _, b := range bufs {
			n, err := f.Write(b)
			total += n
			if err != nil {
				return total, err
			}
		}
		return total, nil
	}
	if err := f.bw.Flush(); err != nil {
		f.err = cause(err)
		return 0, f.err
	}
	f.wmu.Lock()
	n, err := writev(f.f, bufs)
	f.wmu.Unlock()
	if err != nil {
		f.err = cause(err)
	}
	return n, f.err
}

// Name is the destination path.
func (f *File) Name() string { return f.path }

// Staged reports whether path is one of the set's outputs (a writer may
// add an output of its own, as the ONNX writer does for external data).
func (s *Set) Staged(path string) bool {
	for _, f := range s.files {
		if f.path == path {
			return true
		}
	}
	return false
}

// WriteFile stages an output whose bytes are all at hand (a module, a
// report, a plot).
func (s *Set) WriteFile(path string, data []byte) error {
	f, err := s.Create(path)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

// Commit renames every staged file into place. Each is flushed (and
// synced with Options.Sync) and closed first; only when all are complete
// does the first rename happen. Should a rename fail, the outputs already
// renamed are put back (the previous file from a hard link kept for the
// purpose, or removed if there was none), so that on any error the
// destinations are as they were. A Set commits once.
func (s *Set) Commit() (err error) {
	if st := s.current(); st != open {
		return fmt.Errorf("output set already %s", st)
	}
	defer func() {
		if err != nil {
			s.Abort()
		}
	}()
	for _, f := range s.files {
		if err := f.finish(s.opt.Sync); err != nil {
			return fmt.Errorf("%s: %w", f.path, err)
		}
	}
	lock()
	defer unlock()
	if s.state != open {
		return errors.New("interrupted")
	}
	for _, f := range s.files {
		if s.opt.Force {
			if _, err := os.Lstat(f.path); err == nil {
				f.backup = linkBackup(f.path)
			}
		}
		if err := rename(f.tmp, f.path, s.opt.Force); err != nil {
			s.undoLocked()
			return fmt.Errorf("%s: %w", f.path, cause(err))
		}
		f.renamed = true
	}
	for _, f := range s.files {
		f.unlock()
	}
	dirs := map[string]bool{}
	for _, f := range s.files {
		if f.backup != "" {
			os.Remove(f.backup)
		}
		dirs[filepath.Dir(f.path)] = true
	}
	s.state = committed
	unregisterLocked(s)
	// Make the renames durable; failing to sync a directory is not worth
	// failing finished outputs for.
	if s.opt.Sync {
		for dir := range dirs {
			if d, derr := os.Open(dir); derr == nil {
				d.Sync()
				d.Close()
			}
		}
	}
	return nil
}

// current is the set's state, which the signal handler may change.
func (s *Set) current() state {
	lock()
	defer unlock()
	return s.state
}

// Abort removes every temporary file of the set; the destinations keep
// their previous contents. It is a no-op after Commit or a second Abort.
func (s *Set) Abort() {
	lock()
	defer unlock()
	if s.state != open {
		return
	}
	s.undoLocked()
}

// undoLocked puts back what a Commit renamed and removes every temporary
// file. The registry's lock is held.
func (s *Set) undoLocked() {
	for _, f := range s.files {
		if f.f != nil {
			f.f.Close()
		}
		defer f.unlock() // after the removal: a sweeper sees no unlocked leftover
		switch {
		case !f.renamed:
			os.Remove(f.tmp)
			if f.backup != "" {
				os.Remove(f.backup)
			}
		case f.backup != "":
			os.Rename(f.backup, f.path)
		default:
			os.Remove(f.path) // there was no previous file
		}
	}
	s.state = aborted
	unregisterLocked(s)
}

// unlock releases the temporary file's lock.
func (f *File) unlock() {
	if f.lock != nil {
		f.lock.Close()
		f.lock = nil
	}
}

// finish flushes, syncs and closes the temporary file.
func (f *File) finish(sync bool) error {
	if f.err != nil {
		return f.err
	}
	if f.bw != nil {
		if err := f.bw.Flush(); err != nil {
			return cause(err)
		}
	}
	if sync {
		if err := syncFile(f.f); err != nil {
			return cause(err)
		}
	}
	err := f.f.Close()
	f.f = nil
	return cause(err)
}

// linkBackup makes a hard link to the previous file at path, so that a
// failed Commit can put it back; "" when the file system has no hard
// links (the previous file is then lost only if a later rename of the same
// Commit fails, which needs the directory to change under it).
func linkBackup(path string) string {
	dir, base := filepath.Split(path)
	for i := 0; i < 10; i++ {
		name := filepath.Join(dir, fmt.Sprintf(".%s.old-%d", base, rand.Uint32()))
		err := os.Link(path, name)
		if err == nil {
			return name
		}
		if !errors.Is(err, fs.ErrExist) {
			return ""
		}
	}
	return ""
}

// syncs counts the files synced to disk, for Syncs.
var syncs atomic.Int64

// Syncs is how many staged files this process has synced to disk so far
// (Options.Sync): tests check with it that --fsync reaches every writer,
// and that nothing is synced without it.
func Syncs() int64 { return syncs.Load() }

func syncFile(f *os.File) error {
	syncs.Add(1)
	return f.Sync()
}

// cause drops the *fs.PathError wrapper, whose path (a temporary file's)
// would only confuse a message that names the output.
func cause(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	var le *os.LinkError
	if errors.As(err, &le) {
		return le.Err
	}
	return err
}

func (st state) String() string {
	switch st {
	case open:
		return "open"
	case committed:
		return "committed"
	case aborted:
		return "aborted"
	}
	return "interrupted"
}

// Flush writes what the file's buffer holds, so that positioned writes
// (WriteAt) and maps of the file (Fd) see every byte appended so far.
func (f *File) Flush() error {
	if f.err != nil {
		return f.err
	}
	if f.bw != nil {
		if err := f.bw.Flush(); err != nil {
			f.err = cause(err)
		}
	}
	return f.err
}

// WriteAt writes bytes at off, over bytes the file holds or into a range
// appending went past (MoveTo), leaving the position where appending goes
// on unchanged: a writer that laid a file out ahead of knowing some of its
// contents fills them in (package pth's Prewrite). Call Flush first where
// off lies in bytes already appended. An injected fault (InjectFault)
// counts its bytes as it counts Write's.
//
// It may run beside Write, and beside other WriteAts, on other goroutines
// (on bytes Write no longer buffers), so it leaves the file's error alone:
// the caller fails the output with the error it returns.
func (f *File) WriteAt(p []byte, off int64) (int, error) {
	var n int
	var err error
	f.wmu.Lock()
	if fw, ok := f.w.(*faultWriter); ok {
		n, err = fw.writeAt(f.f, p, off)
	} else {
		n, err = f.f.WriteAt(p, off)
	}
	f.wmu.Unlock()
	if err != nil {
		return n, cause(err)
	}
	return n, nil
}

// WriteVecAt is WriteAt of bufs' bytes, one after the other from off, in as
// few pwritev(2) calls as the kernel allows: a copy that writes a range of
// the file out of several pieces (record headers, bytes mapped from its
// input, bytes it changed) hands them to the kernel in one write, without
// gathering them into one buffer. Under an injected fault it is WriteAt of
// each.
func (f *File) WriteVecAt(bufs [][]byte, off int64) (int, error) {
	if fw, ok := f.w.(*faultWriter); ok {
		total := 0
		for _, b := range bufs {
			f.wmu.Lock()
			n, err := fw.writeAt(f.f, b, off+int64(total))
			f.wmu.Unlock()
			total += n
			if err != nil {
				return total, cause(err)
			}
		}
		return total, nil
	}
	f.wmu.Lock()
	n, err := pwritev(f.f, bufs, off)
	f.wmu.Unlock()
	if err != nil {
		return n, cause(err)
	}
	return n, nil
}

// MoveTo moves where appending goes on to off, after writing what the
// buffer holds: a writer that leaves a range to fill in later (package
// pth's Prewrite, whose copy writes the records a conversion may still
// change last) goes on past it, comes back to it, and then goes on from
// the end.
func (f *File) MoveTo(off int64) error {
	if err := f.Flush(); err != nil {
		return err
	}
	if _, err := f.f.Seek(off, io.SeekStart); err != nil {
		f.err = cause(err)
	}
	return f.err
}

// ReadAt reads bytes the file already holds (Flush first); like WriteAt,
// it may run beside Write.
func (f *File) ReadAt(p []byte, off int64) (int, error) {
	n, err := f.f.ReadAt(p, off)
	if err != nil {
		return n, cause(err)
	}
	return n, nil
}

// Rewind empties the file and starts appending again from its first byte,
// for a writer whose early start turned out to lay the file out wrong.
func (f *File) Rewind() error {
	if err := f.Flush(); err != nil {
		return err
	}
	if err := f.f.Truncate(0); err != nil {
		f.err = cause(err)
		return f.err
	}
	if _, err := f.f.Seek(0, io.SeekStart); err != nil {
		f.err = cause(err)
		return f.err
	}
	return nil
}
