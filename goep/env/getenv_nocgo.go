//go:build !cgo

package env

import "os"

// getenv is os.Getenv: without cgo, pyep is no library of a C host process.
func getenv(name string) string { return os.Getenv(name) }
