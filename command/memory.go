package command

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/abnconvert/abnconvert/memory"
)

func memoryCommand() *cli.Command {
	return &cli.Command{
		Name:  "memory",
		Usage: "measure the training memory of a checkpoint's network before and after conversion",
		UsageText: "abnconvert memory [--batch N --size N] [--budget 16GiB] [--plot mem.svg] [--json] IN\n\n" +
			"Runs one training step (forward and backward) of the original network and of its\n" +
			"default conversion in abnconvert's runtime, on a backend that allocates through the\n" +
			"runtime's allocator without computing, and reports the bytes kept for the backward\n" +
			"pass at the end of the forward (saved_bytes: what PyTorch's saved-tensor hooks\n" +
			"count; parameters excluded), the peak over forward and backward, and per technique.",
		Flags: []cli.Flag{
			archFlag(), reluFlag(), slopeFlag(),
			&cli.IntFlag{Name: "batch", Value: 8, Usage: "batch size"},
			&cli.IntFlag{Name: "size", Value: 224, Usage: "input height and width"},
			&cli.StringFlag{Name: "budget", Usage: "also find the largest batch whose peak fits this much memory (e.g. 16GiB, 500MB)"},
			&cli.StringFlag{Name: "plot", Usage: "draw memory live per layer, before and after, to this .svg or .png file"},
			&cli.BoolFlag{Name: "layers", Usage: "include the per-layer breakdown in --json output"},
			&cli.BoolFlag{Name: "json", Usage: "print the result as JSON"},
			&cli.BoolFlag{Name: "force", Aliases: []string{"f"}, Usage: "overwrite an existing --plot file"},
			&cli.BoolFlag{Name: "quiet", Aliases: []string{"q"}, Usage: "no progress lines"},
			&cli.StringFlag{Name: "device", Value: "cpu", Usage: "where the figures are for: cpu (shape-only measurement), or cuda in a binary built with `make cuda`"},
		},
		Action: memoryAction,
		OnUsageError: func(c *cli.Context, err error, isSub bool) error {
			return cli.Exit(fmt.Sprintf("%v (see abnconvert memory --help)", err), ExitBadInput)
		},
	}
}

func memoryAction(c *cli.Context) error {
	if c.NArg() != 1 {
		return cli.Exit("memory takes one checkpoint path (see abnconvert memory --help)", ExitBadInput)
	}
	if _, err := backendFor(c.String("device")); err != nil {
		return cli.Exit(err.Error(), ExitBadInput)
	}
	opt := memory.Options{
		Input: c.Args().First(), Arch: c.String("arch"), ReLU: c.String("relu"), Slope: c.Float64("slope"),
		Batch: c.Int("batch"), Size: c.Int("size"),
	}
	if s := c.String("budget"); s != "" {
		b, err := ParseBytes(s)
		if err != nil {
			return cli.Exit(fmt.Sprintf("--budget %q: %v", s, err), ExitBadInput)
		}
		opt.Budget = b
	}
	plot := c.String("plot")
	if plot != "" && !c.Bool("force") {
		if _, err := os.Stat(plot); err == nil {
			return cli.Exit(plot+": already exists (use --force to overwrite)", ExitBadInput)
		}
	}
	if !c.Bool("quiet") {
		opt.Progress = c.App.ErrWriter
	}
	res, err := memory.Run(opt)
	if err != nil {
		return cli.Exit(oneLine(err.Error()), ExitBadInput)
	}
	if plot != "" {
		b, err := memory.Plot(plot, res)
		if err == nil {
			err = writeAtomic(plot, b)
		}
		if err != nil {
			return cli.Exit(oneLine(err.Error()), ExitBadInput)
		}
	}
	if c.Bool("json") {
		if !c.Bool("layers") {
			res.Original.Layers, res.Converted.Layers = nil, nil
		}
		enc := json.NewEncoder(c.App.Writer)
		enc.SetIndent("", "  ")
		return enc.Encode(res)
	}
	writeMemory(c.App.Writer, res)
	return nil
}

func writeMemory(w io.Writer, r *memory.Result) {
	fmt.Fprintf(w, "%s: %s, training step at batch %d, %dx%d, float32 (%s measurement)\n", r.Input, r.Arch, r.Batch, r.Size, r.Size, r.Backend)
	fmt.Fprintf(w, "%-40s %14s %14s %8s", "", "saved for bwd", "peak", "saving")
	if r.Budget > 0 {
		fmt.Fprintf(w, " %12s", "max batch")
	}
	fmt.Fprintln(w)
	for _, t := range r.Techniques {
		fmt.Fprintf(w, "%-40s %10.1f MiB %10.1f MiB %7.1f%%", t.Name, mibf(t.SavedBytes), mibf(t.PeakBytes), 100*t.Saving)
		if r.Budget > 0 {
			fmt.Fprintf(w, " %12d", t.MaxBatch)
		}
		fmt.Fprintln(w)
	}
	if r.Budget > 0 {
		fmt.Fprintf(w, "max batch: the largest batch whose parameters (%.1f MiB) plus peak fit %.2f GiB, measured\n", mibf(r.Original.ParamBytes), float64(r.Budget)/(1<<30))
	}
}

func mibf(b int64) float64 { return float64(b) / (1 << 20) }

// ParseBytes reads sizes such as 16GiB, 500MB, 1.5G or 1048576.
func ParseBytes(s string) (int64, error) {
	t := strings.TrimSpace(s)
	units := []struct {
		suffix string
		mult   float64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40},
		{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
		{"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}, {"T", 1 << 40}, {"B", 1}}
	mult := 1.0
	for _, u := range units {
		if strings.HasSuffix(t, u.suffix) {
			mult = u.mult
			t = strings.TrimSpace(strings.TrimSuffix(t, u.suffix))
			break
		}
	}
	v, err := strconv.ParseFloat(t, 64)
	if err != nil || v <= 0 || v*mult > 1<<62 {
		return 0, fmt.Errorf("want a positive size such as 16GiB or 500MB")
	}
	return int64(v * mult), nil
}

// writeAtomic writes small outputs (plots) through a temporary file.
func writeAtomic(path string, data []byte) error {
	f, err := os.CreateTemp(dirOf(path), ".abnconvert-*")
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		os.Remove(f.Name())
		return fmt.Errorf("%s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		os.Remove(f.Name())
		return fmt.Errorf("%s: %w", path, err)
	}
	os.Chmod(f.Name(), 0o644)
	if err := os.Rename(f.Name(), path); err != nil {
		os.Remove(f.Name())
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

func dirOf(path string) string {
	if i := strings.LastIndex(path, "/"); i >= 0 {
		return path[:i+1]
	}
	return "."
}
