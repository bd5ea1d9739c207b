"""The head switch's GQA rule and its replicated-token checks, on cases the older tests did not reach.

Issue 29's survivors 4 and 9:

- GQA whose query chunk on one rank straddles K/V groups although its head count
  is a multiple of its K/V heads (9 query / 3 K/V heads on 2 ranks: rank 1 holds
  query heads 5..8, which read K/V heads 1, 2, 2, 2; the plain GQA rule on 2 local
  K/V heads would read 1, 1, 2, 2). Oracle: ``scaled_dot_product_attention`` on the
  whole sequence with every head, one process, fp64; locally the kernel applies
  the GQA rule itself (``enable_gqa=True``), as a model's attention does.
- Joint attention's replicated tokens (``replicated=``) with different token counts
  for q, k, v, or a shape unlike their shard's: refused by a ``ValueError`` that
  names the counts, the same on every rank, before the all-to-all.

Every check names the case, the quantity and the rank; a wrong head count after ``to_heads`` is
reported as such, before the kernel would crash on it (zeros of the right shape stand in, so the
ranks' collectives stay aligned).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dsp_plugin import from_heads, to_heads
from dsp_plugin.checks import forget_signatures
from tests.distributed import run_distributed
from tests.test_heads import _local_heads

# (tokens, query heads, K/V heads) on 2 ranks: 9/3 is survivor 4's case (rank 1: 4 heads over 2 K/V groups,
# unevenly); 10/2 straddles with an odd count (5 heads, 1 K/V head each: aligned), 6/2 and 12/4 straddle evenly
# or not at all (tests/test_heads.py runs 4 ranks: H=10, H_kv=2 straddles there)
GQA_CASES = [(5, 9, 3), (6, 6, 2), (7, 12, 4), (4, 10, 2)]


def _full(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _gqa_attention(rank: int, n: int) -> dict[str, float]:
    """Per case: max |output - oracle| and max |dq, dk, dv - oracle| on this rank's shard."""
    errors: dict[str, float] = {}
    for case, (seq, heads, kv_heads) in enumerate(GQA_CASES):
        batch, size = 2, 4
        fulls = [_full((batch, h, seq, size), 10 * case + i) for i, h in enumerate((heads, kv_heads, kv_heads))]
        grad = _full((batch, heads, seq, size), 10 * case + 7)
        whole = [t.clone().requires_grad_(True) for t in fulls]
        expected = F.scaled_dot_product_attention(*whole, enable_gqa=True)
        expected.backward(grad)
        mine = [t.tensor_split(n, dim=2)[rank].clone().requires_grad_(True) for t in fulls]
        q, k, v = to_heads(*mine, seq_dim=2, head_dim=1, global_len=seq)
        name = f"{heads} query / {kv_heads} K/V heads, {seq} tokens"
        query, kv = _local_heads(heads, kv_heads, n, rank)    # the documented rule, written in tests/test_heads
        if (q.shape[1], k.shape[1], v.shape[1]) != (len(query), len(kv), len(kv)):  # found before the kernel
            errors[f"{name}: heads after to_heads {(q.shape[1], k.shape[1], v.shape[1])}, expected "
                   f"{(len(query), len(kv), len(kv))} (q, k, v)"] = float("inf")
            # zeros of the expected shape, still in to_heads' graph: every rank's backward meets its peers'
            q, k, v = (t.sum() * 0 + t.new_zeros(t.shape[0], h, seq, size)
                       for t, h in ((q, len(query)), (k, len(kv)), (v, len(kv))))
        out = from_heads(F.scaled_dot_product_attention(q, k, v, enable_gqa=True), seq_dim=2, head_dim=1,
                         heads=heads)
        out.backward(grad.tensor_split(n, dim=2)[rank])
        errors[f"{name}: output"] = (out - expected.tensor_split(n, dim=2)[rank]).abs().max().item()
        errors[f"{name}: q, k, v gradients"] = max(
            (t.grad - ref.grad.tensor_split(n, dim=2)[rank]).abs().max().item() if t.grad is not None
            else float("inf") for t, ref in zip(mine, whole))
    return errors


def _two_ranks(rank: int, n: int) -> dict[str, Any]:
    return {"gqa": _gqa_attention(rank, n), "replicated": _replicated(rank, n)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """The 2-rank cases in one spawn."""
    return run_distributed(_two_ranks, 2)


def test_gqa_straddling_groups_attends_like_one_process_on_two_ranks(two_ranks: list[dict[str, Any]]) -> None:
    _check_gqa([r["gqa"] for r in two_ranks])


def _check_gqa(results: list[dict[str, float]]) -> None:
    n = len(results)
    wrong = [f"GQA {what} on rank {rank} of {n}" + ("" if error == float("inf") else
                                                       f": {error:.3g} off one-process SDPA (fp64)")
             for rank, errors in enumerate(results)
             for what, error in errors.items() if not error < 1e-12]
    assert not wrong, ("local query head i must read the K/V head its global head reads ((first + i) // (H / H_kv)):\n"
                       + "\n".join(sorted(wrong, key=lambda line: "heads after" not in line)))


def _replicated(rank: int, n: int) -> dict[str, str]:
    """Each bad ``replicated=`` call: the error text this rank raised, or 'no error'."""
    q = torch.zeros(1, 4, 4, 2)                       # [B, L_local, H, Dh]

    def text(tokens: int) -> torch.Tensor:
        return torch.zeros(1, tokens, 4, 2)

    rows = {
        "to_heads: token counts differ": lambda: to_heads(q, q, q, seq_dim=1, head_dim=2, global_len=8,
                                                          replicated=(text(2), text(3), text(2))),
        "to_heads: heads differ": lambda: to_heads(q, q, q, seq_dim=1, head_dim=2, global_len=8,
                                                   replicated=(text(2), text(2), torch.zeros(1, 2, 3, 2))),
        "to_heads: two tensors": lambda: to_heads(q, q, q, seq_dim=1, head_dim=2, global_len=8,
                                                  replicated=(text(2), text(2))),
        "from_heads: heads differ": lambda: from_heads(q, seq_dim=1, head_dim=2, heads=8,
                                                       replicated=torch.zeros(1, 2, 3, 2)),
    }
    out: dict[str, str] = {}
    for name, call in rows.items():
        forget_signatures()
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - reported, and compared with the expected refusal
            out[name] = f"{type(exc).__name__}: {exc}"
            continue
        out[name] = "no error"
        break  # a call that went through may have left the ranks in different collectives: stop here
    return out


REPLICATED_EXPECTED = {
    "to_heads: token counts differ": "the replicated q, k, v hold [2, 3, 2] tokens on dim 1; expected the same count",
    "to_heads: heads differ": "the replicated v has shape (1, 2, 3, 2), its shard (1, 4, 4, 2)",
    "to_heads: two tensors": "replicated=tuple; expected 3 tensors",
    "from_heads: heads differ": "the replicated out has shape (1, 2, 3, 2), its shard (1, 4, 4, 2)",
}


def test_replicated_tokens_that_do_not_match_are_refused_on_every_rank(two_ranks: list[dict[str, Any]]) -> None:
    results = [r["replicated"] for r in two_ranks]
    for name, expected in REPLICATED_EXPECTED.items():
        for rank, got in enumerate(results):
            assert expected in got.get(name, "not run (an earlier call was not refused)"), (
                f"{name}: rank {rank} raised {got.get(name, 'nothing')!r}; expected a refusal naming the "
                f"replicated tokens ({expected!r}) before the all-to-all")
        assert results[0][name] == results[1][name], f"{name}: the ranks raised different errors: {results}"
