package command

import (
	"io"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"
)

// TestFlagUsageNoBackquotes: urfave/cli takes the first `quoted` text of
// a flag's usage as the name of its argument, so a usage that quotes a
// command or a class for emphasis renders as "--emit-module class Model"
// in --help. No flag of any command may have one.
func TestFlagUsageNoBackquotes(t *testing.T) {
	app := newApp(io.Discard, io.Discard)
	var check func(path string, flags []cli.Flag, cmds []*cli.Command)
	check = func(path string, flags []cli.Flag, cmds []*cli.Command) {
		for _, f := range flags {
			if d, ok := f.(cli.DocGenerationFlag); ok && strings.Contains(d.GetUsage(), "`") {
				t.Errorf("%s --%s: usage %q has a backquote, which --help shows as the argument's name", path, f.Names()[0], d.GetUsage())
			}
		}
		for _, c := range cmds {
			check(path+" "+c.Name, c.Flags, c.Subcommands)
		}
	}
	check("abnconvert", app.Flags, app.Commands)
}

// TestMemoryRefusesOverflow: sizes whose byte counts would overflow are
// refused with the limit named (they once printed 3.25e12 MiB and a
// negative saving, exit 0); a large but countable size runs.
func TestMemoryRefusesOverflow(t *testing.T) {
	fixture := "../fixtures/testdata/tiny_resnext.pth"
	code, _, stderr := run("memory", fixture, "--batch", "100000000", "--size", "100000", "-q")
	if code != 2 || !strings.Contains(stderr, "2^32") {
		t.Fatalf("exit %d, stderr %q; want 2 naming the limit", code, stderr)
	}
	if code, _, stderr := run("memory", fixture, "--batch", "1024", "--size", "1024", "-q", "--json"); code != 0 {
		t.Fatalf("batch 1024 at 1024x1024: exit %d: %s", code, stderr)
	}
}

// TestSyncWarning: --sync with sites that stay ABN (no synchronised form
// in inplace_abn) says how many and what that means (issue 45); without
// --sync, or when every site is in place, nothing is said.
func TestSyncWarning(t *testing.T) {
	fixture := "../fixtures/testdata/tiny_resnet_basic.pth"
	dir := t.TempDir()
	code, stdout, stderr := run("-i", fixture, "-o", dir+"/a.pth", "--sync", "--relu", "abn")
	if code != 0 || !strings.Contains(stdout+stderr, "WARNING: --sync: 7 of 14 sites are ABN") || !strings.Contains(stdout+stderr, "CUDA only") {
		t.Errorf("--sync --relu abn: exit %d, no warning naming the 7 ABN sites:\n%s%s", code, stdout, stderr)
	}
	// Under --relu leaky the ReLU sites are in place; one site stays ABN
	// (the reason is in its row) and is still named.
	code, stdout, stderr = run("-i", fixture, "-o", dir+"/b.pth", "--sync", "--relu", "leaky")
	if code != 0 || !strings.Contains(stdout+stderr, "WARNING: --sync: 1 of 14 sites are ABN") {
		t.Errorf("--sync --relu leaky: exit %d, want the one ABN site named:\n%s%s", code, stdout, stderr)
	}
	code, stdout, stderr = run("-i", fixture, "-o", dir+"/c.pth", "--relu", "abn")
	if code != 0 || strings.Contains(stdout+stderr, "WARNING: --sync") {
		t.Errorf("without --sync: exit %d, warned anyway:\n%s%s", code, stdout, stderr)
	}
}
