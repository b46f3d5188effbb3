package goep

import (
	"errors"
	"fmt"
)

// ArgumentError is a caller's mistake in an argument (Python raises ValueError for it); every
// other error is a failure of the operation (RuntimeError).
type ArgumentError struct{ msg string }

func (e *ArgumentError) Error() string { return e.msg }

// Argf makes an ArgumentError; the message names the argument and what was expected.
func Argf(format string, args ...any) error {
	return &ArgumentError{fmt.Sprintf(format, args...)}
}

// IsArgument reports whether err is, or wraps, an ArgumentError.
func IsArgument(err error) bool {
	var a *ArgumentError
	return errors.As(err, &a)
}
