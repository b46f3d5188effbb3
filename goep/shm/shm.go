// Package shm maps POSIX shared-memory segments that several processes of one user share: the
// cpu backend's stand-in for device memory opened through CUDA IPC.
//
// A segment's name is "pyep-<creator pid>-<128 random bits>": nobody can guess it, and the pid
// lets Sweep remove segments whose creator was killed before anyone unlinked them.
package shm

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"unsafe"
)

// Dir is where Linux exposes POSIX shared memory.
const Dir = "/dev/shm"

const prefix = "pyep-"

// Segment is one shared-memory object mapped read-write into this process.
type Segment struct {
	Name string
	Data []byte
}

// Create makes a new segment of size bytes (zero-filled), readable and writable by this user
// only, and maps it.
func Create(size int64) (*Segment, error) {
	var random [16]byte
	if _, err := rand.Read(random[:]); err != nil {
		return nil, fmt.Errorf("shm: random name: %w", err)
	}
	name := fmt.Sprintf("%s%d-%s", prefix, os.Getpid(), hex.EncodeToString(random[:]))
	fd, err := syscall.Open(filepath.Join(Dir, name), syscall.O_RDWR|syscall.O_CREAT|syscall.O_EXCL|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("shm: create %s: %w", name, err)
	}
	defer syscall.Close(fd)
	if err := syscall.Ftruncate(fd, size); err != nil {
		_ = syscall.Unlink(filepath.Join(Dir, name))
		return nil, fmt.Errorf("shm: size %s to %d bytes: %w", name, size, err)
	}
	data, err := mmap(fd, size)
	if err != nil {
		_ = syscall.Unlink(filepath.Join(Dir, name))
		return nil, fmt.Errorf("shm: map %s: %w", name, err)
	}
	return &Segment{Name: name, Data: data}, nil
}

// ErrGone means the segment no longer has a name: its owner destroyed it, or every peer had
// already mapped it and the last one removed the name.
var ErrGone = errors.New("segment no longer exists")

// Open maps an existing segment that must hold exactly size bytes and belong to this user.
func Open(name string, size int64) (*Segment, error) {
	if !strings.HasPrefix(name, prefix) || strings.ContainsAny(name, "/\x00") {
		return nil, fmt.Errorf("shm: %q is not a pyep segment name", name)
	}
	fd, err := syscall.Open(filepath.Join(Dir, name), syscall.O_RDWR|syscall.O_CLOEXEC, 0)
	if errors.Is(err, syscall.ENOENT) {
		return nil, fmt.Errorf("shm: open %s: %w", name, ErrGone)
	}
	if err != nil {
		return nil, fmt.Errorf("shm: open %s: %w", name, err)
	}
	defer syscall.Close(fd)
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("shm: stat %s: %w", name, err)
	}
	if st.Uid != uint32(os.Getuid()) || st.Mode&0o077 != 0 {
		return nil, fmt.Errorf("shm: %s belongs to uid %d with mode %o: expected this user's private segment", name, st.Uid, st.Mode&0o777)
	}
	if st.Size != size {
		return nil, fmt.Errorf("shm: %s holds %d bytes: expected %d", name, st.Size, size)
	}
	data, err := mmap(fd, size)
	if err != nil {
		return nil, fmt.Errorf("shm: map %s: %w", name, err)
	}
	return &Segment{Name: name, Data: data}, nil
}

func mmap(fd int, size int64) ([]byte, error) {
	if size <= 0 || size != int64(int(size)) {
		return nil, fmt.Errorf("size %d out of range", size)
	}
	return syscall.Mmap(fd, 0, int(size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
}

// Ptr is the address of the first byte.
func (s *Segment) Ptr() unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(s.Data)) }

// Unlink removes the name; mappings stay valid until each process unmaps. Removing a name that
// is already gone is not an error.
func (s *Segment) Unlink() error {
	err := syscall.Unlink(filepath.Join(Dir, s.Name))
	if err != nil && !errors.Is(err, syscall.ENOENT) {
		return fmt.Errorf("shm: unlink %s: %w", s.Name, err)
	}
	return nil
}

// Close unmaps the segment from this process; idempotent.
func (s *Segment) Close() error {
	if s.Data == nil {
		return nil
	}
	err := syscall.Munmap(s.Data)
	s.Data = nil
	if err != nil {
		return fmt.Errorf("shm: unmap %s: %w", s.Name, err)
	}
	return nil
}

// Sweep removes the names of this user's pyep segments whose creating process no longer exists
// (killed before its peers finished mapping), and returns them.
func Sweep() []string {
	entries, err := os.ReadDir(Dir)
	if err != nil {
		return nil
	}
	var removed []string
	for _, e := range entries {
		pid, ok := creatorPID(e.Name())
		if !ok || processAlive(pid) {
			continue
		}
		info, err := e.Info()
		if err != nil {
			continue
		}
		if st, ok := info.Sys().(*syscall.Stat_t); !ok || st.Uid != uint32(os.Getuid()) {
			continue
		}
		if syscall.Unlink(filepath.Join(Dir, e.Name())) == nil {
			removed = append(removed, e.Name())
		}
	}
	return removed
}

func creatorPID(name string) (int, bool) {
	rest, ok := strings.CutPrefix(name, prefix)
	if !ok {
		return 0, false
	}
	pidText, _, ok := strings.Cut(rest, "-")
	if !ok {
		return 0, false
	}
	pid, err := strconv.Atoi(pidText)
	return pid, err == nil && pid > 0
}

// processAlive: signal 0 checks existence; EPERM still means the process exists.
func processAlive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}
