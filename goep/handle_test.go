package goep

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestHandleRoundTrip(t *testing.T) {
	for _, h := range []Handle{
		{Backend: "cpu", Rank: 3, NumRanks: 4, Size: 1 << 30, Token: []byte("pyep-1-abc")},
		{Backend: "cuda", Rank: 0, NumRanks: 8, Size: 128, Token: make([]byte, 64)},
		{Backend: "cpu", Rank: 0, NumRanks: 1, Size: 0, Token: nil},
		{Backend: "cpu", Rank: 2, NumRanks: 3, Size: 0, Token: nil, RDMASize: 1 << 20, RDMAToken: []byte("pyep-2-ll")},
		{Backend: "cpu", Rank: 1, NumRanks: 2, Size: 256, Token: []byte("a"), RDMASize: 128, RDMAToken: []byte("b")},
	} {
		got, err := DecodeHandle(h.Encode())
		require.NoError(t, err)
		if len(h.Token) == 0 {
			h.Token = []byte{}
		}
		assert.Equal(t, h, got)
	}
}

func TestHandleRejectsGarbage(t *testing.T) {
	good := Handle{Backend: "cpu", Rank: 1, NumRanks: 2, Size: 256, Token: []byte("pyep-1-x")}.Encode()
	bumped := append([]byte{}, good...)
	bumped[4] = 99
	tests := []struct {
		name string
		raw  []byte
		err  string
	}{
		{"empty", nil, "not a pyep buffer handle (0 bytes)"},
		{"magic", append([]byte("XXXX"), good[4:]...), "not a pyep buffer handle"},
		{"version", bumped, "handle version 99"},
		{"truncated", good[:len(good)-1], "truncated or padded"},
		{"padded", append(append([]byte{}, good...), 0), "truncated or padded"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := DecodeHandle(tt.raw)
			assert.ErrorContains(t, err, tt.err)
		})
	}
}
