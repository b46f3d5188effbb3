// Package env is where the Go core reads its PYEP_* environment variables: each one is named
// and parsed here, once, and the packages that use it ask here. The README's table of the
// environment lists the same names. (The Python layer reads its own: PYEP_BACKEND,
// PYEP_QUEUED_DISPATCH, PYEP_TUNING_FILE.)
package env

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// The variables.
const (
	TimeoutS      = "PYEP_TIMEOUT_S"      // bound of every wait on a peer, seconds
	NormalThreads = "PYEP_NORMAL_THREADS" // block size of the cuda dispatch and combine kernels
	CopyUnroll    = "PYEP_COPY_UNROLL"    // vectors in flight a lane when their warps copy a row
	JITFlags      = "PYEP_JIT_FLAGS"      // extra NVRTC options, space-separated
	JITCacheDir   = "PYEP_JIT_CACHE_DIR"  // the kernel cache's directory
	JITQuiet      = "PYEP_JIT_QUIET"      // no log line for a cold compile
	NVRTC         = "PYEP_NVRTC"          // the NVRTC library to load
	SitePackages  = "PYEP_SITE_PACKAGES"  // where Python's packages are (NVIDIA's wheels), set by pyep
	DebugSync     = "PYEP_DEBUG_SYNC"     // every launch waits for its kernel
	MemHandle     = "PYEP_MEM_HANDLE"     // use_fabric's handle kind: auto, fabric or fd
	RanksPerNode  = "PYEP_RANKS_PER_NODE" // node size: each k consecutive ranks are one node
	LLTimeline    = "PYEP_LL_TIMELINE"    // low-latency kernels stamp their phases (a diagnosis build)
	CommStream    = "PYEP_COMM_STREAM"    // every normal-mode call runs on the communication stream
)

// Get reads name now, from the C library's environment when the core is a library of a C
// host process (Python's os.environ calls putenv; os.Getenv sees only the environment of the
// moment the Go runtime started).
func Get(name string) string { return getenv(name) }

// Timeout is PYEP_TIMEOUT_S as read at start-up, and whether it was a positive number.
func Timeout() (time.Duration, bool) {
	s, err := strconv.ParseFloat(os.Getenv(TimeoutS), 64)
	if err != nil || !(s > 0) {
		return 0, false
	}
	return time.Duration(s * float64(time.Second)), true
}

// Threads is PYEP_NORMAL_THREADS as read at start-up: a multiple of 32 from 64 to 1024, else def.
func Threads(def int) int { return parseThreads(os.Getenv(NormalThreads), def) }

func parseThreads(s string, def int) int {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil || n < 64 || n > 1024 || n%32 != 0 {
		return def
	}
	return n
}

// Unroll is PYEP_COPY_UNROLL as read at start-up: 1 to 16, else 0.
func Unroll() int { return parseUnroll(os.Getenv(CopyUnroll)) }

func parseUnroll(s string) int {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil || n < 1 || n > 16 {
		return 0
	}
	return n
}

// Flags is PYEP_JIT_FLAGS as set now (the kernel cache reads it once, when the core is loaded: Python
// may set it before it imports pyep).
func Flags() []string { return strings.Fields(Get(JITFlags)) }

// Sync reports whether PYEP_DEBUG_SYNC=1 was set at start-up.
func Sync() bool { return os.Getenv(DebugSync) == "1" }

// Timeline reports whether PYEP_LL_TIMELINE=1 is set now: a low-latency engine made now runs the
// kernels built to stamp their phases (kernels/params.h's timeline). Read once an engine, when
// the buffer's low-latency mode is made, so Python may set it before making the Buffer.
func Timeline() bool { return Get(LLTimeline) == "1" }

// CommStreamOnly reports whether PYEP_COMM_STREAM=1 is set now: the normal-mode engine made now
// runs every call's kernels on the communication stream, in DeepEP's order (the comm stream waits
// for the caller's stream, and the caller's for it), also the usual call, which otherwise runs on
// the caller's stream. Read once an engine, when the buffer's normal mode is first used, so
// Python may set it before making the Buffer.
func CommStreamOnly() bool { return Get(CommStream) == "1" }

// Quiet reports whether PYEP_JIT_QUIET asks for no compile reports.
func Quiet() bool {
	switch os.Getenv(JITQuiet) {
	case "", "0", "false", "no":
		return false
	}
	return true
}

// NodeSize is PYEP_RANKS_PER_NODE as set now (a Buffer reads it when it is made, after Python
// may have set it): 0 when unset or empty, else a positive whole number. Whether it fits the
// group (divides it, at most a node of 8) is goep.NewTopology's to say.
func NodeSize() (int, error) { return parseNodeSize(Get(RanksPerNode)) }

func parseNodeSize(s string) (int, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return 0, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		return 0, fmt.Errorf("%s=%q: expected a positive whole number of ranks a node (at most 8, dividing the "+
			"group), or unset for DeepEP's nodes of 8", RanksPerNode, s)
	}
	return n, nil
}

// CacheDir is PYEP_JIT_CACHE_DIR ("" when unset).
func CacheDir() string { return os.Getenv(JITCacheDir) }
