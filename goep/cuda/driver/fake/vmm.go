package fake

import (
	"fmt"
	"os"
	"unsafe"

	"github.com/pyep/pyep/goep/cuda/driver"
)

// Granularity is the fake's allocation granularity for the cuMem* calls, a real GPU's 2 MiB.
// The backing files are sparse and reserved ranges cost no memory, so rounding up is cheap.
const Granularity = 2 << 20

// physical is memory made by MemCreate: a tmpfs file, alive while a handle or a mapping of
// it remains in any process of the World.
type physical struct {
	id     uint64
	size   int
	device int
	owner  *Driver // the process whose device memory it counts against
	types  driver.MemHandleType
	file   *os.File
	key    fileKey
	refs   int // handles and mappings, in every process
}

// fileKey identifies a backing file: its device and inode, the same through any descriptor.
type fileKey [2]uint64

// vmap is one MemMap mapping of a process.
type vmap struct {
	phys   *physical
	size   int
	access driver.MemAccessFlags
}

func (m *vmap) bytes(base, p driver.DevicePtr, n int) ([]byte, error) {
	off := int(p - base)
	switch {
	case m.access == driver.MemAccessNone:
		return nil, fmt.Errorf("pyep: fake: %#x is mapped but not accessible (MemSetAccess): %w", uint64(p), driver.ErrorIllegalAddress)
	case off+n > m.size:
		return nil, fmt.Errorf("pyep: fake: %d bytes at %#x overrun the %d-byte mapping at %#x: %w", n, uint64(p), m.size, uint64(base), driver.ErrorIllegalAddress)
	}
	return unsafe.Slice((*byte)(addrPointer(uintptr(p))), n), nil
}

// addrPointer makes a mapped address (outside the Go heap) a pointer.
func addrPointer(u uintptr) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&u)) }

const fabricMagic = "pyepfab\x00"

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// vmm reports whether the cuMem* calls work here.
func (d *Driver) vmm() bool { return vmmSupported && !d.cfg.NoVMM }

// vmapAt is the mapping that holds p, if any. w.mu must be held.
func (d *Driver) vmapAt(p driver.DevicePtr) (driver.DevicePtr, *vmap) {
	for base, m := range d.vmaps {
		if p >= base && p < base+driver.DevicePtr(m.size) {
			return base, m
		}
	}
	return 0, nil
}

// lockVMM is lock for the cuMem* calls, which fail where the device has no VMM.
func (d *Driver) lockVMM(op string) (unlock func(), err error) {
	unlock, err = d.lock(op, true)
	if err == nil && !d.vmm() {
		err = fmt.Errorf("pyep: fake %s: no virtual memory management on this host: %w", op, driver.ErrorNotSupported)
	}
	return unlock, err
}

func (d *Driver) granular(op string, n int) error {
	if n <= 0 || n%Granularity != 0 {
		return fmt.Errorf("pyep: fake %s: %d bytes: not a positive multiple of the granularity %d: %w", op, n, Granularity, driver.ErrorInvalidValue)
	}
	return nil
}

// MemGetAllocationGranularity is Granularity.
func (d *Driver) MemGetAllocationGranularity(prop driver.MemAllocationProp, option driver.GranularityOption) (int, error) {
	unlock, err := d.lockVMM("MemGetAllocationGranularity")
	defer unlock()
	if err == nil {
		err = d.device(prop.Location)
	}
	if err != nil {
		return 0, err
	}
	return Granularity, nil
}

// MemCreate makes device memory of prop.Location, zeroed (real memory is not: do not rely on
// it), counted against that device's memory.
func (d *Driver) MemCreate(bytes int, prop driver.MemAllocationProp) (driver.MemHandle, error) {
	unlock, err := d.lockVMM("MemCreate")
	defer unlock()
	if err == nil {
		err = d.device(prop.Location)
	}
	if err == nil {
		err = d.granular("MemCreate", bytes)
	}
	if err != nil {
		return 0, err
	}
	dev := prop.Location.Ordinal()
	switch {
	case prop.HandleTypes&^(driver.MemHandlePosixFD|driver.MemHandleFabric) != 0:
		return 0, fmt.Errorf("pyep: fake MemCreate: handle types %#x: %w", prop.HandleTypes, driver.ErrorNotSupported)
	case prop.HandleTypes&driver.MemHandleFabric != 0 && !d.cfg.Fabric:
		return 0, fmt.Errorf("pyep: fake MemCreate: fabric handles on a device without fabric support: %w", driver.ErrorNotSupported)
	case prop.HandleTypes&driver.MemHandleFabric != 0 && d.cfg.NoIMEX:
		return 0, fmt.Errorf("pyep: fake MemCreate: fabric handles without an IMEX channel: %w", driver.ErrorNotPermitted)
	case d.used[dev]+bytes > d.cfg.MemBytes:
		return 0, fmt.Errorf("pyep: fake MemCreate: %d bytes with %d of %d in use: %w", bytes, d.used[dev], d.cfg.MemBytes, driver.ErrorOutOfMemory)
	}
	f, key, err := newBacking(bytes)
	if err != nil {
		return 0, fmt.Errorf("pyep: fake MemCreate: %v: %w", err, driver.ErrorOutOfMemory)
	}
	d.used[dev] += bytes
	d.w.nextID++
	ph := &physical{id: d.w.nextID, size: bytes, device: dev, owner: d, types: prop.HandleTypes, file: f, key: key}
	d.w.phys[ph.id] = ph
	d.w.files[key] = ph
	return d.newMemHandle(ph), nil
}

func (d *Driver) newMemHandle(ph *physical) driver.MemHandle {
	ph.refs++
	h := driver.MemHandle(d.handle())
	d.memHandles[h] = ph
	return h
}

// unref drops a handle's or a mapping's hold on ph; the last one frees it.
func (d *Driver) unref(ph *physical) {
	ph.refs--
	if ph.refs > 0 {
		return
	}
	_ = ph.file.Close()
	delete(d.w.phys, ph.id)
	delete(d.w.files, ph.key)
	ph.owner.used[ph.device] -= ph.size
}

func (d *Driver) memHandle(op string, h driver.MemHandle) (*physical, error) {
	ph, ok := d.memHandles[h]
	if !ok {
		return nil, fmt.Errorf("pyep: fake %s: memory handle %#x: %w", op, uint64(h), driver.ErrorInvalidValue)
	}
	return ph, nil
}

// MemRelease drops a handle; the memory lives on while mapped.
func (d *Driver) MemRelease(h driver.MemHandle) error {
	unlock, err := d.lockVMM("MemRelease")
	defer unlock()
	var ph *physical
	if err == nil {
		ph, err = d.memHandle("MemRelease", h)
	}
	if err != nil {
		return err
	}
	delete(d.memHandles, h)
	d.unref(ph)
	return nil
}

// MemAddressReserve reserves an inaccessible address range, aligned to alignment (0: the
// granularity).
func (d *Driver) MemAddressReserve(bytes, alignment int) (driver.DevicePtr, error) {
	unlock, err := d.lockVMM("MemAddressReserve")
	defer unlock()
	if err == nil {
		err = d.granular("MemAddressReserve", bytes)
	}
	if err == nil && (alignment < 0 || alignment&(alignment-1) != 0) {
		err = fmt.Errorf("pyep: fake MemAddressReserve: alignment %d: %w", alignment, driver.ErrorInvalidValue)
	}
	if err != nil {
		return 0, err
	}
	p, err := reserve(bytes, max(alignment, Granularity))
	if err != nil {
		return 0, fmt.Errorf("pyep: fake MemAddressReserve(%d bytes): %v: %w", bytes, err, driver.ErrorOutOfMemory)
	}
	d.reserved[driver.DevicePtr(p)] = bytes
	return driver.DevicePtr(p), nil
}

// MemAddressFree frees a whole reserved range, which must hold no mapping.
func (d *Driver) MemAddressFree(p driver.DevicePtr, bytes int) error {
	unlock, err := d.lockVMM("MemAddressFree")
	defer unlock()
	if err != nil {
		return err
	}
	if n, ok := d.reserved[p]; !ok || n != bytes {
		return fmt.Errorf("pyep: fake MemAddressFree: %d bytes at %#x are not a reserved range: %w", bytes, uint64(p), driver.ErrorInvalidValue)
	}
	for base := range d.vmaps {
		if base >= p && base < p+driver.DevicePtr(bytes) {
			return fmt.Errorf("pyep: fake MemAddressFree: %#x is still mapped (MemUnmap first): %w", uint64(base), driver.ErrorInvalidValue)
		}
	}
	if err := unreserve(uintptr(p), bytes); err != nil {
		return fmt.Errorf("pyep: fake MemAddressFree: %v: %w", err, driver.ErrorInvalidValue)
	}
	delete(d.reserved, p)
	return nil
}

// MemMap maps the first bytes of h's memory at p, inside a reserved range and over no other
// mapping; the range stays inaccessible until MemSetAccess.
func (d *Driver) MemMap(p driver.DevicePtr, bytes int, h driver.MemHandle) error {
	unlock, err := d.lockVMM("MemMap")
	defer unlock()
	var ph *physical
	if err == nil {
		ph, err = d.memHandle("MemMap", h)
	}
	if err == nil {
		err = d.granular("MemMap", bytes)
	}
	if err != nil {
		return err
	}
	end := p + driver.DevicePtr(bytes)
	inside := false
	for base, n := range d.reserved {
		inside = inside || (p >= base && end <= base+driver.DevicePtr(n))
	}
	switch {
	case !inside || p%Granularity != 0:
		return fmt.Errorf("pyep: fake MemMap: %d bytes at %#x: not inside a reserved range: %w", bytes, uint64(p), driver.ErrorInvalidValue)
	case bytes > ph.size:
		return fmt.Errorf("pyep: fake MemMap: %d bytes of a %d-byte allocation: %w", bytes, ph.size, driver.ErrorInvalidValue)
	}
	for base, m := range d.vmaps {
		if p < base+driver.DevicePtr(m.size) && base < end {
			return fmt.Errorf("pyep: fake MemMap: %#x overlaps the mapping at %#x: %w", uint64(p), uint64(base), driver.ErrorInvalidValue)
		}
	}
	if err := mapFile(uintptr(p), bytes, ph.file); err != nil {
		return fmt.Errorf("pyep: fake MemMap: %v: %w", err, driver.ErrorOutOfMemory)
	}
	ph.refs++
	d.vmaps[p] = &vmap{phys: ph, size: bytes}
	return nil
}

// MemUnmap unmaps a whole mapping; its range stays reserved.
func (d *Driver) MemUnmap(p driver.DevicePtr, bytes int) error {
	unlock, err := d.lockVMM("MemUnmap")
	defer unlock()
	if err != nil {
		return err
	}
	m, ok := d.vmaps[p]
	if !ok || m.size != bytes {
		return fmt.Errorf("pyep: fake MemUnmap: %d bytes at %#x are not a mapping: %w", bytes, uint64(p), driver.ErrorInvalidValue)
	}
	if err := unmapFile(uintptr(p), bytes); err != nil {
		return fmt.Errorf("pyep: fake MemUnmap: %v: %w", err, driver.ErrorInvalidValue)
	}
	delete(d.vmaps, p)
	d.unref(m.phys)
	return nil
}

// MemSetAccess sets the access to a whole mapping (the fake has one set of page protections
// for all devices of a process: the last call wins).
func (d *Driver) MemSetAccess(p driver.DevicePtr, bytes int, dev driver.Device, flags driver.MemAccessFlags) error {
	unlock, err := d.lockVMM("MemSetAccess")
	defer unlock()
	if err == nil {
		err = d.device(dev)
	}
	if err != nil {
		return err
	}
	m, ok := d.vmaps[p]
	switch {
	case !ok || m.size != bytes:
		return fmt.Errorf("pyep: fake MemSetAccess: %d bytes at %#x are not a mapping: %w", bytes, uint64(p), driver.ErrorInvalidValue)
	case flags != driver.MemAccessNone && flags != driver.MemAccessRead && flags != driver.MemAccessReadWrite:
		return fmt.Errorf("pyep: fake MemSetAccess: flags %d: %w", flags, driver.ErrorInvalidValue)
	}
	if err := protect(uintptr(p), bytes, flags); err != nil {
		return fmt.Errorf("pyep: fake MemSetAccess: %v: %w", err, driver.ErrorInvalidValue)
	}
	m.access = flags
	return nil
}

// MemExportToFD returns a new descriptor of h's backing file (close-on-exec), which the
// caller closes.
func (d *Driver) MemExportToFD(h driver.MemHandle) (int, error) {
	unlock, err := d.lockVMM("MemExportToFD")
	defer unlock()
	var ph *physical
	if err == nil {
		ph, err = d.memHandle("MemExportToFD", h)
	}
	if err == nil && ph.types&driver.MemHandlePosixFD == 0 {
		err = fmt.Errorf("pyep: fake MemExportToFD: the memory was not created for POSIX file descriptors: %w", driver.ErrorInvalidValue)
	}
	if err != nil {
		return -1, err
	}
	fd, err := dupFD(ph.file)
	if err != nil {
		return -1, fmt.Errorf("pyep: fake MemExportToFD: %v: %w", err, driver.ErrorOutOfMemory)
	}
	return fd, nil
}

// MemExportToFabric names h's memory in the World.
func (d *Driver) MemExportToFabric(h driver.MemHandle) (driver.FabricHandle, error) {
	unlock, err := d.lockVMM("MemExportToFabric")
	defer unlock()
	var fh driver.FabricHandle
	var ph *physical
	if err == nil {
		ph, err = d.memHandle("MemExportToFabric", h)
	}
	if err == nil && ph.types&driver.MemHandleFabric == 0 {
		err = fmt.Errorf("pyep: fake MemExportToFabric: the memory was not created for fabric handles: %w", driver.ErrorInvalidValue)
	}
	if err != nil {
		return fh, err
	}
	copy(fh[:], fabricMagic)
	putUint64(fh[8:], ph.id)
	return fh, nil
}

// MemImportFromFD finds the memory whose backing file fd opens; the caller keeps fd.
func (d *Driver) MemImportFromFD(fd int) (driver.MemHandle, error) {
	unlock, err := d.lockVMM("MemImportFromFD")
	defer unlock()
	if err != nil {
		return 0, err
	}
	key, err := keyOfFD(fd)
	if err != nil {
		return 0, fmt.Errorf("pyep: fake MemImportFromFD(%d): %v: %w", fd, err, driver.ErrorInvalidValue)
	}
	ph, ok := d.w.files[key]
	if !ok {
		return 0, fmt.Errorf("pyep: fake MemImportFromFD(%d): not memory of this host: %w", fd, driver.ErrorInvalidValue)
	}
	return d.newMemHandle(ph), nil
}

// MemImportFromFabric finds the memory that fh names.
func (d *Driver) MemImportFromFabric(fh driver.FabricHandle) (driver.MemHandle, error) {
	unlock, err := d.lockVMM("MemImportFromFabric")
	defer unlock()
	if err != nil {
		return 0, err
	}
	ph, ok := d.w.phys[getUint64(fh[8:])]
	if string(fh[:8]) != fabricMagic || !ok || ph.types&driver.MemHandleFabric == 0 {
		return 0, fmt.Errorf("pyep: fake MemImportFromFabric: a fabric handle of no live memory: %w", driver.ErrorInvalidValue)
	}
	return d.newMemHandle(ph), nil
}
