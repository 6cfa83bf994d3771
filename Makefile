# abnconvert. `make demo` converts a bundled fixture; `make test` runs every test.
GO      ?= go
PYTHON  ?= /usr/bin/python3
BIN     := bin/abnconvert
VERSION := $(shell git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X github.com/abnconvert/abnconvert/command.Version=$(VERSION)
# urfave/cli's man-page and Markdown generators (never called) pull in a
# Markdown parser whose package initialisation costs every run about
# 0.5 ms: 5.3 to 4.6 ms for `abnconvert --version` (hyperfine, 200 runs).
TAGS    := urfave_cli_no_docs

.PHONY: build demo test gotest platforms quickstart race pytest interop interop-big interop-structure security-torch26 zoo zoo-all zoo-memory verify-fixtures deps fixtures bench clean cuda cuda-test cuda-emu ptx gpu-bench emudriver gpu-emulated torch26 interop-torch26 onnxruntime

build:
	$(GO) build -tags $(TAGS) -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/abnconvert

# The main job on a bundled example: convert a small ResNeXt-layout checkpoint
# made by real torchvision, with its Python module and report, and verify it.
demo: build
	@mkdir -p out
	$(BIN) --input fixtures/testdata/tiny_resnext.pth --output out/tiny_resnext_abn.pth \
		--emit-module out/tiny_resnext_abn.py --report out/tiny_resnext_report.json --force --verify

# The CI check that conversion preserves outputs: every bundled fixture,
# converted under both ReLU policies, verified by the runtime (exit 1 fails).
verify-fixtures: build
	@mkdir -p out
	@set -e; for f in fixtures/testdata/*.pth; do n=$$(basename $$f .pth); \
		for relu in leaky abn; do \
			$(BIN) convert -i $$f -o out/$$n.$$relu.pth --relu $$relu --force --quiet; \
			$(BIN) verify --original $$f --converted out/$$n.$$relu.pth --quiet > out/$$n.$$relu.verify.txt \
				|| { cat out/$$n.$$relu.verify.txt; echo "verify failed: $$n --relu $$relu"; exit 1; }; \
			tail -1 out/$$n.$$relu.verify.txt | sed "s|^|$$n --relu $$relu: |"; \
		done; done

# The README's quick start, run as written (the block between its
# quickstart markers), in a shell that stops at the first failing command,
# with Debian's python3 (torch) first on PATH.
quickstart:
	@sed -n '/^<!-- quickstart -->$$/,/^<!-- \/quickstart -->$$/p' README.md | sed '/^```/d;/^<!--/d' > /tmp/abn-quickstart.sh
	@test -s /tmp/abn-quickstart.sh || { echo "README.md has no quickstart block"; exit 1; }
	PATH=$(dir $(PYTHON)):$$PATH bash -e /tmp/abn-quickstart.sh

# Everything: Go unit and golden tests, the stand-in's tests against autograd,
# and the interop test (real PyTorch loads and reproduces what Go wrote).
test: deps build gotest pytest verify-fixtures quickstart interop

# go test's output read by .ci/gotest.py: each package's closing line, the
# output of failing tests, and every skipped test with its reason; a skip
# that .ci/skips.allow does not list (with why) fails the target.
gotest:
	$(GO) vet ./...
	bash -o pipefail -c '$(GO) test -json ./... | $(PYTHON) .ci/gotest.py .ci/skips.allow'

# Where abnconvert builds: 64-bit Linux (amd64 and arm64, both vetted here);
# elsewhere the build stops at once naming the reason (cmd/abnconvert/
# unsupported.go), which this checks for macOS and Windows.
platforms:
	GOARCH=arm64 $(GO) vet ./...
	@for os in darwin windows; do \
		if GOOS=$$os $(GO) build -o /dev/null ./cmd/abnconvert 2>/tmp/abn-platform.err; then \
			echo "GOOS=$$os: the build succeeded; update cmd/abnconvert/unsupported.go and the README"; exit 1; fi; \
		grep -q abnconvert_builds_only_on_64bit_linux /tmp/abn-platform.err || { cat /tmp/abn-platform.err; \
			echo "GOOS=$$os: the build failed without naming the supported platforms"; exit 1; }; \
		echo "GOOS=$$os: refused as intended ($$(tail -1 /tmp/abn-platform.err))"; done

# The packages whose work runs on goroutines side by side (the copy beside
# the conversion, the placing goroutines, the read-ahead on the directory's
# goroutine, the edits shared among the cores) under the race detector
# (needs cgo: gcc), and the runtime's and verify's (their kernels and
# checks run on goroutines too). CI runs it.
race:
	$(GO) test -race ./pth/ ./output/ ./convert/ ./model/ ./rewrite/ ./command/ ./runtime/ ./verify/

pytest:
	$(PYTHON) fixtures/test_standin.py

interop: build
	$(PYTHON) fixtures/interop.py --bin $(BIN)
	$(PYTHON) fixtures/interop_graph.py --bin $(BIN)
	$(PYTHON) fixtures/acts.py check --bin $(BIN)
	$(PYTHON) fixtures/acts2.py check --bin $(BIN)
	$(PYTHON) fixtures/alias.py check --bin $(BIN)
	$(PYTHON) fixtures/bnparams.py check --bin $(BIN)
	$(PYTHON) fixtures/shape_nets.py check --bin $(BIN)
	$(PYTHON) fixtures/stochdepth.py check --bin $(BIN)
	$(PYTHON) fixtures/probe.py check --bin $(BIN)
	$(PYTHON) fixtures/ckpts.py check --bin $(BIN)
	$(PYTHON) fixtures/weights_only.py check --bin $(BIN)
	$(PYTHON) fixtures/tinygamma.py check --bin $(BIN)
	$(PYTHON) fixtures/messages.py check --bin $(BIN)
	$(PYTHON) fixtures/memory_cases.py check --bin $(BIN)

# inspect --security's verdicts and the training-tool checkpoints checked
# against real torch 1.13 and torch 2.6 (the chroot is required here).
security-torch26: build torch26
	ABN_TORCH26=1 $(PYTHON) fixtures/weights_only.py check --bin $(BIN)
	ABN_TORCH26=1 $(PYTHON) fixtures/ckpts.py check --bin $(BIN)

# The torchvision networks of the conversion issue (resnet50, densenet121,
# resnext50_32x4d, wide_resnet50_2, vgg16_bn), generated on the fly.
interop-big: build
	$(PYTHON) fixtures/interop.py --bin $(BIN) --big --verify-seeds 5
	$(PYTHON) fixtures/shape_tv.py --bin $(BIN)

# Structure from whole pickled modules (dilated ResNet, segmentation, the
# torchvision classifiers) at full size: the converted checkpoint in the
# emitted module against the original, in real torch.
interop-structure: build
	$(PYTHON) fixtures/structure.py full $(BIN) out/structure

# torchvision's BatchNorm networks (issue 12): the pairs fixtures/zoo.py lists in
# EXPECTED_NOW, from the PRESERVE export and the whole pickled module, --relu abn
# and leaky. zoo-all tries every model and says why each fails (not a gate);
# zoo-memory writes bench/zoo-memory.md.
zoo: build
	$(PYTHON) fixtures/zoo.py --bin $(BIN)

zoo-all: build
	$(PYTHON) fixtures/zoo.py --bin $(BIN) --all

zoo-memory: build
	bash bench/zoo_memory.sh

# The Debian 13 chroot with torch 2.6, torchvision 0.21, onnx 1.17 and
# onnxruntime 1.21 (.ci/torch26.sh; built once, about 6 minutes, as root,
# cached in /var/cache/abnconvert/trixie, never committed).
torch26:
	bash .ci/torch26.sh

# The interop tests under torch 2.6: the input checkpoints and whole pickled
# modules written by torch 2.6 convert, and what abnconvert writes loads in
# torch 2.6 (weights_only=True, the defaults, mmap) and reproduces the
# original. The inplace_abn stand-in (fixtures/standin), as under 1.13.
interop-torch26: build torch26
	bash .ci/torch26.sh --run python3 fixtures/interop.py --bin $(BIN)
	bash .ci/torch26.sh --run python3 fixtures/interop_graph.py --bin $(BIN)

# --onnx-ops standard and fold outputs run in onnxruntime 1.21 against the
# original export (in onnxruntime and in torch 2.6): the ONNX fixtures, and a
# torchvision resnet18 and densenet121 exported by torch 2.6 at 32x32.
onnxruntime: build torch26
	bash .ci/torch26.sh --run python3 fixtures/interop_onnxruntime.py --bin $(BIN)

# Real PyTorch and onnx for fixtures and interop tests (Debian's packages;
# root). -I: the repository's onnx/ directory (Go) must not pass for onnx.
deps:
	@$(PYTHON) -I -c 'import torch, torchvision, onnx.checker' 2>/dev/null || { \
		echo "installing Debian's python3-torch, python3-torchvision, python3-onnx (about 2 minutes)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			python3-torch python3-torchvision python3-onnx >/dev/null && \
		$(PYTHON) -I -c 'import torch, torchvision, onnx.checker'; }

# Regenerate every committed fixture with real PyTorch (each script says
# what it writes; the outputs are deterministic).
fixtures:
	$(PYTHON) fixtures/models.py
	$(PYTHON) fixtures/formats.py
	$(PYTHON) fixtures/formats4.py
	$(PYTHON) fixtures/hostile.py
	$(PYTHON) fixtures/ops.py
	$(PYTHON) fixtures/layout_ops.py
	$(PYTHON) fixtures/shape_nets.py gen
	$(PYTHON) fixtures/alias.py gen
	$(PYTHON) fixtures/stochdepth.py gen  # sd_t26_*: .ci/torch26.sh --run python3 fixtures/stochdepth.py gen --suffix _t26

bench: build
	bash bench/convert.sh

# The CUDA build (needs cuda.h; links no CUDA library, see cuda/README.md).
cuda:
	$(GO) build -tags cuda,$(TAGS) -ldflags "$(LDFLAGS)" -o bin/abnconvert-cuda ./cmd/abnconvert

# The GPU test and benchmark binary that bench/gpu.sh runs on the GPU
# machine, which has no Go.
cuda-test:
	$(GO) test -c -tags cuda -o bin/cuda.test ./cuda

# The kernels' arithmetic against the CPU backend, on the CPU (needs g++).
# cgo does not track the kernels/*.cu that cuda/emu.cc includes: their digest
# in CGO_CXXFLAGS makes an edited kernel rebuild the emulator instead of
# reusing the build cache's.
KERNELS_SHA = $(shell cat cuda/kernels/*.cu cuda/kernels/*.cuh | sha256sum | cut -c1-16)
cuda-emu:
	CGO_CXXFLAGS="$${CGO_CXXFLAGS:--g -O2} -DABN_KERNELS_SHA=$(KERNELS_SHA)" $(GO) test -tags cudaemu ./cuda/

# Regenerate the committed PTX after editing cuda/kernels/*.cu or *.cuh
# (needs nvcc), and its record kernels/PTX.sum: the sha256 of every source,
# header and PTX, which cuda's TestPTXSum checks without nvcc (a source
# edited without `make ptx` fails `go test ./cuda/`).
ptx:
	cd cuda/kernels && for f in *.cu; do nvcc -arch=compute_70 -ptx -o $${f%.cu}.ptx $$f || exit 1; done && \
		sha256sum *.cu *.cuh *.ptx > PTX.sum

# On the GPU machine, from the repo root, with bin/ carried there.
gpu-bench:
	bash bench/gpu.sh

clean:
	rm -rf bin out

# The emulated CUDA driver (bin/emudriver/libcuda.so.1): the driver API calls
# the cuda build uses, on the CPU over the kernels compiled for it, so that the
# GPU path and bench/gpu.sh can be rehearsed without a GPU (needs cuda.h, g++).
emudriver:
	@mkdir -p bin/emudriver
	$(CXX) -std=c++17 -O2 -fno-strict-aliasing -shared -fPIC -Wall $(CGO_CFLAGS) -o bin/emudriver/libcuda.so.1 cuda/emudriver/driver.cc

# bench/gpu.sh on the emulated driver: every step of the GPU script at small
# sizes, through the real binaries and driver calls; exits 1 on a failed check.
gpu-emulated: cuda cuda-test emudriver
	LD_LIBRARY_PATH=$(CURDIR)/bin/emudriver $(GO) test -count=1 -tags cuda -run '^TestDeviceCUDA$$' ./command/
	OUT=$${OUT:-bench} bash bench/gpu.sh --emulated
