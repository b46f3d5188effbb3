//go:build cgo

package dl

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The C library is always there: a table of its symbols, a fallback name, a missing one.
func TestOpen(t *testing.T) {
	lib, err := Open("libc.so.6", []Symbol{{"strlen"}, {"no_such_symbol_v2", "getenv"}}, Options{})
	require.NoError(t, err)
	assert.Len(t, lib.Addrs, 2)
	assert.NotZero(t, lib.Addrs[0])
	assert.NotZero(t, lib.Addrs[1])

	_, err = Open("libc.so.6", []Symbol{{"strlen"}, {"no_such_symbol"}}, Options{})
	var missing *MissingError
	require.True(t, errors.As(err, &missing), "%v", err)
	assert.Equal(t, "no_such_symbol", missing.Symbol)
	assert.Equal(t, 1, missing.Index)

	_, err = Open("libpyep-no-such-library.so", nil, Options{})
	var open *OpenError
	require.True(t, errors.As(err, &open), "%v", err)
	assert.Contains(t, open.Detail, "libpyep-no-such-library.so")
}
