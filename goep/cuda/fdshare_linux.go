//go:build linux

package cuda

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"syscall"
	"time"
)

// A POSIX file descriptor of cuMem memory means something only in the process that holds it,
// so the owner of a kindFD region serves it: each connection to the region's abstract
// Unix-domain socket from a process of the same user receives the region's nonce and a copy
// of the descriptor (SCM_RIGHTS). Copying the descriptor out of the owner with pidfd_getfd
// would need ptrace rights over it, which Yama (ptrace_scope 1) denies between sibling
// processes such as torchrun's ranks.

// fdServer serves one descriptor until Close.
type fdServer struct {
	ln   *net.UnixListener
	done chan struct{}
}

// fdSocketName is the abstract socket of the region with nonce in this process.
func fdSocketName(nonce uint64) string {
	return fmt.Sprintf("@pyep-%d-%016x", os.Getpid(), nonce)
}

// serveFD starts serving fd, which must stay open until Close returns.
func serveFD(name string, fd int, nonce uint64) (*fdServer, error) {
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: name, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("serving the buffer's file descriptor: %w", err)
	}
	s := &fdServer{ln: ln, done: make(chan struct{})}
	go s.serve(fd, nonce)
	return s, nil
}

func (s *fdServer) serve(fd int, nonce uint64) {
	defer close(s.done)
	msg := binary.LittleEndian.AppendUint64(nil, nonce)
	rights := syscall.UnixRights(fd)
	for {
		c, err := s.ln.AcceptUnix()
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil { // out of descriptors, say: the client's connect times out or retries
			time.Sleep(10 * time.Millisecond)
			continue
		}
		// Only processes of this user get the memory; others are hung up on.
		if cred, err := peerCred(c); err == nil && cred.Uid == uint32(os.Getuid()) {
			_ = c.SetWriteDeadline(time.Now().Add(time.Second))
			_, _, _ = c.WriteMsgUnix(msg, rights, nil)
		}
		_ = c.Close()
	}
}

// Close stops serving; when it returns, the descriptor is no longer used. Idempotent.
func (s *fdServer) Close() error {
	if s == nil {
		return nil
	}
	err := s.ln.Close()
	<-s.done
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

func peerCred(c *net.UnixConn) (*syscall.Ucred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *syscall.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = syscall.GetsockoptUcred(int(fd), syscall.SOL_SOCKET, syscall.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, credErr
}

// receiveFD fetches the descriptor of the region with nonce from the process that serves it
// at name (process is the token's; a pid is checked against the server's). The caller closes
// the descriptor.
func receiveFD(name string, nonce uint64, process string, timeout time.Duration) (int, error) {
	fail := func(format string, args ...any) (int, error) {
		return -1, fmt.Errorf("receiving the buffer's file descriptor from process %s over %s: %s", process, name, fmt.Sprintf(format, args...))
	}
	d := net.Dialer{Timeout: timeout}
	conn, err := d.Dial("unix", name)
	if err != nil {
		return fail("%v (the buffer was destroyed or its process exited; processes in different network namespaces "+
			"cannot reach each other's abstract sockets: use PYEP_MEM_HANDLE=fabric or use_fabric=False there)", err)
	}
	c := conn.(*net.UnixConn)
	defer c.Close()
	cred, err := peerCred(c)
	if err != nil {
		return fail("%v", err)
	}
	if cred.Uid != uint32(os.Getuid()) {
		return fail("the socket belongs to user %d, not to this process's user %d", cred.Uid, os.Getuid())
	}
	if pid, err := strconv.Atoi(process); err == nil && int32(pid) != cred.Pid {
		return fail("the socket belongs to process %d", cred.Pid)
	}
	_ = c.SetReadDeadline(time.Now().Add(timeout))
	buf := make([]byte, 16)
	oob := make([]byte, syscall.CmsgSpace(4*4))
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
	var fds []int
	if oobn > 0 {
		msgs, perr := syscall.ParseSocketControlMessage(oob[:oobn])
		for i := range msgs {
			if got, err := syscall.ParseUnixRights(&msgs[i]); err == nil {
				fds = append(fds, got...)
			}
		}
		if perr != nil && err == nil {
			err = perr
		}
	}
	closeAll := func() {
		for _, fd := range fds {
			_ = syscall.Close(fd)
		}
	}
	switch {
	case n == 0 && oobn == 0 && (err == nil || errors.Is(err, io.EOF)):
		return fail("the owner hung up without sending it (it serves processes of its own user only)")
	case err != nil:
		closeAll()
		return fail("%v", err)
	case flags&syscall.MSG_CTRUNC != 0 || len(fds) != 1:
		closeAll()
		return fail("%d descriptors received: expected 1", len(fds))
	case n != 8 || binary.LittleEndian.Uint64(buf) != nonce:
		closeAll()
		return fail("the socket serves another buffer")
	}
	return fds[0], nil
}

func closeFD(fd int) error { return syscall.Close(fd) }
