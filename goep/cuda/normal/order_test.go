//go:build cgo

package cudanormal

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/cuda/driver/fake"
)

// orderBench runs normal-mode calls of one rank in given stream orders, with the fake driver
// tracking which launch a GPU would order after which (fake.Driver.TrackOrder), and marker
// kernels that stand for the caller's own work on a stream.
type orderBench struct {
	*hostBench
	d      *fake.Driver
	c      *normalCase
	calls  map[string]func() error
	marker driver.Function
	a, b   uintptr // two caller streams
	comm   uintptr
	events map[uintptr]driver.Event // previous_event's, recorded on each caller stream
}

func newOrderBench(t *testing.T) *orderBench {
	h := newNormalBench(t)
	d := h.be.Driver().(*fake.Driver)
	calls, c := h.normalCalls(t)
	o := &orderBench{hostBench: h, d: d, c: c, calls: map[string]func() error{}, a: h.stream,
		comm: h.be.CommStream().Raw(), events: map[uintptr]driver.Event{}}
	for _, hc := range calls {
		o.calls[hc.name] = hc.call
		require.NoError(t, hc.call()) // loads the kernels
	}
	o.calls["dispatch_notify"] = o.dispatchNotify
	d.World().RegisterKernel("marker", func(*fake.Launch) error { return nil })
	exit, err := h.be.Enter()
	require.NoError(t, err)
	defer exit()
	mod, err := d.ModuleLoadData([]byte{1})
	require.NoError(t, err)
	o.marker, err = mod.Function("marker")
	require.NoError(t, err)
	b, err := d.StreamCreate(driver.StreamNonBlocking, 0)
	require.NoError(t, err)
	o.b = b.Raw()
	for _, s := range []uintptr{o.a, o.b} {
		ev, err := d.EventCreate(driver.EventDisableTiming)
		require.NoError(t, err)
		o.events[s] = ev
	}
	t.Cleanup(func() {
		exit, err := h.be.Enter()
		require.NoError(t, err)
		defer exit()
		for _, ev := range o.events {
			assert.NoError(t, ev.Destroy())
		}
		assert.NoError(t, b.Destroy())
		assert.NoError(t, mod.Unload())
	})
	return o
}

// dispatchNotify is a dispatch of num_worst_tokens rows: notify, the host's wait, then the data
// phase (DispatchRecv, whose order is the call's join alone, as pyep's export passes it).
func (o *orderBench) dispatchNotify() error {
	a := o.c.dispatch(o.c.x, none)
	a.NumWorstTokens = hbT
	rows, err := o.buf.DispatchNotify(a)
	if err != nil {
		return err
	}
	r := o.c.recv
	r.Rows, r.XScales = rows, 0
	return o.buf.DispatchRecv(r, goep.StreamOrder{Stream: o.c.order.Stream, Flags: o.c.order.Flags & goep.OrderJoin})
}

// mark queues a marker kernel on s and returns its launch number.
func (o *orderBench) mark(t *testing.T, s uintptr) int {
	exit, err := o.be.Enter()
	require.NoError(t, err)
	defer exit()
	require.NoError(t, o.marker.Launch([3]uint32{1, 1, 1}, [3]uint32{32, 1, 1}, 0, o.be.WrapStream(s)))
	return len(o.d.Launches()) - 1
}

// record records s's previous_event.
func (o *orderBench) record(t *testing.T, s uintptr) uintptr {
	exit, err := o.be.Enter()
	require.NoError(t, err)
	defer exit()
	require.NoError(t, o.events[s].Record(o.be.WrapStream(s)))
	return o.events[s].Raw()
}

func (o *orderBench) name(s uintptr) string {
	switch s {
	case o.a:
		return "A"
	case o.b:
		return "B"
	case o.comm:
		return "comm"
	}
	return fmt.Sprintf("%#x", s)
}

// orderStep is one call: its kind (a normalCalls name or dispatch_notify), the caller's current
// stream, previous_event's stream (0: none), async_finish and allocate_on_comm_stream.
type orderStep struct {
	kind           string
	stream, prev   uintptr
	async, allocOn bool
}

// run makes the call as Python's _order would order it, with the caller's work before it (a
// marker on its stream, and on previous_event's), and checks what a GPU would do:
//   - every kernel of the call runs after every earlier kernel of the buffer;
//   - it runs after the caller's work it must wait for: previous_event's, or else the current
//     stream's;
//   - it runs on the current stream for the usual call (commOnly: never), else on the comm stream;
//   - the current stream's later work runs after it, unless async_finish (then it does not).
func (o *orderBench) run(t *testing.T, st orderStep, commOnly bool) {
	t.Helper()
	what := fmt.Sprintf("%s on %s", st.kind, o.name(st.stream))
	order := goep.StreamOrder{Stream: st.stream, Flags: goep.OrderWait | goep.OrderJoin}
	if st.async {
		order.Flags &^= goep.OrderJoin
		what += ", async_finish"
	}
	waitsFor := o.mark(t, st.stream)
	if st.prev != 0 {
		waitsFor = o.mark(t, st.prev)
		order.Event, order.Flags = o.record(t, st.prev), order.Flags&^goep.OrderWait|goep.OrderPrevious
		what += ", previous_event on " + o.name(st.prev)
	}
	if st.allocOn {
		order.Flags |= goep.OrderOnComm
		what += ", allocate_on_comm_stream"
	}
	first := len(o.d.Launches())
	o.c.order = order
	require.NoError(t, o.calls[st.kind](), what)
	launches := o.d.Launches()
	mine := launches[first:]
	require.NotEmpty(t, mine, what)
	wantStream := o.comm
	if !commOnly && st.prev == 0 && !st.async && !st.allocOn {
		wantStream = st.stream
	}
	for _, l := range mine {
		assert.True(t, strings.HasPrefix(l.Name, "host:pyep_"), "%s: launched %s", what, l.Name)
		assert.Equal(t, o.name(wantStream), o.name(l.Stream), "%s: %s's stream", what, l.Name)
		assert.True(t, l.After(waitsFor), "%s: %s may start before the caller's work it waits for", what, l.Name)
		for _, earlier := range launches[:l.Seq] {
			if earlier.Name != "marker" {
				assert.True(t, l.After(earlier.Seq), "%s: %s (#%d) may overlap the buffer's earlier %s (#%d) on %s",
					what, l.Name, l.Seq, earlier.Name, earlier.Seq, o.name(earlier.Stream))
			}
		}
	}
	later := o.mark(t, st.stream)
	for _, l := range mine {
		after := o.d.Launches()[later].After(l.Seq)
		if st.async {
			assert.False(t, after, "%s: the current stream waits for %s despite async_finish", what, l.Name)
		} else {
			assert.True(t, after, "%s: the current stream's later work may start before %s ends", what, l.Name)
		}
	}
}

// TestStreamOrderKeepsKernelsOrdered: however the caller switches streams and mixes the usual
// call with async_finish, previous_event and allocate_on_comm_stream, no two kernels of the
// buffer can overlap on a GPU, and each call keeps DeepEP's order against the caller's streams.
func TestStreamOrderKeepsKernelsOrdered(t *testing.T) {
	steps := func(o *orderBench) []orderStep {
		A, B, comm := o.a, o.b, o.comm
		return []orderStep{
			{kind: "layout", stream: A},
			{kind: "dispatch_bf16", stream: A},
			{kind: "combine", stream: B}, // the user switched streams
			{kind: "dispatch_bf16", stream: A, async: true},
			{kind: "dispatch_cached", stream: A}, // after an async call
			{kind: "combine", stream: B, async: true},
			{kind: "combine", stream: B},
			{kind: "layout", stream: A, prev: B},
			{kind: "dispatch_notify", stream: B},
			{kind: "dispatch_notify", stream: A, async: true},
			{kind: "dispatch_cached", stream: B, prev: A, async: true, allocOn: true},
			{kind: "dispatch_fp8", stream: comm}, // the current stream is the comm stream
			{kind: "combine", stream: A},
			{kind: "dispatch_notify", stream: A, prev: B},
			{kind: "combine", stream: A},
			{kind: "layout", stream: B, prev: A, async: true},
			{kind: "dispatch_fp8", stream: B},
			{kind: "dispatch_cached", stream: A, prev: A},
			{kind: "combine", stream: B},
		}
	}
	for _, commOnly := range []bool{false, true} {
		t.Run(fmt.Sprintf("PYEP_COMM_STREAM=%v", commOnly), func(t *testing.T) {
			if commOnly {
				t.Setenv("PYEP_COMM_STREAM", "1")
			}
			o := newOrderBench(t)
			o.d.TrackOrder()
			for _, st := range steps(o) {
				o.run(t, st, commOnly)
			}
		})
	}
}

// TestOnCallerStream: which orders run on the caller's stream.
func TestOnCallerStream(t *testing.T) {
	const s, other = 0x5000, 0x6000
	wj := goep.OrderWait | goep.OrderJoin
	for _, tt := range []struct {
		name     string
		o        goep.StreamOrder
		tails    tails
		commOnly bool
		want     bool
	}{
		{"usual", goep.StreamOrder{Stream: s, Flags: wj}, tails{}, false, true},
		{"usual on the legacy default stream", goep.StreamOrder{Stream: 0, Flags: wj}, tails{}, false, true},
		{"usual, PYEP_COMM_STREAM=1", goep.StreamOrder{Stream: s, Flags: wj}, tails{}, true, false},
		{"usual on the per-thread default stream", goep.StreamOrder{Stream: driver.StreamPerThread, Flags: wj}, tails{}, false, false},
		{"previous_event=EventOverlap(None)", goep.StreamOrder{Stream: s, Flags: wj | goep.OrderPrevious}, tails{}, false, true},
		{"async_finish", goep.StreamOrder{Stream: s, Flags: goep.OrderWait}, tails{}, false, false},
		{"previous_event", goep.StreamOrder{Stream: s, Event: 0x7000, Flags: goep.OrderJoin | goep.OrderPrevious}, tails{}, false, false},
		{"allocate_on_comm_stream", goep.StreamOrder{Stream: s, Event: 0x7000, Flags: goep.OrderOnComm | goep.OrderPrevious}, tails{}, false, false},
		{"data phase after a notify on the stream", goep.StreamOrder{Stream: s, Flags: goep.OrderJoin}, tails{n: 1, raw: [2]uintptr{s}}, false, true},
		{"data phase after a notify elsewhere", goep.StreamOrder{Stream: s, Flags: goep.OrderJoin}, tails{n: 1, raw: [2]uintptr{other}}, false, false},
		{"async data phase", goep.StreamOrder{Stream: s}, tails{n: 1, raw: [2]uintptr{s}}, false, false},
	} {
		e := &engine{tails: tt.tails, commOnly: tt.commOnly}
		assert.Equal(t, tt.want, e.onCaller(tt.o), tt.name)
	}
}
