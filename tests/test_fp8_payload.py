"""The FP8 payload (``comm_dtype="fp8"``, ``dsp_plugin.comm.payload``) of the switch and the head switch.

The bytes the accounting sees are exactly half of the bf16 payload plus one float32 scale per chunk
sent (one chunk per tensor and per peer); the values come back within FP8's rounding of the exact
(bf16) exchange, forward and backward; a tensor named ``exact`` travels in its own dtype.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed

SCALE = 4  # bytes of one chunk's scale


def _bytes(acct, phase: str) -> int:  # noqa: ANN001
    return sum(r.bytes_sent for r in acct.records if r.op == "all_to_all" and r.phase == phase)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _switch_worker(rank: int, n: int) -> dict[str, float]:
    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.comm import dynamic_switch, split

    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 7, 6, 5, generator=g).to(torch.bfloat16)
    weight = torch.randn(2, 7, 6, 5, generator=g).to(torch.bfloat16)  # a gradient that is not the activation

    def run(comm_dtype: object) -> tuple[torch.Tensor, torch.Tensor, CommAccounting]:
        x = split(full, 1).detach().requires_grad_(True)
        with CommAccounting(activations=False) as acct:
            y = dynamic_switch(x, 1, 2, global_len=7, comm_dtype=comm_dtype)
            (y.float() * split(weight, 2).float()).sum().backward()
        return y.detach(), x.grad, acct

    y16, g16, a16 = run(None)
    y8, g8, a8 = run("fp8")
    return {"fwd16": _bytes(a16, "forward"), "fwd8": _bytes(a8, "forward"),
            "bwd16": _bytes(a16, "backward"), "bwd8": _bytes(a8, "backward"),
            "calls8": len(a8.records), "dtype8": str(y8.dtype),
            "rel_out": _rel(y8, y16), "rel_grad": _rel(g8, g16)}


@pytest.mark.parametrize("n", [2, 3])
def test_fp8_switch_sends_half_the_bytes_plus_the_scales(n: int) -> None:
    for rank, d in enumerate(run_distributed(_switch_worker, n)):
        print(f"n={n} rank {rank}: {d}")
        assert d["calls8"] == 2 and d["dtype8"] == "torch.bfloat16", d  # one all-to-all each way, bf16 out
        for phase in ("fwd", "bwd"):
            assert d[f"{phase}8"] == d[f"{phase}16"] // 2 + SCALE * (n - 1), d
        assert 0 < d["rel_out"] < 0.04 and 0 < d["rel_grad"] < 0.04, d  # e4m3: 3 mantissa bits


def _heads_worker(rank: int, n: int, exact: tuple[str, ...]) -> dict[str, float]:
    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.comm import split
    from dsp_plugin.head_switch import from_heads, to_heads

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 7, 4, 3, generator=g).to(torch.bfloat16) for _ in range(3))
    k = k * 100  # K on another scale: each tensor's chunk has its own scale

    def run(comm_dtype: object, exact: tuple[str, ...]) -> tuple[list[torch.Tensor], CommAccounting]:
        local = [split(t, 1).detach().requires_grad_(True) for t in (q, k, v)]
        with CommAccounting(activations=False) as acct:
            hq, hk, hv = to_heads(*local, seq_dim=1, head_dim=2, global_len=7, comm_dtype=comm_dtype, exact=exact)
            out = from_heads(hq * hk + hv, seq_dim=1, head_dim=2, heads=4,
                             comm_dtype=None if "out" in exact else comm_dtype)
            out.float().square().sum().backward()
        return [hk.detach(), out.detach(), *(t.grad for t in local)], acct

    ref, a16 = run(None, ())
    got, a8 = run("fp8", tuple(e for e in exact if e != "out"))
    forward16 = [r.bytes_sent for r in a16.records if r.phase == "forward"]
    forward8 = [r.bytes_sent for r in a8.records if r.phase == "forward"]
    backward16 = [r.bytes_sent for r in a16.records if r.phase == "backward"]
    backward8 = [r.bytes_sent for r in a8.records if r.phase == "backward"]
    return {"fwd16": forward16, "fwd8": forward8, "bwd16": backward16, "bwd8": backward8,
            "k_equal": bool(torch.equal(got[0], ref[0])),
            **{f"rel_{name}": _rel(a, b) for name, a, b in zip(("k", "out", "dq", "dk", "dv"), got, ref)}}


@pytest.mark.parametrize("exact", [(), ("k",)])
def test_fp8_head_switch_bytes_and_an_exact_k(exact: tuple[str, ...]) -> None:
    n = 2
    for rank, d in enumerate(run_distributed(_heads_worker, n, exact)):
        print(f"exact={exact} rank {rank}: {d}")
        # to_heads: q, k, v in one all-to-all, a third of its bf16 bytes each; from_heads: out alone.
        # backward: from_heads' adjoint (out's gradient) first, then to_heads' (q, k, v's): the same formats
        fp8 = len([t for t in ("q", "k", "v") if t not in exact])

        def expected(qkv16: int, out16: int) -> list[int]:
            third = qkv16 // 3
            return [fp8 * (third // 2 + SCALE * (n - 1)) + (3 - fp8) * third, out16 // 2 + SCALE * (n - 1)]

        assert d["fwd8"] == expected(*d["fwd16"]), d
        assert d["bwd8"][::-1] == expected(*d["bwd16"][::-1]), d
        assert d["k_equal"] == ("k" in exact), d
        assert all(0 < d[f"rel_{t}"] < 0.06 for t in ("out", "dq", "dk", "dv")), d


def _mixed_wire_worker(rank: int, n: int, op: str, exact_on_rank1: bool) -> str:
    """Rank 0 asks for FP8, rank 1 for the activation's dtype (or FP8 with K exact): the check must stop both."""
    from dsp_plugin.comm import dynamic_switch, split
    from dsp_plugin.head_switch import to_heads

    full = torch.randn(2, 6, 4, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    comm_dtype = "fp8" if rank == 0 or exact_on_rank1 else None
    try:
        if op == "dynamic_switch":
            dynamic_switch(split(full, 1), 1, 2, global_len=6, comm_dtype=comm_dtype)
        else:
            x = split(full, 1)
            to_heads(x, x, x, seq_dim=1, head_dim=2, global_len=6, comm_dtype=comm_dtype,
                     exact=("k",) if rank == 1 and exact_on_rank1 else ())
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("op,exact_on_rank1", [("dynamic_switch", False), ("to_heads", False), ("to_heads", True)])
def test_ranks_disagreeing_on_the_wire_format_stop_before_the_all_to_all(op: str, exact_on_rank1: bool) -> None:
    """Under the default check (first call of a signature) the wire format is part of the fingerprint: an FP8
    rank beside a bf16 rank (a config set on one node only) would otherwise exchange buffers of different sizes."""
    messages = run_distributed(_mixed_wire_worker, 2, op, exact_on_rank1)
    print(messages[0])
    assert messages[0] == messages[1], messages               # the same error on every rank
    assert messages[0].startswith("CrossRankMismatch"), messages[0]
    assert "the wire format (comm_dtype; forward/gradient per tensor)" in messages[0], messages[0]
    expected = ("#1 exact, #2 e4m3/e4m3) on rank 1" if exact_on_rank1
                else "the activation's dtype (comm_dtype=None) on rank 1")
    assert expected in messages[0], messages[0]


#: the largest value a finite value travels as: e4m3 has no infinity, so a step below its maximum (which stands for
#: +-inf); e5m2 has its own, so its maximum
FINITE_TOP = {torch.float8_e4m3fn: 416.0, torch.float8_e5m2: 57344.0}


def _reference_chunk(chunk: torch.Tensor, fmt: torch.dtype) -> bytes:
    """One chunk on the wire, by the format's definition: its values / scale in ``fmt``, then the float32 scale."""
    flat = chunk.reshape(-1).float()
    top = torch.finfo(fmt).max
    finite = flat[torch.isfinite(flat)]
    amax = finite.abs().max() if finite.numel() else torch.zeros(())
    scale = (amax / FINITE_TOP[fmt]).clamp_min(torch.finfo(torch.float32).tiny).reshape(1)
    wire = ((flat / scale).clamp(-top, top) if fmt == torch.float8_e4m3fn else flat / scale).to(fmt)
    return bytes(wire.view(torch.uint8).tolist()) + bytes(scale.view(torch.uint8).tolist())


@pytest.mark.parametrize("lengths", [(12, 12, 12), (15, 12, 15), (0, 6, 6), (5, 0, 5)])
@pytest.mark.parametrize("skip", [-1, 1])
def test_encode_is_the_per_chunk_format_and_decode_its_inverse(lengths: tuple[int, ...], skip: int) -> None:
    """``encode`` casts all chunks of a tensor at once (equal lengths) or one by one (uneven): either way each
    chunk's bytes are exactly its own cast and scale, in row order, and ``decode`` gives each chunk back."""
    from dsp_plugin.comm import payload

    g = torch.Generator().manual_seed(1)
    formats = [torch.float8_e4m3fn, None, torch.float8_e5m2]
    rows = [[(torch.randn(n, generator=g) * 10 ** k * (j != 0 or k != 2)).to(torch.bfloat16) for k in range(3)]
            for j, n in enumerate(lengths)]  # rank 0's last chunk all zeros
    send, splits = payload.encode(rows, formats, skip=skip)
    expected: list[bytes] = []
    for j, row in enumerate(rows):
        parts = [] if j == skip else [bytes(c.view(torch.uint8).tolist()) if f is None else _reference_chunk(c, f)
                                      for c, f in zip(row, formats)]
        expected.append(b"".join(parts))
    assert splits == [len(e) for e in expected]
    assert bytes(send.tolist()) == b"".join(expected)
    back = payload.decode(send, [[tuple(c.shape) for c in row] for row in rows], formats, torch.bfloat16, skip=skip)
    for j, (row, got) in enumerate(zip(rows, back)):
        if j == skip:
            assert got is None
            continue
        for c, f, b in zip(row, formats, got):
            assert b.shape == c.shape and b.dtype == torch.bfloat16
            if f is None or not c.numel():
                assert torch.equal(b, c)
            else:
                assert (b.float() - c.float()).abs().max() <= 0.07 * c.float().abs().max(), (j, f)


def test_finite_top_is_the_value_below_e4m3s_maximum() -> None:
    top = torch.tensor(torch.finfo(torch.float8_e4m3fn).max).to(torch.float8_e4m3fn)
    assert (top.view(torch.uint8) - 1).view(torch.float8_e4m3fn).item() == FINITE_TOP[torch.float8_e4m3fn]
    assert FINITE_TOP[torch.float8_e5m2] == torch.finfo(torch.float8_e5m2).max
    assert torch.tensor(float("inf")).to(torch.float8_e5m2).float().item() == float("inf")


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("lengths", [(240, 240), (240, 17)])
def test_non_finite_values_arrive_as_sent(fmt: torch.dtype, lengths: tuple[int, int]) -> None:
    """An ``inf`` in a chunk used to make its scale infinite and all 240 values NaN; now ``inf``, ``-inf`` and
    ``NaN`` arrive as they were sent (the exact wire's result) and the finite values keep their own scale, in
    the equal-length and the uneven path."""
    from dsp_plugin.comm import payload

    g = torch.Generator().manual_seed(3)
    rows = [[torch.randn(n, generator=g).to(torch.bfloat16)] for n in lengths]
    rows[0][0][5], rows[0][0][7], rows[0][0][9] = float("inf"), float("-inf"), float("nan")
    rows[1][0][:] = float("inf")                                     # a chunk of infinities alone
    send, _ = payload.encode(rows, [fmt])
    assert bytes(send[:lengths[0] + SCALE].tolist()) == _reference_chunk(rows[0][0], fmt)
    back = payload.decode(send, [[(n,)] for n in lengths], [fmt], torch.bfloat16)
    got, sent = back[0][0].float(), rows[0][0].float()
    finite = torch.isfinite(sent)
    assert torch.equal(got[~finite].isnan(), sent[~finite].isnan()), got[~finite]
    assert torch.equal(got[~finite].nan_to_num(), sent[~finite].nan_to_num()), got[~finite]   # +-inf kept
    assert int(got.isnan().sum()) == 1 and int(got.isinf().sum()) == 2, got
    assert (got[finite] - sent[finite]).abs().max() <= 0.07 * sent[finite].abs().max()
    assert torch.equal(back[1][0], rows[1][0])


def _non_finite_switch_worker(rank: int, n: int) -> list[torch.Tensor]:
    from dsp_plugin.comm import dynamic_switch, split

    full = torch.randn(2, 4, 6, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    full[0, 0, 5, 1] = float("inf")       # rank 0's frame, rank 1's patches: it travels
    full[1, 3, 0, 2] = float("-inf")      # rank 1's frame, rank 0's patches: it travels
    return [dynamic_switch(split(full, 1), 1, 2, global_len=4, comm_dtype=c) for c in (None, "fp8")]


def test_an_inf_through_the_fp8_switch_stays_one_inf() -> None:
    """The issue's case through the switch on 2 ranks: the FP8 wire gives the exact wire's non-finite values."""
    for rank, (exact, fp8) in enumerate(run_distributed(_non_finite_switch_worker, 2)):
        assert int(exact.isinf().sum()) == 1, rank
        assert torch.equal(fp8.isinf(), exact.isinf()) and torch.equal(fp8[fp8.isinf()], exact[exact.isinf()]), rank
        assert not fp8.isnan().any(), rank
