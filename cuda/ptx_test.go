package cuda

import (
	"crypto/sha256"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// TestEmbeddedPTX checks every embedded module: header directives present,
// a target the H200's driver can compile (a virtual architecture of at
// most compute capability 8.0, as `make ptx` writes), 64-bit addresses.
func TestEmbeddedPTX(t *testing.T) {
	src, err := ptxSources()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range modules() {
		text, ok := src[m]
		if !ok {
			t.Errorf("module %s: kernels/%s.ptx is not embedded", m, m)
			continue
		}
		p, err := parsePTX(text)
		if err != nil {
			t.Errorf("kernels/%s.ptx: %v", m, err)
			continue
		}
		if !regexp.MustCompile(`^\d+\.\d+$`).MatchString(p.Version) {
			t.Errorf("kernels/%s.ptx: .version %q", m, p.Version)
		}
		arch, err := strconv.Atoi(strings.TrimPrefix(p.Target, "sm_"))
		if err != nil || !strings.HasPrefix(p.Target, "sm_") || arch > 80 {
			t.Errorf("kernels/%s.ptx: .target %q, want sm_NN with NN <= 80", m, p.Target)
		}
		if p.AddressSize != 64 {
			t.Errorf("kernels/%s.ptx: .address_size %d, want 64", m, p.AddressSize)
		}
	}
	for name := range src {
		found := false
		for _, m := range modules() {
			found = found || m == name
		}
		if !found {
			t.Errorf("kernels/%s.ptx is embedded but no kernel spec names that module", name)
		}
	}
}

// TestKernelSpecsMatchPTX checks the launcher's table against the PTX: each
// kernel is an entry of its module with as many parameters as the spec, of
// matching types, and each entry of the PTX is in the table.
func TestKernelSpecsMatchPTX(t *testing.T) {
	mods := parsedModules(t)
	inTable := map[string]bool{}
	for k, s := range kernelSpecs {
		if s.name == "" {
			t.Errorf("kernel %d has no spec", k)
			continue
		}
		inTable[s.name] = true
		m, ok := mods[s.module]
		if !ok {
			t.Errorf("%s: module %s not embedded", s.name, s.module)
			continue
		}
		params, ok := m.Entries[s.name]
		if !ok {
			t.Errorf("%s: no .entry in kernels/%s.ptx", s.name, s.module)
			continue
		}
		if len(params) != len(s.params) {
			t.Errorf("%s: spec has %d parameters (%s), the PTX entry %d %v", s.name, len(s.params), s.params, len(params), params)
			continue
		}
		for i := range params {
			if !ptxTypeFits(s.params[i], params[i]) {
				t.Errorf("%s: parameter %d: spec %c, PTX %s", s.name, i, s.params[i], params[i])
			}
		}
	}
	for mod, m := range mods {
		for name := range m.Entries {
			if !inTable[name] {
				t.Errorf("kernels/%s.ptx: entry %s is not in kernelSpecs", mod, name)
			}
		}
	}
}

func parsedModules(t *testing.T) map[string]*ptxModule {
	t.Helper()
	src, err := ptxSources()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*ptxModule{}
	for name, text := range src {
		p, err := parsePTX(text)
		if err != nil {
			t.Fatalf("kernels/%s.ptx: %v", name, err)
		}
		out[name] = p
	}
	return out
}

// TestSourcesMatchSpecs reads the KERNEL declarations of kernels/*.cu and
// checks them against the spec table, which the PTX test ties to the
// committed PTX: a signature changed in the source without `make ptx`
// fails here.
func TestSourcesMatchSpecs(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("kernels", "*.cu"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no kernels/*.cu: %v", err)
	}
	decl := regexp.MustCompile(`(?s)KERNEL void (\w+)\(([^)]*)\)`)
	found := map[string]string{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		mod := strings.TrimSuffix(filepath.Base(f), ".cu")
		for _, m := range decl.FindAllStringSubmatch(string(b), -1) {
			letters, err := cParams(m[2])
			if err != nil {
				t.Errorf("%s: %s: %v", f, m[1], err)
				continue
			}
			found[m[1]] = mod + ":" + letters
		}
	}
	for _, s := range kernelSpecs {
		got, ok := found[s.name]
		if !ok {
			t.Errorf("%s: no KERNEL declaration in kernels/*.cu", s.name)
			continue
		}
		if want := s.module + ":" + s.params; got != want {
			t.Errorf("%s: source declares %s, spec says %s", s.name, got, want)
		}
		delete(found, s.name)
	}
	for name := range found {
		t.Errorf("kernel %s in the sources is not in kernelSpecs", name)
	}
}

// cParams maps a C parameter list to spec letters.
func cParams(list string) (string, error) {
	var out []byte
	for _, p := range strings.Split(list, ",") {
		f := strings.Fields(strings.ReplaceAll(p, "*", " * "))
		if len(f) < 2 {
			return "", errorf("parameter %q", p)
		}
		typ := strings.Join(f[:len(f)-1], " ")
		typ = strings.TrimSpace(strings.TrimPrefix(typ, "const "))
		switch {
		case strings.HasSuffix(typ, "*"):
			out = append(out, 'p')
		case typ == "i64" || typ == "u64":
			out = append(out, 'l')
		case typ == "int" || typ == "unsigned":
			out = append(out, 'i')
		case typ == "float":
			out = append(out, 'f')
		case typ == "double":
			out = append(out, 'd')
		default:
			return "", errorf("parameter %q: type %q", p, typ)
		}
	}
	return string(out), nil
}

// TestParsePTX runs the parser on small hand-written modules.
func TestParsePTX(t *testing.T) {
	const head = ".version 7.8\n.target sm_70\n.address_size 64\n"
	cases := []struct {
		name, src string
		entries   map[string][]string
		err       string
	}{
		{"one per line", head + ".visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .f32 k_param_1\n)\n{\n\tret;\n}\n",
			map[string][]string{"k": {".u64", ".f32"}}, ""},
		{"no parameters", head + ".visible .entry k()\n{\n}\n", map[string][]string{"k": {}}, ""},
		{"on the entry line", head + ".entry k(.param .u32 a, .param .f64 b)\n", map[string][]string{"k": {".u32", ".f64"}}, ""},
		{"aligned struct", head + ".visible .entry k(\n.param .align 8 .b8 k_param_0[16]\n)\n", map[string][]string{"k": {".b8[]"}}, ""},
		{"comments", head + "// .entry fake(\n.visible .entry k( // the kernel\n.param .s64 x // a count\n)\n", map[string][]string{"k": {".s64"}}, ""},
		{"two entries", head + ".visible .entry a(\n.param .u64 p\n)\n{}\n.visible .entry b(\n.param .u32 n\n)\n",
			map[string][]string{"a": {".u64"}, "b": {".u32"}}, ""},
		{"no version", ".target sm_70\n.entry k()\n", nil, "no .version"},
		{"not closed", head + ".visible .entry k(\n.param .u64 p,\n", nil, "not closed"},
		{"declared twice", head + ".entry k()\n.entry k()\n", nil, "twice"},
		{"no name", head + ".entry (\n)\n", nil, "without a name"},
		{"bad parameter", head + ".entry k(\n.reg .u64 p\n)\n", nil, "want .param"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m, err := parsePTX(c.src)
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) {
					t.Fatalf("error %v, want one containing %q", err, c.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if m.Version != "7.8" || m.Target != "sm_70" || m.AddressSize != 64 {
				t.Errorf("header %q %q %d", m.Version, m.Target, m.AddressSize)
			}
			if len(m.Entries) != len(c.entries) {
				t.Fatalf("entries %v, want %v", m.Entries, c.entries)
			}
			for k, want := range c.entries {
				got := m.Entries[k]
				if strings.Join(got, ",") != strings.Join(want, ",") {
					t.Errorf("entry %s: %v, want %v", k, got, want)
				}
			}
		})
	}
}

// ptxSum is the record `make ptx` writes beside the PTX it compiles, in
// sha256sum's format (`cd cuda/kernels && sha256sum -c PTX.sum` reads it):
// the digest of every kernel source and header (*.cu, *.cuh; the headers
// are included by every module) and of every PTX file made from them.
const ptxSum = "PTX.sum"

// TestPTXSum checks, without nvcc, that the committed PTX was made from the
// committed sources: a kernel source or header edited without `make ptx`,
// a PTX file edited by hand, or a kernel file added or removed without
// `make ptx`, fails here. TestPTXUpToDate recompiles where nvcc is installed.
func TestPTXSum(t *testing.T) {
	recorded, err := readPTXSum(filepath.Join("kernels", ptxSum))
	if err != nil {
		t.Fatal(err)
	}
	var present []string
	for _, pat := range []string{"*.cu", "*.cuh", "*.ptx"} {
		m, err := filepath.Glob(filepath.Join("kernels", pat))
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range m {
			present = append(present, filepath.Base(f))
		}
	}
	if len(present) == 0 {
		t.Fatal("no kernel files in kernels/")
	}
	for _, name := range present {
		want, ok := recorded[name]
		if !ok {
			t.Errorf("kernels/%s is not in kernels/%s: run make ptx (needs nvcc)", name, ptxSum)
			continue
		}
		delete(recorded, name)
		b, err := os.ReadFile(filepath.Join("kernels", name))
		if err != nil {
			t.Fatal(err)
		}
		if got := fmt.Sprintf("%x", sha256.Sum256(b)); got != want {
			if strings.HasSuffix(name, ".ptx") {
				t.Errorf("kernels/%s is not the file make ptx wrote (sha256 %s, %s records %s): regenerate it with make ptx", name, got, ptxSum, want)
			} else {
				t.Errorf("kernels/%s changed since the PTX was made (sha256 %s, %s records %s): run make ptx (needs nvcc)", name, got, ptxSum, want)
			}
		}
	}
	for name := range recorded {
		t.Errorf("kernels/%s records %s, which is not in kernels/: run make ptx", ptxSum, name)
	}
}

// readPTXSum parses sha256sum's output: "<64 hex digits>  <name>" per line
// (" *<name>" in binary mode).
func readPTXSum(path string) (map[string]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w (make ptx writes it)", path, err)
	}
	line := regexp.MustCompile(`^([0-9a-f]{64}) [ *](\S+)$`)
	out := map[string]string{}
	for i, l := range strings.Split(strings.TrimRight(string(b), "\n"), "\n") {
		m := line.FindStringSubmatch(l)
		if m == nil {
			return nil, fmt.Errorf("%s line %d: %q is not \"<sha256>  <file>\"", path, i+1, l)
		}
		if _, dup := out[m[2]]; dup {
			return nil, fmt.Errorf("%s line %d: %s recorded twice", path, i+1, m[2])
		}
		out[m[2]] = m[1]
	}
	return out, nil
}

// TestReadPTXSum runs the record's parser on small hand-written records.
func TestReadPTXSum(t *testing.T) {
	const h = "133e0252e81f54b1488815b42de70c85f781c74e2608069b3187e84f1878b957"
	cases := []struct {
		name, src string
		want      map[string]string
		err       string
	}{
		{"text mode", h + "  a.cu\n", map[string]string{"a.cu": h}, ""},
		{"binary mode, no final newline", h + " *a.ptx", map[string]string{"a.ptx": h}, ""},
		{"two files", h + "  a.cu\n" + h + "  a.ptx\n", map[string]string{"a.cu": h, "a.ptx": h}, ""},
		{"short digest", h[:63] + "  a.cu\n", nil, "line 1"},
		{"upper case", strings.ToUpper(h) + "  a.cu\n", nil, "line 1"},
		{"blank line", h + "  a.cu\n\n" + h + "  b.cu\n", nil, "line 2"},
		{"twice", h + "  a.cu\n" + h + "  a.cu\n", nil, "twice"},
		{"empty", "", nil, "line 1"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), ptxSum)
			if err := os.WriteFile(path, []byte(c.src), 0o644); err != nil {
				t.Fatal(err)
			}
			got, err := readPTXSum(path)
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) {
					t.Fatalf("error %v, want one containing %q", err, c.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if fmt.Sprint(got) != fmt.Sprint(c.want) {
				t.Errorf("got %v, want %v", got, c.want)
			}
		})
	}
}

// ptxArch is the virtual architecture `make ptx` compiles for.
const ptxArch = "compute_70"

// TestPTXUpToDate recompiles kernels/*.cu with nvcc, where it is installed
// and is the release that made the committed PTX, and compares: a kernel
// edited without `make ptx` fails here.
func TestPTXUpToDate(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	nvcc, err := exec.LookPath("nvcc")
	if err != nil {
		t.Skip("no nvcc")
	}
	ver, err := exec.Command(nvcc, "--version").Output()
	if err != nil {
		t.Skipf("nvcc --version: %v", err)
	}
	src, err := ptxSources()
	if err != nil {
		t.Fatal(err)
	}
	release := regexp.MustCompile(`Cuda compilation tools, release [0-9.]+, V[0-9.]+`)
	mine := release.FindString(string(ver))
	for _, m := range modules() {
		if made := release.FindString(src[m]); made != mine {
			t.Skipf("kernels/%s.ptx was made by %q, this nvcc is %q", m, made, mine)
		}
	}
	dir := t.TempDir()
	var wg sync.WaitGroup
	errs := make([]error, len(modules()))
	for i, m := range modules() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cmd := exec.Command(nvcc, "-arch="+ptxArch, "-ptx", "-o", filepath.Join(dir, m+".ptx"), m+".cu")
			cmd.Dir = "kernels"
			if out, err := cmd.CombinedOutput(); err != nil {
				errs[i] = fmt.Errorf("nvcc %s.cu: %v\n%s", m, err, out)
			}
		}()
	}
	wg.Wait()
	for i, m := range modules() {
		if errs[i] != nil {
			t.Error(errs[i])
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, m+".ptx"))
		if err != nil {
			t.Fatal(err)
		}
		// nvcc names static shared arrays after a hash of the source's
		// absolute path (_INTERNAL_<hash>_): the same source in another
		// checkout differs only there.
		if internalHash.ReplaceAllString(string(b), "_INTERNAL_x_") != internalHash.ReplaceAllString(src[m], "_INTERNAL_x_") {
			t.Errorf("kernels/%s.ptx is not what kernels/%s.cu compiles to: run make ptx", m, m)
		}
	}
}

var internalHash = regexp.MustCompile(`_INTERNAL_[0-9a-f]{8}_`)

func errorf(format string, args ...any) error { return fmt.Errorf(format, args...) }
