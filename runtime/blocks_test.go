package runtime

import "testing"

// The checkpoint blocks of torchvision's families, from their module paths.
func TestBlockOf(t *testing.T) {
	tests := []struct{ name, want string }{
		{"layer1.0.conv1", "layer1.0"},
		{"backbone.layer4.2.bn3", "backbone.layer4.2"},
		{"features.denseblock1.denselayer3.conv2", "features.denseblock1.denselayer3"},
		{"features.transition2.pool", "features.transition2"},
		{"features.0", ""},   // VGG: stages by max pool instead
		{"features.0.0", ""}, // MobileNet's stem
		{"features.3.conv.1.0", "features.3.conv"},
		{"features.5.block.2.fc1", "features.5.block"},
		{"features.2.1.block.0.0", "features.2.1.block"}, // EfficientNet stage 2, block 1
		{"layers.9.1.layers.3", "layers.9.1"},            // MNASNet
		{"trunk_output.block2.block2-0.f.a", "trunk_output.block2.block2-0"},
		{"stage3.4.branch2.0", "stage3.4"},
		{"inception4b.branch2.1.conv", "inception4b"},
		{"Mixed_6c.branch7x7_1.bn", "Mixed_6c"},
		{"classifier.1", ""},
	}
	for _, tc := range tests {
		if got := blockOf(tc.name); got != tc.want {
			t.Errorf("blockOf(%q) = %q, want %q", tc.name, got, tc.want)
		}
	}
}
