package command

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/memory"
	"github.com/abnconvert/abnconvert/model"
	"github.com/abnconvert/abnconvert/output"
	"github.com/abnconvert/abnconvert/runtime"
)

func memoryCommand() *cli.Command {
	return &cli.Command{
		Name:  "memory",
		Usage: "measure the training memory of a checkpoint's network before and after conversion",
		UsageText: "abnconvert memory [--batch N --size N] [--budget 16GiB] [--plot mem.svg] [--json] IN\n" +
			"   abnconvert memory --compare [--max-batch] [--budget 16GiB] [--plot cmp.svg] [--json] IN\n\n" +
			"Runs one training step (forward and backward) of the original network and of its\n" +
			"default conversion in abnconvert's runtime, on a backend that allocates through the\n" +
			"runtime's allocator without computing, and reports the bytes kept for the backward\n" +
			"pass at the end of the forward (saved_bytes: what PyTorch's saved-tensor hooks\n" +
			"count; parameters excluded), the peak over forward and backward, and per technique.\n\n" +
			"--compare measures every memory technique and combination the same way, each by\n" +
			"running the step under it: InPlace-ABN, shared DenseNet buffers, gradient\n" +
			"checkpointing (one segment per block, or Chen et al.'s sqrt(n) segments), 16-bit\n" +
			"activations as torch.autocast keeps them, and InPlace-ABN with each. Per row: saved\n" +
			"and peak bytes, the saving, the extra compute (recomputed FLOPs over the step's), and\n" +
			"whether outputs stay exact, with the drift from the baseline measured by running\n" +
			"every row with real arithmetic on the CPU at a small size.\n\n" +
			"--device cuda (a binary built with make cuda) runs the step on the GPU instead: the\n" +
			"same figures from the CUDA backend's allocator, and, after each forward, the device's\n" +
			"memory as the allocator, its pool and the driver (cuMemGetInfo) see it.\n\n" +
			"Exit codes: 0 done, 2 bad input, 3 internal error, 4 an op the runtime does not model.",
		Flags: []cli.Flag{
			archFlag(), reluFlag(), slopeFlag(), tinyGammaFlag(),
			&cli.StringFlag{Name: "graph", Usage: "an ONNX export that supplies the structure of a custom architecture (as for convert)"},
			&cli.IntFlag{Name: "batch", Value: 8, Usage: "batch size"},
			&cli.IntFlag{Name: "size", Value: 224, Usage: "input height and width"},
			&cli.StringFlag{Name: "budget", Usage: "also find the largest batch whose parameters and peak fit this much memory (e.g. 16GiB, 500MB)"},
			&cli.BoolFlag{Name: "compare", Usage: "one row per memory technique and combination (see above)"},
			&cli.BoolFlag{Name: "max-batch", Usage: "find each row's largest batch within --budget (16GiB when not given)"},
			&cli.StringFlag{Name: "half", Value: "bfloat16", Usage: "16-bit format of the --compare half-precision rows: bfloat16 (what CPU autocast uses) or float16"},
			&cli.BoolFlag{Name: "no-drift", Usage: "--compare: skip running every row with real arithmetic to measure its drift"},
			&cli.IntFlag{Name: "drift-size", Usage: "--compare: input height and width of the drift step (default min(--size, 64), batch 2)"},
			&cli.StringFlag{Name: "plot", Usage: "draw memory live per layer, before and after, to this .svg or .png file; with --compare, memory against batch size per row (and against depth for DenseNets), .svg"},
			&cli.BoolFlag{Name: "layers", Usage: "include the per-layer breakdown (--compare: the checkpoint segments) in --json output"},
			&cli.BoolFlag{Name: "json", Usage: "print the result as JSON"},
			&cli.BoolFlag{Name: "force", Aliases: []string{"f"}, Usage: "overwrite an existing --plot file"},
			&cli.BoolFlag{Name: "fsync", Usage: "flush the --plot file to disk before renaming it into place"},
			&cli.BoolFlag{Name: "quiet", Aliases: []string{"q"}, Usage: "no progress lines"},
			&cli.StringFlag{Name: "device", Value: "cpu", Usage: "where the step runs: cpu (shape-only measurement, no arithmetic), or cuda (on the GPU, cross-checked with the driver; a binary built with make cuda)"},
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
	var progress io.Writer
	if !c.Bool("quiet") {
		progress = c.App.ErrWriter
	}
	nb, err := backendFor(c.String("device"), progress)
	if err != nil {
		return err
	}
	if err := checkInputSize(c.Int("batch"), c.Int("size")); err != nil {
		return cli.Exit(err.Error(), ExitBadInput)
	}
	opt := memory.Options{
		Input: c.Args().First(), Arch: c.String("arch"), ReLU: c.String("relu"), Slope: c.Float64("slope"), TinyGamma: c.String("tiny-gamma"),
		Batch: c.Int("batch"), Size: c.Int("size"),
	}
	// On the CPU the shape-only backend measures (the CPU backend's figures
	// are identical, tested, and it would spend minutes computing them).
	if c.String("device") == "cuda" {
		if c.Bool("compare") {
			return cli.Exit("--compare --device cuda: the comparison measures on the shape-only backend (its 16-bit rows need storage the CUDA backend does not have); run memory --device cuda without --compare", ExitBadInput)
		}
		opt.NewBackend = nb
	}
	opt.Source, opt.Structure = networkSource(opt.Input, model.Options{Arch: opt.Arch, Graph: c.String("graph")})
	if s := c.String("budget"); s != "" {
		b, err := ParseBytes(s)
		if err != nil {
			return cli.Exit(fmt.Sprintf("--budget %q: %v", s, err), ExitBadInput)
		}
		opt.Budget = b
	} else if c.Bool("max-batch") {
		opt.Budget = 16 << 30
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
	if c.Bool("compare") {
		return compareAction(c, opt, plot)
	}
	res, err := memory.Run(opt)
	if err != nil {
		return err
	}
	if plot != "" {
		b, err := memory.Plot(plot, res)
		if err == nil {
			err = writeOutput(c, plot, b)
		}
		if err != nil {
			return err
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

// writeOutput writes a file the command made (a --plot) as a one-file
// output set: staged beside path and renamed into place, never over the
// command's input, removed on a signal.
func writeOutput(c *cli.Context, path string, data []byte) error {
	set := output.New(output.Options{Force: c.Bool("force"), Sync: c.Bool("fsync")})
	defer set.Abort()
	set.Protect(c.Args().Slice()...)
	set.Protect(c.String("graph"))
	if err := set.WriteFile(path, data); err != nil {
		return err
	}
	return set.Commit()
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
	for _, v := range []struct {
		name string
		f    memory.Figures
	}{{"original", r.Original}, {"converted", r.Converted}} {
		d := v.f.Device
		if d == nil {
			continue
		}
		verdict := "consistent"
		if !d.Consistent {
			verdict = "INCONSISTENT"
		}
		fmt.Fprintf(w, "device, %s: after the forward live %.1f MiB, pool %.1f MiB, driver %.1f MiB; pool peak %.1f MiB of %.1f GiB: %s\n",
			v.name, mibf(d.LiveBytes), mibf(d.ReservedBytes), mibf(d.DriverUsedBytes), mibf(d.PeakReservedBytes), float64(d.TotalBytes)/(1<<30), verdict)
	}
	if r.Original.Device != nil {
		fmt.Fprintln(w, "device: live is the allocator's count (parameters included), pool what its cache holds from the driver\n"+
			"(emptied before each step), driver the device's used memory since abnconvert opened it; consistent:\n"+
			"driver >= pool >= live, and the pool's peak holds the step's peak plus parameters")
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

// compareAction runs memory --compare.
func compareAction(c *cli.Context, opt memory.Options, plot string) error {
	switch h := strings.ToLower(c.String("half")); h {
	case "bfloat16", "bf16":
		opt.Half = runtime.BFloat16
	case "float16", "fp16", "half":
		opt.Half = runtime.Float16
	default:
		return cli.Exit(fmt.Sprintf("--half %q: want bfloat16 or float16", h), ExitBadInput)
	}
	if n := c.Int("drift-size"); n < 0 {
		return cli.Exit("--drift-size must be positive", ExitBadInput)
	} else {
		opt.DriftSize = n
	}
	opt.NoDrift = c.Bool("no-drift")
	opt.Curves = plot != ""
	if plot != "" && !strings.EqualFold(filepath.Ext(plot), ".svg") {
		return cli.Exit(plot+": --compare --plot writes .svg", ExitBadInput)
	}
	res, err := memory.Compare(opt)
	if err != nil {
		return err
	}
	if plot != "" {
		b, err := memory.PlotComparison(plot, res)
		if err == nil {
			err = writeOutput(c, plot, b)
		}
		if err != nil {
			return err
		}
	}
	if c.Bool("json") {
		if !c.Bool("layers") {
			res.Segments = nil
		}
		enc := json.NewEncoder(c.App.Writer)
		enc.SetIndent("", "  ")
		return enc.Encode(res)
	}
	writeComparison(c.App.Writer, res)
	return nil
}

// writeComparison prints the table.
func writeComparison(w io.Writer, r *memory.Comparison) {
	fmt.Fprintf(w, "%s: %s, training step at batch %d, %dx%d (%s measurement), parameters %.1f MiB\n", r.Input, r.Arch, r.Batch, r.Size, r.Size, r.Backend, mibf(r.ParamBytes))
	fmt.Fprintf(w, "%-52s %13s %13s %7s %8s", "technique", "saved for bwd", "peak", "saving", "extra")
	if r.Budget > 0 {
		fmt.Fprintf(w, " %9s", "max batch")
	}
	fmt.Fprintf(w, "  %s\n", "outputs")
	for i, row := range r.Rows {
		name := row.Name
		if row.Segments > 0 {
			name = fmt.Sprintf("%s (%d)", name, row.Segments)
		}
		fmt.Fprintf(w, "%-52s %9.1f MiB %9.1f MiB %6.1f%% %7.2f%%", name, mibf(row.SavedBytes), mibf(row.PeakBytes), 100*row.Saving, 100*row.ExtraCompute)
		if r.Budget > 0 {
			fmt.Fprintf(w, " %9d", row.MaxBatch)
		}
		if i == 0 {
			fmt.Fprintf(w, "  reference\n")
			continue
		}
		fmt.Fprintf(w, "  %s\n", outcome(row))
	}
	fmt.Fprintf(w, "saving: of the baseline's bytes kept for backward; extra: recomputed FLOPs over one step's forward and backward FLOPs;\n")
	fmt.Fprintf(w, "(n): checkpoint segments. Half-precision rows keep activations, their gradients and the weight copies convolutions\n")
	fmt.Fprintf(w, "compute with in %s, as torch.autocast does.\n", r.Half)
	if d := r.DriftSetup; d != nil {
		fmt.Fprintf(w, "drift: largest difference from the baseline's output and input gradient over their largest magnitude, one training\n")
		fmt.Fprintf(w, "step with real arithmetic on the CPU at batch %d, %dx%d.\n", d.Batch, d.Size, d.Size)
	}
	if r.Budget > 0 {
		fmt.Fprintf(w, "max batch: the largest batch whose parameters plus peak fit %.2f GiB, measured.\n", float64(r.Budget)/(1<<30))
	}
}

// outcome says whether a row keeps the baseline's numbers, and by how much
// it moves them.
func outcome(r memory.Row) string {
	var drift string
	if d := r.Drift; d != nil {
		if d.OutputMaxAbs == 0 && d.InputGradMaxAbs == 0 {
			drift = "bitwise identical"
		} else {
			drift = fmt.Sprintf("drift: output %.1e, input grad %.1e", d.OutputMaxRel, d.InputGradMaxRel)
		}
	}
	if r.Exact {
		if drift == "" {
			return "exact"
		}
		return "exact (" + drift + ")"
	}
	if drift == "" {
		return r.Note
	}
	return r.Note + "; " + drift
}

// networkSource opens path as a conversion does (every state-dict format,
// whole pickled modules, --graph), for the memory measurements: each open
// is a fresh view, and Structure builds a fresh graph over a view.
func networkSource(path string, mopt model.Options) (memory.Source, func(graph.Weights) (*graph.Graph, *arch.Match, error)) {
	nets := map[graph.Weights]*model.Network{}
	src := func() (graph.Weights, func() error, error) {
		n, err := model.OpenNetwork(path, mopt)
		if err != nil {
			return nil, nil, err
		}
		nets[n.Weights] = n
		return n.Weights, func() error { delete(nets, n.Weights); n.Close(); return nil }, nil
	}
	structure := func(w graph.Weights) (*graph.Graph, *arch.Match, error) {
		n, ok := nets[w]
		if !ok {
			return nil, nil, fmt.Errorf("%s: internal error: weights not opened by this source", path)
		}
		return n.Rebuild(mopt)
	}
	return src, structure
}

// maxInputElems bounds --batch x --size x --size: a layer's activation is
// at most that many pixels times its channels (a few thousand) times 8
// bytes, and each such byte count, summed over the layers, must stay far
// inside int64 and exact in a float64 (2^53) where the report divides it.
// 2^32 pixels of a batch (a batch of 85,000 images at 224x224) is far
// past any GPU, with room for 2^21 bytes of channels per pixel.
const maxInputElems = 1 << 32

// checkInputSize refuses sizes whose byte counts would overflow, naming
// the limit, rather than printing nonsense figures.
func checkInputSize(batch, size int) error {
	if batch < 1 || size < 1 {
		return fmt.Errorf("--batch %d --size %d: both must be at least 1", batch, size)
	}
	if size > maxInputElems || batch > maxInputElems/size/size {
		return fmt.Errorf("--batch %d --size %d: batch x size x size = %.3g pixels, over the %d (2^32) abnconvert can count in bytes exactly; measure a smaller batch and scale (the activations grow linearly with --batch)", batch, size, float64(batch)*float64(size)*float64(size), maxInputElems)
	}
	return nil
}
