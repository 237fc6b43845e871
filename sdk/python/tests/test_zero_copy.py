"""comm.empty(): arrays and tensors in the daemon's shared memory."""

import pytest

import ranks

CASES = [("numpy", d) for d in ranks.DTYPES if d != "bfloat16"] + [
    ("torch", d) for d in ranks.DTYPES]


@pytest.mark.parametrize("lib,dtype", CASES)
def test_empty_is_shared_and_reduced_in_place(pool, lib, dtype):
    pool.run(ranks.empty_buffers, lib, dtype, 21)


def test_shared_arrays_need_no_staging(pool):
    messages = pool.run(ranks.zero_copy_proof)
    assert all("arena" in m for m in messages), messages
