package cudall

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep/lowlatency"
)

// The kernels' dispatch messages (a message a token and destination rank) fit the layout that the
// cpu reference sizes for its own (a message a selection), for every shape: the bodies below the
// headers, the headers past a combine's rows and inside the recv area, and the remote staging (a
// body a token, a header a (rank, token)) inside the send area.
func TestMsgFormatFits(t *testing.T) {
	for _, R := range []int{1, 2, 3, 4, 8, 16, 64} {
		for _, L := range []int{1, 2, 3, 4, 5, 11, 12, 36, 144} {
			for _, M := range []int{1, 7, 128, 1024} {
				for _, H := range []int{128, 640, 2048, 7168} {
					l, err := lowlatency.NewLayout(R, lowlatency.Shape{MaxTokens: M, Hidden: H, NumExperts: R * L})
					require.NoError(t, err)
					for _, fp8 := range []bool{false, true} {
						name := fmt.Sprintf("R%d L%d M%d H%d fp8=%v", R, L, M, H, fp8)
						f, err := newMsgFormat(l, fp8)
						require.NoError(t, err, name)
						assert.Zero(t, f.Header%16, name)
						assert.GreaterOrEqual(t, f.Header, int64(4*(3+min(lowlatency.MaxTopk, L))), "%s: room for an entry a distinct expert", name)
						assert.Equal(t, int64(R*L*M)*l.CombineMsgBytes, f.Heads, "%s: the headers start where a combine's rows end", name)
						assert.LessOrEqual(t, int64(R*M)*f.Body, f.Heads, name)
						assert.LessOrEqual(t, f.Heads+int64(R*M)*f.Header, l.RecvBytes, name)
						assert.LessOrEqual(t, int64(M)*f.Body+int64(R*M)*f.Header, l.SendBytes, name)
						h, _ := newMsgFormat(l, !fp8)
						assert.Equal(t, h.Header, f.Header, "%s: the headers' place depends on the shape alone", name)
						assert.Equal(t, h.Heads, f.Heads, name)
					}
				}
			}
		}
	}
}

// An entry is j * M + slot in an int32: a shape whose L * M passes that is refused.
func TestMsgFormatEntriesFitInt32(t *testing.T) {
	M := math.MaxInt32/2 + 1
	l := lowlatency.Layout{Shape: lowlatency.Shape{MaxTokens: M, Hidden: 128, NumExperts: 2}, NumRanks: 1, NumLocalExperts: 2}
	_, err := newMsgFormat(l, true)
	assert.ErrorIs(t, err, lowlatency.ErrInvalid)
}
