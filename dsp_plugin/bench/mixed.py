"""``python -m dsp_plugin.bench.mixed``: a model mixing factorized and full-attention blocks, in bytes.

    python -m dsp_plugin.bench.mixed                     # N = 4, pattern spatial,temporal,full x 2
    python -m dsp_plugin.bench.mixed --nproc 2 --pattern spatial,full,temporal,full

The model: blocks ``x + proj(attention(qkv(x)))`` over tokens ``[B, T, S, D]``,
attending along S (``spatial``), T (``temporal``) or every token (``full``). Only
attention communicates, so the other parts of a DiT block are left out. Four
ways to run it on N ranks, each checked against the same model on one process:

=================  ============================================================  ==================
strategy           what moves                                                    all-to-alls/block
=================  ============================================================  ==================
``dsp``            DSP: ``dynamic_switch`` only where a factorized block's         switch: 1, full: 2
                   attended dim is sharded; full blocks: the head switch
                   (``to_heads``: q, k, v packed in one all-to-all; ``from_heads``)
``dsp_apart``      as ``dsp``, but q, k, v switched to heads one by one           switch: 1, full: 4
                   (diffusers' and DeepSpeed's way: 3 + 1)
``ulysses``        Ulysses everywhere: the activation stays sharded on T and      2 every block
                   every attention goes through the head switch (packed)
``ulysses_apart``  Ulysses everywhere, q, k, v apart (3 + 1)                     4 every block
=================  ============================================================  ==================

Bytes per rank, with ``M`` one block's activation ``[B, T, S, D]`` over the whole
group and ``u = M (N-1) / N^2`` (what one rank sends in one DSP switch): a DSP
switch moves ``u``; a head switch around one attention moves ``3u`` (q, k, v)
plus ``u`` (the output), packed or apart alike. Forward and backward move the
same. So per forward, with ``W`` DSP switches and ``F`` full blocks out of ``L``::

    dsp, dsp_apart          (W + 4 F) u          ulysses, ulysses_apart      4 L u

(exact for even lengths, which this bench uses). Counts come from
``dsp_plugin.accounting`` (all-to-alls only: the entry split and the exit gather
are left out, as in paper Table 3); the formula column is computed independently.
Timing is printed for information (CPU gloo), never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

STRATEGIES = ("dsp", "dsp_apart", "ulysses", "ulysses_apart")
PATTERN = ("spatial", "temporal", "full", "spatial", "temporal", "full")
SHAPE, QUICK_SHAPE, HEADS = (1, 8, 16, 32), (1, 4, 8, 16), 4  # [B, T, S, D]: T and S divisible by 2 and 4
FRAME, PATCH, HEAD = 1, 2, 3  # dims of q, k, v [B, T, S, H, Dh]; of the activation [B, T, S, D]: T=1, S=2
ATTENDS = {"spatial": PATCH, "temporal": FRAME, "full": None}


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str) -> torch.Tensor:
    """Softmax attention of ``[B, T, S, h, Dh]`` q, k, v along S, T or all of T x S; same shape out."""
    if kind == "full":  # [B, T, S, h, Dh] -> [B, h, T*S, Dh]
        out = F.scaled_dot_product_attention(*(t.flatten(1, 2).transpose(1, 2) for t in (q, k, v)))
        return out.transpose(1, 2).unflatten(1, q.shape[1:3])
    attended = ATTENDS[kind]
    order = (0, FRAME + PATCH - attended, HEAD, attended, 4)  # [B, other, h, attended, Dh]
    out = F.scaled_dot_product_attention(*(t.permute(order) for t in (q, k, v)))
    return out.permute(*[order.index(d) for d in range(5)])


class Block(nn.Module):
    def __init__(self, kind: str, hidden: int, heads: int) -> None:
        super().__init__()
        self.kind, self.heads = kind, heads
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=torch.float64)
        self.proj = nn.Linear(hidden, hidden, dtype=torch.float64)

    def forward(self, x: torch.Tensor, heads_mode: str | None, shard: int, full_len: int) -> torch.Tensor:
        """``heads_mode``: None (attend locally), ``packed`` (to_heads/from_heads) or ``apart`` (3 + 1 switches)."""
        from dsp_plugin import dynamic_switch, from_heads, to_heads

        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(3)  # [B, T_x, S_x, H, Dh] each
        if heads_mode == "packed":
            q, k, v = to_heads(q, k, v, seq_dim=shard, head_dim=HEAD, global_len=full_len)
        elif heads_mode == "apart":
            q, k, v = (dynamic_switch(t, shard, HEAD, global_len=full_len) for t in (q, k, v))
        out = _attend(q, k, v, self.kind)
        if heads_mode == "packed":
            out = from_heads(out, seq_dim=shard, head_dim=HEAD, heads=self.heads)
        elif heads_mode == "apart":
            out = dynamic_switch(out, HEAD, shard, global_len=self.heads)
        return x + self.proj(out.flatten(3))


class MixedModel(nn.Module):
    """``[B, T, S, D] -> [B, T, S, D]`` through ``pattern``'s blocks; ``strategy`` None is one process."""

    def __init__(self, pattern: tuple[str, ...], hidden: int, heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(kind, hidden, heads) for kind in pattern)

    def forward(self, x: torch.Tensor, strategy: str | None = None) -> torch.Tensor:
        from dsp_plugin import dynamic_switch, gather, split

        if strategy is None:
            return self._blocks(x, None)
        lengths = {FRAME: x.shape[FRAME], PATCH: x.shape[PATCH]}
        shard = entry_shard(tuple(b.kind for b in self.blocks)) if strategy.startswith("dsp") else FRAME
        x = split(x, shard)
        for block in self.blocks:
            attended = ATTENDS[block.kind]
            if strategy.startswith("ulysses") or attended is None:
                x = block(x, "packed" if strategy in ("dsp", "ulysses") else "apart", shard, lengths[shard])
                continue
            if attended == shard:  # DSP: keep the attended dim whole
                x, shard = dynamic_switch(x, shard, FRAME + PATCH - shard, global_len=lengths[shard]), \
                    FRAME + PATCH - shard
            x = block(x, None, shard, lengths[shard])
        return gather(x, shard, global_len=lengths[shard])

    def _blocks(self, x: torch.Tensor, heads_mode: str | None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, heads_mode, FRAME, x.shape[FRAME])
        return x


def entry_shard(pattern: tuple[str, ...]) -> int:
    """Split where the first factorized block attends not (T if every block is full)."""
    factorized = [ATTENDS[k] for k in pattern if ATTENDS[k] is not None]
    return FRAME + PATCH - factorized[0] if factorized else FRAME


def dsp_switches(pattern: tuple[str, ...]) -> int:
    """How many DSP switches ``pattern`` needs: one per factorized block whose attended dim arrives sharded."""
    shard, switches = entry_shard(pattern), 0
    for kind in pattern:
        if ATTENDS[kind] == shard:
            shard, switches = FRAME + PATCH - shard, switches + 1
    return switches


def formula(strategy: str, pattern: tuple[str, ...], n: int, activation_bytes: int) -> tuple[int, float]:
    """``(all-to-alls, bytes sent per rank)`` of one forward (the backward moves the same)."""
    unit = activation_bytes * (n - 1) / n**2
    full, switches = sum(kind == "full" for kind in pattern), dsp_switches(pattern)
    per_attention = 2 if not strategy.endswith("apart") else 4
    if strategy.startswith("dsp"):
        return switches + per_attention * full, (switches + 4 * full) * unit
    return per_attention * len(pattern), 4 * len(pattern) * unit


def worker(rank: int, n: int, pattern: tuple[str, ...], shape: tuple[int, int, int, int], heads: int,
           reps: int) -> dict[str, Any]:
    from dsp_plugin.log import quiet_third_party

    quiet_third_party()                 # third-party notices stay out of the tables
    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.topology import Topology, set_topology

    set_topology(Topology.world())   # the whole world is the DSP group (group=None refuses without one)
    torch.manual_seed(0)
    model = MixedModel(pattern, shape[-1], heads)
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reference = model(x)
    out: dict[str, Any] = {}
    for strategy in STRATEGIES:
        model(x, strategy).sum().backward()  # the ranks agree on each signature once, outside the count
        with CommAccounting(activations=False) as acct:
            y = model(x, strategy)
            y.sum().backward()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            model(x, strategy).sum().backward()
            times.append(time.perf_counter() - start)
        out[strategy] = {
            phase: {"count": acct.count("all_to_all", phase), "bytes": acct.bytes_sent("all_to_all", phase)}
            for phase in ("forward", "backward")} | {
            "max_diff": (y - reference).abs().max().item(), "median_s": statistics.median(times) if times else 0.0}
    return out


def markdown(results: dict[str, Any], pattern: tuple[str, ...], n: int, shape: tuple[int, ...], heads: int) -> str:
    activation = 8 * int(torch.tensor(shape).prod())  # fp64
    base = results["dsp"]["forward"]["bytes"]
    lines = [f"Mixed model on N={n} gloo ranks: blocks {', '.join(pattern)}; tokens [B, T, S, D] = {list(shape)} "
             f"fp64, {heads} heads; M = {activation / 2**10:.0f} KiB; bytes sent per rank (rank 0), all-to-alls "
             f"only (entry split and exit gather left out).", "",
             "| strategy | all-to-alls fwd / bwd | bytes fwd / bwd | formula (count, bytes) | bytes vs dsp "
             "| max abs diff vs 1 process | median step (s) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for strategy in STRATEGIES:
        r = results[strategy]
        count, nbytes = formula(strategy, pattern, n, activation)
        lines.append(f"| {strategy} | {r['forward']['count']} / {r['backward']['count']} | "
                     f"{r['forward']['bytes'] / 2**10:.1f} / {r['backward']['bytes'] / 2**10:.1f} KiB | "
                     f"{count}, {nbytes / 2**10:.1f} KiB | {r['forward']['bytes'] / base:.2f}x | "
                     f"{r['max_diff']:.1e} | {r['median_s']:.4f} |")
    full = sum(kind == "full" for kind in pattern)
    lines += ["", f"Head switch against diffusers-style q, k, v apart, per full attention: 2 all-to-alls against 4 "
                  f"(here {full} full blocks: dsp {results['dsp']['forward']['count']} vs dsp_apart "
                  f"{results['dsp_apart']['forward']['count']} forward), the same bytes (4u each)."]
    return "\n".join(lines)


def run(n: int, pattern: tuple[str, ...], shape: tuple[int, int, int, int], heads: int, reps: int) -> str:
    from dsp_plugin.spawn import spawn

    per_rank = spawn(worker, n, pattern, shape, heads, reps, timeout=600, collective_timeout_s=120)
    return markdown(per_rank[0], pattern, n, shape, heads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsp_plugin.bench.mixed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--pattern", default=",".join(PATTERN))
    parser.add_argument("--shape", default=",".join(map(str, SHAPE)), help="B,T,S,D (T and S divisible by --nproc)")
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--reps", type=int, default=5, help="timed steps per strategy (information only)")
    args = parser.parse_args(argv)
    pattern = tuple(args.pattern.split(","))
    if any(kind not in ATTENDS for kind in pattern):
        parser.error(f"--pattern {args.pattern!r}: expected comma-separated kinds of {sorted(ATTENDS)}")
    shape = tuple(int(s) for s in args.shape.split(","))
    print(run(args.nproc, pattern, shape, args.heads, args.reps))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
