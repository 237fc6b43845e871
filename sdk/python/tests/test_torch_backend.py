"""torch.distributed with backend="ciuic" (ciuic/torch_backend.py): real
daemons and rank processes (conftest.TorchPool), 1 node x 2 ranks and 2
nodes x 2 ranks."""

import pytest

import backend_ranks as br
from conftest import free_port

SHAPES = [(1, 2), (2, 2)]
SHAPE_IDS = ["1x2", "2x2"]
DTYPE_SETS = [("float32", "float64"), ("float16", "bfloat16"), ("int8", "uint8"),
              ("int32", "int64")]


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtypes", DTYPE_SETS, ids=["-".join(d) for d in DTYPE_SETS])
def test_collectives(torch_pool, shape, dtypes):
    checks = torch_pool.run(shape, br.collectives, dtypes, 5, True, timeout=180)
    assert len(set(checks)) == 1 and checks[0] > 100, checks


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_movable_dtypes(torch_pool, shape):
    assert torch_pool.run(shape, br.movable_dtypes, 3) == [15] * (shape[0] * shape[1])


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_object_collectives_and_barrier(torch_pool, shape):
    torch_pool.run(shape, br.object_collectives_and_barrier)


def test_async_work_and_refusals(torch_pool):
    counts = torch_pool.run((1, 2), br.async_and_refusals)
    assert counts[0] == counts[1] >= 12


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_mismatch_raised_on_every_rank(torch_pool, shape):
    for results in torch_pool.run(shape, br.mismatch_everywhere):
        assert [how for how, _, _ in results] == ["sync", "wait", "future"]
        for how, cls, message in results:
            assert "mismatched" in message and "torch." in message, (how, message)
            if how != "future":
                assert cls == "InvalidArgumentError", (how, cls)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_timeout_raised_not_hung(torch_pool, shape):
    timeout_s = 2
    results = torch_pool.run(shape, br.timeout_raised, timeout_s)
    took, _ = results[0]
    assert timeout_s * 0.9 <= took <= timeout_s + 10, took
    assert results[0][1] is True  # Work.wait(timeout) raised while the op went on


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_ddp_matches_gloo(torch_pool, shape):
    """DDP through the backend, with the ciuic hook on top, and with
    ZeroRedundancyOptimizer, against DDP (+ SGD, + ZeRO) over gloo."""
    results = torch_pool.run(shape, br.ddp_variants, 5, timeout=180)
    for rank, res in enumerate(results):
        gloo, gloo_losses = res["gloo"]
        assert gloo_losses[-1] < gloo_losses[0]
        scale = max(abs(x) for x in gloo)
        for variant in ("ciuic", "hook", "zero", "gloo_zero"):
            params, _ = res[variant]
            worst = max(abs(a - b) for a, b in zip(params, gloo)) / scale
            assert worst <= 1e-6, (rank, variant, worst)
    assert results[0]["ciuic"][0] == results[-1]["ciuic"][0]  # every rank the same


def test_zero2_example_matches_one_process(torch_pool):
    results = torch_pool.run((2, 2), br.zero2_example, 10, 3, timeout=180)
    worst, nparams, losses, ref_losses = results[0]
    assert nparams == 6 and len(losses) == 10
    assert losses[-1] < losses[0]
    assert worst <= 1e-5, (worst, losses, ref_losses)


def test_two_groups_in_one_step(torch_pool):
    steps = 3
    results = torch_pool.run((2, 2), br.two_groups, steps)
    # dp groups {0, 2} and {1, 3} span both nodes; mp groups {0, 1}, {2, 3} one node.
    for rank, (checksum, mp_sums, layout, dp_job, mp_job) in enumerate(results):
        assert layout == [(2, 1, True), (2, 2, False)], layout
        node = rank // 2
        assert mp_sums == [float(2 * node * 2 + 1 + 2 * s) for s in range(steps)], mp_sums
        assert dp_job != mp_job and dp_job.startswith("127.0.0.1:")
    assert results[0][0] == results[2][0] and results[1][0] == results[3][0]
    assert results[0][3] == results[2][3] and results[0][4] == results[1][4]
    assert results[0][4] != results[2][4]


def test_slurm_environment(torch_pool):
    port = free_port()

    def env(rank, node, local):
        return {k: None for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                  "MASTER_ADDR", "MASTER_PORT", "CIUIC_PEER_PORT")} | {
            "SLURM_PROCID": str(rank), "SLURM_NTASKS": "4", "SLURM_LOCALID": str(local),
            "SLURM_NODEID": str(node), "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "77",
            "SLURM_STEP_ID": str(port), "CIUIC_COORDINATOR": torch_pool.cluster.coordinator,
            "TEST_STORE_PORT": str(port)}
    results = torch_pool.run((2, 2), br.slurm_layout, env=env)
    assert results == [(r, 4, r % 2, 2, f"slurm-77.{port}") for r in range(4)], results


def test_layout_from_store(torch_pool):
    port = free_port()

    def env(rank, node, local):
        return {k: None for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                  "MASTER_ADDR", "MASTER_PORT")} | {
            "CIUIC_COORDINATOR": torch_pool.cluster.coordinator, "TEST_RANK": str(rank),
            "TEST_WORLD": "4", "TEST_STORE_PORT": str(port)}
    results = torch_pool.run((2, 2), br.store_layout, env=env)
    jobs = {r[4] for r in results}
    assert len(jobs) == 1 and jobs.pop().startswith("torch-")
    assert [r[:4] for r in results] == [(r, 4, r % 2, 2) for r in range(4)], results


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_ciuic_group_under_gloo(torch_pool, shape):
    results = torch_pool.run(shape, br.ciuic_group_under_gloo)
    per_node = shape[1]
    for rank, (job, local_rank, local_size, backend) in enumerate(results):
        assert backend == "ciuic"
        assert job.startswith("127.0.0.1:") and job.endswith(".g1"), job
        assert (local_rank, local_size) == (rank % per_node, per_node)


def test_torch2_registration_names_the_devices():
    """torch 2.x registers a backend for device types (register_backend's
    devices=): ciuic for cpu and cuda. torch 1.13 has no such parameter,
    and the test says so and skips."""
    import inspect

    import torch
    import torch.distributed as dist

    import ciuic.torch

    ciuic.torch.register()
    ciuic.torch.register()  # idempotent
    assert dist.Backend("ciuic") == "ciuic"
    if "devices" not in inspect.signature(dist.Backend.register_backend).parameters:
        pytest.skip(f"torch {torch.__version__}: register_backend takes no devices= (a torch "
                    "2.x parameter); the 2.x registration is not exercised here")
    assert dist.Backend.backend_capability.get("ciuic") == ["cpu", "cuda"]
