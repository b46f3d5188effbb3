package jit

import (
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

	"github.com/pyep/pyep/goep/env"
)

// keyVersion changes whenever the key's recipe or the cache file format does.
const keyVersion = "pyep-jit-1"

// keyInput is everything that can change a compiler's output, for either compiler: the key of a
// cubin and of a host library are made by one recipe (cacheKey), so that a change to a kernel,
// a header, a define, a flag or the compiler misses the cache alike in both.
type keyInput struct {
	// compiler names the compiler and its version. NVRTC: its "major.minor"; the host compiler:
	// "host", its path and its --version text.
	compiler string
	// output is what the compiler emits. NVRTC: "true" for PTX, "false" for a cubin (so keys of
	// NVRTC are those that keyVersion has always made); the host compiler: "so".
	output string
	// flags is the complete command line but for file names: arch, -D defines, options.
	flags []string
	src   Source
	// files are the identities of inputs read from disk rather than carried in src (a linked
	// kernel's include directories and device libraries); nil for every other compile, whose
	// keys are then those this recipe has always made.
	files []string
}

// cacheKey is the hex SHA-256 of in. Each part is length-prefixed so that no two different
// inputs can run together into the same byte stream.
func cacheKey(in keyInput) string {
	h := sha256.New()
	put := func(s string) {
		var n [8]byte
		binary.LittleEndian.PutUint64(n[:], uint64(len(s)))
		h.Write(n[:])
		io.WriteString(h, s)
	}
	put(keyVersion)
	put(in.compiler)
	put(in.output)
	put(fmt.Sprint(len(in.flags)))
	for _, f := range in.flags {
		put(f)
	}
	put(in.src.Name)
	put(in.src.Text)
	put(fmt.Sprint(len(in.src.Headers)))
	for _, hd := range in.src.Headers {
		put(hd.Name)
		put(hd.Text)
	}
	if in.files != nil {
		put(fmt.Sprint(len(in.files)))
		for _, f := range in.files {
			put(f)
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}

// defineFlags are -DNAME=VALUE (-DNAME when VALUE is empty), sorted by name: both compilers take
// a kernel's shape constants this way.
func defineFlags(defines map[string]string) ([]string, error) {
	names := make([]string, 0, len(defines))
	for name, value := range defines {
		if !identRE.MatchString(name) || strings.ContainsAny(value, "\n\r") {
			return nil, fmt.Errorf("pyep: jit: define %s=%q: expected an identifier and a one-line value", name, value)
		}
		names = append(names, name)
	}
	sort.Strings(names)
	flags := make([]string, 0, len(names))
	for _, name := range names {
		if v := defines[name]; v != "" {
			flags = append(flags, "-D"+name+"="+v)
		} else {
			flags = append(flags, "-D"+name)
		}
	}
	return flags, nil
}

// DefaultDir is the on-disk cache: $PYEP_JIT_CACHE_DIR, else pyep under the user's cache
// directory (~/.cache/pyep on Linux).
func DefaultDir() (string, error) {
	if d := env.CacheDir(); d != "" {
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
	Compiles   int64 // compiled by NVRTC or the host compiler (successfully)
}

// Cache compiles sources, with NVRTC for the GPU (Compile) or with the host C++ compiler for
// the emulator (CompileHost), and keeps the results in memory and in a directory. Compiling
// takes hundreds of milliseconds to seconds per kernel configuration, and every rank of every
// run needs the same ones, so results are kept across processes. Safe for concurrent use, also
// by several processes sharing the directory: files appear atomically (temporary file, then
// rename), and two processes racing on one key both write equivalent files.
type Cache struct {
	dir string
	log io.Writer

	mu  sync.Mutex
	mem map[string]*entry

	memoryHits, diskHits, compiles atomic.Int64
}

// entry is one key's result; done is closed once value/err are set, so that concurrent callers
// for a key wait for one compile instead of starting their own.
type entry struct {
	done  chan struct{}
	value any // []byte (NVRTC) or *Library (host)
	err   error
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

// once returns key's value from memory, or runs load for it; concurrent callers of one key
// share one load. Failures are not remembered: a later call may succeed (a fixed source
// reloaded, memory freed).
func (c *Cache) once(key string, load func() (any, error)) (any, error) {
	c.mu.Lock()
	if e, ok := c.mem[key]; ok {
		c.mu.Unlock()
		<-e.done
		if e.err == nil {
			c.memoryHits.Add(1)
		}
		return e.value, e.err
	}
	e := &entry{done: make(chan struct{})}
	c.mem[key] = e
	c.mu.Unlock()

	e.value, e.err = load()
	if e.err != nil {
		c.mu.Lock()
		delete(c.mem, key)
		c.mu.Unlock()
	}
	close(e.done)
	return e.value, e.err
}

// keep counts a compile that started at start, writes its output out to file (the disk cache;
// "" keeps it in memory only) and reports it.
func (c *Cache) keep(file string, out []byte, name, target string, defines map[string]string, start time.Time) {
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
	c.report(name, target, defines, elapsed.Milliseconds(), where)
}

// report writes the one line of a compile: what, for what, how long, where it went.
func (c *Cache) report(name, target string, defines map[string]string, ms int64, where string) {
	if c.log != nil && !quiet() {
		fmt.Fprintf(c.log, "pyep: compiled %s for %s%s in %d ms; %s\n", name, target, describeDefines(defines), ms, where)
	}
}

// quiet reports whether PYEP_JIT_QUIET asks for no compile reports.
func quiet() bool {
	return env.Quiet()
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

// entryFileName is "<stem>-<target>-<key prefix><ext>": readable enough to tell entries apart
// when clearing the directory by hand; 128 bits of key keep collisions out of reach.
func entryFileName(name, target, key, ext string) string {
	stem := strings.TrimSuffix(path.Base(filepath.ToSlash(name)), path.Ext(name))
	stem = unsafeNameRE.ReplaceAllString(stem, "_")
	return fmt.Sprintf("%s-%s-%s%s", stem, unsafeNameRE.ReplaceAllString(target, "_"), key[:32], ext)
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
