package jit

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
)

// NVJitLink describes the loaded nvJitLink library, which links NVRTC's LTO-IR with device
// libraries (libnvshmem_device.a) into a cubin. Only one is loaded per process.
type NVJitLink struct {
	// Path is the file the dynamic loader mapped.
	Path string
	// Major and Minor are what nvJitLinkVersion reports; they are part of the key of every
	// linked cubin.
	Major, Minor int
}

// LinkInputKind is an nvJitLinkInputType.
type LinkInputKind int

// The kinds of input pyep links.
const (
	LinkLTOIR   LinkInputKind = 3 // NVJITLINK_INPUT_LTOIR: NVRTC's output under -dlto
	LinkLibrary LinkInputKind = 6 // NVJITLINK_INPUT_LIBRARY: a static device library (.a)
)

// LinkInput is one input of a link: its kind, a name for messages, its bytes.
type LinkInput struct {
	Kind LinkInputKind
	Name string
	Data []byte
}

// jitLinkResultNames are nvJitLinkResult's names, by value.
var jitLinkResultNames = []string{
	"NVJITLINK_SUCCESS", "NVJITLINK_ERROR_UNRECOGNIZED_OPTION", "NVJITLINK_ERROR_MISSING_ARCH",
	"NVJITLINK_ERROR_INVALID_INPUT", "NVJITLINK_ERROR_PTX_COMPILE", "NVJITLINK_ERROR_NVVM_COMPILE",
	"NVJITLINK_ERROR_INTERNAL", "NVJITLINK_ERROR_THREADPOOL", "NVJITLINK_ERROR_UNRECOGNIZED_INPUT",
	"NVJITLINK_ERROR_FINALIZE", "NVJITLINK_ERROR_NULL_INPUT", "NVJITLINK_ERROR_INCOMPATIBLE_OPTIONS",
	"NVJITLINK_ERROR_INCORRECT_INPUT_TYPE", "NVJITLINK_ERROR_ARCH_MISMATCH", "NVJITLINK_ERROR_OUTDATED_LIBRARY",
	"NVJITLINK_ERROR_MISSING_FATBIN", "NVJITLINK_ERROR_UNRECOGNIZED_ARCH", "NVJITLINK_ERROR_UNSUPPORTED_ARCH",
	"NVJITLINK_ERROR_LTO_NOT_ENABLED",
}

func jitLinkResultName(r int) string {
	if r >= 0 && r < len(jitLinkResultNames) {
		return jitLinkResultNames[r]
	}
	return fmt.Sprintf("nvJitLink error %d", r)
}

// LinkError is a failed link; Log is nvJitLink's error and info logs.
type LinkError struct {
	Name   string // the program linked, e.g. kernels/low_latency.cu
	Stage  string // what failed: "start", "add an input to", "complete" or "emit the output of"
	Input  string // the input being added, when Stage is "add an input to"
	Result string // nvJitLink's name for the failure
	Log    string
}

func (e *LinkError) Error() string {
	link := "a link"
	if e.Name != "" {
		link = "the link of " + e.Name
	}
	msg := fmt.Sprintf("pyep: nvJitLink cannot %s %s: %s", e.Stage, link, e.Result)
	if e.Input != "" {
		msg = fmt.Sprintf("pyep: nvJitLink cannot add %s to %s: %s", e.Input, link, e.Result)
	}
	if log := strings.TrimSpace(e.Log); log != "" {
		msg += "\n" + log
	}
	return msg
}

// JitLinkNotFoundError says that no nvJitLink candidate could be loaded, and why each failed.
type JitLinkNotFoundError struct {
	Tried []string // "candidate (reason)", in search order
}

func (e *JitLinkNotFoundError) Error() string {
	return "pyep: cannot find nvJitLink, which links kernels with device libraries such as NVSHMEM's (searched " +
		"beside NVRTC, the NVIDIA wheels under PYEP_SITE_PACKAGES, $CUDA_HOME/lib64, /usr/local/cuda/lib64 and the loader's path); tried " +
		strings.Join(e.Tried, ", ") +
		". Install it with `pip install nvidia-nvjitlink` (PyTorch's CUDA wheels bring it too), of NVRTC's CUDA version or newer"
}

// jitLinkLibDirs are where NVIDIA's wheels put libnvJitLink in a site-packages directory.
var jitLinkLibDirs = []string{"nvidia/cu13/lib", "nvidia/nvjitlink/lib", "nvidia/cu12/lib"}

// JitLinkCandidates lists where LoadNVJitLink looks, in order, as read through getenv: the
// directory of the NVRTC in use (nvrtcDir; its own CUDA's linker matches it best), the NVIDIA
// wheels in each site-packages directory (dl.SitePackages), $CUDA_HOME/lib64,
// /usr/local/cuda/lib64, then bare sonames for the loader's own search. Files are listed only
// if they exist.
func JitLinkCandidates(getenv func(string) string, nvrtcDir string) []string {
	var first []string
	if nvrtcDir != "" {
		first = []string{nvrtcDir}
	}
	return toolkitLibraries(getenv, first, jitLinkLibDirs, "libnvJitLink.so*", "libnvJitLink.so.13", "libnvJitLink.so.12")
}

var (
	jitLinkOnce sync.Once
	jitLinkLib  *NVJitLink
	jitLinkErr  error
)

// LoadNVJitLink opens nvJitLink on first use and returns it; later calls return the same
// result. It loads NVRTC first: the linker must read what that NVRTC emits.
func LoadNVJitLink() (*NVJitLink, error) {
	jitLinkOnce.Do(func() {
		nv, err := LoadNVRTC()
		if err != nil {
			jitLinkErr = err
			return
		}
		jitLinkLib, jitLinkErr = loadNVJitLink(JitLinkCandidates(os.Getenv, filepath.Dir(nv.Path)), nv)
	})
	return jitLinkLib, jitLinkErr
}

// Link links inputs into a cubin with options (at least -arch=sm_XX; -lto for LTO-IR). log is
// nvJitLink's output, also on success. Links are independent, so concurrent calls are safe.
func (l *NVJitLink) Link(options []string, inputs []LinkInput) (cubin []byte, log string, err error) {
	if l == nil {
		return nil, "", errors.New("pyep: nvJitLink is not loaded")
	}
	return jitLink(options, inputs)
}
