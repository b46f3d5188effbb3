package driver

import (
	"fmt"
	"sync/atomic"
)

// loaded is set once libcuda is loaded; from then on the driver names Results.
var loaded atomic.Bool

// Result is a CUresult, the status every driver call returns. Non-zero Results are errors, so
// callers can test for one with errors.Is(err, cuda.ErrorOutOfMemory) through the wrapping that
// adds the failing call's name.
type Result int32

// The Results pyep handles or reports by name; the driver may return others, which still
// print with the driver's own name and description.
const (
	Success                       Result = 0
	ErrorInvalidValue             Result = 1
	ErrorOutOfMemory              Result = 2
	ErrorNotInitialized           Result = 3
	ErrorDeinitialized            Result = 4
	ErrorStubLibrary              Result = 34
	ErrorNoDevice                 Result = 100
	ErrorInvalidDevice            Result = 101
	ErrorInvalidImage             Result = 200
	ErrorInvalidContext           Result = 201
	ErrorNoBinaryForGPU           Result = 209
	ErrorInvalidPTX               Result = 218
	ErrorUnsupportedPTXVersion    Result = 222
	ErrorInvalidHandle            Result = 400
	ErrorNotFound                 Result = 500
	ErrorNotReady                 Result = 600
	ErrorIllegalAddress           Result = 700
	ErrorLaunchOutOfResources     Result = 701
	ErrorLaunchTimeout            Result = 702
	ErrorPeerAccessAlreadyEnabled Result = 704
	ErrorLaunchFailed             Result = 719
	ErrorNotPermitted             Result = 800
	ErrorNotSupported             Result = 801
	ErrorUnknown                  Result = 999
)

// knownResults names Results when the driver cannot (it is not loaded: the fake driver, or
// errors reported before loading). Descriptions follow the driver's wording.
var knownResults = map[Result][2]string{
	Success:                       {"CUDA_SUCCESS", "no error"},
	ErrorInvalidValue:             {"CUDA_ERROR_INVALID_VALUE", "invalid argument"},
	ErrorOutOfMemory:              {"CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
	ErrorNotInitialized:           {"CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
	ErrorDeinitialized:            {"CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
	ErrorStubLibrary:              {"CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
	ErrorNoDevice:                 {"CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
	ErrorInvalidDevice:            {"CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
	ErrorInvalidImage:             {"CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
	ErrorInvalidContext:           {"CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
	ErrorNoBinaryForGPU:           {"CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device"},
	ErrorInvalidPTX:               {"CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
	ErrorUnsupportedPTXVersion:    {"CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "the provided PTX was compiled with an unsupported toolchain."},
	ErrorInvalidHandle:            {"CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
	ErrorNotFound:                 {"CUDA_ERROR_NOT_FOUND", "named symbol not found"},
	ErrorNotReady:                 {"CUDA_ERROR_NOT_READY", "device not ready"},
	ErrorIllegalAddress:           {"CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
	ErrorLaunchOutOfResources:     {"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
	ErrorLaunchTimeout:            {"CUDA_ERROR_LAUNCH_TIMEOUT", "the launch timed out and was terminated"},
	ErrorPeerAccessAlreadyEnabled: {"CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", "peer access is already enabled"},
	ErrorLaunchFailed:             {"CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
	ErrorNotPermitted:             {"CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
	ErrorNotSupported:             {"CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
	ErrorUnknown:                  {"CUDA_ERROR_UNKNOWN", "unknown error"},
}

// Name is the driver's name for r, e.g. CUDA_ERROR_INVALID_VALUE.
func (r Result) Name() string {
	name, _ := r.describe()
	return name
}

// Error is "NAME: description", e.g. "CUDA_ERROR_INVALID_VALUE: invalid argument".
func (r Result) Error() string {
	name, desc := r.describe()
	return name + ": " + desc
}

// describe prefers the loaded driver's own strings, which cover codes newer than this file.
func (r Result) describe() (name, desc string) {
	if name, desc, ok := driverErrorText(r); ok {
		return name, desc
	}
	return r.builtinText()
}

// builtinText names r from knownResults.
func (r Result) builtinText() (name, desc string) {
	if nd, ok := knownResults[r]; ok {
		return nd[0], nd[1]
	}
	return fmt.Sprintf("CUDA_ERROR_%d", int32(r)), "unrecognized CUDA error code"
}

// wrap names the call that failed; nil for Success, so hot paths allocate nothing.
func wrap(op string, r Result) error {
	if r == Success {
		return nil
	}
	return fmt.Errorf("pyep: %s: %w", op, r)
}
