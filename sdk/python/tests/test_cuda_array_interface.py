"""Device arrays of other libraries (CuPy, Numba, ...) through their
__cuda_array_interface__: every collective, dtype (bfloat16 has no typestr)
and op against numpy references, and what is refused. Needs a CUDA runtime
to allocate device memory from (ctypes): the CUDA emulation's, in the build
tools/test.sh makes against it (build-emu), or a libcudart on the library
path with a GPU; skipped otherwise."""

import os

import pytest

import ciuic
import conftest
import ranks

_rt = ranks.CudaRuntime.load() if ciuic._ciuic.sdk_supports_device_buffers()[0] else None
# The emulated build's ctest sets it: there a skip would pass having run
# nothing.
if _rt is None and os.environ.get("CIUIC_REQUIRE_CUDA_RUNTIME") == "1":
    raise RuntimeError("CIUIC_REQUIRE_CUDA_RUNTIME=1, but no CUDA runtime with a device loads "
                       f"({', '.join(ranks.CudaRuntime._NAMES)})")
pytestmark = pytest.mark.skipif(
    _rt is None,
    reason="no CUDA runtime with a device here (nor the CUDA emulation): "
           "__cuda_array_interface__ tests not run")


@pytest.mark.parametrize("dtype", [d for d in ranks.DTYPES if d != "bfloat16"])
def test_cai_collectives(pool, dtype):
    assert pool.run(ranks.cai_collectives, dtype, 31)[0] > 0


def test_cai_two_communicators_share_an_allocation():
    # A daemon and ranks of its own, so that `ciuicctl status` counts this
    # test's allocations alone (the shared daemon keeps the other tests'
    # freed arrays mapped while their sessions last).
    daemon = conftest.Daemon(conftest.ciuicd_binary())
    try:
        pool = conftest.RankPool(daemon.socket)
        try:
            assert pool.run(ranks.cai_two_communicators) == [9] * pool.world
        finally:
            pool.close()
        alive = daemon.proc.poll() is None
    finally:
        daemon.stop()
    assert alive, "ciuicd died"


def test_cai_refusals(pool):
    said = pool.run(ranks.cai_refusals)
    assert said == [8] * len(said)
