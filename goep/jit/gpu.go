package jit

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"time"
)

// Options are what a kernel is compiled for. Together with the source, its headers and the
// NVRTC version they make the cache key.
type Options struct {
	// Arch is the GPU to compile for: a real architecture ("sm_90", "sm_90a") for a cubin. With
	// PTX it may also be a virtual one ("compute_90"); sm_XX is then read as compute_XX.
	Arch string
	// Defines become -DNAME=VALUE (-DNAME when VALUE is empty): the shape constants, such as
	// PYEP_HIDDEN_BYTES, that kernels are specialised on.
	Defines map[string]string
	// Flags are further NVRTC options, e.g. "-lineinfo", "--maxrregcount=128".
	Flags []string
	// PTX asks for PTX instead of a cubin: for GPUs newer than this NVRTC knows, whose driver
	// can still JIT it. Cubins are the default because they load without a second compile.
	PTX bool
}

// baseFlags go to every compile. NVRTC optimises device code fully by default (it rejects -O3),
// so there is no optimisation flag here.
var baseFlags = []string{"-std=c++17"}

var archRE = regexp.MustCompile(`^(sm|compute)_([0-9]+[a-z]?)$`)

// nvrtcOptions is the complete, deterministic NVRTC command line for o.
func (o Options) nvrtcOptions() ([]string, error) {
	m := archRE.FindStringSubmatch(o.Arch)
	switch {
	case m == nil:
		return nil, fmt.Errorf("pyep: jit: arch %q: expected sm_XX (e.g. sm_90) or, for PTX, compute_XX", o.Arch)
	case !o.PTX && m[1] == "compute":
		return nil, fmt.Errorf("pyep: jit: arch %q is virtual: a cubin needs a real arch such as sm_%s", o.Arch, m[2])
	}
	arch := o.Arch
	if o.PTX {
		arch = "compute_" + m[2]
	}
	defines, err := defineFlags(o.Defines)
	if err != nil {
		return nil, err
	}
	opts := append([]string{"--gpu-architecture=" + arch}, baseFlags...)
	opts = append(opts, defines...)
	return append(opts, o.Flags...), nil
}

// nvrtcKey is the cache key of a compile by NVRTC version nvrtcVersion ("major.minor").
func nvrtcKey(src Source, flags []string, ptx bool, nvrtcVersion string) string {
	return cacheKey(keyInput{compiler: nvrtcVersion, output: fmt.Sprint(ptx), flags: flags, src: src})
}

// Compile compiles src for opts through the Default cache.
func Compile(src Source, opts Options) ([]byte, error) { return Default().Compile(src, opts) }

// Compile returns the cubin (or PTX) of src for opts, from memory, from disk, or by running
// NVRTC. The returned slice is shared with the cache and with other callers: do not modify it.
func (c *Cache) Compile(src Source, opts Options) ([]byte, error) {
	key, flags, nv, err := c.key(src, opts)
	if err != nil {
		return nil, err
	}
	v, err := c.once(key, func() (any, error) { return c.load(src, opts, key, flags, nv) })
	if err != nil {
		return nil, err
	}
	return v.([]byte), nil
}

// Key is the cache key of src under opts with the loaded NVRTC, as a hex SHA-256.
func (c *Cache) Key(src Source, opts Options) (string, error) {
	key, _, _, err := c.key(src, opts)
	return key, err
}

func (c *Cache) key(src Source, opts Options) (key string, flags []string, nv *NVRTC, err error) {
	if flags, err = opts.nvrtcOptions(); err != nil {
		return "", nil, nil, err
	}
	// The cached output is only valid for the NVRTC that made it, so even a disk hit needs
	// NVRTC found (a dlopen, not a compile).
	if nv, err = LoadNVRTC(); err != nil {
		return "", nil, nil, err
	}
	return nvrtcKey(src, flags, opts.PTX, fmt.Sprintf("%d.%d", nv.Major, nv.Minor)), flags, nv, nil
}

func (c *Cache) load(src Source, opts Options, key string, flags []string, nv *NVRTC) ([]byte, error) {
	file := ""
	if c.dir != "" {
		file = filepath.Join(c.dir, cacheFileName(src.Name, opts, key))
		if data, err := os.ReadFile(file); err == nil && validOutput(data, opts.PTX) {
			c.diskHits.Add(1)
			return data, nil
		}
		// Missing, unreadable or not what we write: compile and (re)write it.
	}
	start := time.Now()
	out, _, err := nv.Compile(src.Name, src.Text, src.Headers, flags, opts.PTX)
	if err != nil {
		return nil, err
	}
	c.keep(file, out, src.Name, opts.Arch, opts.Defines, start)
	return out, nil
}

// cacheFileName is "<stem>-<arch>-<key prefix>.cubin" (or .ptx).
func cacheFileName(name string, opts Options, key string) string {
	ext := ".cubin"
	if opts.PTX {
		ext = ".ptx"
	}
	return entryFileName(name, opts.Arch, key, ext)
}

// validOutput rejects files that are not what we write (say, truncated by a full disk before
// an older pyep renamed them): a cubin is an ELF image, PTX text declares its version.
func validOutput(data []byte, ptx bool) bool {
	if ptx {
		return bytes.Contains(data, []byte(".version"))
	}
	return bytes.HasPrefix(data, []byte("\x7fELF"))
}
