//go:build !cgo

package jit

// Without cgo there is no dlopen, hence no NVRTC: say so instead of failing to build, so the
// rest of pyep (the cpu backend) still works in such a build.
func loadNVRTC([]string) (*NVRTC, error) { return nil, errNoCgo }

func nvrtcCompile(string, string, []Header, []string, outputKind) ([]byte, string, error) {
	return nil, "", errNoCgo
}

func loadLTOIR(*NVRTC) error { return errNoCgo }
