package lowlatency

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func logRoundTrip(row []uint16) []uint16 {
	buf := make([]byte, LogFMTBytes(len(row)))
	out := make([]uint16, len(row))
	EncodeLogFMT(buf, row)
	DecodeLogFMT(out, buf)
	return out
}

func TestLogFMTSize(t *testing.T) {
	assert.Equal(t, 56*164, LogFMTBytes(7168))
	assert.LessOrEqual(t, LogFMTBytes(128), 2*128)
}

// A group whose magnitudes span at most 509 bf16 steps travels exactly; signs and zeros too.
func TestLogFMTExactWithinItsLevels(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	row := make([]uint16, 3*LogGroup)
	for i := range row {
		row[i] = uint16(0x3c00 + rng.IntN(509)) // magnitudes in [0x3c00, 0x3c00 + 508]
		if rng.IntN(2) == 0 {
			row[i] |= 0x8000
		}
	}
	row[5], row[200] = 0, 0x8000 // zeros in range groups
	for i := 2 * LogGroup; i < 3*LogGroup; i++ {
		row[i] = f32ToBF16(float32((64 + i%64) * (1 - 2*(i%2)))) // integers of one octave, both signs
	}
	assert.Equal(t, row, logRoundTrip(row))
	constant := make([]uint16, LogGroup)
	for i := range constant {
		constant[i] = f32ToBF16(-128)
	}
	assert.Equal(t, constant, logRoundTrip(constant))
	assert.Equal(t, make([]uint16, LogGroup), logRoundTrip(make([]uint16, LogGroup)))
}

// A wider group: every value within D/1018 + 1/2 bf16 steps of its own, its sign kept, none past the group's
// largest; what lies 32 octaves below the largest value becomes zero or the least level.
func TestLogFMTBounded(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	row := make([]uint16, 4*LogGroup)
	for i := range row {
		row[i] = f32ToBF16(float32(rng.NormFloat64() * math.Pow(2, float64(i/LogGroup)*4-6)))
	}
	row[3] = f32ToBF16(1e-30) // below the clip of group 0
	got := logRoundTrip(row)
	for g := range 4 {
		bmin, bmax := logRange(row[g*LogGroup : (g+1)*LogGroup])
		require.Greater(t, int(bmax-bmin), logLevels, "group %d is lossy", g)
		slack := float64(bmax-bmin)/(2*logLevels) + 0.5
		for i := g * LogGroup; i < (g+1)*LogGroup; i++ {
			m, n := int(row[i]&0x7fff), int(got[i]&0x7fff)
			assert.Equal(t, row[i]>>15, got[i]>>15, "sign of %d", i)
			assert.LessOrEqual(t, n, int(bmax), "value %d", i)
			if m >= int(bmin) {
				assert.LessOrEqual(t, math.Abs(float64(n-m)), slack, "value %d: %#x became %#x", i, m, n)
			} else {
				assert.Contains(t, []int{0, int(bmin)}, n, "value %d below the range", i)
			}
		}
	}
	assert.Equal(t, uint16(0), got[3]&0x7fff)
}

func TestLogFMTNonFinite(t *testing.T) {
	row := make([]uint16, LogGroup)
	for i := range row {
		row[i] = f32ToBF16(2 + float32(i)/64) // one octave
	}
	row[7], row[8], row[9] = 0x7f80, 0xff80, 0x7fc0 // +inf, -inf, NaN
	got := logRoundTrip(row)
	assert.Equal(t, uint16(0x7f80), got[7])
	assert.Equal(t, uint16(0xff80), got[8])
	assert.Equal(t, uint16(0x7f80), got[9], "a NaN travels as an infinity")
	for i := range row {
		if i < 7 || i > 9 {
			assert.Equal(t, row[i], got[i], "the finite values span few levels: exact")
		}
	}
}
