package jit

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"time"
	"unsafe"
)

// HostOptions are what a source is built with for the host (the emulator's kernels).
type HostOptions struct {
	// Defines become -DNAME=VALUE (-DNAME when VALUE is empty), as for NVRTC.
	Defines map[string]string
	// Flags are further compiler options.
	Flags []string
}

// hostFlags go to every host build (-x c++: kernel sources are .cu files): a shared object, optimised enough that thousands of
// emulated threads run at a useful pace, cheap enough to compile in a few seconds. Symbols are
// hidden but for those a source marks default: every library carries its own copies of what
// it includes, and none may bind to another's.
var hostFlags = []string{"-x", "c++", "-std=c++17", "-O1", "-pthread", "-shared", "-fPIC", "-fvisibility=hidden",
	"-Wno-unused-variable", "-Wno-unused-function"}

// hostOptions is the complete host compiler command line for o but for the file names.
func (o HostOptions) hostOptions() ([]string, error) {
	defines, err := defineFlags(o.Defines)
	if err != nil {
		return nil, err
	}
	opts := append(append([]string{}, hostFlags...), defines...)
	return append(opts, o.Flags...), nil
}

// Library is a source built for the host and loaded into this process. It stays loaded for the
// life of the process (code in it may run on any thread at any time).
type Library struct {
	// Path is the shared object the loader mapped.
	Path string
	// Key is the cache key it was built under.
	Key    string
	handle unsafe.Pointer
}

// Symbol is the address of the library's symbol name (a function or variable that the source
// gave default visibility, e.g. with __attribute__((visibility("default")))).
func (l *Library) Symbol(name string) (unsafe.Pointer, error) {
	p, err := dlsym(l.handle, name)
	if err != nil {
		return nil, fmt.Errorf("pyep: %s: %w", l.Path, err)
	}
	return p, nil
}

// hostCompiler is the C++ compiler: its command (program and leading arguments) and its
// identity for cache keys.
type hostCompiler struct {
	argv     []string
	identity string
}

var (
	hostMu        sync.Mutex
	hostCompilers = map[string]*hostCompiler{}
)

// findHostCompiler resolves $CXX (a program, possibly with arguments), else c++, else g++,
// from PATH, and asks it its version once per process.
func findHostCompiler() (*hostCompiler, error) {
	cxx := os.Getenv("CXX")
	hostMu.Lock()
	defer hostMu.Unlock()
	if hc, ok := hostCompilers[cxx]; ok {
		return hc, nil
	}
	var argv []string
	if fields := strings.Fields(cxx); len(fields) > 0 {
		prog, err := exec.LookPath(fields[0])
		if err != nil {
			return nil, fmt.Errorf("pyep: jit: the host C++ compiler $CXX=%q: %w", cxx, err)
		}
		argv = append([]string{prog}, fields[1:]...)
	} else {
		for _, name := range []string{"c++", "g++"} {
			if prog, err := exec.LookPath(name); err == nil {
				argv = []string{prog}
				break
			}
		}
		if argv == nil {
			return nil, errors.New("pyep: jit: no host C++ compiler (c++ or g++ on PATH, or $CXX), " +
				"which builds the emulator's kernels: install g++ or set CXX")
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	version, err := exec.CommandContext(ctx, argv[0], append(argv[1:], "--version")...).Output()
	if err != nil {
		return nil, fmt.Errorf("pyep: jit: %s --version: %w", strings.Join(argv, " "), err)
	}
	hc := &hostCompiler{argv: argv, identity: "host " + strings.Join(argv, " ") + "\n" + string(version)}
	hostCompilers[cxx] = hc
	return hc, nil
}

// CompileHost builds src for the host through the Default cache.
func CompileHost(src Source, opts HostOptions) (*Library, error) {
	return Default().CompileHost(src, opts)
}

// CompileHost builds src with the host C++ compiler into a shared object and loads it: from
// memory, from the cache directory, or by compiling. src.Text is the translation unit; its
// headers are written beside it, so that #include "name" finds them. A memory-only cache builds
// in a temporary directory, removed once the library is loaded.
func (c *Cache) CompileHost(src Source, opts HostOptions) (*Library, error) {
	flags, err := opts.hostOptions()
	if err != nil {
		return nil, err
	}
	hc, err := findHostCompiler()
	if err != nil {
		return nil, err
	}
	key := cacheKey(keyInput{compiler: hc.identity, output: "so", flags: flags, src: src})
	v, err := c.once(key, func() (any, error) { return c.loadHost(hc, src, opts, flags, key) })
	if err != nil {
		return nil, err
	}
	return v.(*Library), nil
}

func (c *Cache) loadHost(hc *hostCompiler, src Source, opts HostOptions, flags []string, key string) (*Library, error) {
	dir := c.dir
	if dir == "" {
		tmp, err := os.MkdirTemp("", "pyep-jit-")
		if err != nil {
			return nil, fmt.Errorf("pyep: jit: %w", err)
		}
		defer os.RemoveAll(tmp)
		dir = tmp
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("pyep: jit: cache directory: %w", err)
	}
	file := filepath.Join(dir, entryFileName(src.Name, "host", key, ".so"))
	if c.dir != "" {
		if _, err := os.Stat(file); err == nil {
			if h, err := dlopen(file); err == nil {
				c.diskHits.Add(1)
				return &Library{Path: file, Key: key, handle: h}, nil
			}
			// Damaged (a disk that filled up under an older writer): build it again.
		}
	}
	start := time.Now()
	if err := hc.build(src, flags, file); err != nil {
		return nil, err
	}
	elapsed := time.Since(start)
	c.compiles.Add(1)
	h, err := dlopen(file)
	if err != nil {
		return nil, fmt.Errorf("pyep: jit: loading %s built from %s: %w", file, src.Name, err)
	}
	where := "kept until the process ends"
	if c.dir != "" {
		where = "cached at " + file
	}
	c.report(src.Name, "the host", opts.Defines, elapsed.Milliseconds(), where)
	return &Library{Path: file, Key: key, handle: h}, nil
}

// build writes src and its headers to a fresh directory beside file, compiles them there and
// renames the result to file: a concurrent builder of the same key (another process) renames
// an equivalent file over it, and no reader ever sees half a file.
func (hc *hostCompiler) build(src Source, flags []string, file string) error {
	work, err := os.MkdirTemp(filepath.Dir(file), ".build-"+strings.TrimSuffix(filepath.Base(file), ".so")+"-")
	if err != nil {
		return fmt.Errorf("pyep: jit: %w", err)
	}
	defer os.RemoveAll(work)
	tu := path.Base(filepath.ToSlash(src.Name))
	files := append([]Header{{Name: tu, Text: src.Text}}, src.Headers...)
	for _, f := range files {
		if !fs.ValidPath(f.Name) {
			return fmt.Errorf("pyep: jit: %s: header name %q is not a relative path", src.Name, f.Name)
		}
		p := filepath.Join(work, filepath.FromSlash(f.Name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return fmt.Errorf("pyep: jit: %w", err)
		}
		if err := os.WriteFile(p, []byte(f.Text), 0o644); err != nil {
			return fmt.Errorf("pyep: jit: %w", err)
		}
	}
	out := filepath.Join(work, "out.so")
	args := append(append(append([]string{}, hc.argv[1:]...), flags...), "-I", work, "-o", out, filepath.Join(work, tu))
	cmd := exec.Command(hc.argv[0], args...)
	var log bytes.Buffer
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Run(); err != nil {
		return &CompileError{Compiler: hc.argv[0], Name: src.Name, Stage: "compile", Result: err.Error(),
			Log: strings.ReplaceAll(log.String(), work+string(filepath.Separator), "")}
	}
	if err := os.Chmod(out, 0o755); err != nil {
		return fmt.Errorf("pyep: jit: %w", err)
	}
	if err := os.Rename(out, file); err != nil {
		return fmt.Errorf("pyep: jit: %w", err)
	}
	return nil
}
