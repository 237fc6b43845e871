"""torch CUDA tensors through the daemon (device buffers, CUDA IPC): every
collective, dtype and op against numpy references, and the DDP hook on CUDA
buckets. Needs torch with CUDA and a GPU; skipped (with the reason) where
torch has no CUDA, as Debian's CPU-only torch. The error path without CUDA
is test_errors.py::test_device_buffers_without_cuda."""

import pytest
import torch

import ranks

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="torch has no CUDA here (CPU-only build or no GPU): CUDA tensor tests not run")


@pytest.mark.parametrize("dtype", ranks.DTYPES)
def test_cuda_collectives(pool, dtype):
    checks = pool.run(ranks.cuda_collectives, dtype, 21)
    assert checks[0] > 0


def test_cuda_ddp_hook(pool):
    assert pool.run(ranks.cuda_ddp_hook, 3)[0] == 3


def test_dropped_cuda_tensors_live_on(pool):
    assert pool.run(ranks.cuda_dropped_tensors_live_on) == [True, True]


def test_busy_stream_times_out_and_nothing_runs(pool):
    assert pool.run(ranks.cuda_busy_stream_times_out) == [True, True]
