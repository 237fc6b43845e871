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


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_private_input_and_output_far_apart(daemon, lib):
    """Staging needs the arrays' own size, not the distance between them (the
    C++ SDK stages one region spanning a private input and a private output:
    worked around in ciuic.Communicator._stage_apart)."""
    import uuid

    import numpy as np
    import torch

    import ciuic
    with ciuic.init(rank=0, world_size=1, job=f"apart-{uuid.uuid4().hex[:8]}",
                    socket=daemon.socket, arena_bytes=8 << 20) as comm:
        n = 1 << 18  # 1 MiB of float32; the two 32 MiB apart in one private block
        gap = 8 << 20
        block = np.zeros(n + gap + n, np.float32) if lib == "numpy" else torch.zeros(n + gap + n)
        inp, out = block[:n], block[n + gap:]
        inp[:] = (np.arange(n, dtype=np.float32) if lib == "numpy"
                  else torch.arange(n, dtype=torch.float32))
        comm.allgather(out, inp, name="apart.ag")
        assert (out == inp).all()
        out[:] = 0
        comm.reduce_scatter(out, inp, name="apart.rs")
        assert (out == inp).all()
