package jit

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
)

// NVRTC describes the loaded NVRTC library. Only one is loaded per process: the first
// candidate (see Candidates) that opens and exports every function we need.
type NVRTC struct {
	// Path is the file the dynamic loader mapped.
	Path string
	// Major and Minor are what nvrtcVersion reports; they are part of every cache key, since
	// another NVRTC may emit different code for the same source.
	Major, Minor int
}

// errNoCgo is what a build without cgo (hence without dlopen) answers.
var errNoCgo = errors.New("pyep: this build of pyep has no cgo, so it cannot load NVRTC; rebuild with CGO_ENABLED=1")

var (
	nvrtcOnce sync.Once
	nvrtcLib  *NVRTC
	nvrtcErr  error
)

// LoadNVRTC opens NVRTC on first use and returns it; later calls return the same result. The
// search order is that of Candidates, read from the environment at the first call.
func LoadNVRTC() (*NVRTC, error) {
	nvrtcOnce.Do(func() { nvrtcLib, nvrtcErr = loadNVRTC(Candidates(os.Getenv)) })
	return nvrtcLib, nvrtcErr
}

// NotFoundError says that no NVRTC candidate could be loaded, and why each one failed. Callers
// that can live without kernels (tests on machines without CUDA) check for it with errors.As.
type NotFoundError struct {
	Tried []string // "candidate (reason)", in search order
}

func (e *NotFoundError) Error() string {
	return "pyep: cannot find NVRTC, which compiles pyep's CUDA kernels at run time (searched PYEP_NVRTC, " +
		"the NVIDIA wheels under PYEP_SITE_PACKAGES, $CUDA_HOME/lib64, /usr/local/cuda/lib64 and the loader's path); tried " +
		strings.Join(e.Tried, ", ") +
		". Install it with `pip install nvidia-cuda-nvrtc` (PyTorch's CUDA wheels bring it too) or set PYEP_NVRTC=/path/to/libnvrtc.so"
}

// Header is a named header handed to NVRTC: #include "Name" resolves to Text.
type Header struct {
	Name, Text string
}

// CompileError is a failed compile; Log is the compiler's diagnostic output.
type CompileError struct {
	Compiler string // "" for NVRTC, else the host compiler's path
	Name     string // the program name, e.g. kernels/selftest.cu
	Stage    string // what failed: "create a program for", "compile" or "emit the output of"
	Result   string // NVRTC's name for the failure
	Log      string
}

func (e *CompileError) Error() string {
	compiler := e.Compiler
	if compiler == "" {
		compiler = "NVRTC"
	}
	msg := fmt.Sprintf("pyep: %s cannot %s %s: %s", compiler, e.Stage, e.Name, e.Result)
	if log := strings.TrimSpace(e.Log); log != "" {
		msg += "\n" + log
	}
	return msg
}

// Compile runs NVRTC on src with the given headers and options and returns the cubin, or the
// PTX when ptx is set (options must then name a virtual arch, compute_XX). log is NVRTC's
// output, warnings included, also on success. Programs are independent, so concurrent calls
// are safe.
func (n *NVRTC) Compile(name, src string, headers []Header, options []string, ptx bool) (out []byte, log string, err error) {
	if n == nil {
		return nil, "", errors.New("pyep: NVRTC is not loaded")
	}
	output := outCubin
	if ptx {
		output = outPTX
	}
	return nvrtcCompile(name, src, headers, options, output)
}

// outputKind is what a compile emits, in pyep_nvrtc_compile's numbering.
type outputKind int

const (
	outCubin outputKind = iota
	outPTX
	outLTOIR
)

var (
	ltoirOnce sync.Once
	ltoirErr  error
)

// CompileLTOIR runs NVRTC as Compile does but returns LTO-IR, which nvJitLink links with device
// libraries (options must ask for it: -rdc=true -dlto and a real arch, sm_XX).
func (n *NVRTC) CompileLTOIR(name, src string, headers []Header, options []string) (out []byte, log string, err error) {
	if n == nil {
		return nil, "", errors.New("pyep: NVRTC is not loaded")
	}
	if ltoirOnce.Do(func() { ltoirErr = loadLTOIR(n) }); ltoirErr != nil {
		return nil, "", ltoirErr
	}
	return nvrtcCompile(name, src, headers, options, outLTOIR)
}
