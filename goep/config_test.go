package goep

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestNewConfig(t *testing.T) {
	tests := []struct {
		fields [5]int
		want   Config
		err    string
	}{
		{fields: [5]int{20, 6, 256, 6, 128}, want: Config{20, 6, 256, 6, 132}},
		{fields: [5]int{24, 8, 256, 16, 128}, want: Config{24, 8, 256, 16, 128}},
		{fields: [5]int{19, 6, 256, 6, 128}, err: "num_sms = 19"},
		{fields: [5]int{0, 6, 256, 6, 128}, err: "num_sms = 0"},
		{fields: [5]int{20, 0, 256, 6, 128}, err: "num_max_nvl_chunked_send_tokens = 0"},
		{fields: [5]int{20, 256, 256, 6, 128}, err: "expected fewer than num_max_nvl_chunked_recv_tokens = 256"},
		{fields: [5]int{20, 6, 256, -1, 128}, err: "num_max_rdma_chunked_send_tokens = -1"},
		{fields: [5]int{20, 6, 256, 128, 128}, err: "expected at most half"},
	}
	for _, tt := range tests {
		f := tt.fields
		got, err := NewConfig(f[0], f[1], f[2], f[3], f[4])
		if tt.err != "" {
			require.Error(t, err, "%v", f)
			assert.Contains(t, err.Error(), tt.err)
			assert.True(t, IsArgument(err))
			continue
		}
		require.NoError(t, err, "%v", f)
		assert.Equal(t, tt.want, got)
		assert.Equal(t, f[0]/2, got.NumChannels())
	}
}

func TestSizeHints(t *testing.T) {
	c, err := NewConfig(24, 6, 256, 6, 128)
	require.NoError(t, err)
	hidden := 7168 * 2
	n, err := c.NVLBufferSizeHint(hidden, 8)
	require.NoError(t, err)
	perSlot := int64(hidden + 8 + 128*8 + 128*4 + 128*4)
	assert.Equal(t, align(12*8*5*4+12*8*256*perSlot, 128), n)
	assert.Zero(t, n%BufferAlignment)

	rdma, err := c.RDMABufferSizeHint(hidden, 8)
	require.NoError(t, err)
	assert.Zero(t, rdma, "one NVLink domain needs no RDMA buffer")
	rdma, err = c.RDMABufferSizeHint(hidden, 32)
	require.NoError(t, err)
	assert.Equal(t, align(12*4*18*2*4+12*4*int64(c.NumMaxRDMAChunkedRecvTokens)*perSlot*2, 128), rdma)

	_, err = c.NVLBufferSizeHint(0, 8)
	assert.ErrorContains(t, err, "hidden_bytes = 0")
	_, err = c.NVLBufferSizeHint(hidden, 12)
	assert.ErrorContains(t, err, "num_ranks = 12")
}

func TestDefaultConfigs(t *testing.T) {
	for _, ranks := range []int{1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160} {
		d, err := DefaultDispatchConfig(ranks, 20)
		require.NoError(t, err, "dispatch %d", ranks)
		c, err := DefaultCombineConfig(ranks, 20)
		require.NoError(t, err, "combine %d", ranks)
		assert.Equal(t, 20, d.NumSMs)
		assert.Equal(t, 20, c.NumSMs)
	}
	d, err := DefaultDispatchConfig(4, 24)
	require.NoError(t, err)
	assert.Equal(t, Config{24, 6, 256, 6, 132}, d)
	c, err := DefaultCombineConfig(8, 24)
	require.NoError(t, err)
	assert.Equal(t, Config{24, 4, 256, 6, 132}, c)
	_, err = DefaultDispatchConfig(12, 20)
	assert.ErrorContains(t, err, "num_ranks = 12: no recommended dispatch config")
	_, err = DefaultCombineConfig(8, 7)
	assert.ErrorContains(t, err, "num_sms = 7")
}
