"""Worker for ``tests/test_megatron_example.py``: run the "Your own model" block of docs/megatron.md."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[1] / "docs" / "megatron.md"


def example_source() -> str:
    """The python block after ``<!-- example: own-model -->`` in docs/megatron.md."""
    match = re.search(r"<!-- example: own-model -->\s*```python\n(.*?)```", DOC.read_text(), re.S)
    if match is None:
        raise AssertionError(f"{DOC}: no python block after '<!-- example: own-model -->'")
    return match.group(1)


def run_example(rank: int, world_size: int, dsp_sizes: list[int]) -> list[dict[str, Any]]:
    """Execute the example at each DSP size; adaLN weights are drawn non-zero between building and running
    (adaLN-Zero would make every gated branch vanish and the comparison trivial)."""
    import torch
    from megatron.core import parallel_state as ps

    from dsp_plugin.comm import sharded_calls
    from dsp_plugin.megatron.cpu import install_cuda_shim
    from dsp_plugin.megatron.groups import initialize_dsp_model_parallel
    from dsp_plugin.topology import set_topology

    install_cuda_shim()
    source = example_source()
    build, run = source.split("\nvideo = ", 1)
    out = []
    for dsp in dsp_sizes:
        initialize_dsp_model_parallel(dsp=dsp, timeout_minutes=2)
        try:
            torch.manual_seed(0)
            scope: dict[str, Any] = {}
            exec(compile(build, str(DOC), "exec"), scope)  # noqa: S102 - the documented example itself
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for layer in scope["block"].layers:
                    layer.adaln_modulation.weight.copy_(0.1 * torch.randn(layer.adaln_modulation.weight.shape,
                                                                          generator=gen))
            torch.manual_seed(2)
            calls = sharded_calls()
            exec(compile("video = " + run, str(DOC), "exec"), scope)  # noqa: S102
            calls = sharded_calls() - calls
            rope_error = ""
            try:
                scope["block"](hidden_states=scope["split_video_tokens"](scope["video"], scope["config"]),
                               attention_mask=scope["timestep_embedding"], context=scope["text"],
                               rotary_pos_emb=torch.zeros(6, 1, 1, 8))
            except ValueError as exc:  # a rotary table, but the config does not say RoPE
                rope_error = str(exc)
            out.append({"out": scope["out"].detach().numpy().copy(),
                        "video_grad": scope["video"].grad.numpy().copy(), "rope_error": rope_error,
                        "sharded_calls": calls})
        finally:
            ps.destroy_model_parallel()
            set_topology(None)
    return out


def dropout_case(rank: int, world_size: int) -> dict[str, Any]:
    """DSP=2 over the world with dropout 0.5: the hidden-dropout mask each shard draws, and a 2-layer block's
    parameter gradients without and with full recompute (the same draws: the checkpoint restores the CPU
    generator the masks are seeded from), with the eval-mode output difference (dropout is on)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import TransformerBlock

    from dsp_plugin.megatron import DSPTransformerConfig, dsp_layer_spec, split_video_tokens
    from dsp_plugin.megatron.cpu import install_cuda_shim
    from dsp_plugin.megatron.groups import initialize_dsp_model_parallel
    from dsp_plugin.topology import set_topology

    install_cuda_shim()
    initialize_dsp_model_parallel(dsp=2, timeout_minutes=2)
    try:
        blocks = []
        for recompute in ({}, {"recompute_granularity": "full", "recompute_method": "uniform",
                              "recompute_num_layers": 1}):
            config = DSPTransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4,
                                          use_cpu_initialization=True, hidden_dropout=0.5, attention_dropout=0.5,
                                          **recompute)
            torch.manual_seed(0)
            blocks.append(TransformerBlock(config, dsp_layer_spec("local"), post_layer_norm=False))
        blocks[1].load_state_dict(blocks[0].state_dict())
        torch.manual_seed(3)  # the same CPU generator on both ranks
        mask = blocks[0].layers[0]._bias_dropout(torch.ones(6, 2, 16), None)
        q, k, v = (torch.randn(5, 2, 4, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
        attention = blocks[0].layers[0].self_attention.core_attention(q, k, v, None)  # the same q, k, v on both
        gen = torch.Generator().manual_seed(1)
        video = torch.randn(2, 4, 6, 16, generator=gen).requires_grad_()  # the reentrant checkpoint needs a grad
        cond, text = torch.randn(2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
        grads, outs = [], []
        for block in blocks:
            torch.manual_seed(4)
            out = block(hidden_states=split_video_tokens(video, config), attention_mask=cond, context=text)
            out.square().mean().backward()
            outs.append(out.detach())
            grads.append({n: p.grad.numpy().copy() for n, p in block.named_parameters()})
        blocks[0].eval()
        with torch.no_grad():
            plain = blocks[0](hidden_states=split_video_tokens(video, config), attention_mask=cond, context=text)
        return {"mask": mask.numpy().copy(), "attention": attention.numpy().copy(), "grads": grads,
                "dropout_changes_output": (outs[0] - plain).abs().max().item(),
                "recompute_output_diff": (outs[0] - outs[1]).abs().max().item()}
    finally:
        ps.destroy_model_parallel()
        set_topology(None)


def example_and_dropout(rank: int, world_size: int, dsp_sizes: list[int]) -> tuple[list[dict[str, Any]], dict]:
    """One 2-rank spawn for both (importing megatron dominates the cost)."""
    return run_example(rank, world_size, dsp_sizes), dropout_case(rank, world_size)
