//go:build !linux

package fake

import (
	"errors"
	"os"

	"github.com/pyep/pyep/goep/cuda/driver"
)

// Off Linux the fake has no virtual memory management: the devices say so, and the cuMem*
// calls fail before reaching these.
const vmmSupported = false

var errNoVMM = errors.New("the fake's virtual memory management needs Linux")

func newBacking(int) (*os.File, fileKey, error)         { return nil, fileKey{}, errNoVMM }
func keyOfFD(int) (fileKey, error)                      { return fileKey{}, errNoVMM }
func dupFD(*os.File) (int, error)                       { return -1, errNoVMM }
func reserve(int, int) (uintptr, error)                 { return 0, errNoVMM }
func unreserve(uintptr, int) error                      { return errNoVMM }
func mapFile(uintptr, int, *os.File) error              { return errNoVMM }
func unmapFile(uintptr, int) error                      { return errNoVMM }
func protect(uintptr, int, driver.MemAccessFlags) error { return errNoVMM }
