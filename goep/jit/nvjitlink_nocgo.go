//go:build !cgo

package jit

// Without cgo there is no dlopen, hence no nvJitLink.
func loadNVJitLink([]string, *NVRTC) (*NVJitLink, error) { return nil, errNoCgo }

func jitLink([]string, []LinkInput) ([]byte, string, error) { return nil, "", errNoCgo }
