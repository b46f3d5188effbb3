package jit

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
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
	opts := append([]string{"--gpu-architecture=" + arch}, baseFlags...)
	names := make([]string, 0, len(o.Defines))
	for name, value := range o.Defines {
		if !identRE.MatchString(name) || strings.ContainsAny(value, "\n\r") {
			return nil, fmt.Errorf("pyep: jit: define %s=%q: expected an identifier and a one-line value", name, value)
		}
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		if v := o.Defines[name]; v != "" {
			opts = append(opts, "-D"+name+"="+v)
		} else {
			opts = append(opts, "-D"+name)
		}
	}
	return append(opts, o.Flags...), nil
}

// keyVersion changes whenever the key's recipe or the cache file format does.
const keyVersion = "pyep-jit-1"

// cacheKey hashes everything that can change the compiler's output. Each part is length-prefixed
// so that no two different inputs can run together into the same byte stream.
func cacheKey(src Source, flags []string, ptx bool, nvrtcVersion string) string {
	h := sha256.New()
	put := func(s string) {
		var n [8]byte
		binary.LittleEndian.PutUint64(n[:], uint64(len(s)))
		h.Write(n[:])
		io.WriteString(h, s)
	}
	put(keyVersion)
	put(nvrtcVersion)
	put(fmt.Sprint(ptx))
	put(fmt.Sprint(len(flags)))
	for _, f := range flags {
		put(f)
	}
	put(src.Name)
	put(src.Text)
	put(fmt.Sprint(len(src.Headers)))
	for _, hd := range src.Headers {
		put(hd.Name)
		put(hd.Text)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// DefaultDir is the on-disk cache: $PYEP_JIT_CACHE_DIR, else pyep under the user's cache
// directory (~/.cache/pyep on Linux).
func DefaultDir() (string, error) {
	if d := os.Getenv("PYEP_JIT_CACHE_DIR"); d != "" {
		return d, nil
	}
	base, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("pyep: jit: no cache directory (set PYEP_JIT_CACHE_DIR): %w", err)
	}
	return filepath.Join(base, "pyep"), nil
}

// Stats counts how a Cache answered; tests and diagnostics read it.
type Stats struct {
	MemoryHits int64 // answered from this process's memory
	DiskHits   int64 // read from the cache directory
	Compiles   int64 // compiled by NVRTC (successfully)
}

// Cache compiles sources with NVRTC and keeps the results in memory and in a directory.
// Compiling takes hundreds of milliseconds to seconds per kernel configuration, and every rank
// of every run needs the same ones, so results are kept across processes. Safe for concurrent
// use, also by several processes sharing the directory: files appear atomically (temporary
// file, then rename), and two processes racing on one key both write the same bytes.
type Cache struct {
	dir string
	log io.Writer

	mu  sync.Mutex
	mem map[string]*entry

	memoryHits, diskHits, compiles atomic.Int64
}

// entry is one key's result; done is closed once data/err are set, so that concurrent callers
// for a key wait for one compile instead of starting their own.
type entry struct {
	done chan struct{}
	data []byte
	err  error
}

// NewCache returns a cache over dir; with dir "" it keeps results in memory only.
func NewCache(dir string) *Cache {
	return &Cache{dir: dir, log: os.Stderr, mem: map[string]*entry{}}
}

// SetLog redirects the one-line compile reports (os.Stderr by default; nil silences them).
func (c *Cache) SetLog(w io.Writer) { c.log = w }

// Dir is the cache directory, "" for a memory-only cache.
func (c *Cache) Dir() string { return c.dir }

// Stats returns the counts so far.
func (c *Cache) Stats() Stats {
	return Stats{MemoryHits: c.memoryHits.Load(), DiskHits: c.diskHits.Load(), Compiles: c.compiles.Load()}
}

var (
	defaultOnce  sync.Once
	defaultCache *Cache
)

// Default is the process-wide cache over DefaultDir. If there is no usable directory it keeps
// results in memory only and says so once on stderr.
func Default() *Cache {
	defaultOnce.Do(func() {
		dir, err := DefaultDir()
		if err != nil && !quiet() {
			fmt.Fprintf(os.Stderr, "%v; compiled kernels are kept in memory only\n", err)
		}
		defaultCache = NewCache(dir)
	})
	return defaultCache
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
	c.mu.Lock()
	if e, ok := c.mem[key]; ok {
		c.mu.Unlock()
		<-e.done
		if e.err == nil {
			c.memoryHits.Add(1)
		}
		return e.data, e.err
	}
	e := &entry{done: make(chan struct{})}
	c.mem[key] = e
	c.mu.Unlock()

	e.data, e.err = c.load(src, opts, key, flags, nv)
	if e.err != nil {
		// Not remembered: a later call may succeed (a fixed source reloaded, memory freed).
		c.mu.Lock()
		delete(c.mem, key)
		c.mu.Unlock()
	}
	close(e.done)
	return e.data, e.err
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
	return cacheKey(src, flags, opts.PTX, fmt.Sprintf("%d.%d", nv.Major, nv.Minor)), flags, nv, nil
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
	elapsed := time.Since(start)
	c.compiles.Add(1)
	where := "kept in memory only"
	if file != "" {
		if err := writeAtomic(file, out); err != nil {
			where = fmt.Sprintf("not cached: %v", err)
		} else {
			where = "cached at " + file
		}
	}
	if c.log != nil && !quiet() {
		fmt.Fprintf(c.log, "pyep: compiled %s for %s%s in %d ms; %s\n",
			src.Name, opts.Arch, describeDefines(opts.Defines), elapsed.Milliseconds(), where)
	}
	return out, nil
}

// quiet reports whether PYEP_JIT_QUIET asks for no compile reports.
func quiet() bool {
	switch os.Getenv("PYEP_JIT_QUIET") {
	case "", "0", "false", "no":
		return false
	}
	return true
}

// describeDefines is " (HIDDEN_BYTES=14336, ...)": the shape a compile was for, without the
// PYEP_ prefix every define has.
func describeDefines(defines map[string]string) string {
	if len(defines) == 0 {
		return ""
	}
	parts := make([]string, 0, len(defines))
	for name, value := range defines {
		part := strings.TrimPrefix(name, "PYEP_")
		if value != "" {
			part += "=" + value
		}
		parts = append(parts, part)
	}
	sort.Strings(parts)
	return " (" + strings.Join(parts, ", ") + ")"
}

var unsafeNameRE = regexp.MustCompile(`[^A-Za-z0-9_.-]+`)

// cacheFileName is "<stem>-<arch>-<key prefix>.cubin": readable enough to tell entries apart
// when clearing the directory by hand; 128 bits of key keep collisions out of reach.
func cacheFileName(name string, opts Options, key string) string {
	stem := strings.TrimSuffix(path.Base(filepath.ToSlash(name)), path.Ext(name))
	stem = unsafeNameRE.ReplaceAllString(stem, "_")
	ext := ".cubin"
	if opts.PTX {
		ext = ".ptx"
	}
	return fmt.Sprintf("%s-%s-%s%s", stem, unsafeNameRE.ReplaceAllString(opts.Arch, "_"), key[:32], ext)
}

// validOutput rejects files that are not what we write (say, truncated by a full disk before
// an older pyep renamed them): a cubin is an ELF image, PTX text declares its version.
func validOutput(data []byte, ptx bool) bool {
	if ptx {
		return bytes.Contains(data, []byte(".version"))
	}
	return bytes.HasPrefix(data, []byte("\x7fELF"))
}

// writeAtomic makes file appear with data all at once: readers (other ranks, other processes)
// see either no file or the whole file, never a partial one.
func writeAtomic(file string, data []byte) (err error) {
	dir := filepath.Dir(file)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(file)+".tmp-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			os.Remove(tmp.Name())
		}
	}()
	if _, err = tmp.Write(data); err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		// CreateTemp makes 0600 files; the cache may be shared with other users' jobs.
		err = os.Chmod(tmp.Name(), 0o644)
	}
	if err == nil {
		err = os.Rename(tmp.Name(), file)
	}
	return err
}
