package model

import (
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/pth"
)

// TestSequentialRefusals: hand-built module trees the chain builder must
// refuse, each with the module path and the reason.
func TestSequentialRefusals(t *testing.T) {
	i := func(v int64) pth.Value { return v }
	pair := func(a, b int64) pth.Value { return &pth.Tuple{Items: []pth.Value{a, b}} }
	conv := func(attrs map[string]pth.Value) *pth.Module {
		a := map[string]pth.Value{"in_channels": i(3), "out_channels": i(4), "groups": i(1), "padding_mode": "zeros",
			"transposed": false, "kernel_size": pair(3, 3), "stride": pair(1, 1), "dilation": pair(1, 1), "padding": pair(1, 1)}
		for k, v := range attrs {
			a[k] = v
		}
		return &pth.Module{Class: "torch.nn.modules.conv.Conv2d", Attrs: a}
	}
	mod := func(class string, attrs map[string]pth.Value) *pth.Module {
		return &pth.Module{Class: class, Attrs: attrs}
	}
	seq := func(children ...*pth.Module) *pth.Module {
		m := &pth.Module{Class: sequentialClass}
		for k, c := range children {
			m.Children = append(m.Children, pth.Child{Name: string(rune('0' + k)), Module: c})
		}
		return m
	}
	cases := []struct {
		name string
		m    *pth.Module
		want string
	}{
		{"custom root", mod("__main__.Net", nil), "only nn.Sequential chains"},
		{"starts with relu", seq(mod("torch.nn.modules.activation.ReLU", nil)), "must start with a Conv2d"},
		{"reflect padding", seq(conv(map[string]pth.Value{"padding_mode": "reflect"})), `0 (Conv2d): padding_mode "reflect"`},
		{"same padding, even kernel", seq(conv(map[string]pth.Value{"padding": "same", "kernel_size": pair(2, 2)})), "not expressible as symmetric padding"},
		{"flatten all", seq(conv(nil), mod("torch.nn.modules.flatten.Flatten", map[string]pth.Value{"start_dim": i(0), "end_dim": i(-1)})), "only Flatten(start_dim=1"},
		{"bn features", seq(conv(nil), mod("torch.nn.modules.batchnorm.BatchNorm2d", map[string]pth.Value{"num_features": i(5), "eps": 1e-5, "momentum": 0.1, "affine": true, "track_running_stats": true})), "num_features 5, but 4 channels reach it"},
		{"bn not affine", seq(conv(nil), mod("torch.nn.modules.batchnorm.BatchNorm2d", map[string]pth.Value{"num_features": i(4), "eps": 1e-5, "momentum": 0.1, "affine": false, "track_running_stats": true})), "affine=False"},
		{"torchvision block", seq(conv(nil), &pth.Module{Class: "torchvision.models.resnet.BasicBlock", Children: []pth.Child{{Name: "conv1", Module: conv(nil)}}}), "is not a chain layer"},
		{"max pool indices", seq(conv(nil), mod("torch.nn.modules.pooling.MaxPool2d", map[string]pth.Value{"kernel_size": i(2), "stride": i(2), "padding": i(0), "dilation": i(1), "ceil_mode": false, "return_indices": true})), "return_indices"},
		{"pool kernel", seq(conv(nil), mod("torch.nn.modules.pooling.AvgPool2d", map[string]pth.Value{"kernel_size": "x"})), "kernel_size is x"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, _, err := moduleGraph(c.m, graph.NewMemWeights(), "auto")
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want %q", err, c.want)
			}
		})
	}
}
