"""Every test runs in each rank of a torchrun launch (1 to 8 processes) over a gloo group, so the
cpu backend is what runs here; a plain `pytest` is a group of one."""
import os
import tempfile
from datetime import timedelta

import pytest
import torch.distributed as dist

# A collective test that fails on one rank must not leave the others waiting for half an hour.
GROUP_TIMEOUT = timedelta(seconds=int(os.environ.get("PYEP_TEST_GROUP_TIMEOUT", "120")))


@pytest.fixture(scope="session")
def group():
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
        else:
            store = tempfile.mkdtemp(prefix="pyep-test-")
            dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1,
                                    timeout=GROUP_TIMEOUT)
    yield dist.group.WORLD
    dist.barrier()


@pytest.fixture
def rank(group):
    return group.rank()


@pytest.fixture
def num_ranks(group):
    return group.size()
