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
