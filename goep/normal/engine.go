package normal

import (
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// task is one side (sender or receiver) of one channel. step never blocks:
// it moves whatever can move now and reports whether it moved anything.
// Because no task ever blocks on one ring, a worker serving many tasks
// cannot deadlock: every ring is drained as soon as its data exists.
type task interface {
	step() (progress bool, err error)
	done() bool
	// waiting describes what the task waited for in its last step that made
	// no progress (formatted only for error messages).
	waiting() waitNote
	channel() int
}

// waitNote records, without formatting, why a task could not progress.
type waitNote struct {
	peer int
	kind int
	a, b int64
	cap  int64
}

const (
	waitTail  = iota // a = tokens received so far, b = expected
	waitHead         // a = head, b = tail, cap = ring size
	waitToken        // a = token index, b = slot it sits in
)

func (w waitNote) String() string {
	switch w.kind {
	case waitTail:
		return fmt.Sprintf("push tokens (tail %d/%d)", w.a, w.b)
	case waitHead:
		return fmt.Sprintf("free ring slots (head %d, tail %d, ring of %d slots)", w.a, w.b, w.cap)
	case waitToken:
		return fmt.Sprintf("send back token %d (slot %d, tail %d)", w.a, w.b, w.cap)
	}
	return "make progress"
}

// workers returns how many goroutines to use for numChannels channels.
func (d *Domain) workers(numChannels int) int {
	w := d.Workers
	if w <= 0 {
		w = runtime.GOMAXPROCS(0)
	}
	return max(1, min(w, numChannels))
}

// runTasks drives tasks with nw workers (the calling goroutine is one of
// them); worker i serves the tasks of channels i, i+nw, ... It returns the
// first error; the other workers stop at their next poll.
func (c *call) runTasks(tasks []task, nw int) error {
	var stop atomic.Bool
	errs := make([]error, nw)
	var wg sync.WaitGroup
	for w := 1; w < nw; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[w] = c.worker(tasks, w, nw, &stop)
		}()
	}
	errs[0] = c.worker(tasks, 0, nw, &stop)
	wg.Wait()
	for _, err := range errs {
		if err != nil && err != errStopped {
			return err
		}
	}
	return nil
}

var errStopped = fmt.Errorf("stopped")

func (c *call) worker(all []task, w, nw int, stop *atomic.Bool) error {
	var mine []task
	for _, t := range all {
		if t.channel()%nw == w {
			mine = append(mine, t)
		}
	}
	if testHook != nil {
		testHook(c, "worker")
	}
	var b backoff
	var since time.Time // start of the current stretch without progress
	suspect := -1       // peer that had left the call at the last slow check
	fail := func(err error) error {
		stop.Store(true)
		return err
	}
	for {
		progress, pending := false, false
		for _, t := range mine {
			if t.done() {
				continue
			}
			p, err := t.step()
			if err != nil {
				return fail(err)
			}
			progress = progress || p
			pending = pending || !t.done()
		}
		if !pending {
			return nil
		}
		if stop.Load() {
			return errStopped
		}
		if progress {
			b.reset()
			since = time.Time{}
			suspect = -1
			continue
		}
		b.pause()
		if !b.slow() {
			continue
		}
		now := time.Now()
		if since.IsZero() {
			since = now
		}
		if err := c.peerFailed(); err != nil {
			return fail(err)
		}
		// The first pending task names the wait in messages.
		var blocked task
		for _, t := range mine {
			if !t.done() {
				blocked = t
				break
			}
		}
		note := blocked.waiting()
		peer := note.peer
		if peer >= 0 && peer == suspect {
			// It had left before our last step, which still could not move.
			return fail(c.chErrf(blocked.channel(), ErrPeer, "rank %d left call #%d (%s) while this rank was waiting for it to %s",
				peer, c.gen, phaseName(c.state(peer)), note))
		}
		suspect = -1
		if peer >= 0 && c.peerLeft(peer) {
			suspect = peer
		}
		if now.Sub(since) > c.timeout {
			return fail(c.chErrf(blocked.channel(), ErrTimeout, "timed out after %v waiting for rank %d to %s",
				c.timeout, peer, note))
		}
	}
}
