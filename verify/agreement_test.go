package verify

import "testing"

// TestDriftAgreement: the argmax agreement follows the output's rank. A
// 2-D output agrees per sample over its classes (top-1); a 4-D one per
// pixel over its channels, so that a segmentation map whose every pixel
// keeps its class reads 100% (a top-1 over the flattened map read 0% at
// cosine 1); other ranks get none.
func TestDriftAgreement(t *testing.T) {
	// (N=1, C=2, H=1, W=4): pixel p's classes are want[p] and want[4+p].
	want := []float32{1, 0, 5, 0 /* channel 0 */, 0, 2, 0, 3 /* channel 1 */}
	same := append([]float32(nil), want...)
	d := drift(same, want, []int{1, 2, 1, 4})
	if d.Top1Agree != nil || d.PixelAgree == nil || *d.PixelAgree != 1 {
		t.Fatalf("4-D, same map: top-1 %v, per-pixel %v; want none and 1", d.Top1Agree, d.PixelAgree)
	}
	// Pixel 1 changes class (0 -> 2 over 2 in channel 0), the others keep theirs.
	moved := []float32{1, 3, 5, 0, 0, 2, 0, 3}
	d = drift(moved, want, []int{1, 2, 1, 4})
	if d.PixelAgree == nil || *d.PixelAgree != 0.75 {
		t.Fatalf("4-D, one pixel of 4 changed: per-pixel %v, want 0.75", d.PixelAgree)
	}
	// The same data as (N=2, classes=4): sample 0's argmax is index 2 in
	// want, 2 in moved; sample 1's is 3 in both.
	d = drift(moved, want, []int{2, 4})
	if d.PixelAgree != nil || d.Top1Agree == nil || *d.Top1Agree != 1 {
		t.Fatalf("2-D: top-1 %v, per-pixel %v; want 1 and none", d.Top1Agree, d.PixelAgree)
	}
	d = drift([]float32{0, 9, 0, 0}, []float32{9, 0, 0, 0}, []int{2, 2})
	if d.Top1Agree == nil || *d.Top1Agree != 0.5 {
		t.Fatalf("2-D, one sample of 2 changed: top-1 %v, want 0.5", d.Top1Agree)
	}
	d = drift(moved, want, []int{2, 2, 2})
	if d.Top1Agree != nil || d.PixelAgree != nil {
		t.Fatalf("3-D: top-1 %v, per-pixel %v; want neither", d.Top1Agree, d.PixelAgree)
	}
}
