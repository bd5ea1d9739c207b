"""Shared worker for the Megatron composition tests, and the plain-torch oracle they are checked against.

The oracle (:func:`reference_run`) is ``dsp_plugin.models.stdit.STDiT`` trained with
torch SGD on the whole global batch in one process: no megatron-core, no
collective, no code shared with the system under test except the weights it is
drawn with. Each Megatron layout (:func:`run_layouts`) loads those weights
(``load_reference_weights``) and trains the same steps through real megatron-core:
parallel_state with DSP in the CP slot, a stock ``TransformerBlock`` of DSP layers,
DDP over DP x CP, the pipeline schedules, ``finalize_model_grads``.

One spawn runs several layouts one after the other (``initialize_model_parallel`` /
``destroy_model_parallel`` between them), because starting processes that import
megatron is the dominant cost on CI.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dsp_plugin.accounting import CommAccounting
from dsp_plugin.megatron.model import VideoShape

#: Latent geometry: T=6 and S=2*3=6 split unevenly over 4 DSP ranks (2,2,1,1) and evenly over 2.
VIDEO = VideoShape(channels=4, frames=6, height=2, width=3)
TEXT_DIM, TEXT_LEN = 8, 3
GLOBAL_BATCH = 2
SEED = 1234
LR = 0.1

#: Recompute: False (none); full recompute: True (``uniform``, 1 layer per chunk), ``(recompute_method,
#: recompute_num_layers)``, or ``"distributed"`` (``uniform`` 1 with ``--distribute-saved-activations``: the
#: checkpoint keeps 1/TP of its input); ``"selective"`` (``--recompute-granularity selective``, ``core_attn``).
Recompute = bool | str | tuple[str, int]
#: name -> (tp, dsp, pp, micro_batch_size, num_microbatches, recompute), on 4 ranks
COMPOSITIONS: dict[str, tuple[int, int, int, int, int, Recompute]] = {
    "DSP=4": (1, 4, 1, 2, 1, False),
    "DSP=2 x DP=2": (1, 2, 1, 1, 1, False),
    "TP=2 x DSP=2": (2, 2, 1, 2, 1, False),
    "PP=2 x DSP=2": (1, 2, 2, 1, 2, False),
    "PP=2 x DSP=2 + full recompute": (1, 2, 2, 1, 2, True),
    "TP=2 x DSP=2 + full recompute, distributed saved activations": (2, 2, 1, 2, 1, "distributed"),
}
#: OpenSora 1.2's features (the "paper" variant): RoPE (temporal and 2-D spatial), qk-layernorm,
#: adaLN-single, captions of varying length; "paper+buckets" also changes (frames, height, width) every
#: step: T = 6, 4, 5 and S = 6, 6, 4 split unevenly over 4 DSP ranks
VARIANTS = ("plain", "paper", "paper+buckets", "mixed", "mixed+rope")
#: "mixed": layer kinds (spatial, full, temporal, full): the full layer 2 runs on the T shard the spatial layer
#: leaves, the full layer 4 on the S shard after the temporal layer's switch; "mixed+rope" adds RoPE (temporal
#: in the temporal layer, 3-D in the full layers) with hidden 32 (head dim 8: 2 + 1 + 1 rotated pairs)
MIXED_PATTERN = ("spatial", "full", "temporal", "full")
BUCKETS = ((6, 2, 3), (4, 3, 2), (5, 2, 2))
#: the paper variant's layouts: 2 ranks, then 4 ranks
PAPER_TWO_RANK = {"DSP=2": (1, 2, 1, 2, 1, False), "DSP=2 + full recompute": (1, 2, 1, 2, 1, True)}
PAPER_FOUR_RANK = {
    "DSP=4": (1, 4, 1, 2, 1, False),
    "TP=2 x DSP=2": (2, 2, 1, 2, 1, False),
    "PP=2 x DSP=2": (1, 2, 2, 1, 2, False),
    "PP=2 x DSP=2 + full recompute": (1, 2, 2, 1, 2, True),
}
#: on 2 ranks: DSP alone, without and with full recompute: uniform with 1 and 2 layers per chunk, and block
#: (the first 2 layers checkpointed one by one); the 4 layers' switches: layers 2, 3, 4 (1-based)
TWO_RANK_COMPOSITIONS: dict[str, tuple[int, int, int, int, int, Recompute]] = {
    "DSP=2": (1, 2, 1, 2, 1, False),
    "DSP=2 + full recompute": (1, 2, 1, 2, 1, True),
    "DSP=2 + full recompute uniform 2": (1, 2, 1, 2, 1, ("uniform", 2)),
    "DSP=2 + full recompute block 2": (1, 2, 1, 2, 1, ("block", 2)),
}


def tiny_config(tp: int, pp: int, *, recompute: Recompute = False, dtype: str = "fp32",
                variant: str = "plain", comm_dtype: str | None = None) -> Any:
    from dsp_plugin.megatron.steps import dsp_config, gelu_tanh

    method, layers = recompute if isinstance(recompute, tuple) else ("uniform", 1)
    recompute_args = dict(recompute_granularity="full", recompute_method=method,
                          recompute_num_layers=layers) if recompute else {}
    if recompute == "selective":
        recompute_args = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif recompute == "distributed":
        recompute_args["distribute_saved_activations"] = True
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r} is not one of {VARIANTS}")
    if variant.startswith("paper"):  # --position-embedding-type rope --spatial-rope --qk-layernorm --adaln-single
        recompute_args |= dict(position_embedding_type="rope", dsp_spatial_rope=True, qk_layernorm=True,
                               dsp_adaln_single=True)
    if variant.startswith("mixed"):
        recompute_args["dsp_attend_pattern"] = MIXED_PATTERN
    if variant == "mixed+rope":
        recompute_args["position_embedding_type"] = "rope"
    return dsp_config(
        VIDEO, num_layers=4, hidden_size=32 if variant == "mixed+rope" else 16, num_attention_heads=4,
        ffn_hidden_size=32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=1,
        pipeline_dtype=half or torch.float32, params_dtype=torch.float32, bf16=dtype == "bf16", fp16=dtype == "fp16",
        variable_seq_lengths=pp > 1, moe_token_dispatcher_type="alltoall",  # required by variable lengths
        use_cpu_initialization=True, perform_initialization=False, layernorm_epsilon=1e-6,
        activation_func=gelu_tanh, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        deallocate_pipeline_outputs=True, dsp_comm_dtype=comm_dtype, **recompute_args)


def tiny_compile_model(n: int, *, recompute: Recompute = False, clone_grads: bool = False) -> tuple:
    """The torch.compile tests' model on this rank of ``n`` DSP ranks: ``(model, video, (latents, timestep, text),
    step)``. ``tiny_config``'s mixed pattern (``recompute``: its option) on T = 5 frames (uneven on 2 ranks),
    S = 2 x 3, batch 2, built under ``cuda_shim`` (the forward runs without it); ``step(m)`` runs ``m`` (the
    model, or a compiled one) forward and ``out.square().mean().backward()`` from zeroed gradients and returns
    ``(out, latents' grad, [the model's parameter grads])`` (``clone_grads``: copies)."""
    from dsp_plugin.megatron.cpu import cuda_shim
    from dsp_plugin.megatron.groups import initialize_dsp_model_parallel
    from dsp_plugin.megatron.steps import build_model

    video = VideoShape(channels=4, frames=5, height=2, width=3)
    with cuda_shim():  # megatron-core's CUDA queries while it builds
        initialize_dsp_model_parallel(dsp=n, timeout_minutes=2)
        model = build_model(tiny_config(1, 1, variant="mixed", recompute=recompute), video, text_dim=TEXT_DIM,
                            text_len=TEXT_LEN, seed=1)
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(2, video.channels, video.frames, video.height, video.width, generator=gen)
    timestep, text = torch.tensor([3.0, 7.0]), torch.randn(2, TEXT_LEN, TEXT_DIM, generator=gen)

    def step(m: torch.nn.Module) -> tuple:
        for p in model.parameters():
            p.grad = None
        x = latents.clone().requires_grad_(True)
        out = m(x, timestep, text)
        out.square().mean().backward()
        return out.detach(), x.grad, [p.grad.clone() if clone_grads else p.grad for p in model.parameters()]

    return model, video, (latents, timestep, text), step


def dataset(steps: int, variant: str = "plain") -> Any:
    from dsp_plugin.megatron.steps import SyntheticVideoDataset

    return SyntheticVideoDataset(VIDEO, GLOBAL_BATCH * steps, seed=SEED, text_dim=TEXT_DIM, text_len=TEXT_LEN,
                                 varying_captions=variant.startswith("paper"),
                                 buckets=BUCKETS if variant == "paper+buckets" else (), bucket_size=GLOBAL_BATCH)


def reference_run(steps: int, variant: str = "plain",
                  oracle: Callable[[Any], torch.nn.Module] | None = None) -> dict[str, Any]:
    """The plain-torch oracle: losses, Megatron-named full gradients and outputs ``[B, T, S, C]`` per step.

    ``oracle(config)``: the reference model for the variant's config (default: ``STDiT``, spatial and temporal
    blocks alternating), before its weights are loaded."""
    from dsp_plugin.megatron.steps import reference_weights
    from dsp_plugin.megatron.weights import megatron_names, reference_config
    from dsp_plugin.models.stdit import STDiT

    config = tiny_config(1, 1, variant=variant)
    model = oracle(config) if oracle else STDiT(reference_config(config, VIDEO.channels, TEXT_DIM))
    model.load_state_dict(reference_weights(config, VIDEO, TEXT_DIM, SEED))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = dataset(steps, variant)
    losses, grads, outputs = [], [], []
    for step in range(steps):
        batch = torch.utils.data.default_collate([data[step * GLOBAL_BATCH + i] for i in range(GLOBAL_BATCH)])
        optimizer.zero_grad()
        output = model(batch["latents"], batch["timestep"], batch["text"], batch.get("text_mask"))
        loss = torch.nn.functional.mse_loss(output, batch["target"])
        loss.backward()
        losses.append(loss.item())
        grads.append(megatron_names({n: p.grad.clone() for n, p in model.named_parameters()},
                                    config.num_attention_heads))
        batch_size, channels, frames, height, width = output.shape
        outputs.append(output.detach().permute(0, 2, 3, 4, 1).reshape(batch_size, frames, height * width, channels))
        optimizer.step()
    return {"losses": losses, "grads": grads, "outputs": outputs}


def parse_error(argv: list[str], world_size: int, *, launch: bool = False) -> str:
    """Megatron's argument parsing with the DSP provider (``launch``: and the launch's model options,
    as ``dsp_plugin/launch/pretrain_stdit.py``) on this rank; the error it raises, or ''."""
    import os
    import sys

    from megatron.training.arguments import parse_args

    from dsp_plugin.megatron.arguments import add_dsp_arguments

    saved_argv, saved_world = sys.argv, os.environ.get("WORLD_SIZE")
    sys.argv, os.environ["WORLD_SIZE"] = ["pretrain_stdit.py", *argv], str(world_size)
    try:
        if launch:
            from dsp_plugin.megatron.steps import add_model_arguments

            parse_args(extra_args_provider=lambda parser: add_model_arguments(add_dsp_arguments(parser)))
        else:
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


def _record_outputs(model: Any, sink: list) -> Any:
    """Forward hook on the last stage: each micro-batch's local output (gathered over DSP later, outside
    the step's collective accounting), with its DP rank."""
    from megatron.core import parallel_state as ps

    from dsp_plugin.megatron.config import output_shard_dim

    def hook(module: Any, args: tuple, output: torch.Tensor) -> None:
        if module.post_process and module.training:
            frames, height, width = args[0].shape[2:]
            shard = output_shard_dim(module.config, module.config.num_layers)
            sink.append((ps.get_data_parallel_rank(), output.detach().clone(), shard,
                         frames if shard == 1 else height * width))

    return model.register_forward_hook(hook)


def _gathered(sink: list) -> list:
    from megatron.core import parallel_state as ps

    from dsp_plugin.comm import gather

    return [(dp_rank, gather(out, shard, group=ps.get_context_parallel_group(), global_len=full).numpy().copy())
            for dp_rank, out, shard, full in sink]


def run_layouts(rank: int, world_size: int, layouts: list[tuple[int, int, int, int, int, Recompute]],
                steps: int, bad_argv: list[str] | None = None, variant: str = "plain") -> list[dict[str, Any]]:
    """For each layout: ``{"losses": [(value, count) | None], "grads": [{global_name: (tp_rank, dim, grad)}],
    "outputs": [[(dp_rank, full output of one micro-batch)]]}`` plus the collectives of step 0 on this rank.

    With ``bad_argv`` every rank first parses those arguments; the error is stored
    under ``"bad_args_error"`` of each layout's result (no rank may wait on another).
    """
    bad_args_error = parse_error(bad_argv, world_size) if bad_argv is not None else None
    from megatron.core import parallel_state as ps
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    from dsp_plugin.megatron.cpu import install_cuda_shim, train_step, wrap_ddp
    from dsp_plugin.megatron.groups import initialize_dsp_model_parallel
    from dsp_plugin.megatron.steps import build_model
    from dsp_plugin.megatron.weights import global_parameter_name
    from dsp_plugin.topology import set_topology

    install_cuda_shim()
    out = []
    for tp, dsp, pp, mbs, num_mb, recompute in layouts:
        initialize_dsp_model_parallel(tp=tp, dsp=dsp, pp=pp, timeout_minutes=2)
        try:
            config = tiny_config(tp, pp, recompute=recompute, variant=variant)
            model = build_model(config, VIDEO, text_dim=TEXT_DIM, text_len=TEXT_LEN,
                                pre_process=ps.is_pipeline_first_stage(),
                                post_process=ps.is_pipeline_last_stage(), seed=SEED)
            ddp = wrap_ddp(model, config)
            optimizer = torch.optim.SGD(ddp.module.parameters(), lr=LR)
            data = dataset(steps, variant)
            sampler = MegatronPretrainingSampler(
                total_samples=len(data), consumed_samples=0, micro_batch_size=mbs,
                data_parallel_rank=ps.get_data_parallel_rank(),
                data_parallel_size=ps.get_data_parallel_world_size())
            batches = iter(torch.utils.data.DataLoader(data, batch_sampler=sampler))
            losses, grads, outputs = [], [], []
            hook = _record_outputs(model, sink := [])
            tp_rank = ps.get_tensor_model_parallel_rank()
            collectives = None
            for step in range(steps):
                with CommAccounting(activations=False) as acct:
                    losses.append(train_step([ddp], batches, optimizer, num_microbatches=num_mb,
                                             micro_batch_size=mbs, seq_length=VIDEO.tokens))
                outputs.append(_gathered(sink))
                sink.clear()
                if step == 0:  # every collective of one step on this rank: (op, group size, phase)
                    collectives = [(r.op, r.group_size, r.phase) for r in acct.records]
                grads.append({
                    global_parameter_name(name, model.layer_offset): (
                        tp_rank, getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False)
                        else None, p.main_grad.detach().numpy().copy())  # numpy: pickled by value
                    for name, p in model.named_parameters()})
            hook.remove()
            kinds = ["full" if getattr(layer, "attend_dim", 0) is None else "factorized"
                     for layer in model.decoder.layers]
            out.append({"losses": losses, "grads": grads, "outputs": outputs, "tp_rank": tp_rank,
                        "collectives": collectives, "stage_layers": len(model.decoder.layers),
                        "first_stage": model.pre_process, "kinds": kinds,
                        "bad_args_error": bad_args_error})
        finally:
            ps.destroy_model_parallel()
            set_topology(None)
    return out


def run_variants(rank: int, world_size: int, groups: list[tuple[str, list[tuple[int, int, int, int, int, Recompute]]]],
                 steps: int) -> list[dict[str, Any]]:
    """:func:`run_layouts` for several ``(variant, layouts)`` in one spawn (importing megatron dominates the cost);
    the results in order."""
    return [result for variant, layouts in groups
            for result in run_layouts(rank, world_size, layouts, steps, None, variant)]


def assemble(per_rank: list[dict[str, Any]], step: int) -> dict[str, torch.Tensor]:
    """Full gradients of one step: TP chunks concatenated; replicas across DSP/DP/TP must agree."""
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


def max_differences(reference: dict[str, Any], per_rank: list[dict[str, Any]]) -> tuple[float, float]:
    """(max |loss - oracle loss|, max |grad - oracle grad|) over all steps and parameters."""
    loss_diff = max(abs(a - b) for a, b in zip(global_losses(per_rank), reference["losses"], strict=True))
    grad_diff = 0.0
    for step, ref in enumerate(reference["grads"]):
        got = assemble(per_rank, step)
        if set(ref) != set(got):
            raise AssertionError(f"parameter sets differ: {sorted(set(ref) ^ set(got))}")
        for name in ref:
            grad_diff = max(grad_diff, (got[name] - ref[name]).abs().max().item())
    return loss_diff, grad_diff


def max_relative_differences(reference: dict[str, Any], per_rank: list[dict[str, Any]], micro_batch_size: int,
                             ) -> dict[str, float]:
    """Max relative differences to the oracle over all steps: ``|loss - ref| / |ref|``; per parameter
    ``max |grad - ref| / max |ref|``; per step ``max |output - ref| / max |ref|`` of the global batch
    (assembled from each DP rank's micro-batches: Megatron's sampler gives DP rank r samples
    ``[m * mbs * dp + r * mbs, ...)`` for micro-batch m)."""
    losses = max(abs(a - b) / abs(b) for a, b in zip(global_losses(per_rank), reference["losses"], strict=True))
    grads = 0.0
    for step, ref in enumerate(reference["grads"]):
        got = assemble(per_rank, step)
        if set(ref) != set(got):
            raise AssertionError(f"parameter sets differ: {sorted(set(ref) ^ set(got))}")
        grads = max(grads, max(((got[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref))
    outputs = 0.0
    for step, ref in enumerate(reference["outputs"]):
        per_dp: dict[int, list[torch.Tensor]] = {}  # one replica per DP rank (DSP/TP replicas must agree)
        for result in per_rank:
            micro = result["outputs"][step]
            if not micro:
                continue  # not a last pipeline stage
            tensors = [torch.from_numpy(out) for _, out in micro]
            first = per_dp.setdefault(micro[0][0], tensors)
            for a, b in zip(first, tensors, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        got = torch.full_like(ref, float("nan"))
        for dp_rank, micro in per_dp.items():
            for m, out in enumerate(micro):
                start = (m * len(per_dp) + dp_rank) * micro_batch_size
                got[start:start + micro_batch_size] = out
        if got.isnan().any():
            raise AssertionError(f"step {step}: the layout's outputs do not cover the global batch")
        outputs = max(outputs, ((got - ref).abs().max() / ref.abs().max()).item())
    return {"losses": losses, "grads": grads, "outputs": outputs}


def run_precision(rank: int, world_size: int, cases: list[tuple]) -> list[dict[str, Any]]:
    """For each ``(dsp, dtype[, options])``: the model under megatron-core's ``Float16Module`` (bf16/fp16) or
    bare (fp32), one forward and backward on the same 2 samples; the full output and the gradients summed over
    DSP, and the all-to-all bytes this rank sent. ``options``: ``tiny_config``'s keywords (``comm_dtype``,
    ``variant``, ``recompute``).

    ``dsp=1`` on 2 ranks is DSP=1 x DP=2: each rank computes the whole sample, as a single process would.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.comm import gather
    from dsp_plugin.megatron.config import output_shard_dim
    from dsp_plugin.megatron.cpu import install_cuda_shim
    from dsp_plugin.megatron.groups import initialize_dsp_model_parallel
    from dsp_plugin.megatron.steps import build_model, loss_func
    from dsp_plugin.topology import set_topology

    install_cuda_shim()
    data = dataset(1)
    batch = torch.utils.data.default_collate([data[i] for i in range(GLOBAL_BATCH)])
    out = []
    for dsp, dtype, *options in cases:
        initialize_dsp_model_parallel(dsp=dsp, timeout_minutes=2)
        try:
            config = tiny_config(1, 1, dtype=dtype, **(options[0] if options else {}))
            model = build_model(config, VIDEO, text_dim=TEXT_DIM, text_len=TEXT_LEN, seed=SEED)
            wrapped = Float16Module(config, model) if dtype != "fp32" else model
            with CommAccounting(activations=False) as acct:
                output = wrapped(batch["latents"], batch["timestep"], batch["text"])
                loss, _ = loss_func(batch["target"], config.num_layers, config, output)
                loss.backward()
            group = ps.get_context_parallel_group()
            shard = output_shard_dim(config, config.num_layers)
            full = gather(output.detach().float(), shard, group=group,
                          global_len=VIDEO.frames if shard == 1 else VIDEO.patches)
            grads = {}
            for name, p in model.named_parameters():
                g = p.grad.float()
                dist.all_reduce(g, group=group)  # partial sums over the DSP shards
                grads[name] = g.numpy().copy()
            total = loss.detach().float()
            dist.all_reduce(total, group=group)
            out.append({"dtype": str(output.dtype), "param_dtype": str(next(model.parameters()).dtype),
                        "output": full.numpy().copy(), "grads": grads, "loss": total.item(),
                        "all_to_all": {phase: [r.bytes_sent for r in acct.records
                                               if r.op == "all_to_all" and r.phase == phase]
                                       for phase in ("forward", "backward")}})
        finally:
            ps.destroy_model_parallel()
            set_topology(None)
    return out
