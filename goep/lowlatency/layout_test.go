package lowlatency

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// deepEPHint is DeepEP V1's get_low_latency_rdma_size_hint, from its documented layout.
func deepEPHint(M, H, R, E int64) int64 {
	S := H / 128
	dmsg := 16 + max(2*H, H+4*S)
	cmsg := 4*S + 2*H
	send := max(M*dmsg, E*M*cmsg)
	recv := E * M * max(dmsg, cmsg)
	sig := (E*4 + 127) / 128 * 128
	total := 2*send + 2*recv + 2*sig
	return (total + 128) / 128 * 128
}

func TestLayout(t *testing.T) {
	for _, c := range []struct{ M, H, R, E int }{{128, 7168, 8, 288}, {1, 128, 1, 1}, {256, 4096, 4, 256}, {7, 640, 3, 9}, {16, 2048, 8, 8}} {
		l, err := NewLayout(c.R, Shape{MaxTokens: c.M, Hidden: c.H, NumExperts: c.E})
		require.NoError(t, err)
		// A buffer sized by DeepEP's hint holds pyep's layout from hidden 2048 (DeepEP's room for LogFMT scales holds
		// the combine's pushed selections); below, and with tiny M * E (the header), it may need a little more.
		if c.M*c.E >= 8 && c.H >= 2048 {
			assert.LessOrEqual(t, l.TotalBytes, deepEPHint(int64(c.M), int64(c.H), int64(c.R), int64(c.E)), "%+v", c)
		}
		// The areas follow each other without overlap, each 128-aligned.
		offs := []int64{l.Sync(0), l.Ack(0, 0), l.Mask(0), l.DispatchFlags(0), l.CombineFlags(0), l.DispatchDone(0), l.Send(0),
			l.Recv(0), l.Push(0), l.DispatchFlags(1), l.CombineFlags(1), l.DispatchDone(1), l.Send(1), l.Recv(1), l.Push(1), l.TotalBytes}
		for i := 1; i < len(offs); i++ {
			assert.Less(t, offs[i-1], offs[i])
			assert.Zero(t, offs[i]%align)
		}
		assert.Equal(t, l.Push(0)+l.PushBytes, l.DispatchFlags(1))
		assert.LessOrEqual(t, l.PushEntry(1, c.R-1, c.M-1, MaxTopk-1)+8, l.TotalBytes)
		last := l.DispatchSlot(1, l.NumLocalExperts-1, c.R-1, c.M-1) + l.DispatchMsgBytes
		assert.LessOrEqual(t, last, l.TotalBytes)
		assert.LessOrEqual(t, l.CombineSlot(1, c.R-1, c.M-1)+l.CombineMsgBytes, l.Push(1))
	}
	for _, bad := range []Shape{{0, 128, 2}, {1, 100, 2}, {1, 128, 3}} {
		_, err := NewLayout(2, bad)
		assert.ErrorIs(t, err, ErrInvalid, "%+v", bad)
	}
}

func TestCasts(t *testing.T) {
	for _, c := range []struct {
		f    float32
		want uint8
	}{
		{0, 0}, {1, 0x38}, {-1, 0xb8}, {448, 0x7e}, {460, 0x7e}, {1e9, 0x7e}, {0.5, 0x30},
		{1.0625, 0x38}, {1.1875, 0x3a}, {1.0625 + 1e-6, 0x39}, // ties to even, above the tie rounds up
		{float32(math.Ldexp(1, -9)), 0x01}, {float32(math.Ldexp(1, -10)), 0}, {float32(math.Ldexp(3, -10)), 0x02},
		{float32(math.Ldexp(1, -6)), 0x08}, {240, 0x77},
	} {
		assert.Equal(t, c.want, toE4M3(c.f), "%g", c.f)
	}
	assert.Equal(t, uint16(0x3f80), f32ToBF16(1))
	assert.Equal(t, uint16(0x3f80), f32ToBF16(math.Float32frombits(0x3f808000))) // tie to even (down)
	assert.Equal(t, uint16(0x3f82), f32ToBF16(math.Float32frombits(0x3f818000))) // tie to even (up)
	scale, inv := fp8Scales(3, true)
	assert.Equal(t, float32(1.0/128), inv) // 3/448 rounds up to 2^-7
	assert.Equal(t, float32(128), scale)
	assert.Equal(t, uint8(127-7), ue8m0(inv))
	scale, inv = fp8Scales(3, false)
	assert.Equal(t, float32(448)/3, scale)
	assert.Equal(t, float32(3)*(float32(1)/448), inv)
}
