"""Async handles, out-of-order named submission, torch futures."""

import ranks


def test_async_handles_and_futures(pool):
    assert pool.run(ranks.async_ops) == [True, True]


class _FakeHandle:
    def __init__(self):
        self.completed = False

    def is_completed(self):
        return self.completed


def test_device_tensors_stay_alive_until_their_operation_completes():
    """What a device operation uses stays referenced until it completes,
    though the caller drops its Work and tensors (ciuic._DeviceHolds; the
    CUDA run of the same is test_cuda.py::test_dropped_cuda_tensors_live_on)."""
    import weakref
    import ciuic

    class Tensor:  # stands in for a torch tensor: weakly referable
        pass

    holds = ciuic._DeviceHolds()
    first, second = _FakeHandle(), _FakeHandle()
    t1, t2 = Tensor(), Tensor()
    r1, r2 = weakref.ref(t1), weakref.ref(t2)
    holds.add(first, (t1, t1))
    holds.add(second, (t2,))
    del t1, t2
    assert r1() is not None and r2() is not None and len(holds) == 2
    holds.prune()  # nothing completed: nothing goes
    assert r1() is not None and r2() is not None
    second.completed = True  # out of order
    holds.prune()
    assert r1() is not None and r2() is None and len(holds) == 1
    first.completed = True
    third = _FakeHandle()
    t3, t4 = Tensor(), Tensor()
    r3, r4 = weakref.ref(t3), weakref.ref(t4)
    holds.add(third, (t3,))  # a submission prunes too
    assert r1() is None and len(holds) == 1
    done = _FakeHandle()
    holds.add(done, (t4,))
    del t3, t4
    done.completed = True

    def close():  # as the session's end does: every handle completes
        third.completed = True

    # At close, what was still in flight stays referenced for good (the
    # daemon may still be at it), what had completed goes.
    holds.close_with(close)
    assert len(holds) == 0 and third.completed
    assert r3() is not None and r4() is None
    assert any(keep and keep[0] is r3() for keep in ciuic._orphaned_device_tensors)
