package pyep

import "fmt"

// fastCall is an export that Python calls through fastcall.c: its arguments, all integers,
// arrive as int64s in the order of its parameters; call converts them (fastcall_table.go,
// generated from the exports' signatures by TestFastCallTable).
type fastCall struct {
	name  string
	arity int
	call  func(a []int64) (int64, error)
}

// fastNames are the exports of the per-call path, in the table's order.
var fastNames = []string{
	"Layout", "DispatchQueued", "DispatchNotify", "DispatchRecv", "DispatchCached", "Combine",
	"PlanDispatch", "DispatchPlanned", "PlanCombine", "CombinePlanned",
	"LowLatencyDispatch", "LowLatencyCombine", "LowLatencyReceive", "LastEntryNs", "BufferLastLaunchNs",
}

// callFast runs call fn with a (given arguments in Python, of which a are read). The exports
// recover their own panics; one here (a table that does not match fastCalls) becomes an error.
func callFast(fn int, a []int64, given int) (r int64, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("pyep internal error in fast call %d: %v", fn, p)
		}
	}()
	if fn < 0 || fn >= len(fastCalls) {
		return 0, fmt.Errorf("pyep: no fast call %d", fn)
	}
	f := &fastCalls[fn]
	if given != f.arity || len(a) != f.arity {
		return 0, fmt.Errorf("TypeError: %s takes %d arguments (%d given)", f.name, f.arity, given)
	}
	return f.call(a)
}
