//go:build !cgo

package driver

import (
	"errors"
)

// Open fails in a build without cgo, which cannot dlopen the driver; the rest of pyep (the cpu
// backend, the fake driver) still builds and works.
func Open() (Driver, error) {
	return nil, errors.New("pyep: cannot load the CUDA driver (libcuda.so.1): this build of pyep has no cgo; rebuild with CGO_ENABLED=1; the cpu backend needs none")
}

func driverErrorText(Result) (string, string, bool) { return "", "", false }
