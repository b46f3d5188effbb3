package goep

import (
	"errors"
	"fmt"
)

// ArgumentError is a caller's mistake in an argument (Python raises ValueError for it, or
// TypeError for an argument of the wrong type); every other error is a failure of the
// operation (RuntimeError).
type ArgumentError struct {
	msg    string
	isType bool
}

func (e *ArgumentError) Error() string { return e.msg }

// Argf makes an ArgumentError; the message names the argument and what was expected.
func Argf(format string, args ...any) error {
	return &ArgumentError{msg: fmt.Sprintf(format, args...)}
}

// Typef makes an ArgumentError that Python raises as TypeError.
func Typef(format string, args ...any) error {
	return &ArgumentError{msg: fmt.Sprintf(format, args...), isType: true}
}

// IsArgument reports whether err is, or wraps, an ArgumentError.
func IsArgument(err error) bool {
	var a *ArgumentError
	return errors.As(err, &a)
}

// IsType reports whether err is, or wraps, an ArgumentError made by Typef.
func IsType(err error) bool {
	var a *ArgumentError
	return errors.As(err, &a) && a.isType
}
