"""dsp_plugin.steplog: the lines the DeepSpeed and Megatron launches print after step 1, on 2 gloo ranks."""

from __future__ import annotations

from tests.distributed import run_distributed


def _step(rank: int, world: int) -> list[str]:
    import torch

    from dsp_plugin import Topology, dynamic_switch, gather, set_topology, split
    from dsp_plugin.steplog import log_first_call

    set_topology(Topology.build(dsp=world))
    lines: list[str] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        y = gather(dynamic_switch(split(x, tgt_shard=1), cur_shard=1, tgt_shard=2), cur_shard=2)
        y.sum().backward()
        return y

    logged = log_first_call(step, log=lines.append)
    x = torch.randn(2, 4, 6, 8, requires_grad=True)
    logged(x)
    logged(x)          # not counted, not logged
    return lines


def test_first_step_is_logged_once_with_groups_switches_and_bytes():
    lines = run_distributed(_step, 2, world_topology=False)[0]
    assert lines[0] == "DSP: tp(1) x dsp(2) x dp(1) x pp(1) = 2; rank 0 at tp=0 dsp=0 dp=0 pp=0; DSP groups [[0, 1]]"
    # a [2, 2, 6, 8] fp32 shard is 768 bytes; a switch sends half of it (384 B) to the peer, once each way
    assert lines[1] == ("DSP step traffic (this rank): 1 all-to-alls forward, 1 backward, 0.8 KiB sent, "
                        "0.4 KiB per forward switch")
    assert any("all_gather" in line for line in lines[2:]), lines
    assert len([line for line in lines if line.startswith("DSP:")]) == 1
