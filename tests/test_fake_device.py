"""The fake GPU node itself: it fails where CUDA and NCCL would, answers value questions, and leaves no trace.

These pin what the fake-device tier (``tests/test_fake_device_*.py``) relies on:
a tensor on the wrong GPU or on the CPU fails as on a device, a collective off
``cuda:LOCAL_RANK`` fails as NCCL refuses it, a collective's result can be read
on the host, and everything is restored when the node closes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

from tests.fake_cuda import fake_cuda_node
from tests.fake_values import CollectiveDeviceError

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


def test_the_device_is_the_current_one_as_in_cuda() -> None:
    with fake_cuda_node(local_rank=1):
        assert torch.cuda.is_available() and torch.cuda.device_count() == 2
        assert torch.cuda.current_device() == 0, "a fresh CUDA process starts on device 0"
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        x = torch.ones(2, device="cuda")
        placed = [x, torch.ones(2).to("cuda"), torch.ones(2).cuda(), torch.tensor([1.0], device="cuda"),
                  x.new_tensor(3.0), torch.randn(2, device=torch.device("cuda"))]
        assert [t.device for t in placed] == [CUDA1] * len(placed)


def test_runtime_puts_a_fake_group_on_the_gpu() -> None:
    """torch's ``fake`` backend stands in for NCCL (Megatron's ``--fake-process-group``): the launches and benches
    that ask ``dsp_plugin.backend.current_device()`` compute on the GPU, not on the CPU as under gloo."""
    from dsp_plugin import backend

    with fake_cuda_node(local_rank=1):
        torch.cuda.set_device(backend.choose().device)
        assert dist.get_backend() == "fake" and backend.current_device() == CUDA1


def test_a_tensor_on_the_wrong_device_fails() -> None:
    with fake_cuda_node(local_rank=1):
        x = torch.ones(3, device=CUDA1)
        with pytest.raises(FakeTensorDeviceMismatchError, match="cuda:1 and cuda:0"):
            x + torch.ones(3, device=CUDA0)
        with pytest.raises(FakeTensorDeviceMismatchError, match="cuda:1 and cpu"):
            x + torch.ones(3)
        assert (x + torch.tensor(2.0)).device == CUDA1, "a 0-dim CPU tensor meets a CUDA one, as on a device"


def test_a_collective_off_the_local_gpu_fails_as_nccl_refuses_it() -> None:
    with fake_cuda_node(local_rank=1) as node:
        for device in (CUDA0, torch.device("cpu")):
            out = torch.empty(4, device=device)
            with pytest.raises(CollectiveDeviceError, match=f"a tensor on {device}, but this rank's NCCL process "
                                                            f"group is bound to cuda:1"):
                dist.all_gather_into_tensor(out, torch.ones(2, device=device))
        dist.all_reduce(torch.ones(2, device=CUDA1))
        assert node.collectives[-1][1] == [CUDA1]


def test_a_collective_result_is_read_on_the_host() -> None:
    """The fake process group hallucinates every peer holding this rank's data; the values follow."""
    with fake_cuda_node(local_rank=1):
        table = torch.empty(2, 3, dtype=torch.int64, device=CUDA1)
        dist.all_gather_into_tensor(table, torch.tensor([7, 8, 9], device=CUDA1))
        assert table.device == CUDA1 and table.tolist() == [[7, 8, 9], [7, 8, 9]]
        assert int(table.sum()) == 48 and bool((table == 7).any()) and table.nonzero().shape == (6, 2)
        assert table.cpu().numpy().tolist() == [[7, 8, 9], [7, 8, 9]]
        with pytest.raises(TypeError, match="can't convert cuda:1 device type tensor to numpy"):
            table.numpy()


def test_random_cuda_ops_leave_the_cpu_generator_alone() -> None:
    """As on a GPU: values of a CUDA random op come from that device's generator, not the CPU's."""
    with fake_cuda_node(local_rank=1):
        torch.cuda.manual_seed_all(3)
        cpu_state = torch.get_rng_state()
        first = torch.randn(4, device=CUDA1).tolist()
        assert torch.equal(torch.get_rng_state(), cpu_state)
        torch.cuda.manual_seed_all(3)
        assert torch.randn(4, device=CUDA1).tolist() == first


def test_the_node_leaves_no_trace() -> None:
    before = (torch.cuda.is_available(), os.environ.get("LOCAL_RANK"), dict(vars(torch.Tensor)))
    with fake_cuda_node(local_rank=1):
        pass
    assert not dist.is_initialized()
    assert (torch.cuda.is_available(), os.environ.get("LOCAL_RANK"), dict(vars(torch.Tensor))) == before
    assert not isinstance(torch.ones(1), torch._subclasses.fake_tensor.FakeTensor)
