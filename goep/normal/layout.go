package normal

// Layout computes DeepEP's dispatch layout from topk_idx [numTokens,
// numTopk] (global expert indices, -1 for none). Experts are split evenly:
// rank r holds experts [r*E/R, (r+1)*E/R). Outputs (caller-allocated):
// perRank [R] = tokens with at least one expert on rank r, perExpert [E] =
// tokens choosing expert e, inRank [T*R] = token t goes to rank r. It is
// purely local.
func Layout(topkIdx []int64, numTokens, numTopk, numExperts, numRanks int,
	perRank []int32, perExpert []int32, inRank []bool) error {
	const op = "layout"
	switch {
	case numRanks < 1:
		return newErr(ErrInvalid, "%s: num_ranks = %d must be positive", op, numRanks)
	case numExperts <= 0 || numExperts%numRanks != 0:
		return newErr(ErrInvalid, "%s: num_experts = %d must be a positive multiple of num_ranks = %d", op, numExperts, numRanks)
	case numTokens < 0 || numTokens > maxTokens:
		return newErr(ErrInvalid, "%s: num_tokens = %d is out of range", op, numTokens)
	case numTopk < 0:
		return newErr(ErrInvalid, "%s: num_topk = %d is negative", op, numTopk)
	}
	if err := checkLen(op, "topk_idx", len(topkIdx), numTokens*numTopk); err != nil {
		return err
	}
	if err := checkLen(op, "num_tokens_per_rank", len(perRank), numRanks); err != nil {
		return err
	}
	if err := checkLen(op, "num_tokens_per_expert", len(perExpert), numExperts); err != nil {
		return err
	}
	if err := checkLen(op, "is_token_in_rank", len(inRank), numTokens*numRanks); err != nil {
		return err
	}
	if err := checkTopk(op, topkIdx, numTopk, numExperts); err != nil {
		return err
	}
	clear(perRank)
	clear(perExpert)
	clear(inRank)
	perRankExperts := int64(numExperts / numRanks)
	for t := 0; t < numTokens; t++ {
		row := inRank[t*numRanks : (t+1)*numRanks]
		for _, e := range topkIdx[t*numTopk : (t+1)*numTopk] {
			if e < 0 {
				continue
			}
			perExpert[e]++
			row[e/perRankExperts] = true
		}
		for r, in := range row {
			if in {
				perRank[r]++
			}
		}
	}
	return nil
}

// checkTopk validates top-k expert indices: -1 or in [0, numExperts).
func checkTopk(op string, topkIdx []int64, numTopk, numExperts int) error {
	for i, e := range topkIdx {
		if e < -1 || e >= int64(numExperts) {
			return newErr(ErrInvalid, "%s: topk_idx[%d,%d] = %d is out of range [0, %d) (or -1 for no expert)",
				op, i/numTopk, i%numTopk, e, numExperts)
		}
	}
	return nil
}

func checkLen(op, name string, got, want int) error {
	if got != want {
		return newErr(ErrInvalid, "%s: %s has %d elements, want %d", op, name, got, want)
	}
	return nil
}
