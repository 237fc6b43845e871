"""ciuic.init(): torchrun's environment, job id and socket resolution."""

import numpy as np
import pytest
import torch

import ciuic

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
       "CIUIC_JOB", "TORCHELASTIC_RUN_ID", "CIUIC_SOCKET", "CIUIC_COORDINATOR",
       "CIUIC_PEER_PORT")


@pytest.fixture
def env(monkeypatch, daemon):
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CIUIC_SOCKET", daemon.socket)
    monkeypatch.setenv("CIUIC_ARENA_BYTES", str(16 << 20))
    return monkeypatch


def test_torchrun_environment(env):
    env.setenv("RANK", "0")
    env.setenv("WORLD_SIZE", "1")
    env.setenv("LOCAL_RANK", "0")
    env.setenv("LOCAL_WORLD_SIZE", "1")
    env.setenv("MASTER_ADDR", "10.1.2.3")
    env.setenv("MASTER_PORT", "29500")
    with ciuic.init() as comm:
        assert (comm.rank, comm.world_size, comm.local_rank, comm.local_size) == (0, 1, 0, 1)
        assert comm.job_id == "10.1.2.3:29500"
        assert comm.node_name == "pytest"
        t = torch.arange(4.0)
        comm.allreduce(t)  # one rank: unchanged
        assert t.tolist() == [0, 1, 2, 3]
    env.setenv("TORCHELASTIC_RUN_ID", "elastic-7")
    with ciuic.init() as comm:
        assert comm.job_id == "elastic-7"
    env.setenv("CIUIC_JOB", "my-job")
    with ciuic.init() as comm:
        assert comm.job_id == "my-job"
    with ciuic.init(job="explicit") as comm:
        assert comm.job_id == "explicit"


def test_explicit_arguments_override(env, daemon):
    env.setenv("RANK", "3")
    env.setenv("WORLD_SIZE", "8")
    env.setenv("CIUIC_SOCKET", "/nonexistent/ciuicd.sock")
    with ciuic.init(rank=0, world_size=1, local_rank=0, local_size=1, job="override",
                    socket=daemon.socket) as comm:
        assert (comm.rank, comm.world_size, comm.job_id) == (0, 1, "override")
        a = np.ones(3, np.float32)
        comm.allreduce(a, op="avg")
        assert a.tolist() == [1, 1, 1]


def test_missing_job_id(env):
    env.setenv("RANK", "0")
    env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ciuic.InvalidArgumentError, match="job id"):
        ciuic.init()


def test_bad_rank(env):
    with pytest.raises(ciuic.InvalidArgumentError, match="rank 2"):
        ciuic.init(rank=2, world_size=2, job="bad-rank")


def test_default_socket(env, daemon):
    assert ciuic.default_socket_path() == daemon.socket  # $CIUIC_SOCKET
    env.delenv("CIUIC_SOCKET")
    assert ciuic.default_socket_path() == "/run/ciuic/ciuicd.sock"


def test_resolve_coordinator():
    resolve = ciuic.resolve_coordinator
    env = {"CIUIC_COORDINATOR": "10.0.0.9:9000", "MASTER_ADDR": "10.0.0.1",
           "CIUIC_PEER_PORT": "7400"}
    # Explicit wins, for any job.
    assert resolve("h:1", 4, 2, env) == "h:1"
    assert resolve("h:1", 2, None, env) == "h:1"
    # One node (local_size unknown or == world_size): none needed, env ignored.
    assert resolve(None, 4, None, env) == ""
    assert resolve(None, 4, 4, env) == ""
    # Several nodes: $CIUIC_COORDINATOR, else $MASTER_ADDR:$CIUIC_PEER_PORT (default 7361).
    assert resolve(None, 4, 2, env) == "10.0.0.9:9000"
    assert resolve(None, 4, 2, {"MASTER_ADDR": "10.0.0.1", "CIUIC_PEER_PORT": "7400"}) == \
        "10.0.0.1:7400"
    assert resolve(None, 4, 1, {"MASTER_ADDR": "10.0.0.1"}) == "10.0.0.1:7361"
    assert ciuic.DEFAULT_PEER_PORT == 7361
    with pytest.raises(ciuic.InvalidArgumentError, match="coordinator"):
        resolve(None, 4, 2, {"MASTER_PORT": "29500"})


def test_multinode_without_coordinator(env):
    env.delenv("CIUIC_COORDINATOR", raising=False)
    with pytest.raises(ciuic.InvalidArgumentError, match="CIUIC_COORDINATOR"):
        ciuic.init(rank=0, world_size=2, local_rank=0, local_size=1, job="no-coordinator")


def test_single_node_has_no_coordinator(env):
    env.setenv("CIUIC_COORDINATOR", "10.9.9.9:1")  # not used: the job spans one node
    with ciuic.init(rank=0, world_size=1, job="one-node") as comm:
        assert comm.coordinator == ""
