// Package pb holds Go types generated from ONNX's onnx.proto (onnx 1.12,
// IR version 8), the lossless representation the onnx package reads into
// and writes from. Generated messages keep fields they do not know (newer
// IR versions) as unknown fields and marshal them back, which is what makes
// a read-write round trip lossless.
//
// onnx.proto is copied from Debian's python3-onnx
// (/usr/lib/python3/dist-packages/onnx/onnx.proto, Apache-2.0). To
// regenerate onnx.pb.go (protoc from Debian's protobuf-compiler, and
// go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12):
//
//	go generate ./onnx/internal/pb
package pb

//go:generate protoc --go_out=. --go_opt=paths=source_relative --go_opt=Monnx.proto=github.com/abnconvert/abnconvert/onnx/internal/pb onnx.proto
