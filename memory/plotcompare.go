package memory

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"strings"
)

// comparePalette gives each row its colour, the same in both panels.
var comparePalette = []string{
	"#000000", "#1f77b4", "#17becf", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
	"#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#393b79", "#ad494a",
}

// panel is one chart of the comparison figure.
type panel struct {
	title, xlabel, ylabel string
	xs                    []float64
	xticks                []string
	lines                 [][]float64 // per row, one y (GiB) per x; nil rows are skipped
}

// PlotComparison draws a Comparison made with Options.Curves as SVG: memory
// that must fit (parameters plus the step's peak) against batch size for
// every row and, for DenseNets, the bytes kept for backward against depth
// (densenet121 to 264), the figure of the memory-efficient DenseNet report.
func PlotComparison(path string, c *Comparison) ([]byte, error) {
	if strings.ToLower(filepath.Ext(path)) != ".svg" {
		return nil, fmt.Errorf("%s: --compare --plot writes .svg", path)
	}
	if len(c.Batches) == 0 {
		return nil, errors.New("the comparison has no curves (measure it with Options.Curves)")
	}
	var panels []panel
	p := panel{title: fmt.Sprintf("parameters + peak of one training step, %dx%d", c.Size, c.Size), xlabel: "batch size", ylabel: "GiB"}
	for _, b := range c.Batches {
		p.xs = append(p.xs, float64(b))
		p.xticks = append(p.xticks, fmt.Sprint(b))
	}
	for _, r := range c.Rows {
		var ys []float64
		for _, pt := range r.ByBatch {
			ys = append(ys, gib(pt.TotalBytes))
		}
		p.lines = append(p.lines, ys)
	}
	panels = append(panels, p)
	if len(c.Depth) > 0 {
		d := panel{title: fmt.Sprintf("kept for backward by DenseNets of growing depth, batch %d, %dx%d", c.Batch, c.Size, c.Size), xlabel: "depth", ylabel: "GiB"}
		for _, pt := range c.Depth {
			d.xs = append(d.xs, float64(pt.Depth))
			tick := fmt.Sprint(pt.Depth)
			if n := strings.TrimPrefix(pt.Name, "densenet"); n != tick {
				tick += " (" + pt.Name + ")"
			}
			d.xticks = append(d.xticks, tick)
		}
		for _, r := range c.Rows {
			var ys []float64
			for _, pt := range c.Depth {
				f, ok := pt.Rows[r.Key]
				if !ok {
					ys = nil
					break
				}
				ys = append(ys, gib(f.SavedBytes))
			}
			d.lines = append(d.lines, ys)
		}
		panels = append(panels, d)
	}
	return comparisonSVG(c, panels), nil
}

func gib(b int64) float64 { return float64(b) / (1 << 30) }

func comparisonSVG(c *Comparison, panels []panel) []byte {
	const PW, PH, L, R, T, B, legendW = 520.0, 400.0, 60.0, 30.0, 60.0, 60.0, 400.0
	W := float64(len(panels))*PW + legendW
	H := PH + 20
	var b bytes.Buffer
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%g" height="%g" font-family="sans-serif" font-size="12">`+"\n", W, H)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="%g" y="22" font-size="15">%s</text>`+"\n", L,
		xmlEscape(fmt.Sprintf("%s: training memory per technique, measured in abnconvert's runtime", c.Arch)))
	for k, p := range panels {
		x0 := float64(k) * PW
		xmin, xmax := p.xs[0], p.xs[len(p.xs)-1]
		ymax := 0.0
		for _, ys := range p.lines {
			for _, y := range ys {
				ymax = math.Max(ymax, y)
			}
		}
		ymax = niceCeil(ymax)
		// Linear axes: memory is affine in the batch, and the depth
		// panel is about whether it is linear in depth.
		fx := func(v float64) float64 {
			if xmax == xmin {
				return x0 + L
			}
			return x0 + L + (PW-L-R)*(v-xmin)/(xmax-xmin)
		}
		fy := func(v float64) float64 { return PH - B - (PH-T-B)*v/ymax }
		fmt.Fprintf(&b, `<text x="%g" y="%g" font-size="13">%s</text>`+"\n", x0+L, T-14, xmlEscape(p.title))
		for i := 0; i <= 5; i++ {
			v := ymax * float64(i) / 5
			fmt.Fprintf(&b, `<line x1="%g" x2="%g" y1="%.1f" y2="%.1f" stroke="#ddd"/><text x="%g" y="%.1f" text-anchor="end">%s</text>`+"\n",
				x0+L, x0+PW-R, fy(v), fy(v), x0+L-6, fy(v)+4, trimFloat(v))
		}
		labelled := math.Inf(1)
		for i := len(p.xs) - 1; i >= 0; i-- {
			x := p.xs[i]
			fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%g" y2="%g" stroke="#eee"/>`+"\n", fx(x), fx(x), T, PH-B)
			// Label ticks from the right while they do not crowd.
			if labelled-fx(x) >= 8*float64(len(p.xticks[i]))+6 {
				fmt.Fprintf(&b, `<text x="%.1f" y="%g" text-anchor="middle">%s</text>`+"\n", fx(x), PH-B+16, xmlEscape(p.xticks[i]))
				labelled = fx(x)
			}
		}
		fmt.Fprintf(&b, `<text x="%g" y="%g" text-anchor="middle">%s</text>`+"\n", x0+(L+PW-R)/2, PH-B+36, xmlEscape(p.xlabel))
		fmt.Fprintf(&b, `<text x="%g" y="%g" transform="rotate(-90 %g %g)" text-anchor="middle">%s</text>`+"\n", x0+16, (T+PH-B)/2, x0+16, (T+PH-B)/2, p.ylabel)
		for r, ys := range p.lines {
			if len(ys) != len(p.xs) {
				continue
			}
			var pts []string
			for i, y := range ys {
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", fx(p.xs[i]), fy(y)))
			}
			col := comparePalette[r%len(comparePalette)]
			dash := ""
			if strings.HasPrefix(c.Rows[r].Key, "inplace-abn") {
				dash = ` stroke-dasharray="6 3"`
			}
			fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="1.8"%s points="%s"><title>%s</title></polyline>`+"\n", col, dash, strings.Join(pts, " "), xmlEscape(c.Rows[r].Name))
		}
	}
	lx := float64(len(panels))*PW + 10
	for r, row := range c.Rows {
		y := T + float64(r)*20
		col := comparePalette[r%len(comparePalette)]
		dash := ""
		if strings.HasPrefix(row.Key, "inplace-abn") {
			dash = ` stroke-dasharray="6 3"`
		}
		fmt.Fprintf(&b, `<line x1="%g" x2="%g" y1="%g" y2="%g" stroke="%s" stroke-width="2"%s/><text x="%g" y="%g">%s</text>`+"\n",
			lx, lx+24, y, y, col, dash, lx+30, y+4, xmlEscape(row.Name))
	}
	b.WriteString("</svg>\n")
	return b.Bytes()
}

// niceCeil rounds v up to a round number (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8
// times a power of ten), so that fifths of it read well.
func niceCeil(v float64) float64 {
	if v <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10} {
		if m*p >= v {
			return m * p
		}
	}
	return 10 * p
}

func trimFloat(v float64) string {
	s := fmt.Sprintf("%.2f", v)
	s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	return s
}
