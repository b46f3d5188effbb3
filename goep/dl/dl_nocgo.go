//go:build !cgo

package dl

import "errors"

// Symbol is one entry point of a table: its names, tried in order.
type Symbol []string

// Library is an opened library and the addresses of its table's symbols.
type Library struct {
	Path  string
	Addrs []uintptr
}

// Options of Open.
type Options struct{ Global bool }

// Open fails: a build without cgo cannot dlopen.
func Open(path string, table []Symbol, o Options) (*Library, error) {
	return nil, errors.New("pyep: this build has no cgo and cannot dlopen " + path)
}
