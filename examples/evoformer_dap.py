"""An AlphaFold2-style Evoformer made DSP-parallel in FastFold's Dynamic Axial Parallelism (DAP) layout.

    .venv/bin/python examples/evoformer_dap.py            # N=2 and N=4 gloo processes on CPU, R=13, S=6, fp64

The model (``Evoformer``) is single-device code: an MSA stack ``m [B, S, R, Cm]`` (S sequences, R residues)
and a pair stack ``z [B, R, R, Cz]``, with AlphaFold2's blocks: MSA row attention with a pair bias, MSA column
attention, MSA transition, outer-product mean (MSA -> pair), triangle multiplication outgoing and incoming,
triangle attention around the starting and the ending node, pair transition. Each block that needs another
tensor's full extent exposes its two halves as methods (``pair_bias`` / ``attend``, ``project`` / ``combine``,
``operands`` / ``combine``), which its own ``forward`` chains, as FastFold's modules do.

``dap_block`` runs one block on shards with the documented primitives only (``dsp_plugin.split``, ``gather``,
``dynamic_switch``), in DAP's layout:

==========================  ==================  ===========================================================
step                        placement           communication (forward; backward)
==========================  ==================  ===========================================================
row attention, pair bias    m S(S), z S(i)      bias [B, R, R, H] all-gathered on i; reduce-scatter
m S -> R                                        all-to-all; all-to-all
column attention, MSA       m S(R)              none
  transition
outer-product mean          m S(R) -> z S(i)    right operand [B, S, R, Co] all-gathered on R; reduce-scatter
triangle mult. outgoing     z S(i)              right operand [B, R, R, Ct] all-gathered on i; reduce-scatter
z i -> j                                        all-to-all; all-to-all
triangle mult. incoming     z S(j)              left operand [B, R, R, Ct] all-gathered on j; reduce-scatter
z j -> i                                        all-to-all; all-to-all
triangle attention, start   z S(i)              bias [B, R, R, H] all-gathered on i; reduce-scatter
z i -> j                                        all-to-all; all-to-all
triangle attention, end,    z S(j)              bias [B, R, R, H] all-gathered on j; reduce-scatter
  pair transition
z j -> i, m R -> S                              two all-to-alls; two all-to-alls
==========================  ==================  ===========================================================

Every gathered tensor feeds work that each rank does on its own shard (its MSA rows, its pair rows), so each
rank's gradient of it is partial: ``gather(..., partial_grad=True)`` reduce-scatters it in backward. The model's
outputs are gathered with the default ``partial_grad=False`` (the loss is the same on every rank), and the
inputs enter through ``split`` (whose backward all-gathers: the full input gradient on every rank). After
``dsp_plugin.reduce_gradients`` every parameter gradient equals one process's.

The run compares, at N=2 and N=4 with uneven R=13 and S=6 in fp64: outputs, parameter gradients (after
``reduce_gradients``) and input gradients against one process; and each block's collectives, measured by
``dsp_plugin.accounting.CommAccounting``, against DAP's, counted from the layout above (``dap_bytes``). It
also runs the two alternatives to ``partial_grad=True`` (``--modes``): ``split`` (the plain ``gather``, whose
backward drops the other ranks' share: wrong gradients) and ``replicate`` (``replicate_grad(gather(x))``:
exact, with an all-reduce in backward). docs/evoformer.md shows the output.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from torch import nn

from dsp_plugin import dynamic_switch, gather, reduce_gradients, replicate_grad, split
from dsp_plugin.accounting import CommAccounting
from dsp_plugin.packing import chunk_sizes

SIZES = {"B": 1, "S": 6, "R": 13, "Cm": 8, "Cz": 6, "H": 2, "D": 4, "Co": 3, "Ct": 4}
MODES = ("partial", "split", "replicate")   # how a gathered tensor that feeds sharded work gets its gradient


# ---------------------------------------------------------------------------------------------------------------
# the model: single-device code
# ---------------------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Gated multi-head attention along dim -2 of ``x [..., L, C]``; ``bias`` broadcasts to ``[..., H, L, L]``."""

    def __init__(self, c: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q, self.k, self.v = (nn.Linear(c, heads * head_dim, bias=False) for _ in range(3))
        self.gate = nn.Linear(c, heads * head_dim)
        self.out = nn.Linear(heads * head_dim, c)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = (p(x).unflatten(-1, (self.heads, self.head_dim)) for p in (self.q, self.k, self.v))
        logits = torch.einsum("...ihd,...jhd->...hij", q, k) / math.sqrt(self.head_dim)
        if bias is not None:
            logits = logits + bias
        o = torch.einsum("...hij,...jhd->...ihd", logits.softmax(-1), v).flatten(-2)
        return self.out(o * torch.sigmoid(self.gate(x)))


class MSARowAttention(nn.Module):
    """Each MSA row attends along the residues R, biased by the pair: ``bias[b, h, i, j] = Linear(LN(z))``."""

    def __init__(self, c_m: int, c_z: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm_m, self.norm_z = nn.LayerNorm(c_m), nn.LayerNorm(c_z)
        self.bias = nn.Linear(c_z, heads, bias=False)
        self.attention = Attention(c_m, heads, head_dim)

    def pair_bias(self, z: torch.Tensor) -> torch.Tensor:
        return self.bias(self.norm_z(z))                                   # [B, I, R, Cz] -> [B, I, R, H]

    def attend(self, m: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # m [B, S, R, Cm], bias [B, R, R, H] -> [B, 1, H, R, R], the same for every MSA row
        return self.attention(self.norm_m(m), bias.permute(0, 3, 1, 2).unsqueeze(1))

    def forward(self, m: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.attend(m, self.pair_bias(z))


class MSAColumnAttention(nn.Module):
    """Each residue's column attends along the MSA sequences S."""

    def __init__(self, c_m: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(c_m)
        self.attention = Attention(c_m, heads, head_dim)

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        return self.attention(self.norm(m).transpose(1, 2)).transpose(1, 2)   # [B, R, S, Cm] attends along S


class Transition(nn.Module):
    def __init__(self, c: int, factor: int = 2) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(c), nn.Linear(c, factor * c), nn.Linear(factor * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


class OuterProductMean(nn.Module):
    """MSA -> pair: ``z[b, i, j] = Linear(mean over s of a[b, s, i] (x) b[b, s, j])``."""

    def __init__(self, c_m: int, c_o: int, c_z: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(c_m)
        self.left, self.right = nn.Linear(c_m, c_o), nn.Linear(c_m, c_o)
        self.out = nn.Linear(c_o * c_o, c_z)

    def project(self, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.norm(m)
        return self.left(x), self.right(x)                                 # [B, S, R, Co] each

    def combine(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        outer = torch.einsum("bsic,bsjd->bijcd", a, b) / a.shape[1]        # [B, I, J, Co, Co]
        return self.out(outer.flatten(-2))

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        return self.combine(*self.project(m))


class TriangleMultiplication(nn.Module):
    """Outgoing: ``p[i, j] = sum_k a[i, k] b[j, k]``; incoming: ``p[i, j] = sum_k a[k, i] b[k, j]``."""

    def __init__(self, c_z: int, c_t: int, *, outgoing: bool) -> None:
        super().__init__()
        self.outgoing = outgoing
        self.norm_in, self.norm_out = nn.LayerNorm(c_z), nn.LayerNorm(c_t)
        self.a_proj, self.a_gate, self.b_proj, self.b_gate = (nn.Linear(c_z, c_t) for _ in range(4))
        self.gate, self.out = nn.Linear(c_z, c_z), nn.Linear(c_t, c_z)

    def operands(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.norm_in(z)
        a = torch.sigmoid(self.a_gate(x)) * self.a_proj(x)
        b = torch.sigmoid(self.b_gate(x)) * self.b_proj(x)
        return a, b, torch.sigmoid(self.gate(x))

    def combine(self, a: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        p = torch.einsum("bikc,bjkc->bijc" if self.outgoing else "bkic,bkjc->bijc", a, b)
        return g * self.out(self.norm_out(p))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.combine(*self.operands(z))


class TriangleAttention(nn.Module):
    """Around the starting node: row i attends along j with ``bias[j, k]``; the ending node on ``z`` transposed."""

    def __init__(self, c_z: int, heads: int, head_dim: int, *, starting: bool) -> None:
        super().__init__()
        self.starting = starting
        self.norm = nn.LayerNorm(c_z)
        self.bias = nn.Linear(c_z, heads, bias=False)
        self.attention = Attention(c_z, heads, head_dim)

    def attend(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.attention(x, bias.permute(0, 3, 1, 2).unsqueeze(1))   # x [B, I, R, Cz], bias [B, R, R, H]

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = z if self.starting else z.transpose(1, 2)
        x = self.norm(z)
        out = self.attend(x, self.bias(x))
        return out if self.starting else out.transpose(1, 2)


class EvoformerBlock(nn.Module):
    def __init__(self, s: dict[str, int]) -> None:
        super().__init__()
        cm, cz, h, d = s["Cm"], s["Cz"], s["H"], s["D"]
        self.row = MSARowAttention(cm, cz, h, d)
        self.col = MSAColumnAttention(cm, h, d)
        self.msa_transition = Transition(cm)
        self.opm = OuterProductMean(cm, s["Co"], cz)
        self.tri_out = TriangleMultiplication(cz, s["Ct"], outgoing=True)
        self.tri_in = TriangleMultiplication(cz, s["Ct"], outgoing=False)
        self.tri_start = TriangleAttention(cz, h, d, starting=True)
        self.tri_end = TriangleAttention(cz, h, d, starting=False)
        self.pair_transition = Transition(cz)

    def forward(self, m: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = m + self.row(m, z)
        m = m + self.col(m)
        m = m + self.msa_transition(m)
        z = z + self.opm(m)
        z = z + self.tri_out(z)
        z = z + self.tri_in(z)
        z = z + self.tri_start(z)
        z = z + self.tri_end(z)
        z = z + self.pair_transition(z)
        return m, z


class Evoformer(nn.Module):
    def __init__(self, sizes: dict[str, int] = SIZES, blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EvoformerBlock(sizes) for _ in range(blocks))

    def forward(self, m: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for block in self.blocks:
            m, z = block(m, z)
        return m, z


# ---------------------------------------------------------------------------------------------------------------
# DAP with the documented primitives
# ---------------------------------------------------------------------------------------------------------------


def gather_for_shards(x: torch.Tensor, dim: int, length: int, mode: str = "partial") -> torch.Tensor:
    """``x`` gathered on ``dim`` for work each rank does on its own shard. ``mode``: ``partial`` (the right one:
    reduce-scatter in backward), ``split`` (the plain gather: drops the other ranks' share of the gradient),
    ``replicate`` (``replicate_grad`` then the plain gather: exact, one all-reduce in backward)."""
    if mode == "partial":
        return gather(x, dim, global_len=length, partial_grad=True)
    if mode == "replicate":
        return replicate_grad(gather(x, dim, global_len=length))
    return gather(x, dim, global_len=length)


def dap_block(block: EvoformerBlock, m: torch.Tensor, z: torch.Tensor, *, mode: str = "partial"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One block on shards: ``m`` S(S) ``[B, S_r, R, Cm]``, ``z`` S(i) ``[B, R_r, R, Cz]`` -> the same placements.

    ``z.shape[2]`` and ``m.shape[2]`` are the full R, ``m``'s sequences S come from the switch's ``global_len``;
    every length a primitive needs is passed (the block's own arithmetic makes new, untagged tensors)."""
    s_len, r_len = SIZES["S"], z.shape[2]
    bias = gather_for_shards(block.row.pair_bias(z), 1, r_len, mode)       # [B, R, R, H]
    m = m + block.row.attend(m, bias)                                      # S(S): row attention along R, local
    m = dynamic_switch(m, 1, 2, global_len=s_len)                          # S(S) -> S(R)
    m = m + block.col(m)                                                   # along S, local
    m = m + block.msa_transition(m)
    left, right = block.opm.project(m)                                     # [B, S, R_r, Co]
    z = z + block.opm.combine(left, gather_for_shards(right, 2, r_len, mode))   # -> [B, R_r, R, Cz], S(i)
    a, b, g = block.tri_out.operands(z)
    z = z + block.tri_out.combine(a, gather_for_shards(b, 1, r_len, mode), g)   # a[i, k] b[j, k], rows i local
    z = dynamic_switch(z, 1, 2, global_len=r_len)                          # S(i) -> S(j)
    a, b, g = block.tri_in.operands(z)
    z = z + block.tri_in.combine(gather_for_shards(a, 2, r_len, mode), b, g)    # a[k, i] b[k, j], columns j local
    z = dynamic_switch(z, 2, 1, global_len=r_len)                          # S(j) -> S(i)
    x = block.tri_start.norm(z)
    z = z + block.tri_start.attend(x, gather_for_shards(block.tri_start.bias(x), 1, r_len, mode))
    z = dynamic_switch(z, 1, 2, global_len=r_len)                          # S(i) -> S(j)
    x = block.tri_end.norm(z.transpose(1, 2))                              # [B, J_r, R, Cz]: rows j local
    bias = gather_for_shards(block.tri_end.bias(x), 1, r_len, mode)
    z = z + block.tri_end.attend(x, bias).transpose(1, 2)
    z = z + block.pair_transition(z)
    z = dynamic_switch(z, 2, 1, global_len=r_len)                          # S(j) -> S(i)
    m = dynamic_switch(m, 2, 1, global_len=r_len)                          # S(R) -> S(S), for the next block
    return m, z


def dap_evoformer(model: Evoformer, m: torch.Tensor, z: torch.Tensor, *, mode: str = "partial"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole model on the DSP group: inputs split (S of the MSA, i of the pair), outputs gathered."""
    s_len, r_len = m.shape[1], z.shape[1]
    m, z = split(m, 1), split(z, 1)
    for block in model.blocks:
        m, z = dap_block(block, m, z, mode=mode)
    return gather(m, 1, global_len=s_len), gather(z, 1, global_len=r_len)


def dap_bytes(n: int, rank: int, s: dict[str, int], itemsize: int = 8) -> dict[str, tuple[int, int]]:
    """Bytes this rank sends per block in DAP's layout, counted from the table above: ``{op: (count, bytes)}``
    for ``all_to_all/forward``, ``all_gather/forward``, ``all_to_all/backward``, ``reduce_scatter/backward``.

    An all-to-all sends the rank's shard but the block it keeps; an all-gather sends its chunk to N-1 peers and
    a reduce-scatter N-1 chunks, each padded to the largest chunk (equal blocks, as NCCL's and gloo's take them)."""
    b, seq, res = s["B"], s["S"], s["R"]
    s_r, r_r = chunk_sizes(seq, n)[rank], chunk_sizes(res, n)[rank]
    block = max(chunk_sizes(res, n))
    msa = b * (s_r * (res - r_r) + (seq - s_r) * r_r) * s["Cm"]            # S -> R and R -> S
    pair = 4 * b * r_r * (res - r_r) * s["Cz"]                             # i -> j, j -> i, twice
    gathered = b * block * (n - 1) * (3 * res * s["H"] + seq * s["Co"] + 2 * res * s["Ct"])
    switches = (6, (msa + pair) * itemsize)
    return {"all_to_all/forward": switches, "all_gather/forward": (6, gathered * itemsize),
            "all_to_all/backward": switches, "reduce_scatter/backward": (6, gathered * itemsize)}


# ---------------------------------------------------------------------------------------------------------------
# the comparison against one process
# ---------------------------------------------------------------------------------------------------------------


def _inputs(sizes: dict[str, int]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    b, s, r = sizes["B"], sizes["S"], sizes["R"]
    m = torch.randn(b, s, r, sizes["Cm"], generator=g, dtype=torch.float64)
    z = torch.randn(b, r, r, sizes["Cz"], generator=g, dtype=torch.float64)
    return m, z, torch.randn(m.shape, generator=g, dtype=torch.float64), torch.randn(z.shape, generator=g,
                                                                                     dtype=torch.float64)


def _model(blocks: int) -> Evoformer:
    torch.manual_seed(0)
    return Evoformer(SIZES, blocks).double()


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def compare(rank: int, n: int, modes: tuple[str, ...] = ("partial",), blocks: int = 2) -> dict[str, Any]:
    """On every rank: the model on one process and on the group, per mode; the differences and a block's traffic."""
    from dsp_plugin.topology import Topology, get_topology, set_topology

    if get_topology() is None:
        set_topology(Topology.world())
    m, z, wm, wz = _inputs(SIZES)
    reference = _model(blocks)
    m_ref, z_ref = m.clone().requires_grad_(True), z.clone().requires_grad_(True)
    out_ref = reference(m_ref, z_ref)
    ((out_ref[0] * wm).sum() + (out_ref[1] * wz).sum()).backward()
    grads_ref = [p.grad for p in reference.parameters()]
    report: dict[str, Any] = {"n": n, "rank": rank, "modes": {}}
    for mode in modes:
        model = _model(blocks)
        m_in, z_in = m.clone().requires_grad_(True), z.clone().requires_grad_(True)
        out = dap_evoformer(model, m_in, z_in, mode=mode)
        ((out[0] * wm).sum() + (out[1] * wz).sum()).backward()
        reduce_gradients(model.parameters())                  # the sum over the DSP group (docs/concepts.md)
        grads = [p.grad for p in model.parameters()]
        scale = max(g.abs().max().item() for g in grads_ref)
        report["modes"][mode] = {
            "output": _max_diff(list(out), list(out_ref)),
            "param_grad": _max_diff(grads, grads_ref), "param_grad_rel": _max_diff(grads, grads_ref) / scale,
            "input_grad": _max_diff([m_in.grad, z_in.grad], [m_ref.grad, z_ref.grad]),
            "traffic": _block_traffic(model.blocks[0], m, z, wm, n, rank, mode)}
    report["dap"] = dap_bytes(n, rank, SIZES)
    return report


def _block_traffic(block: EvoformerBlock, m: torch.Tensor, z: torch.Tensor, wm: torch.Tensor, n: int, rank: int,
                   mode: str) -> dict[str, tuple[int, int]]:
    """One block's collectives, forward and backward, as ``{op/phase: (count, bytes sent by this rank)}``."""
    m_s = m.tensor_split(n, 1)[rank].clone().requires_grad_(True)
    z_s = z.tensor_split(n, 1)[rank].clone().requires_grad_(True)
    dap_block(block, m_s, z_s, mode=mode)                     # the ranks agree on each call's signature first
    with CommAccounting(activations=False) as acct:
        m_out, z_out = dap_block(block, m_s, z_s, mode=mode)
        torch.autograd.backward([m_out, z_out], [torch.ones_like(m_out), torch.ones_like(z_out)])
    return {key: (row["count"], row["bytes_sent"]) for key, row in sorted(acct.summary().items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4], help="DSP group sizes to run")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                        help="the gradient of a gathered tensor that feeds sharded work (partial: partial_grad=True)")
    args = parser.parse_args()
    from dsp_plugin.spawn import spawn

    print(f"Evoformer, 2 blocks, fp64: {SIZES}")
    for n in args.nproc:
        results = spawn(compare, n, tuple(args.modes), timeout=600)
        print(f"\nN={n}: largest difference from one process over the ranks")
        print(f"  {'mode':<10} {'outputs':>9} {'param grads':>12} {'(relative)':>11} {'input grads':>12}")
        for mode in args.modes:
            worst = {k: max(r["modes"][mode][k] for r in results)
                     for k in ("output", "param_grad", "param_grad_rel", "input_grad")}
            print(f"  {mode:<10} {worst['output']:9.1e} {worst['param_grad']:12.1e} {worst['param_grad_rel']:11.1e} "
                  f"{worst['input_grad']:12.1e}")
        print("  bytes sent per block by rank 0 (count x bytes; DAP counted from its layout):")
        dap = results[0]["dap"]
        keys = sorted({k for mode in args.modes for k in results[0]["modes"][mode]["traffic"]} | set(dap))
        print(f"  {'op/phase':<26} {'DAP':>14} " + " ".join(f"{mode:>16}" for mode in args.modes))
        for key in keys:
            cells = [results[0]["modes"][mode]["traffic"].get(key, (0, 0)) for mode in args.modes]
            fmt = [f"{c} x {b:>9,}" for c, b in [dap.get(key, (0, 0)), *cells]]
            print(f"  {key:<26} {fmt[0]:>14} " + " ".join(f"{c:>16}" for c in fmt[1:]))


if __name__ == "__main__":
    main()
