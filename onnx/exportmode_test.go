package onnx

import (
	"path/filepath"
	"testing"
)

func TestExportMode(t *testing.T) {
	tests := []struct{ file, want string }{
		{"tiny_cnn_train.onnx", "train"}, // opset 13: BN's running-statistics outputs
		{"tiny_cnn.onnx", "eval"},
		{"tiny_cnn_op17.onnx", "eval"}, // training_mode=0
	}
	for _, tc := range tests {
		m := mustRead(t, filepath.Join("testdata", tc.file))
		if got := m.ExportMode(); got != tc.want {
			t.Errorf("%s: ExportMode() = %q, want %q", tc.file, got, tc.want)
		}
	}
}
