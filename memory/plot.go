package memory

import (
	"bytes"
	"fmt"
	"image"
	"image/color"
	"image/png"
	"math"
	"path/filepath"
	"strings"

	"golang.org/x/image/font"
	"golang.org/x/image/font/basicfont"
	"golang.org/x/image/math/fixed"

	"github.com/abnconvert/abnconvert/runtime"
)

// series is one line of the plot: memory live after each step of the
// training step, forward then backward.
type series struct {
	name  string
	color color.RGBA
	ys    []float64 // MiB
}

func timeline(layers []runtime.LayerMemory) []float64 {
	var ys []float64
	for _, l := range layers {
		ys = append(ys, float64(l.LiveBytes)/(1<<20))
	}
	for i := len(layers) - 1; i >= 0; i-- {
		ys = append(ys, float64(layers[i].BackwardLiveBytes)/(1<<20))
	}
	return ys
}

var palette = []color.RGBA{{0xc0, 0x39, 0x2b, 0xff}, {0x27, 0x80, 0xc0, 0xff}, {0x27, 0xae, 0x60, 0xff}}

// Plot draws memory live after every step of one training step (forward,
// then backward), before and after conversion, as SVG or PNG by the path's
// extension.
func Plot(path string, r *Result) ([]byte, error) {
	ss := []series{
		{name: "original: " + mib(r.Original.SavedBytes) + " saved for backward, peak " + mib(r.Original.PeakBytes), color: palette[0], ys: timeline(r.Original.Layers)},
		{name: "converted: " + mib(r.Converted.SavedBytes) + " saved for backward, peak " + mib(r.Converted.PeakBytes), color: palette[1], ys: timeline(r.Converted.Layers)},
	}
	title := fmt.Sprintf("%s, batch %d, %dx%d: memory live during one training step", r.Arch, r.Batch, r.Size, r.Size)
	switch strings.ToLower(filepath.Ext(path)) {
	case ".svg":
		return svg(title, ss), nil
	case ".png":
		return pngPlot(title, ss)
	}
	return nil, fmt.Errorf("%s: --plot writes .svg or .png", path)
}

func bounds(ss []series) (n int, ymax float64) {
	for _, s := range ss {
		n = max(n, len(s.ys))
		for _, y := range s.ys {
			ymax = math.Max(ymax, y)
		}
	}
	if ymax == 0 {
		ymax = 1
	}
	return n, ymax * 1.05
}

func svg(title string, ss []series) []byte {
	const W, H, L, R, T, B = 900.0, 480.0, 70.0, 20.0, 40.0, 50.0
	_, ymax := bounds(ss)
	// Each series spans the width: the graphs differ in node count (fused
	// layers), and forward/backward meet in the middle for both.
	xs := func(s series, i int) float64 { return L + (W-L-R)*float64(i)/math.Max(1, float64(len(s.ys)-1)) }
	y := func(v float64) float64 { return H - B - (H-T-B)*v/ymax }
	var b bytes.Buffer
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%g" height="%g" font-family="sans-serif" font-size="12">`+"\n", W, H)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="%g" y="22" font-size="14">%s</text>`+"\n", L, xmlEscape(title))
	for k := 0; k <= 5; k++ {
		v := ymax * float64(k) / 5
		fmt.Fprintf(&b, `<line x1="%g" x2="%g" y1="%.1f" y2="%.1f" stroke="#ddd"/><text x="%g" y="%.1f" text-anchor="end">%.0f MiB</text>`+"\n", L, W-R, y(v), y(v), L-6, y(v)+4, v)
	}
	mid := (L + W - R) / 2
	fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%g" y2="%g" stroke="#999" stroke-dasharray="4 3"/>`+"\n", mid, mid, T, H-B)
	fmt.Fprintf(&b, `<text x="%.1f" y="%g" text-anchor="middle">forward</text><text x="%.1f" y="%g" text-anchor="middle">backward</text>`+"\n", (L+mid)/2, H-B+20, (mid+W-R)/2, H-B+20)
	fmt.Fprintf(&b, `<text x="%g" y="%g" text-anchor="middle">layer (in execution order)</text>`+"\n", (L+W-R)/2, H-10)
	for i, s := range ss {
		var pts []string
		for j, v := range s.ys {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", xs(s, j), y(v)))
		}
		c := fmt.Sprintf("#%02x%02x%02x", s.color.R, s.color.G, s.color.B)
		fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>`+"\n", c, strings.Join(pts, " "))
		fmt.Fprintf(&b, `<rect x="%g" y="%g" width="12" height="3" fill="%s"/><text x="%g" y="%g">%s</text>`+"\n", L+10, T+8+float64(i)*16, c, L+28, T+13+float64(i)*16, xmlEscape(s.name))
	}
	b.WriteString("</svg>\n")
	return b.Bytes()
}

func mib(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }

func xmlEscape(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;", `"`, "&quot;").Replace(s)
}

// pngPlot draws what the SVG draws, labels included (a bitmap font, so
// that the PNG stands alone in a report or a chat): the title, the MiB
// scale on a grid line every fifth of the maximum, the forward/backward
// divide, the axis's name and the legend.
func pngPlot(title string, ss []series) ([]byte, error) {
	const W, H, L, R, T, B = 900, 480, 70, 20, 40, 50
	img := image.NewRGBA(image.Rect(0, 0, W, H))
	for i := range img.Pix {
		img.Pix[i] = 0xff
	}
	_, ymax := bounds(ss)
	xs := func(s series, i int) int { return L + (W-L-R)*i/max(1, len(s.ys)-1) }
	y := func(v float64) int { return H - B - int(float64(H-T-B)*v/ymax) }
	grey := color.RGBA{0xdd, 0xdd, 0xdd, 0xff}
	black := color.RGBA{0x22, 0x22, 0x22, 0xff}
	text(img, L, 22, title, black, false)
	for k := 0; k <= 5; k++ {
		v := ymax * float64(k) / 5
		line(img, L, y(v), W-R, y(v), grey)
		text(img, L-6, y(v)+4, fmt.Sprintf("%.0f MiB", v), black, true)
	}
	mid := (L + W - R) / 2
	for yy := T; yy < H-B; yy += 7 {
		line(img, mid, yy, mid, min(yy+3, H-B), color.RGBA{0x99, 0x99, 0x99, 0xff})
	}
	centre := func(x, y int, s string) { text(img, x-width(s)/2, y, s, black, false) }
	centre((L+mid)/2, H-B+20, "forward")
	centre((mid+W-R)/2, H-B+20, "backward")
	centre((L+W-R)/2, H-10, "layer (in execution order)")
	for i, s := range ss {
		for j := 1; j < len(s.ys); j++ {
			line(img, xs(s, j-1), y(s.ys[j-1]), xs(s, j), y(s.ys[j]), s.color)
		}
		ly := T + 8 + i*16
		for d := 0; d < 3; d++ {
			line(img, L+10, ly+d, L+22, ly+d, s.color)
		}
		text(img, L+28, ly+5, s.name, black, false)
	}
	var b bytes.Buffer
	if err := png.Encode(&b, img); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// face is the PNG's font: x/image's 7x13 bitmap, whole in the binary.
var face = basicfont.Face7x13

func width(s string) int { return font.MeasureString(face, s).Round() }

// text draws s with its baseline at y, starting at x (ending at x when
// right is set).
func text(img *image.RGBA, x, y int, s string, c color.RGBA, right bool) {
	if right {
		x -= width(s)
	}
	d := font.Drawer{Dst: img, Src: image.NewUniform(c), Face: face, Dot: fixed.P(x, y)}
	d.DrawString(s)
}

// line draws with Bresenham's algorithm.
func line(img *image.RGBA, x0, y0, x1, y1 int, c color.RGBA) {
	dx, dy := abs(x1-x0), -abs(y1-y0)
	sx, sy := 1, 1
	if x0 > x1 {
		sx = -1
	}
	if y0 > y1 {
		sy = -1
	}
	e := dx + dy
	for {
		img.SetRGBA(x0, y0, c)
		if x0 == x1 && y0 == y1 {
			return
		}
		e2 := 2 * e
		if e2 >= dy {
			e += dy
			x0 += sx
		}
		if e2 <= dx {
			e += dx
			y0 += sy
		}
	}
}

func abs(v int) int {
	if v < 0 {
		return -v
	}
	return v
}
