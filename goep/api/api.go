// Package api is pyep's composition root: what a binding calls. It names buffers by integer
// ids (a stale id is an error, never a dangling pointer), makes backends by name, and holds the
// process's settings and statistics. The Python binding (pyep/) and a future C ABI call it and
// only convert values; neither imports a backend.
package api

import (
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cpu"
	"github.com/pyep/pyep/goep/cuda"
	cudall "github.com/pyep/pyep/goep/cuda/lowlatency"
	cudanormal "github.com/pyep/pyep/goep/cuda/normal"
	"github.com/pyep/pyep/goep/jit"
)

var registry struct {
	sync.Mutex
	next    int64
	buffers map[int64]*goep.Buffer
}

// cudaEngines are the cuda backend's engines, one package per mode beside goep/cuda (which
// knows none of them): every buffer on a GPU gets them through goep.Params.Engines.
var cudaEngines = goep.Engines{Normal: cudanormal.NewEngine, LowLatency: cudall.NewEngine}

// Backend is the backend named "cpu", or "cuda:N" for device ordinal N (plain "cuda" is device
// 0). Every Buffer on a GPU shares the process's Backend of that GPU (its primary context, its
// communication stream and its compiled kernels).
func Backend(name string) (goep.Backend, error) {
	be, _, err := backend(name)
	return be, err
}

// backend is the backend named name and the makers of its buffers' engines that live outside
// it (the cpu backend makes its own).
func backend(name string) (goep.Backend, goep.Engines, error) {
	switch {
	case name == "cpu":
		return cpu.Backend{}, goep.Engines{}, nil
	case name == "cuda" || strings.HasPrefix(name, "cuda:"):
		ordinal := 0
		if s, ok := strings.CutPrefix(name, "cuda:"); ok {
			n, err := strconv.Atoi(s)
			if err != nil || n < 0 {
				return nil, goep.Engines{}, goep.Argf("backend %q: expected \"cuda:N\" with N a device ordinal", name)
			}
			ordinal = n
		}
		be, err := cuda.SharedBackend(ordinal)
		if err != nil {
			return nil, goep.Engines{}, err
		}
		return be, cudaEngines, nil
	}
	return nil, goep.Engines{}, goep.Argf("backend %q: expected \"cpu\" or \"cuda:N\"", name)
}

// NewBuffer allocates a Buffer on the named backend, with the backend's engines where p names
// none, and returns its id.
func NewBuffer(name string, p goep.Params) (int64, error) {
	be, engines, err := backend(name)
	if err != nil {
		return 0, err
	}
	if p.Engines.Normal == nil {
		p.Engines.Normal = engines.Normal
	}
	if p.Engines.LowLatency == nil {
		p.Engines.LowLatency = engines.LowLatency
	}
	b, err := goep.NewBuffer(p, be)
	if err != nil {
		return 0, err
	}
	registry.Lock()
	defer registry.Unlock()
	if registry.buffers == nil {
		registry.buffers = map[int64]*goep.Buffer{}
	}
	registry.next++
	registry.buffers[registry.next] = b
	return registry.next, nil
}

// Buffer is the buffer of id.
func Buffer(id int64) (*goep.Buffer, error) {
	registry.Lock()
	defer registry.Unlock()
	b, ok := registry.buffers[id]
	if !ok {
		return nil, fmt.Errorf("buffer #%d does not exist: it was destroyed, or the object is stale", id)
	}
	return b, nil
}

// Destroy releases the buffer of id and forgets the id; destroying an unknown id is a no-op, so
// that destroy stays idempotent.
func Destroy(id int64) error {
	registry.Lock()
	b, ok := registry.buffers[id]
	delete(registry.buffers, id)
	registry.Unlock()
	if !ok {
		return nil
	}
	return b.Destroy()
}

// SetOpTimeout sets the bound of every wait on a peer, in seconds, for calls made from now on
// (PYEP_TIMEOUT_S sets it at start-up); tests shorten it.
func SetOpTimeout(seconds float64) error {
	if !(seconds > 0) || seconds > 1e6 {
		return goep.Argf("seconds = %v: expected a positive number", seconds)
	}
	goep.SetOpTimeout(time.Duration(seconds * float64(time.Second)))
	return nil
}

// KernelCacheStats is how this process's kernel cache answered so far.
func KernelCacheStats() jit.Stats { return jit.Default().Stats() }
