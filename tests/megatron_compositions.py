"""Shared worker for the Megatron composition tests: train a few steps per layout, return losses and grads.

One spawn of 4 gloo ranks runs several layouts one after the other
(``initialize_model_parallel`` / ``destroy_model_parallel`` between them),
because starting processes that import megatron is the dominant cost on CI.
Everything that runs is real megatron-core: parallel_state, TransformerLayers,
DDP, the pipeline schedules and ``finalize_model_grads``.
"""

from __future__ import annotations

from typing import Any

import torch

from dsp_plugin.accounting import CommAccounting
from dsp_plugin.megatron.model import VideoShape

#: Latent geometry: T=6 and S=2*3=6 split unevenly over 4 DSP ranks (2,2,1,1) and evenly over 2.
VIDEO = VideoShape(channels=4, frames=6, height=2, width=3)
GLOBAL_BATCH = 2
SEED = 1234

#: name -> (tp, dsp, pp, micro_batch_size, num_microbatches, megatron sequence_parallel), on 4 ranks
COMPOSITIONS: dict[str, tuple[int, int, int, int, int, bool]] = {
    "DSP=4": (1, 4, 1, 2, 1, False),
    "DSP=2 x DP=2": (1, 2, 1, 1, 1, False),
    "TP=2 x DSP=2": (2, 2, 1, 2, 1, False),
    "PP=2 x DSP=2": (1, 2, 2, 1, 2, False),
    "TP=2 x DSP=2 + Megatron-SP": (2, 2, 1, 2, 1, True),
}
#: the same on 2 ranks: DSP alone, no data parallelism
TWO_RANK_COMPOSITIONS: dict[str, tuple[int, int, int, int, int, bool]] = {
    "DSP=2": (1, 2, 1, 2, 1, False),
}
REFERENCE = (1, 1, 1, GLOBAL_BATCH, 1, False)


def tiny_config(tp: int, pp: int, sequence_parallel: bool) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=4, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sequence_parallel,
        context_parallel_size=1, pipeline_dtype=torch.float32, params_dtype=torch.float32,
        variable_seq_lengths=pp > 1, moe_token_dispatcher_type="alltoall",  # required by variable lengths
        use_cpu_initialization=True, perform_initialization=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0, deallocate_pipeline_outputs=True)


def parse_error(argv: list[str], world_size: int) -> str:
    """Megatron's argument parsing with the DSP provider on this rank; the error it raises, or ''."""
    import os
    import sys

    from megatron.training.arguments import parse_args

    from dsp_plugin.megatron.arguments import add_dsp_arguments

    saved_argv, saved_world = sys.argv, os.environ.get("WORLD_SIZE")
    sys.argv, os.environ["WORLD_SIZE"] = ["pretrain_stdit.py", *argv], str(world_size)
    try:
        parse_args(extra_args_provider=add_dsp_arguments)
    except ValueError as exc:
        return str(exc)
    finally:
        sys.argv = saved_argv
        if saved_world is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved_world
    return ""


def run_layouts(rank: int, world_size: int, layouts: list[tuple[int, int, int, int, int, bool]],
                steps: int, bad_argv: list[str] | None = None) -> list[dict[str, Any]]:
    """For each layout: ``{"losses": [...], "grads": [{global_name: (tp_rank, dim, grad)}] per step}``.

    With ``bad_argv`` every rank first parses those arguments; the error is stored
    under ``"bad_args_error"`` of each layout's result (no rank may wait on another).
    """
    bad_args_error = parse_error(bad_argv, world_size) if bad_argv is not None else None
    from megatron.core import parallel_state as ps
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    from dsp_plugin.megatron.cpu import install_cuda_shim, train_step, wrap_ddp
    from dsp_plugin.megatron.groups import initialize_dsp_model_parallel
    from dsp_plugin.megatron.steps import SyntheticVideoDataset, build_model
    from dsp_plugin.megatron.weights import global_parameter_name
    from dsp_plugin.topology import set_topology

    install_cuda_shim()
    out = []
    for tp, dsp, pp, mbs, num_mb, seq_par in layouts:
        initialize_dsp_model_parallel(tp=tp, dsp=dsp, pp=pp, timeout_minutes=2)
        try:
            config = tiny_config(tp, pp, seq_par)
            model = build_model(config, VIDEO, pre_process=ps.is_pipeline_first_stage(),
                                post_process=ps.is_pipeline_last_stage(), seed=SEED)
            ddp = wrap_ddp(model, config)
            optimizer = torch.optim.SGD(ddp.module.parameters(), lr=0.1)
            dataset = SyntheticVideoDataset(VIDEO, GLOBAL_BATCH * steps, seed=SEED)
            sampler = MegatronPretrainingSampler(
                total_samples=len(dataset), consumed_samples=0, micro_batch_size=mbs,
                data_parallel_rank=ps.get_data_parallel_rank(),
                data_parallel_size=ps.get_data_parallel_world_size())
            batches = iter(torch.utils.data.DataLoader(dataset, batch_sampler=sampler))
            losses, grads = [], []
            tp_rank = ps.get_tensor_model_parallel_rank()
            switches = None
            for step in range(steps):
                with CommAccounting(activations=False) as acct:
                    losses.append(train_step([ddp], batches, optimizer, num_microbatches=num_mb,
                                             micro_batch_size=mbs, seq_length=VIDEO.tokens))
                if step == 0:  # DSP all-to-alls of one step on this rank: (forward, backward)
                    switches = tuple(sum(1 for r in acct.select(op="all_to_all", phase=phase)
                                         if r.group_size == dsp) for phase in ("forward", "backward"))
                grads.append({
                    global_parameter_name(name, model.layer_offset): (
                        tp_rank, getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False)
                        else None, p.main_grad.detach().numpy().copy())  # numpy: pickled by value
                    for name, p in model.named_parameters()})
            out.append({"losses": losses, "grads": grads, "tp_rank": tp_rank, "switches": switches,
                        "stage_layers": len(model.layers), "first_stage": model.pre_process,
                        "bad_args_error": bad_args_error})
        finally:
            ps.destroy_model_parallel()
            set_topology(None)
    return out


def assemble(per_rank: list[dict[str, Any]], step: int) -> dict[str, torch.Tensor]:
    """Full gradients of one step: TP chunks concatenated; replicas across DSP/DP/TP must agree exactly-ish."""
    by_name: dict[str, dict[int, list[tuple[int | None, torch.Tensor]]]] = {}
    for result in per_rank:
        for name, (tp_rank, dim, grad) in result["grads"][step].items():
            grad = torch.from_numpy(grad)
            by_name.setdefault(name, {}).setdefault(tp_rank, []).append((dim, grad))
    full = {}
    for name, chunks in by_name.items():
        for replicas in chunks.values():
            for _, grad in replicas[1:]:
                torch.testing.assert_close(grad, replicas[0][1], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name: f"replicas of {n} disagree: {m}")
        dim = next(iter(chunks.values()))[0][0]
        if dim is None:
            full[name] = next(iter(chunks.values()))[0][1]
        else:
            full[name] = torch.cat([chunks[r][0][1] for r in sorted(chunks)], dim=dim)
    return full


def global_losses(per_rank: list[dict[str, Any]]) -> list[float]:
    """Per step: sum of reported values / sum of counts over all last-stage ranks.

    What ``megatron.training``'s train_step logs (it all-reduces the pairs over DP x CP);
    TP replicas double both sums alike, so they need no special care.
    """
    out = []
    for step in range(len(per_rank[0]["losses"])):
        pairs = [r["losses"][step] for r in per_rank if r["losses"][step] is not None]
        if not pairs:
            raise AssertionError(f"no rank reported a loss at step {step}")
        out.append(sum(v for v, _ in pairs) / sum(c for _, c in pairs))
    return out


def max_differences(reference: list[dict[str, Any]], per_rank: list[dict[str, Any]]) -> tuple[float, float]:
    """(max |loss - reference loss|, max |grad - reference grad|) over all steps and parameters."""
    ref_losses = global_losses(reference)
    loss_diff = 0.0
    for mine, ref in zip(global_losses(per_rank), ref_losses, strict=True):
        loss_diff = max(loss_diff, abs(mine - ref))
    grad_diff = 0.0
    for step in range(len(ref_losses)):
        ref = assemble(reference, step)
        got = assemble(per_rank, step)
        if set(ref) != set(got):
            raise AssertionError(f"parameter sets differ: {sorted(set(ref) ^ set(got))}")
        for name in ref:
            grad_diff = max(grad_diff, (got[name] - ref[name]).abs().max().item())
    return loss_diff, grad_diff
