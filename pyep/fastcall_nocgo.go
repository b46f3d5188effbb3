//go:build !cgo

package pyep

// FastCalls is 0 without cgo: Python calls gopy's wrappers.
func FastCalls() uintptr { return 0 }
