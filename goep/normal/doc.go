// Package normal holds the reference normal-mode (high-throughput,
// intranode) expert-parallel algorithms of the cpu backend: Layout, Notify,
// Dispatch (also cached), Combine and Barrier, with the semantics of DeepEP
// V1's intranode kernels.
//
// Every rank is a separate process. All ranks of one NVLink domain (at most
// 8) have mapped every peer's shared segment, which is described by a
// [Domain]: per rank a small control region (ControlBytes, call
// synchronisation) and a data region (num_nvl_bytes, ring buffers and
// scratch). Nothing but those two regions is shared; a Domain value itself
// holds no state, so callers may rebuild it for every call.
//
// # Calls and generations
//
// Every public operation except Layout is a collective call: all ranks must
// make the same sequence of calls. Each call runs under a generation number
// agreed by all ranks:
//
//   - The decision word in rank 0's control region holds the last decided
//     generation and its outcome (committed or aborted). A rank entering a
//     call proposes decided+1 and publishes it in its state word.
//   - The first rank that sees every rank at that generation commits it with
//     a compare-and-swap; a rank that times out first aborts it with the same
//     compare-and-swap, recording which ranks had entered. Exactly one of the
//     two wins, so no two ranks ever disagree on whether a generation ran.
//     The ranks recorded as present return an error; a rank that enters
//     after the abort (it never joined that call, or came too late) moves its
//     call to the next generation, which its peers' next call proposes too.
//     So after a timeout the next call every rank makes works.
//   - Once committed, every rank zeroes the ring counters of its own data
//     region and then waits until all ranks have done so before anyone
//     writes to a peer. Committing needs every rank to have entered the call,
//     and a rank enters a call only after all goroutines of its previous call
//     have ended, so nothing of an earlier (possibly aborted) call can write
//     into a region after it has been zeroed.
//   - A rank that fails after commit (bad argument, timeout, peer mismatch)
//     publishes its error text and a failed state; peers waiting on it stop
//     at once with that text instead of waiting for their own timeout.
//
// # Data movement
//
// All payload moves through ring buffers in the receivers' data regions, one
// ring per (channel, sender) pair, as DeepEP's intranode kernels do: the
// sender owns the tail counter, the receiver the head counter, the sender
// pushes at most num_max_nvl_chunked_send_tokens per step and waits while a
// ring of num_max_nvl_chunked_recv_tokens slots lacks room for a chunk. The
// tail word also carries the number of tokens the sender will push on that
// ring, which lets the receiver check the routing handle it was given and
// derive recv_channel_prefix_matrix itself.
package normal
