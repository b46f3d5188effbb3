package fake

import "github.com/pyep/pyep/goep/cuda/driver"

// The order of work on streams, for tests that assert what a GPU would run in which order: off
// until TrackOrder (work runs when queued here, so nothing can overlap; the tracker says what
// could on a GPU). Each stream's queue is ordered. An event's record stands for what its stream
// has queued so far, and a stream that waits for the event orders its later work after all of
// that. A host synchronisation (of a stream, an event, the context) completes what it waited
// for, so work queued afterwards is ordered after it. The legacy default stream's implicit
// synchronisation with blocking streams is not modelled: every stream is independent, as
// non-blocking ones are.

// OrderedLaunch is a launch as TrackOrder records it.
type OrderedLaunch struct {
	Seq    int // its number among the tracked launches, from 0
	Name   string
	Stream uintptr
	after  launchSet
}

// After reports whether l cannot start on a GPU before launch seq has finished.
func (l OrderedLaunch) After(seq int) bool { return l.after.has(seq) }

// launchSet is a set of launch numbers.
type launchSet []uint64

func (s launchSet) has(i int) bool { return i/64 < len(s) && s[i/64]&(1<<(i%64)) != 0 }

func (s *launchSet) add(i int) {
	for len(*s) <= i/64 {
		*s = append(*s, 0)
	}
	(*s)[i/64] |= 1 << (i % 64)
}

func (s *launchSet) union(o launchSet) {
	for len(*s) < len(o) {
		*s = append(*s, 0)
	}
	for i, w := range o {
		(*s)[i] |= w
	}
}

func (s launchSet) clone() launchSet { return append(launchSet(nil), s...) }

// orderState is what TrackOrder keeps; w.mu guards it.
type orderState struct {
	launches []OrderedLaunch
	streams  map[uintptr]launchSet // what a stream's next work is ordered after
	events   map[uintptr]launchSet // what an event's last record stands for
	done     launchSet             // launches the host has waited for
}

// TrackOrder makes d record, from now on, which of its earlier launches each launch is ordered
// after (Launches). Work queued before the call counts as finished.
func (d *Driver) TrackOrder() {
	d.w.mu.Lock()
	defer d.w.mu.Unlock()
	d.order = &orderState{streams: map[uintptr]launchSet{}, events: map[uintptr]launchSet{}}
}

// Launches are the launches since TrackOrder, in the order they were queued.
func (d *Driver) Launches() []OrderedLaunch {
	d.w.mu.Lock()
	defer d.w.mu.Unlock()
	if d.order == nil {
		return nil
	}
	return append([]OrderedLaunch(nil), d.order.launches...)
}

// The hooks below run with w.mu held, after the call's checks passed.

func (o *orderState) launch(name string, s driver.Stream) {
	if o == nil {
		return
	}
	seq := len(o.launches)
	after := o.streams[s.Raw()].clone()
	after.union(o.done)
	o.launches = append(o.launches, OrderedLaunch{Seq: seq, Name: name, Stream: s.Raw(), after: after})
	next := after.clone()
	next.add(seq)
	o.streams[s.Raw()] = next
}

func (o *orderState) record(e driver.Event, s driver.Stream) {
	if o != nil {
		o.events[e.Raw()] = o.streams[s.Raw()].clone()
	}
}

func (o *orderState) wait(s driver.Stream, e driver.Event) {
	if o != nil {
		set := o.streams[s.Raw()]
		set.union(o.events[e.Raw()])
		o.streams[s.Raw()] = set
	}
}

func (o *orderState) syncStream(s driver.Stream) {
	if o != nil {
		o.done.union(o.streams[s.Raw()])
	}
}

func (o *orderState) syncEvent(e driver.Event) {
	if o != nil {
		o.done.union(o.events[e.Raw()])
	}
}

func (o *orderState) syncAll() {
	if o != nil {
		for i := range o.launches {
			o.done.add(i)
		}
	}
}

func (o *orderState) forgetStream(s driver.Stream) {
	if o != nil {
		delete(o.streams, s.Raw())
	}
}

func (o *orderState) forgetEvent(e driver.Event) {
	if o != nil {
		delete(o.events, e.Raw())
	}
}
