package fake

import (
	"fmt"
	"time"
	"unsafe"

	"github.com/pyep/pyep/goep/cuda/driver"
)

// IPC handles, modules and launches, streams and events.

// ipcMagic marks fake handles, so that garbage handles are told apart from stale ones.
const ipcMagic = "pyepfake"

// IpcGetMemHandle exports one of d's device allocations.
func (d *Driver) IpcGetMemHandle(p driver.DevicePtr) (driver.IpcMemHandle, error) {
	unlock, err := d.lock("IpcGetMemHandle", true)
	defer unlock()
	var h driver.IpcMemHandle
	if err != nil {
		return h, err
	}
	a, err := d.own("IpcGetMemHandle", p, false)
	if err != nil {
		return h, err
	}
	copy(h[:], ipcMagic)
	putUint64(h[8:], a.id)
	return h, nil
}

// IpcOpenMemHandle maps another process's allocation. Like the real driver, a process cannot
// open its own handles.
func (d *Driver) IpcOpenMemHandle(h driver.IpcMemHandle) (driver.DevicePtr, error) {
	unlock, err := d.lock("IpcOpenMemHandle", true)
	defer unlock()
	if err != nil {
		return 0, err
	}
	a, ok := d.w.allocs[getUint64(h[8:])]
	switch {
	case string(h[:8]) != ipcMagic || !ok || a.freed:
		return 0, fmt.Errorf("pyep: fake: IPC handle of no live allocation: %w", driver.ErrorInvalidValue)
	case a.owner == d:
		return 0, fmt.Errorf("pyep: fake: opening an IPC handle in the process that exported it: %w", driver.ErrorInvalidContext)
	case d.imported[a.base]:
		return 0, fmt.Errorf("pyep: fake: IPC handle opened twice: %w", driver.ErrorInvalidValue)
	}
	a.opened++
	d.mapped[a.base] = a
	d.imported[a.base] = true
	return a.base, nil
}

// IpcCloseMemHandle unmaps what IpcOpenMemHandle mapped.
func (d *Driver) IpcCloseMemHandle(p driver.DevicePtr) error {
	unlock, err := d.lock("IpcCloseMemHandle", true)
	defer unlock()
	if err != nil {
		return err
	}
	if !d.imported[p] {
		return fmt.Errorf("pyep: fake: %#x is not an IPC mapping: %w", uint64(p), driver.ErrorInvalidValue)
	}
	a := d.mapped[p]
	delete(d.mapped, p)
	delete(d.imported, p)
	a.opened--
	if a.freed && a.opened == 0 {
		delete(d.w.allocs, a.id)
		if a.owner.cfg.Guard {
			unguard(a.buf)
		}
	}
	return nil
}

// ModuleLoadData accepts any non-empty image: kernels come from World.RegisterKernel.
func (d *Driver) ModuleLoadData(image []byte) (driver.Module, error) {
	unlock, err := d.lock("ModuleLoadData", true)
	defer unlock()
	if err == nil && len(image) == 0 {
		err = fmt.Errorf("pyep: fake: empty module image: %w", driver.ErrorInvalidImage)
	}
	if err != nil {
		return driver.Module{}, err
	}
	h := d.handle()
	d.modules[h] = true
	return driver.WrapModule(d, h), nil
}

// ModuleGetFunction finds a kernel registered on the World.
func (d *Driver) ModuleGetFunction(m driver.Module, name string) (driver.Function, error) {
	unlock, err := d.lock("ModuleGetFunction", true)
	defer unlock()
	if err == nil && !d.modules[m.Raw()] {
		err = fmt.Errorf("pyep: fake: module %#x: %w", m.Raw(), driver.ErrorInvalidHandle)
	}
	if err != nil {
		return driver.Function{}, err
	}
	k, ok := d.w.kernels[name]
	if !ok {
		return driver.Function{}, fmt.Errorf("pyep: fake: no kernel %q registered: %w", name, driver.ErrorNotFound)
	}
	h := d.handle()
	d.functions[h] = &function{name: name, kernel: k, attrs: map[driver.FuncAttribute]int{}}
	return driver.WrapFunction(d, h, name), nil
}

// ModuleUnload forgets a module.
func (d *Driver) ModuleUnload(m driver.Module) error {
	unlock, err := d.lock("ModuleUnload", true)
	defer unlock()
	if err == nil && !d.modules[m.Raw()] {
		err = fmt.Errorf("pyep: fake: module %#x: %w", m.Raw(), driver.ErrorInvalidHandle)
	}
	if err == nil {
		delete(d.modules, m.Raw())
	}
	return err
}

func (d *Driver) function(f driver.Function) (*function, error) {
	fn, ok := d.functions[f.Raw()]
	if !ok {
		return nil, fmt.Errorf("pyep: fake: function %#x: %w", f.Raw(), driver.ErrorInvalidHandle)
	}
	return fn, nil
}

// FuncGetAttribute returns what FuncSetAttribute set (0 otherwise).
func (d *Driver) FuncGetAttribute(f driver.Function, attr driver.FuncAttribute) (int, error) {
	unlock, err := d.lock("FuncGetAttribute", true)
	defer unlock()
	if err != nil {
		return 0, err
	}
	fn, err := d.function(f)
	if err != nil {
		return 0, err
	}
	return fn.attrs[attr], nil
}

// FuncSetAttribute records the attribute; LaunchKernel honours the dynamic shared memory limit.
func (d *Driver) FuncSetAttribute(f driver.Function, attr driver.FuncAttribute, value int) error {
	unlock, err := d.lock("FuncSetAttribute", true)
	defer unlock()
	if err != nil {
		return err
	}
	fn, err := d.function(f)
	if err != nil {
		return err
	}
	if attr == driver.FuncAttrMaxDynamicSharedSizeBytes && (value < 0 || value > 232448) {
		return fmt.Errorf("pyep: fake: %d bytes of dynamic shared memory: %w", value, driver.ErrorInvalidValue)
	}
	fn.attrs[attr] = value
	return nil
}

// LaunchKernel checks the launch as the real driver would, then runs the kernel at once.
func (d *Driver) LaunchKernel(f driver.Function, grid, block [3]uint32, sharedBytes uint32, s driver.Stream, args driver.KernelArgs) error {
	d.w.mu.Lock()
	err := d.enterCtx("LaunchKernel")
	if err == nil {
		err = d.stream(s)
	}
	var fn *function
	if err == nil {
		fn, err = d.function(f)
	}
	if err == nil {
		threads := uint64(block[0]) * uint64(block[1]) * uint64(block[2])
		limit := max(48<<10, fn.attrs[driver.FuncAttrMaxDynamicSharedSizeBytes])
		switch {
		case grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || threads == 0 || threads > 1024:
			err = fmt.Errorf("pyep: fake: launching %s with grid %v, block %v: %w", fn.name, grid, block, driver.ErrorInvalidValue)
		case int(sharedBytes) > limit:
			err = fmt.Errorf("pyep: fake: launching %s with %d bytes of dynamic shared memory, limit %d (FuncAttrMaxDynamicSharedSizeBytes): %w", fn.name, sharedBytes, limit, driver.ErrorInvalidValue)
		}
	}
	if err == nil {
		d.order.launch(fn.name, s)
	}
	d.w.mu.Unlock()
	if err != nil {
		return err
	}
	// The kernel runs unlocked: it reaches memory through d.Bytes.
	l := &Launch{Driver: d, Name: fn.name, Grid: grid, Block: block, SharedBytes: sharedBytes, Stream: s,
		Args: append([]unsafe.Pointer(nil), args.Slice()...)}
	if err := fn.kernel(l); err != nil {
		return fmt.Errorf("pyep: fake: kernel %s: %w", fn.name, err)
	}
	return nil
}

// StreamCreate makes a stream; flags and priority are accepted and ignored.
func (d *Driver) StreamCreate(flags driver.StreamFlags, priority int) (driver.Stream, error) {
	unlock, err := d.lock("StreamCreate", true)
	defer unlock()
	if err != nil {
		return driver.Stream{}, err
	}
	h := d.handle()
	d.streams[h] = true
	return driver.WrapStream(d, h), nil
}

// StreamDestroy forgets a stream (not the default stream 0).
func (d *Driver) StreamDestroy(s driver.Stream) error {
	unlock, err := d.lock("StreamDestroy", true)
	defer unlock()
	if err == nil && (s.Raw() == 0 || !d.streams[s.Raw()]) {
		err = fmt.Errorf("pyep: fake: destroying stream %#x: %w", s.Raw(), driver.ErrorInvalidHandle)
	}
	if err == nil {
		delete(d.streams, s.Raw())
		d.order.forgetStream(s)
	}
	return err
}

// StreamSynchronize has nothing to wait for.
func (d *Driver) StreamSynchronize(s driver.Stream) error {
	unlock, err := d.lock("StreamSynchronize", true)
	defer unlock()
	if err == nil {
		err = d.stream(s)
	}
	if err == nil {
		d.order.syncStream(s)
	}
	return err
}

// StreamQuery: always idle.
func (d *Driver) StreamQuery(s driver.Stream) (bool, error) {
	unlock, err := d.lock("StreamQuery", true)
	defer unlock()
	if err == nil {
		err = d.stream(s)
	}
	return err == nil, err
}

// StreamWaitEvent: work is done when queued, so there is nothing to wait for.
func (d *Driver) StreamWaitEvent(s driver.Stream, e driver.Event) error {
	unlock, err := d.lock("StreamWaitEvent", true)
	defer unlock()
	if err == nil {
		err = d.stream(s)
	}
	if err == nil {
		_, err = d.event(e)
	}
	if err == nil {
		d.order.wait(s, e)
	}
	return err
}

func (d *Driver) event(e driver.Event) (*event, error) {
	ev, ok := d.events[e.Raw()]
	if !ok {
		return nil, fmt.Errorf("pyep: fake: event %#x: %w", e.Raw(), driver.ErrorInvalidHandle)
	}
	return ev, nil
}

// EventCreate makes an event.
func (d *Driver) EventCreate(flags driver.EventFlags) (driver.Event, error) {
	unlock, err := d.lock("EventCreate", true)
	defer unlock()
	if err != nil {
		return driver.Event{}, err
	}
	h := d.handle()
	d.events[h] = &event{flags: flags}
	return driver.WrapEvent(d, h), nil
}

// EventRecord stamps the event with the host clock.
func (d *Driver) EventRecord(e driver.Event, s driver.Stream) error {
	unlock, err := d.lock("EventRecord", true)
	defer unlock()
	if err == nil {
		err = d.stream(s)
	}
	var ev *event
	if err == nil {
		ev, err = d.event(e)
	}
	if err == nil {
		ev.recorded, ev.at = true, time.Now()
		d.order.record(e, s)
	}
	return err
}

// EventQuery: always complete.
func (d *Driver) EventQuery(e driver.Event) (bool, error) {
	unlock, err := d.lock("EventQuery", true)
	defer unlock()
	if err == nil {
		_, err = d.event(e)
	}
	return err == nil, err
}

// EventSynchronize has nothing to wait for.
func (d *Driver) EventSynchronize(e driver.Event) error {
	unlock, err := d.lock("EventSynchronize", true)
	defer unlock()
	if err == nil {
		_, err = d.event(e)
	}
	if err == nil {
		d.order.syncEvent(e)
	}
	return err
}

// EventDestroy forgets an event.
func (d *Driver) EventDestroy(e driver.Event) error {
	unlock, err := d.lock("EventDestroy", true)
	defer unlock()
	if err == nil {
		_, err = d.event(e)
	}
	if err == nil {
		delete(d.events, e.Raw())
		d.order.forgetEvent(e)
	}
	return err
}

// EventElapsedTime is the host time between the records; like the real driver it refuses
// events created with EventDisableTiming or never recorded.
func (d *Driver) EventElapsedTime(start, end driver.Event) (float32, error) {
	unlock, err := d.lock("EventElapsedTime", true)
	defer unlock()
	if err != nil {
		return 0, err
	}
	a, err := d.event(start)
	if err != nil {
		return 0, err
	}
	b, err := d.event(end)
	if err != nil {
		return 0, err
	}
	if !a.recorded || !b.recorded || a.flags&driver.EventDisableTiming != 0 || b.flags&driver.EventDisableTiming != 0 {
		return 0, fmt.Errorf("pyep: fake: elapsed time between untimed or unrecorded events: %w", driver.ErrorInvalidHandle)
	}
	return float32(b.at.Sub(a.at).Seconds() * 1e3), nil
}

func putUint64(b []byte, v uint64) {
	for i := 0; i < 8; i++ {
		b[i] = byte(v >> (8 * i))
	}
}

func getUint64(b []byte) uint64 {
	var v uint64
	for i := 0; i < 8; i++ {
		v |= uint64(b[i]) << (8 * i)
	}
	return v
}
