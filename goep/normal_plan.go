package goep

import "fmt"

// Plans: the next call of a layer, prepared by the call before it.
//
// In an MoE layer get_dispatch_layout is followed by its dispatch, and a dispatch by its combine.
// After the earlier call's launch the Python layer knows everything the next usual call will pass
// but the tensors the model makes in between (x, its scales, the weights): the layout's outputs,
// the handle's tensors, the rows or outputs allocated ahead, the config and the stream. It plans
// the next call then (PlanDispatch, PlanCombine), when nothing waits for the host, and the next
// call passes only what is new (DispatchPlanned, CombinePlanned): a third of the integers across
// the binding. A planned call is checked and run exactly as the call it stands for; a plan is used
// once, by the call that names its number, and any later plan replaces it.

// plans are a buffer's plans, under mu; a number of 0 is none.
type plans struct {
	dispatchNum int64
	dispatch    DispatchArgs
	recv        RecvTensors
	combineNum  int64
	combine     CombineArgs
}

// PlanDispatch keeps a (but its x, scales, weights and expert alignment) and r for the queued
// dispatch numbered num.
func (b *Buffer) PlanDispatch(num int64, a *DispatchArgs, r RecvTensors) {
	b.mu.Lock()
	b.plans.dispatchNum, b.plans.dispatch, b.plans.recv = num, *a, r
	b.mu.Unlock()
}

// DispatchPlanned is DispatchQueued of the plan numbered num with x, its scales, topk_weights and
// expert_alignment.
func (b *Buffer) DispatchPlanned(num int64, x, scales, weights Desc, expertAlignment int) (int, bool, error) {
	b.mu.Lock()
	planned, a, r := b.plans.dispatchNum, b.plans.dispatch, b.plans.recv
	b.plans.dispatchNum = 0
	b.mu.Unlock()
	if planned != num || num == 0 {
		return 0, false, fmt.Errorf("dispatch: no plan %d (the buffer's plan is %d)", num, planned)
	}
	a.X, a.XScales, a.TopkWeights, a.ExpertAlignment = x, scales, weights, expertAlignment
	return b.DispatchQueued(&a, r)
}

// PlanCombine keeps a (but its x and topk_weights) for the combine numbered num.
func (b *Buffer) PlanCombine(num int64, a *CombineArgs) {
	b.mu.Lock()
	b.plans.combineNum, b.plans.combine = num, *a
	b.mu.Unlock()
}

// CombinePlanned is Combine of the plan numbered num with x and topk_weights (no bias).
func (b *Buffer) CombinePlanned(num int64, x, weights Desc) error {
	b.mu.Lock()
	planned, a := b.plans.combineNum, b.plans.combine
	b.plans.combineNum = 0
	b.mu.Unlock()
	if planned != num || num == 0 {
		return fmt.Errorf("combine: no plan %d (the buffer's plan is %d)", num, planned)
	}
	a.X, a.TopkWeights = x, weights
	return b.Combine(&a)
}
