"""Megatron DSP dropout under torch.compile (issue 28): the hidden dropout traced, the attention dropout outside.

``dsp_plugin.megatron.dropout``: eagerly each DSP shard draws its mask from a generator seeded by one CPU draw
mixed with its rank (``rank_rng``); a graph can do neither (``.item()`` and ``manual_seed`` break it). Under
compile ``sharded_dropout`` draws a counter-based mask (``hashed_keep``) from the same CPU draw as a traced
tensor, and the attention's dropout (inside SDPA's kernel) runs outside the graph (``rank_dropout_attention``).

Checked here: the hash keeps ``1 - p`` of the elements, differs per seed and repeats for one seed, and
Inductor's generated code computes it bit for bit as eager torch does (int64 products wrap alike);
``sharded_dropout`` compiles with ``fullgraph=True`` (no break) and reads no value on the host, its masks
differ per salt and repeat when the CPU generator is restored (what Megatron's activation checkpoints do before
a recompute), its gradient is the mask over ``1 - p``; and the Megatron layers of ``test_compile_megatron.py``
compiled in training with hidden and attention dropout 0.1 break only around the attention's dropout.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.test_compile_models import HostSyncs

P = 0.1


def test_hashed_keep_keeps_one_minus_p_per_seed() -> None:
    from dsp_plugin.megatron.dropout import hashed_keep

    shape = (64, 8, 400)   # 204,800 elements: the kept share is 0.9 within 0.0020 at 3 standard deviations
    a, b = (hashed_keep(shape, P, torch.tensor(s, dtype=torch.int64)) for s in (12345, 12346))
    assert a.shape == shape and a.dtype == torch.bool
    for mask in (a, b):
        assert abs(mask.float().mean().item() - (1 - P)) < 0.002, mask.float().mean()
    # independent masks agree where both keep or both drop: 0.9^2 + 0.1^2 = 0.82
    assert abs((a == b).float().mean().item() - 0.82) < 0.004
    assert torch.equal(a, hashed_keep(shape, P, torch.tensor(12345, dtype=torch.int64)))
    assert hashed_keep(shape, 0.0, torch.tensor(7)).all() and not hashed_keep(shape, 1.0, torch.tensor(7)).any()


def test_hashed_keep_compiled_by_inductor_is_eagers_bit_for_bit() -> None:
    import torch._dynamo as dynamo

    from dsp_plugin.megatron.dropout import hashed_keep

    dynamo.reset()
    seed = torch.tensor(-3_141_592_653_589_793, dtype=torch.int64)   # products of every size wrap
    compiled = torch.compile(lambda s: hashed_keep((7, 333), P, s), backend="inductor", fullgraph=True)
    assert torch.equal(compiled(seed), hashed_keep((7, 333), P, seed))


def test_sharded_dropout_compiles_without_break_or_host_read() -> None:
    import torch._dynamo as dynamo

    from dsp_plugin.megatron.dropout import sharded_dropout

    dynamo.reset()
    fn = torch.compile(lambda x, salt: sharded_dropout(x, P, True, salt=salt), backend="aot_eager", fullgraph=True)
    x = torch.randn(12, 2, 40).abs() + 1   # no zero: a zero in the output is a dropped element
    torch.manual_seed(5)
    state = torch.get_rng_state()
    xg = x.clone().requires_grad_(True)
    with HostSyncs() as syncs:
        out0 = fn(xg, (0,))
    out0.sum().backward()
    out1 = fn(x, (1,))
    torch.set_rng_state(state)          # what Megatron's checkpoint restores before a recompute
    again = fn(x, (0,))
    assert syncs.count == 0
    keep0, keep1 = out0 != 0, out1 != 0
    assert torch.equal(again, out0.detach())                                   # the recompute's mask
    assert not torch.equal(keep0, keep1)                                       # another shard, another mask
    assert torch.allclose(out0[keep0], x[keep0] / (1 - P))
    assert torch.allclose(xg.grad, keep0.float() / (1 - P))
    assert abs(keep0.float().mean().item() - (1 - P)) < 0.05
    assert torch.equal(sharded_dropout(x, P, False, salt=(0,)), x)             # eval: the input itself


def _layers_worker(rank: int, n: int) -> dict[str, object]:
    import torch._dynamo as dynamo
    from megatron.core import parallel_state as ps
    from torch._dynamo.backends.debugging import ExplainWithBackend

    from dsp_plugin.megatron.core_attention import SDPACoreAttention
    from dsp_plugin.megatron.dsp_layer import attach_video_grid
    from dsp_plugin.topology import set_topology
    from tests.megatron_compositions import tiny_compile_model
    from tests.test_compile_megatron import _reason

    torch.set_num_threads(1)
    model, video, (latents, timestep, text), _ = tiny_compile_model(n)
    inputs = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, k: inputs.append((m, k)), with_kwargs=True)
             for layer in model.decoder.layers]
    model(latents, timestep, text)   # eager: the first call's cross-rank checks, and each layer's inputs
    for hook in hooks:
        hook.remove()
    results = {}
    try:
        model.train()
        for layer, kwargs in inputs:
            if layer.layer_number not in (2, 3):   # the full layer (head switch) and the temporal one (switch)
                continue
            layer.hidden_dropout = P
            for module in layer.self_attention.modules():   # layer 2's is inside the head switch's wrapper
                if isinstance(module, SDPACoreAttention):
                    module.dropout_p = P
            hidden = kwargs["hidden_states"].detach()
            rest = {k: kwargs[k] for k in ("attention_mask", "context", "context_mask", "rotary_pos_emb")}

            def step(m: torch.nn.Module, layer: torch.nn.Module = layer, hidden: torch.Tensor = hidden,
                     rest: dict = rest) -> None:
                x = attach_video_grid(hidden.clone().requires_grad_(True), (video.frames, video.patches),
                                      layer.input_shard_dim)
                out = m(x, **{k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in rest.items()})[0]
                out.square().mean().backward()

            dynamo.reset()
            explain = ExplainWithBackend("aot_eager")
            compiled = torch.compile(layer, backend=explain)
            with dynamo.config.patch(ignore_logging_functions={warnings.warn}):
                step(compiled)
                traced = len(explain.graphs)
                with HostSyncs() as syncs:
                    step(compiled)
            explained = explain.output()
            results[layer.layer_number] = {
                "graphs": len([g for g in explained.graphs if len(g.graph.nodes)]),
                "reasons": [_reason(b) for b in explained.break_reasons], "recompiled": len(explain.graphs) - traced,
                "host_reads": syncs.count,
                # the CPU draws of sharded_dropout's traced seeds, one per hidden dropout, inside the graphs
                "draws": sum("randint" in str(node.target) for g in explained.graphs for node in g.graph.nodes)}
    finally:
        ps.destroy_model_parallel()
        set_topology(None)
    return results


@pytest.mark.slow
def test_compiled_megatron_layers_with_dropout_break_only_around_the_attention() -> None:
    pytest.importorskip("megatron.core")
    from tests.distributed import run_distributed

    for rank, result in enumerate(run_distributed(_layers_worker, 2, timeout=600)):
        for number, d in result.items():
            print(f"rank {rank} layer {number}: graphs {d['graphs']}, reasons {d['reasons']}, host reads "
                  f"{d['host_reads']}, recompiled {d['recompiled']}, traced seed draws {d['draws']}")
            ours = [r for r in d["reasons"] if r["ours"]]
            # the breaks in dsp_plugin are the attention's dropout, run outside the graph; the hidden dropout
            # (sharded_dropout) adds none
            assert ours and all(r["where"].endswith(" forward") and "core_attention.py" in r["where"]
                                for r in ours), d
            assert d["recompiled"] == 0, d
            # the CPU draw of rank_rng (one .item() of a CPU tensor, no device sync) per attention with dropout
            assert d["host_reads"] == 1, d
            assert d["draws"] == 3, d   # the hidden dropouts after self-attention, cross-attention and the MLP
