"""Every collective and every dtype, numpy and torch, against references
computed with numpy (see ranks.py); sizes 0, 1, odd, and just over 4 MiB."""

import pytest

import ranks

NUMPY_DTYPES = [d for d in ranks.DTYPES if d != "bfloat16"]  # numpy has no bfloat16
CASES = [("numpy", d) for d in NUMPY_DTYPES] + [("torch", d) for d in ranks.DTYPES]


@pytest.mark.parametrize("lib,dtype", CASES)
def test_allreduce(pool, lib, dtype):
    checks = pool.run(ranks.allreduce_all, lib, dtype, 11)
    assert checks[0] == len(ranks.OPS) * len(ranks.SMALL_SIZES) + 1


@pytest.mark.parametrize("lib,dtype", CASES)
def test_reduce_scatter(pool, lib, dtype):
    pool.run(ranks.reduce_scatter_all, lib, dtype, 12)


@pytest.mark.parametrize("lib,dtype", CASES)
def test_allgather(pool, lib, dtype):
    pool.run(ranks.allgather_all, lib, dtype, 13)


@pytest.mark.parametrize("lib,dtype", CASES)
def test_alltoall(pool, lib, dtype):
    checks = pool.run(ranks.alltoall_all, lib, dtype, 15)
    assert checks[0] == len(ranks.SMALL_SIZES) + 1


@pytest.mark.parametrize("lib,dtype", CASES)
def test_alltoall_with_split_sizes(pool, lib, dtype):
    checks = pool.run(ranks.alltoallv_all, lib, dtype, 16)
    assert checks[0] == 4


def test_alltoall_split_sizes_that_disagree_fail_on_every_rank(pool):
    for message in pool.run(ranks.alltoallv_mismatch):
        assert "mismatched across ranks" in message and "alltoallv counts disagree" in message, \
            message


@pytest.mark.parametrize("lib,dtype", CASES)
def test_broadcast(pool, lib, dtype):
    pool.run(ranks.broadcast_all, lib, dtype, 14)


def test_barrier(pool):
    waited = pool.run(ranks.barriers)
    assert waited[0] >= 0.25, "rank 0 left the barrier before rank 1 arrived"


@pytest.mark.parametrize("shared", [False, True], ids=["staged", "shared"])
def test_large_allreduce_16M_float32(pool, shared):
    pool.run(ranks.large_allreduce, shared)
