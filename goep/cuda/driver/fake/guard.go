//go:build unix

package fake

import (
	"syscall"
	"unsafe"
)

// guarded maps n bytes that end 256-byte aligned as close to an inaccessible page as the
// alignment allows (Config.Guard): an access past the end faults.
func guarded(n int) ([]byte, error) {
	page := syscall.Getpagesize()
	span := (n + 255) / 256 * 256
	data := (span + page - 1) / page * page
	m, err := syscall.Mmap(-1, 0, data+page, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		return nil, err
	}
	if err := syscall.Mprotect(m[data:], syscall.PROT_NONE); err != nil {
		_ = syscall.Munmap(m)
		return nil, err
	}
	off := data - span
	return m[off : off+n : off+n], nil
}

// unguard makes freed guarded memory inaccessible and returns its pages to the system; the
// address range stays reserved, so that a later allocation never reuses it and a stale
// pointer faults.
func unguard(buf []byte) {
	if len(buf) == 0 {
		return
	}
	page := syscall.Getpagesize()
	head := int(uintptr(unsafe.Pointer(&buf[0])) % uintptr(page))
	n := (head + len(buf) + page - 1) / page * page
	region := unsafe.Slice((*byte)(unsafe.Add(unsafe.Pointer(&buf[0]), -head)), n)
	_ = syscall.Madvise(region, syscall.MADV_DONTNEED)
	_ = syscall.Mprotect(region, syscall.PROT_NONE)
}
