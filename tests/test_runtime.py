"""dsp_plugin.backend picks the backend and device for every launch and bench: the choice, on CPU.

CUDA's presence is injected (``cuda_available``, ``device_count``), not mocked; the gloo path
then initializes a real process group through ``init_distributed``.
"""

from __future__ import annotations

import pytest
import torch

from dsp_plugin import backend as runtime
from dsp_plugin.backend import Runtime, choose


def test_cuda_present_gives_nccl_on_the_local_gpu():
    assert choose(local_rank=3, cuda_available=True, device_count=8, env={}) == Runtime("nccl", torch.device("cuda", 3))
    assert choose(cuda_available=True, device_count=8, env={"LOCAL_RANK": "5"}).device == torch.device("cuda", 5)
    assert choose(cuda_available=True, device_count=1, env={}).device == torch.device("cuda", 0)


def test_no_cuda_gives_gloo_on_the_cpu():
    assert choose(cuda_available=False, env={"LOCAL_RANK": "3"}) == Runtime("gloo", torch.device("cpu"))


def test_env_forces_the_cpu_or_insists_on_gpus():
    assert choose(cuda_available=True, device_count=8, env={"DSP_BACKEND": "gloo"}).backend == "gloo"
    assert choose(cuda_available=True, device_count=8, env={"DSP_BACKEND": "NCCL"}).backend == "nccl"
    with pytest.raises(ValueError, match="DSP_BACKEND=nccl: NCCL needs CUDA"):
        choose(cuda_available=False, env={"DSP_BACKEND": "nccl"})
    with pytest.raises(ValueError, match=r"DSP_BACKEND='mpi': expected one of auto, nccl, gloo"):
        choose(cuda_available=True, env={"DSP_BACKEND": "mpi"})


def test_more_processes_than_gpus_is_refused_with_the_counts():
    with pytest.raises(ValueError, match=r"LOCAL_RANK=4: this node has 4 GPU\(s\) \(cuda:0..3\)"):
        choose(cuda_available=True, device_count=4, env={"LOCAL_RANK": "4"})


def test_this_machine_uses_what_it_has():
    rt = choose(env={})
    assert rt.backend == ("nccl" if torch.cuda.is_available() else "gloo")


def test_init_distributed_on_cpu(tmp_path, monkeypatch):
    import torch.distributed as dist

    if torch.cuda.is_available():
        monkeypatch.setenv("DSP_BACKEND", "gloo")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    rt = runtime.init_distributed(store=store, rank=0, world_size=1)
    try:
        assert rt == Runtime("gloo", torch.device("cpu"))
        assert dist.get_backend() == "gloo" and runtime.current_device() == torch.device("cpu")
    finally:
        dist.destroy_process_group()
