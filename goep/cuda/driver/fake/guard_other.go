//go:build !unix

package fake

import "errors"

func guarded(int) ([]byte, error) { return nil, errors.New("Config.Guard needs a unix host") }

func unguard([]byte) {}
