//go:build !cgo

package jit

import (
	"errors"
	"unsafe"
)

var errNoCgoHost = errors.New("pyep: this build of pyep has no cgo, so it cannot load host-built kernels; rebuild with CGO_ENABLED=1")

func dlopen(string) (unsafe.Pointer, error) { return nil, errNoCgoHost }

func dlsym(unsafe.Pointer, string) (unsafe.Pointer, error) { return nil, errNoCgoHost }
