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

// NotAvailableError is an operation that pyep has the API of but cannot run in this setting yet
// (Python raises pyep.NotAvailableError for it): the message says what is missing and, where a
// setting of the user's is why, which one to change.
type NotAvailableError struct{ msg string }

func (e *NotAvailableError) Error() string { return e.msg }

// NotAvailablef makes a NotAvailableError.
func NotAvailablef(format string, args ...any) error {
	return &NotAvailableError{msg: fmt.Sprintf(format, args...)}
}

// IsNotAvailable reports whether err is, or wraps, a NotAvailableError.
func IsNotAvailable(err error) bool {
	var n *NotAvailableError
	return errors.As(err, &n)
}
