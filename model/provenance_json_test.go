package model

import (
	"bytes"
	"encoding/json"
	"math"
	"math/rand"
	"testing"
)

// TestEncodeAsMarshal: Encode writes the bytes json.Marshal writes, for
// records with every kind of string, float, nil and empty value, and for
// random ones; a value JSON cannot hold gets json.Marshal's error.
func TestEncodeAsMarshal(t *testing.T) {
	odd := []string{"", "plain", `quote " back \ slash`, "<script>&amp;</script>", "\b\f\n\r\t\x00\x01\x1f\x7f",
		"é ü 漢字 😀", "\u2028 line \u2029 para", "bad \xff\xfe utf-8 \xe2\x82", "features.denseblock1.denselayer1.norm1"}
	floats := []float64{0, math.Copysign(0, -1), 1e-5, 1e-6, 9.99e-7, 1e-7, 1e20, 1e21, 123.456, -2.5e-10, 5e-324,
		math.MaxFloat64, 0.01, 1.0 / 3, -1e300, 1e-100}
	records := []*Provenance{
		{},
		{Sites: []Site{}, BNEps: map[string]float64{}, Flips: map[string][]int{}},
		{Tool: "abnconvert", Version: "dev", Schema: 1, Input: FileDigest{File: "x.pth", SHA256: "ab", Method: DigestZipRecords},
			Structure: StructureSource{Source: SourceRecogniser, SHA256: "cd"}, Arch: "auto", Recognised: "densenet201",
			ReLU: "leaky", Slope: 0.01, Sync: true, TinyGamma: "exact", ONNXOps: "custom",
			BNEps: map[string]float64{"b": 1e-5, "a": 1e-3, "B": 0.001, "a.b": 2e-7},
			Flips: map[string][]int{"z": {1, 2, 3}, "y": nil, "x": {}, "w": {-1, 0, 1 << 40}},
			Sites: []Site{{Node: "n", Op: "InPlaceABN", Activation: "relu", OpActivation: "leaky_relu", OpActivationParam: 0.01,
				Outcome: "folded", FoldedChannels: []int{0, 5}, FoldedInto: []string{"conv.weight", "<b>"}, FlippedChannels: []int{},
				TinyGammaChannels: []int{7}, TinyGammaExactChannels: []int{3, 4}}, {FoldedInto: []string{}}, {}}},
	}
	for _, s := range odd {
		for _, f := range floats {
			records = append(records, &Provenance{Tool: s, Version: s, Arch: s, Slope: f, BNEps: map[string]float64{s: f, s + "x": -f},
				Input: FileDigest{File: s, Method: s}, Structure: StructureSource{File: s},
				Flips: map[string][]int{s: {1}}, Sites: []Site{{Node: s, ActivationNode: s, OpActivationParam: f, FoldedInto: []string{s}}}})
		}
	}
	rng := rand.New(rand.NewSource(1))
	str := func() string {
		if rng.Intn(3) == 0 {
			return odd[rng.Intn(len(odd))]
		}
		b := make([]byte, rng.Intn(12))
		for i := range b {
			b[i] = byte(rng.Intn(256))
		}
		return string(b)
	}
	ints := func() []int {
		switch rng.Intn(4) {
		case 0:
			return nil
		case 1:
			return []int{}
		}
		v := make([]int, rng.Intn(20)+1)
		for i := range v {
			v[i] = rng.Intn(2000) - 10
		}
		return v
	}
	flt := func() float64 {
		if rng.Intn(2) == 0 {
			return floats[rng.Intn(len(floats))]
		}
		return math.Float64frombits(rng.Uint64()&^(0x7ff<<52) | uint64(rng.Intn(0x7ff))<<52)
	}
	for range 300 {
		p := &Provenance{Tool: str(), Version: str(), Schema: rng.Intn(5) - 1, Input: FileDigest{str(), str(), str()},
			Structure: StructureSource{str(), str(), str()}, Arch: str(), Recognised: str(), ReLU: str(), Slope: flt(),
			Sync: rng.Intn(2) == 0, TinyGamma: str(), ONNXOps: str(), BNEps: map[string]float64{}, Flips: map[string][]int{}}
		for range rng.Intn(10) {
			p.BNEps[str()] = flt()
			p.Flips[str()] = ints()
		}
		if rng.Intn(5) > 0 {
			p.Sites = []Site{}
			for range rng.Intn(6) {
				s := Site{Node: str(), Op: str(), Activation: str(), ActivationNode: str(), OpActivation: str(),
					Outcome: str(), FoldedChannels: ints(), FlippedChannels: ints(), TinyGammaChannels: ints(), TinyGammaExactChannels: ints()}
				if rng.Intn(2) == 0 {
					s.OpActivationParam = flt()
				}
				if rng.Intn(2) == 0 {
					s.FoldedInto = []string{str(), str()}
				}
				p.Sites = append(p.Sites, s)
			}
		}
		records = append(records, p)
	}
	for i, p := range records {
		want, werr := json.Marshal(p)
		got, gerr := p.Encode()
		if werr != nil || gerr != nil {
			t.Fatalf("record %d: Encode error %v, json.Marshal error %v", i, gerr, werr)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("record %d:\nEncode:       %s\njson.Marshal: %s", i, got, want)
		}
	}
	for _, bad := range []float64{math.NaN(), math.Inf(1), math.Inf(-1)} {
		for _, p := range []*Provenance{{Slope: bad}, {BNEps: map[string]float64{"x": bad}}, {Sites: []Site{{OpActivationParam: bad}}}} {
			_, werr := json.Marshal(p)
			_, gerr := p.Encode()
			if werr == nil || gerr == nil || werr.Error() != gerr.Error() {
				t.Errorf("%v: Encode error %v, json.Marshal error %v", bad, gerr, werr)
			}
		}
	}
}
