package jit

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"
)

// LinkOptions are what a kernel that calls into a static device library (NVSHMEM's
// libnvshmem_device.a) is built with: NVRTC compiles it to LTO-IR, nvJitLink links that with
// the libraries into a cubin.
type LinkOptions struct {
	// Options are the NVRTC step's: Arch (a real one, sm_XX), Defines, Flags. PTX must be unset.
	Options
	// IncludeDirs are directories NVRTC searches for the includes that the source does not
	// carry (NVSHMEM's include/), in order; the CUDA headers of the NVRTC in use (IncludeDirs
	// of NVRTC) follow them. Every file under them is part of the cache key by name, size and
	// modification time.
	IncludeDirs []string
	// Libraries are static device libraries (.a) linked in as NVJITLINK_INPUT_LIBRARY; each is
	// part of the cache key by its contents' SHA-256.
	Libraries []string
	// LinkFlags are further nvJitLink options (e.g. "-lineinfo").
	LinkFlags []string
}

// rdcFlags make NVRTC emit what nvJitLink links: relocatable device code (calls into the
// library resolve at link time) as LTO-IR, and functions without an execution space taken as
// device functions, as in the recipe proven with NVSHMEM's headers on a GPU.
var rdcFlags = []string{"-rdc=true", "-dlto", "-default-device"}

// linkPlan is one link's complete command lines and cache key.
type linkPlan struct {
	nvrtcFlags, linkFlags []string
	key                   string
	nv                    *NVRTC
	jl                    *NVJitLink
}

func (c *Cache) linkPlan(src Source, opts LinkOptions) (*linkPlan, error) {
	if opts.PTX {
		return nil, fmt.Errorf("pyep: jit: %s: a linked kernel is a cubin: PTX is not linked", src.Name)
	}
	base, err := opts.nvrtcOptions()
	if err != nil {
		return nil, err
	}
	nv, err := LoadNVRTC()
	if err != nil {
		return nil, err
	}
	jl, err := LoadNVJitLink()
	if err != nil {
		return nil, err
	}
	includes := append(append([]string{}, opts.IncludeDirs...), nv.IncludeDirs()...)
	// The key takes the files, not their paths: two installations of one NVSHMEM share entries.
	var files []string
	for _, d := range includes {
		id, err := treeIdentity(d)
		if err != nil {
			return nil, fmt.Errorf("pyep: jit: include directory of %s: %w", src.Name, err)
		}
		files = append(files, "include "+id)
	}
	for _, lib := range opts.Libraries {
		id, err := fileIdentity(lib)
		if err != nil {
			return nil, fmt.Errorf("pyep: jit: device library of %s: %w", src.Name, err)
		}
		files = append(files, "library "+id)
	}
	p := &linkPlan{nv: nv, jl: jl}
	p.nvrtcFlags = append(append([]string{}, base...), rdcFlags...)
	keyFlags := append([]string{}, p.nvrtcFlags...)
	for _, d := range includes {
		p.nvrtcFlags = append(p.nvrtcFlags, "-I"+d)
	}
	p.linkFlags = append([]string{"-arch=" + opts.Arch, "-lto"}, opts.LinkFlags...)
	keyFlags = append(append(keyFlags, "--nvjitlink"), p.linkFlags...)
	p.key = cacheKey(keyInput{
		compiler: fmt.Sprintf("%d.%d nvJitLink %d.%d", nv.Major, nv.Minor, jl.Major, jl.Minor),
		output:   "linked cubin",
		flags:    keyFlags,
		src:      src,
		files:    files,
	})
	return p, nil
}

// CompileLinked compiles and links src for opts through the Default cache.
func CompileLinked(src Source, opts LinkOptions) ([]byte, error) {
	return Default().CompileLinked(src, opts)
}

// CompileLinked returns the cubin of src linked with opts.Libraries, from memory, from disk, or
// by running NVRTC (to LTO-IR) then nvJitLink. The returned slice is shared with the cache and
// with other callers: do not modify it. Loading it needs more than a plain cubin: a module
// linked with NVSHMEM's device library must be handed to nvshmemx_cumodule_init
// (goep/nvshmem's ModuleInit) before its first launch.
func (c *Cache) CompileLinked(src Source, opts LinkOptions) ([]byte, error) {
	src = src.under(linkedHeaders)
	p, err := c.linkPlan(src, opts)
	if err != nil {
		return nil, err
	}
	v, err := c.once(p.key, func() (any, error) { return c.loadLinked(src, opts, p) })
	if err != nil {
		return nil, err
	}
	return v.([]byte), nil
}

func (c *Cache) loadLinked(src Source, opts LinkOptions, p *linkPlan) ([]byte, error) {
	file := ""
	if c.dir != "" {
		file = filepath.Join(c.dir, entryFileName(src.Name, opts.Arch+"-linked", p.key, ".cubin"))
		if data, err := os.ReadFile(file); err == nil && validOutput(data, false) {
			c.diskHits.Add(1)
			return data, nil
		}
	}
	start := time.Now()
	ir, _, err := p.nv.CompileLTOIR(src.Name, src.Text, src.Headers, p.nvrtcFlags)
	if err != nil {
		return nil, err
	}
	inputs := []LinkInput{{Kind: LinkLTOIR, Name: src.Name, Data: ir}}
	for _, lib := range opts.Libraries {
		data, err := os.ReadFile(lib)
		if err != nil {
			return nil, fmt.Errorf("pyep: jit: device library of %s: %w", src.Name, err)
		}
		inputs = append(inputs, LinkInput{Kind: LinkLibrary, Name: filepath.Base(lib), Data: data})
	}
	out, _, err := p.jl.Link(p.linkFlags, inputs)
	if err != nil {
		if le, ok := err.(*LinkError); ok {
			le.Name = src.Name
		}
		return nil, err
	}
	c.keep(file, out, src.Name, opts.Arch+" (linked)", opts.Defines, start)
	return out, nil
}

// IncludeDirs are the CUDA headers that go with this NVRTC (cuda_runtime.h; CCCL's cuda/std),
// which NVSHMEM's device headers include, found beside its library in the layouts of a CUDA
// toolkit (lib64/../include, CCCL in include/cccl from CUDA 13 on) and of NVIDIA's wheels
// (nvidia/cu13/lib/../include; CUDA 12's nvidia/cuda_nvrtc/lib beside nvidia/cuda_runtime and
// nvidia/cuda_cccl). What is not found there comes from a CUDA toolkit, $CUDA_HOME then
// /usr/local/cuda: PyTorch's nvidia/cu13 wheel ships cuda_runtime.h but no CCCL.
func (n *NVRTC) IncludeDirs() []string {
	if n == nil {
		return nil
	}
	var toolkits []string
	if home := os.Getenv("CUDA_HOME"); home != "" {
		toolkits = append(toolkits, home)
	}
	return includeDirs(filepath.Dir(n.Path), append(toolkits, "/usr/local/cuda"))
}

// includeDirs is IncludeDirs for an NVRTC library in lib, with toolkits as the fallback roots.
func includeDirs(lib string, toolkits []string) []string {
	var out []string
	runtime, cccl := false, false
	add := func(d string) {
		hasRuntime, hasCCCL := isFile(filepath.Join(d, "cuda_runtime.h")), isDir(filepath.Join(d, "cuda", "std"))
		if (hasRuntime && !runtime) || (hasCCCL && !cccl) {
			out = append(out, filepath.Clean(d))
			runtime, cccl = runtime || hasRuntime, cccl || hasCCCL
		}
	}
	for _, d := range []string{
		filepath.Join(lib, "..", "include"),
		filepath.Join(lib, "..", "include", "cccl"),
		filepath.Join(lib, "..", "..", "cuda_runtime", "include"),
		filepath.Join(lib, "..", "..", "cuda_cccl", "include"),
	} {
		add(d)
	}
	for _, root := range toolkits {
		add(filepath.Join(root, "include"))
		add(filepath.Join(root, "include", "cccl"))
	}
	return out
}

func isFile(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode().IsRegular()
}

func isDir(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.IsDir()
}

// identities remembers, per process, what treeIdentity and fileIdentity computed, by the path
// and (for files) their size and modification time: a directory is walked once per process.
var identities sync.Map

// treeIdentity is the hex SHA-256 of every regular file under dir (a link to a file counts as
// the file), by relative name, size and modification time. dir may be a link to a directory, as
// a CUDA toolkit's include is (to targets/<platform>/include).
func treeIdentity(dir string) (string, error) {
	if v, ok := identities.Load("tree " + dir); ok {
		return v.(string), nil
	}
	root, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	n := 0
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			return nil
		}
		st, err := os.Stat(p)
		if err != nil || !st.Mode().IsRegular() {
			return nil // a dangling link or a special file: no header of ours
		}
		rel, _ := filepath.Rel(root, p)
		fmt.Fprintf(h, "%s\x00%d\x00%d\n", filepath.ToSlash(rel), st.Size(), st.ModTime().UnixNano())
		n++
		return nil
	})
	if err != nil {
		return "", err
	}
	if n == 0 {
		return "", fmt.Errorf("%s has no files", dir)
	}
	id := hex.EncodeToString(h.Sum(nil))
	identities.Store("tree "+dir, id)
	return id, nil
}

// fileIdentity is the hex SHA-256 of file's contents.
func fileIdentity(file string) (string, error) {
	st, err := os.Stat(file)
	if err != nil {
		return "", err
	}
	if !st.Mode().IsRegular() {
		return "", fmt.Errorf("%s is not a file", file)
	}
	memo := fmt.Sprintf("file %s\x00%d\x00%d", file, st.Size(), st.ModTime().UnixNano())
	if v, ok := identities.Load(memo); ok {
		return v.(string), nil
	}
	f, err := os.Open(file)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	id := hex.EncodeToString(h.Sum(nil))
	identities.Store(memo, id)
	return id, nil
}

// linkedHeaders is where a linked source's own headers are handed to NVRTC: NVRTC looks its
// named headers up before the include path, so a library header of the same name (NVSHMEM's
// coll/utils.cuh includes "utils.cuh") would otherwise get ours.
const linkedHeaders = "pyep/"

// under returns s with its headers named dir + name, and its quoted includes of them (in its text
// and theirs) rewritten to match.
func (s Source) under(dir string) Source {
	if len(s.Headers) == 0 {
		return s
	}
	names := make([]string, len(s.Headers))
	for i, h := range s.Headers {
		names[i] = regexp.QuoteMeta(h.Name)
	}
	re := regexp.MustCompile(`(?m)^([ \t]*#[ \t]*include[ \t]*")(` + strings.Join(names, "|") + `)"`)
	rewrite := func(text string) string { return re.ReplaceAllString(text, `${1}`+dir+`${2}"`) }
	out := Source{Name: s.Name, Text: rewrite(s.Text), Headers: make([]Header, len(s.Headers))}
	for i, h := range s.Headers {
		out.Headers[i] = Header{Name: dir + h.Name, Text: rewrite(h.Text)}
	}
	return out
}
