package emu_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/dlpack"
)

// TestEmulatedStreamOrder: a call queues its stream order itself. The usual call runs on the
// caller's stream and needs none; the others run on the comm stream, which waits for
// previous_event or the caller's stream before the first launch (and for the caller's stream when
// the buffer's last call ran there), and the caller's stream waits for it after the last launch
// (not with async_finish). The subtests run in turn on one buffer.
func TestEmulatedStreamOrder(t *testing.T) {
	e := newDomain(t, 1, 8<<20)[0]
	exit, err := e.be.Enter()
	require.NoError(t, err)
	caller, err := e.drv.StreamCreate(driver.StreamNonBlocking, 0)
	require.NoError(t, err)
	previous, err := e.drv.EventCreate(driver.EventDisableTiming)
	require.NoError(t, err)
	require.NoError(t, previous.Record(caller))
	exit()
	t.Cleanup(func() {
		exit, err := e.be.Enter()
		require.NoError(t, err)
		defer exit()
		assert.NoError(t, previous.Destroy())
		assert.NoError(t, caller.Destroy())
	})
	topk := e.upload(t, dlpack.I64, bytesOf([]int64{0, 1, 2, 3}), 2, 2)
	s, ev := caller.Raw(), previous.Raw()
	for _, tt := range []struct {
		name           string
		order          goep.StreamOrder
		records, waits int
	}{
		{"current stream", goep.StreamOrder{Stream: s, Flags: goep.OrderWait | goep.OrderJoin}, 0, 0},
		{"current stream, again", goep.StreamOrder{Stream: s, Flags: goep.OrderWait | goep.OrderJoin}, 0, 0},
		{"previous_event", goep.StreamOrder{Stream: s, Event: ev, Flags: goep.OrderPrevious | goep.OrderJoin}, 2, 3},
		{"previous_event, again", goep.StreamOrder{Stream: s, Event: ev, Flags: goep.OrderPrevious | goep.OrderJoin}, 1, 2},
		{"previous_event, async_finish", goep.StreamOrder{Stream: s, Event: ev, Flags: goep.OrderPrevious | goep.OrderOnComm}, 0, 1},
		{"async_finish", goep.StreamOrder{Stream: s, Flags: goep.OrderWait}, 1, 1},
		{"current stream after async_finish", goep.StreamOrder{Stream: s, Flags: goep.OrderWait | goep.OrderJoin}, 1, 1},
		{"none (cpu-like)", goep.StreamOrder{}, 1, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			records, waits := e.drv.Calls("EventRecord"), e.drv.Calls("StreamWaitEvent")
			require.NoError(t, e.normal().Layout(&goep.LayoutOp{NumExperts: 4, NumRanks: 1, TopkIdx: topk.t,
				PerRank: e.alloc(t, dlpack.I32, 1).t, PerExpert: e.alloc(t, dlpack.I32, 4).t,
				InRank: e.alloc(t, dlpack.BoolT, 2, 1).t, Order: tt.order}))
			assert.Equal(t, tt.records, e.drv.Calls("EventRecord")-records, "event records")
			assert.Equal(t, tt.waits, e.drv.Calls("StreamWaitEvent")-waits, "stream waits")
		})
	}
}
