//go:build linux

package fake

import (
	"os"
	"syscall"

	"github.com/pyep/pyep/goep/cuda/driver"
)

const vmmSupported = true

// newBacking makes an unlinked, sparse file of n bytes, on tmpfs where there is one.
func newBacking(n int) (*os.File, fileKey, error) {
	dir := "/dev/shm"
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		dir = ""
	}
	f, err := os.CreateTemp(dir, "pyep-fake-vmm-*")
	if err != nil {
		return nil, fileKey{}, err
	}
	_ = os.Remove(f.Name())
	if err := f.Truncate(int64(n)); err != nil {
		_ = f.Close()
		return nil, fileKey{}, err
	}
	key, err := keyOfFD(int(f.Fd()))
	if err != nil {
		_ = f.Close()
		return nil, fileKey{}, err
	}
	return f, key, nil
}

func keyOfFD(fd int) (fileKey, error) {
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return fileKey{}, err
	}
	return fileKey{uint64(st.Dev), st.Ino}, nil
}

func dupFD(f *os.File) (int, error) {
	fd, _, errno := syscall.Syscall(syscall.SYS_FCNTL, f.Fd(), syscall.F_DUPFD_CLOEXEC, 0)
	if errno != 0 {
		return -1, errno
	}
	return int(fd), nil
}

// The mappings are made with raw system calls: syscall.Mmap cannot map at a fixed address,
// and syscall.Munmap only takes whole slices that syscall.Mmap returned.

func mmap(addr uintptr, n int, prot, flags int, fd int) (uintptr, error) {
	p, _, errno := syscall.Syscall6(syscall.SYS_MMAP, addr, uintptr(n), uintptr(prot), uintptr(flags), uintptr(fd), 0)
	if errno != 0 {
		return 0, errno
	}
	return p, nil
}

func munmap(addr uintptr, n int) error {
	if n == 0 {
		return nil
	}
	if _, _, errno := syscall.Syscall(syscall.SYS_MUNMAP, addr, uintptr(n), 0); errno != 0 {
		return errno
	}
	return nil
}

const reservedFlags = syscall.MAP_PRIVATE | syscall.MAP_ANON | syscall.MAP_NORESERVE

// reserve maps n inaccessible bytes aligned to align (a power of two).
func reserve(n, align int) (uintptr, error) {
	raw, err := mmap(0, n+align, syscall.PROT_NONE, reservedFlags, -1)
	if err != nil {
		return 0, err
	}
	p := (raw + uintptr(align) - 1) &^ (uintptr(align) - 1)
	_ = munmap(raw, int(p-raw))
	_ = munmap(p+uintptr(n), int(raw+uintptr(n+align)-(p+uintptr(n))))
	return p, nil
}

func unreserve(p uintptr, n int) error { return munmap(p, n) }

// mapFile maps f over [p, p+n), inaccessible until protect.
func mapFile(p uintptr, n int, f *os.File) error {
	_, err := mmap(p, n, syscall.PROT_NONE, syscall.MAP_SHARED|syscall.MAP_FIXED, int(f.Fd()))
	return err
}

// unmapFile puts an inaccessible reservation back over [p, p+n).
func unmapFile(p uintptr, n int) error {
	_, err := mmap(p, n, syscall.PROT_NONE, reservedFlags|syscall.MAP_FIXED, -1)
	return err
}

func protect(p uintptr, n int, flags driver.MemAccessFlags) error {
	prot := syscall.PROT_NONE
	switch flags {
	case driver.MemAccessRead:
		prot = syscall.PROT_READ
	case driver.MemAccessReadWrite:
		prot = syscall.PROT_READ | syscall.PROT_WRITE
	}
	if _, _, errno := syscall.Syscall(syscall.SYS_MPROTECT, p, uintptr(n), uintptr(prot)); errno != 0 {
		return errno
	}
	return nil
}
