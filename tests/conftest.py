"""Every test runs in each rank of a torchrun launch (1 to 8 processes); a plain `pytest` is a group of one.

The `group` is gloo (the cpu backend) unless PYEP_TEST_DEVICE=cuda, which selects the cuda backend: rank r
uses GPU `LOCAL_RANK % device_count`, in an NCCL group when every rank has a GPU of its own. When ranks share a
GPU (more ranks than GPUs, e.g. 4 ranks on a one-GPU host), NCCL refuses the communicator, so the group is gloo
(which handles CUDA tensors) and PYEP_BACKEND=cuda keeps pyep on its cuda backend. `device` is where the tests
put their tensors; BACKEND names pyep's backend ("cpu" or "cuda")."""
import os
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

DEVICE = os.environ.get("PYEP_TEST_DEVICE", "cpu")
BACKEND = "cuda" if DEVICE == "cuda" else "cpu"
# Recommended configs are DeepEP's table in tests, whatever a bench --tune run left on this machine.
os.environ.setdefault("PYEP_TUNING_FILE", os.path.join(tempfile.gettempdir(), "pyep-tests-no-tuning.json"))

# A collective test that fails on one rank must not leave the others waiting for half an hour.
GROUP_TIMEOUT = timedelta(seconds=int(os.environ.get("PYEP_TEST_GROUP_TIMEOUT", "120")))


@pytest.fixture(scope="session")
def group():
    if not dist.is_initialized():
        backend = "gloo"
        if DEVICE == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
            if local_ranks <= torch.cuda.device_count():
                backend = "nccl"
            else:
                os.environ["PYEP_BACKEND"] = "cuda"
                if local_rank == 0:
                    print(f"\nconftest: {local_ranks} ranks share {torch.cuda.device_count()} GPU(s): a gloo group "
                          "(NCCL refuses ranks on one GPU) with pyep's cuda backend (PYEP_BACKEND=cuda)", flush=True)
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=GROUP_TIMEOUT)
        else:
            store = tempfile.mkdtemp(prefix="pyep-test-")
            dist.init_process_group(backend, init_method=f"file://{store}/store", rank=0, world_size=1,
                                    timeout=GROUP_TIMEOUT)
    yield dist.group.WORLD
    dist.barrier()
    # Let gloo's worker threads release the barrier's tensors before the interpreter exits (see
    # test_no_shared_memory_left_after_exit: a late release during finalization aborts the process).
    time.sleep(0.1)


@pytest.fixture
def rank(group):
    return group.rank()


@pytest.fixture
def num_ranks(group):
    return group.size()


@pytest.fixture(scope="session")
def device(group):
    return torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")


def shares_gpu():
    """Whether ranks of this launch share a GPU (the cuda backend over a gloo group)."""
    return DEVICE == "cuda" and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count()


def record_spawned_sets(mp):
    """Records, in the list returned, each set of processes pyep.bench's launcher spawns (its `part`: None for a run
    in one set; sweep.FIRST and sweep.NODES for the two sets of a run with --ll-nodes where a process holds one NVSHMEM
    group). mp: a pytest MonkeyPatch."""
    from pyep.bench import launch
    sets, spawn_set = [], launch._spawn_set

    def record(nprocs, opts, part=None):
        sets.append(part)
        return spawn_set(nprocs, opts, part)

    mp.setattr(launch, "_spawn_set", record)
    return sets


class TorchCalls:
    """A torch function mode (as torch.set_default_device installs) that counts the torch calls routed through it:
    pyep's calls run without modes, so they make none."""

    def __init__(self):
        from torch.overrides import TorchFunctionMode

        calls = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                calls.seen.append(getattr(func, "__name__", str(func)))
                return func(*args, **(kwargs or {}))

        self.seen = []
        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)
