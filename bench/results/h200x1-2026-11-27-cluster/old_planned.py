def _dispatch_planned(self, plan: tuple, x, topk_weights, expert_alignment, in_rank: torch.Tensor):
    """The dispatch that `plan` (see _plan_dispatch) prepared, when x, its scales and the stream are the ones it was
    prepared for; else None (the rows ahead stay, for the call's usual path to take or let go)."""
    num, stream, key, fp8, row_bytes, S, hl, rl, cap, R, C, T, per_expert, gp = plan
    if ((type(x) is tuple) is not fp8 or (type(self).num_sms, tuning.generation) != key
            or (_current_stream(self._device_index) if self._cuda else 0) != stream):
        return None
    try:  # the descriptions of _desc2, read in place: anything unusual takes the call's usual path
        if fp8:
            x, scales = x
            s0, xS = scales.shape
            ss0, ss1 = scales.stride()
            sp, st, sv, sn = scales.data_ptr(), _DT[scales.dtype], _DV[scales.device], 2
        else:
            scales, (sp, st, sv, sn, s0, xS, ss0, ss1) = None, _NONE
        xT, H = x.shape
        xs0, xs1 = x.stride()
        xp, xt, xv = x.data_ptr(), _DT[x.dtype], _DV[x.device]
        w0, K = topk_weights.shape
        ws0, ws1 = topk_weights.stride()
        wp, wt, wv = topk_weights.data_ptr(), _DT[topk_weights.dtype], _DV[topk_weights.device]
    except (AttributeError, TypeError, ValueError):
        return None
    if H * _ITEMSIZE.get(xt, 1) != row_bytes or xS != S:
        return None
    rb, self._rows_ahead = self._rows_ahead[0], None
    try:
        n = _go.DispatchPlanned(self._rid, num, expert_alignment, xp, xt, xv, 2, xT, H, xs0, xs1,
                                sp, st, sv, sn, s0, S, ss0, ss1, wp, wt, wv, 2, w0, K, ws0, ws1)
    except RuntimeError as e:
        raise _core.error(e) from None
    except TypeError as e:
        _raise_int(e, expert_alignment=(expert_alignment, 1))
    lay = self._layout
    return self._dispatch_outputs(
        n >= 0, n if n >= 0 else -n - 1, True, cap, rb, rl, lay[0], lay[10], hl, _USUAL, stream, T, H, R, C, xt, st,
        S, K, scales, per_expert, row_bytes, gp, in_rank, 0, False, ())

