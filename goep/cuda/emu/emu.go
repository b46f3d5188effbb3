//go:build cgo

// Package emu runs pyep's CUDA kernels (kernels/*.cu, compiled as C++ against emu.h) on the
// host, under goep/cuda's fake driver, so that the normal-mode engine and its kernels are
// tested end to end on machines without a GPU: every CUDA thread is an OS thread, every fake
// rank a goroutine with its own Backend. The kernel variants it can run are the ones gen.go
// lists (v_*.cc); a test must use shapes among them.
package emu

/*
#cgo CXXFLAGS: -std=c++17 -O1 -DPYEP_EMU -pthread -Wno-unused-variable -Wno-unused-function
#cgo LDFLAGS: -pthread -lstdc++
#include <stdlib.h>
int emu_find(const char* key, const char* kernel);
int emu_launch(int id, unsigned grid, unsigned block, const void* params);
*/
import "C"

import (
	"fmt"
	"sort"
	"strings"
	"unsafe"

	"github.com/pyep/pyep/goep/cuda"
	"github.com/pyep/pyep/goep/cuda/fake"
)

// Options are the engine options that run the emulated kernels (block sizes as gen.go built them).
func Options() cuda.NormalOptions {
	return cuda.NormalOptions{Loader: Loader{}, Threads: 128, NotifyThreads: 64, LayoutThreads: 64}
}

// Options4 are Options for four ranks (gen.go's four-rank variants).
func Options4() cuda.NormalOptions {
	o := Options()
	o.Threads = 160
	return o
}

// OptionsGPU are Options with the GPU's block size of dispatch and combine.
func OptionsGPU() cuda.NormalOptions {
	o := Options()
	o.Threads = 768
	return o
}

// Key is the canonical string of a define set: sorted NAME or NAME=VALUE, space-separated.
func Key(defines map[string]string) string {
	parts := make([]string, 0, len(defines))
	for k, v := range defines {
		if v == "" {
			parts = append(parts, k)
		} else {
			parts = append(parts, k+"="+v)
		}
	}
	sort.Strings(parts)
	return strings.Join(parts, " ")
}

// Loader is a cuda.KernelLoader for Backends over a fake driver.
type Loader struct{}

// Load implements cuda.KernelLoader.
func (Loader) Load(b *cuda.Backend, file, kernel string, defines map[string]string) (cuda.Function, error) {
	d, ok := b.Driver().(*fake.Driver)
	if !ok {
		return cuda.Function{}, fmt.Errorf("emu: the backend's driver is not a fake driver")
	}
	key := Key(defines)
	ck, cn := C.CString(key), C.CString(kernel)
	defer C.free(unsafe.Pointer(ck))
	defer C.free(unsafe.Pointer(cn))
	id := C.emu_find(ck, cn)
	if id < 0 {
		return cuda.Function{}, fmt.Errorf("emu: %s of %s was not built for %q (add it to gen.go)", kernel, file, key)
	}
	name := fmt.Sprintf("emu:%d", int(id))
	d.World().RegisterKernel(name, func(l *fake.Launch) error {
		if l.Grid[1] != 1 || l.Grid[2] != 1 || l.Block[1] != 1 || l.Block[2] != 1 {
			return fmt.Errorf("emu: one-dimensional launches only")
		}
		if rc := C.emu_launch(id, C.uint(l.Grid[0]), C.uint(l.Block[0]), l.Args[0]); rc != 0 {
			return fmt.Errorf("emu: could not start the threads of %s", l.Name)
		}
		return nil
	})
	mod, err := d.ModuleLoadData([]byte{1})
	if err != nil {
		return cuda.Function{}, err
	}
	return mod.Function(name)
}
