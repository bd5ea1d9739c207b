"""The head switch (dsp_plugin.head_switch) against a single-process reference.

Data movement is checked bit-exact against the full tensors every worker
builds from a seed (``narrow`` / ``index_select`` of the full q, k, v), with
integer-valued gradients so that the K/V heads whose gradients several ranks
sum stay exact. Attention through ``to_heads``/``from_heads`` is checked against
one process running the same module on the whole sequence (fp64, 1e-9).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dsp_plugin import from_heads, gather, reduce_gradients, split, to_heads
from dsp_plugin.accounting import CommAccounting
from dsp_plugin.checks import CrossRankMismatch, forget_signatures
from dsp_plugin.head_switch import head_ranges, kv_elements_sent
from dsp_plugin.layout import attach, shard_spec
from tests.distributed import run_distributed

# (sequence length, query heads, K/V heads): even; uneven sequence; H % N != 0 (and N > H at N=4);
# GQA aligned; MQA; GQA whose query chunks straddle K/V groups (H=10, H_kv=2 at N=4: 3,3,2,2 heads)
CASES = [(8, 4, 4), (7, 4, 4), (7, 3, 3), (6, 4, 2), (5, 4, 1), (9, 10, 2)]


def _full(shape: tuple[int, ...], seed: int, *, integer: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if integer:
        return torch.randint(-8, 9, shape, generator=gen).double()
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _local_heads(heads: int, kv_heads: int, n: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank j's query heads and the K/V heads it holds after the switch, by the documented rule.

    The K/V heads its query heads read, once each, when local query head i reads local K/V head
    i // ratio; else one K/V head per query head.
    """
    first, count = head_ranges(heads, n)[j]
    query = torch.arange(first, first + count)
    read = query // (heads // kv_heads)
    once = torch.unique(read)
    if count == 0 or (count % len(once) == 0 and torch.equal(read, once.repeat_interleave(count // len(once)))):
        return query, once
    return query, read


def _movement(rank: int, n: int) -> int:
    checks = 0
    for case, (seq, heads, kv_heads) in enumerate(CASES):
        batch, size = 2, 3
        q_full = _full((batch, seq, heads, size), 10 * case)
        k_full = _full((batch, seq, kv_heads, size), 10 * case + 1)
        v_full = _full((batch, seq, kv_heads, size + 1), 10 * case + 2)   # V's head size may differ
        fulls = (q_full, k_full, v_full)
        q, k, v = (t.tensor_split(n, dim=1)[rank].clone().requires_grad_(True) for t in fulls)
        attach(q, 1, seq)  # the length from the tag, as a split or switch output carries it
        outs = to_heads(q, k, v, seq_dim=1, head_dim=2)
        query, kv = _local_heads(heads, kv_heads, n, rank)
        for out, full, index in zip(outs, fulls, (query, kv, kv)):
            assert torch.equal(out, full.index_select(2, index)), (case, rank)
        assert shard_spec(outs[0]).dim == 2 and shard_spec(outs[0]).global_len == heads
        # backward against autograd on the full tensors, every rank's outputs simulated on one process
        refs = [t.clone().requires_grad_(True) for t in fulls]
        loss, mine = torch.zeros((), dtype=torch.float64), None
        for j in range(n):
            query_j, kv_j = _local_heads(heads, kv_heads, n, j)
            for i, (ref, index) in enumerate(zip(refs, (query_j, kv_j, kv_j))):
                grad = _full((batch, seq, len(index), ref.shape[3]), 1000 * case + 10 * j + i, integer=True)
                loss = loss + (ref.index_select(2, index) * grad).sum()
                if j == rank:
                    mine = [grad] if i == 0 else [*mine, grad]
        loss.backward()
        torch.autograd.backward(outs, mine)
        for t, ref in zip((q, k, v), refs):
            assert torch.equal(t.grad, ref.grad.tensor_split(n, dim=1)[rank]), (case, "grad")
        # from_heads is the inverse: the heads go back to the sequence shard
        back = from_heads(outs[0].detach(), seq_dim=1, head_dim=2, heads=heads)
        assert torch.equal(back, q.detach()) and shard_spec(back).global_len == seq
        assert torch.equal(from_heads(outs[0].detach(), seq_dim=-3, head_dim=-2), q.detach())  # heads: the group
        checks += 1
    # other dim orders: [B, H, S, D] with the head dim before the sequence dim
    x_full = _full((2, 5, 7, 3), 99)
    x = x_full.tensor_split(n, dim=2)[rank]
    q_h, k_h, v_h = to_heads(x, x, x, seq_dim=2, head_dim=1, global_len=7)
    assert torch.equal(q_h, x_full.tensor_split(n, dim=1)[rank]) and torch.equal(k_h, q_h)
    assert torch.equal(from_heads(q_h, seq_dim=2, head_dim=1, heads=5, global_len=7), x)
    return checks + 1


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_movement_bit_exact(spawned: Callable[[int, str], list[Any]], world_size: int) -> None:
    assert spawned(world_size, "movement") == [len(CASES) + 1] * world_size


class _Attention(nn.Module):
    """Self-attention over ``[B, S, D]`` with GQA; ``parallel`` wraps the core in the head switch."""

    def __init__(self, dim: int, heads: int, kv_heads: int, size: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.size = heads, kv_heads, size
        self.q = nn.Linear(dim, heads * size, dtype=torch.float64)
        self.kv = nn.Linear(dim, 2 * kv_heads * size, dtype=torch.float64)
        self.out = nn.Linear(heads * size, dim, dtype=torch.float64)

    def forward(self, x: torch.Tensor, *, parallel: bool = False) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q = self.q(x).view(batch, tokens, self.heads, self.size)
        k, v = self.kv(x).view(batch, tokens, 2, self.kv_heads, self.size).unbind(2)
        if parallel:
            q, k, v = to_heads(q, k, v, seq_dim=1, head_dim=2)
        ratio = q.shape[2] // k.shape[2] if k.shape[2] else 1
        k, v = k.repeat_interleave(ratio, dim=2), v.repeat_interleave(ratio, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / self.size ** 0.5
        o = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
        if parallel:
            o = from_heads(o, seq_dim=1, head_dim=2, heads=self.heads)
        return self.out(o.reshape(batch, o.shape[1], -1))


ATTENTION_CASES = [(7, 3, 3), (6, 4, 2), (5, 4, 1)]  # (tokens, heads, kv heads): uneven, N > H at N=4, GQA, MQA


def _attention(rank: int, n: int) -> list[dict[str, float]]:
    return [_attention_case(*case) for case in ATTENTION_CASES]


def _attention_case(tokens: int, heads: int, kv_heads: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = _Attention(8, heads, kv_heads, 4)
    x_full = _full((2, tokens, 8), 1)
    weight = _full((2, tokens, 8), 2)
    ref_x = x_full.clone().requires_grad_(True)
    (model(ref_x) * weight).sum().backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    x = x_full.clone().requires_grad_(True)
    y = gather(model(split(x, 1), parallel=True), 1)
    (y * weight).sum().backward()
    reduce_gradients(model.parameters())  # the convention: parameter gradients summed over the group
    errors = {"output": (y - model(x_full)).abs().max().item(), "input": (x.grad - ref_x.grad).abs().max().item()}
    errors["params"] = max((p.grad - ref_grads[name]).abs().max().item() for name, p in model.named_parameters())
    return errors


@pytest.mark.parametrize("world_size", [2, 4])
def test_attention_equals_one_process(spawned: Callable[[int, str], list[Any]], world_size: int) -> None:
    for rank, cases in enumerate(spawned(world_size, "attention")):
        for case, errors in zip(ATTENTION_CASES, cases):
            assert max(errors.values()) < 1e-9, (rank, case, errors)


def _counts(rank: int, n: int) -> dict[str, object]:
    batch, seq, heads, kv_heads, size = 2, 7, 8, 2, 3
    q, k, v = (_full((batch, seq, h, size), i).tensor_split(n, dim=1)[rank].clone().requires_grad_(True)
               for i, h in enumerate((heads, kv_heads, kv_heads)))
    to_heads(q.detach(), k.detach(), v.detach(), seq_dim=1, head_dim=2, global_len=seq)  # the ranks agree once
    with CommAccounting() as acct:
        q_h, k_h, v_h = to_heads(q, k, v, seq_dim=1, head_dim=2, global_len=seq)
        out = from_heads(q_h + k_h.repeat_interleave(q_h.shape[2] // k_h.shape[2], 2) + v_h.sum(), seq_dim=1,
                         head_dim=2, heads=heads)
        out.sum().backward()
    # double backward: to_heads only moves data, so d/dq sum((2q)^2) = 8q through two more exchanges
    x = q.detach().clone().requires_grad_(True)
    y = to_heads(x, x, x, seq_dim=1, head_dim=2, global_len=seq)[0]
    (grad,) = torch.autograd.grad((y ** 2).sum(), x, create_graph=True)
    (grad ** 2).sum().backward()
    return {"records": [(r.op, r.phase) for r in acct.records],
            "sent": [r.bytes_sent for r in acct.records if r.phase == "forward"],
            "double": torch.equal(x.grad, 8 * x.detach())}


def test_one_all_to_all_each_way_and_the_bytes(spawned: Callable[[int, str], list[Any]]) -> None:
    n, seq, heads, kv_heads, row = 4, 7, 8, 2, 2 * 3 * 8  # row: batch * head size * 8 bytes
    for rank, res in enumerate(spawned(n, "counts")):
        assert res["records"] == [("all_to_all", "forward")] * 2 + [("all_to_all", "backward")] * 2, res
        tokens = [2, 2, 2, 1][rank]
        kv = kv_elements_sent(heads=heads, kv_heads=kv_heads, n=n, rank=rank, tokens=tokens, row=row)
        q_sent = tokens * row * heads * (n - 1) // n
        assert res["sent"][0] == q_sent + 2 * kv["this_switch"]
        assert res["sent"][1] == sum(s * row * 2 for j, s in enumerate([2, 2, 2, 1]) if j != rank)
        assert kv["this_switch"] <= min(kv["repeat_to_heads"], kv["all_gather"])
        assert res["double"]


def _bad(rank: int, n: int) -> dict[str, str]:
    q = torch.zeros(1, 4, 4, 2)
    rows = {
        "kv heads do not divide": lambda: to_heads(q, q[:, :, :3], q[:, :, :3], seq_dim=1, head_dim=2, global_len=8),
        "one rank's dims": lambda: to_heads(q, q, q, seq_dim=1 + rank, head_dim=2, global_len=8),
        "global_len differs": lambda: to_heads(q, q, q, seq_dim=1, head_dim=2, global_len=8 - rank),
        "v heads differ from k": lambda: to_heads(q, q, q[:, :, :2 + 2 * rank], seq_dim=1, head_dim=2, global_len=8),
        "from_heads global_len": lambda: from_heads(q, seq_dim=1, head_dim=2, global_len=5, heads=8),
        "from_heads heads": lambda: from_heads(q, seq_dim=1, head_dim=2, heads=3 + rank),
        "folded tag": lambda: to_heads(attach(q.clone(), 1, 8, grid=(2, 4), axis=1), q, q, seq_dim=1, head_dim=2),
    }
    out = {}
    for name, call in rows.items():
        forget_signatures()
        try:
            call()
            out[name] = "no error"
        except CrossRankMismatch as exc:
            out[name] = str(exc)
    return out


EXPECTED = {
    "kv heads do not divide": "expected k and v alike, with a head count >= 1 that divides q's",
    "one rank's dims": "seq_dim=2 and head_dim=2 are both dim 2",
    "global_len differs": "the full length of dim 1 (global_len) is 8 on rank 0, 7 on rank 1",
    "v heads differ from k": "q, k, v have 4, 4, 2 heads (dim 2)",
    "from_heads global_len": "from_heads: global_len=5, but out holds 4 tokens on dim 1",
    "from_heads heads": "from_heads: the 2 ranks of group [0, 1] disagree before the collective: the full length",
    "folded tag": "folds the sequence axes (2, 4)",
}


def test_bad_inputs_fail_alike_on_every_rank(spawned: Callable[[int, str], list[Any]]) -> None:
    results = spawned(2, "bad")
    for name, expected in EXPECTED.items():
        assert results[0][name] == results[1][name], name
        assert expected in results[0][name], (name, results[0][name])


def test_one_process_is_identity_and_checks_at_once() -> None:
    q = torch.zeros(1, 4, 4, 2)
    assert all(a is b for a, b in zip(to_heads(q, q, q, seq_dim=1, head_dim=2), (q, q, q)))
    assert from_heads(q, seq_dim=1, head_dim=2) is q
    with pytest.raises(ValueError, match="seq_dim=1 and head_dim=-3 are both dim 1"):
        to_heads(q, q, q, seq_dim=1, head_dim=-3)
    with pytest.raises(TypeError, match="to_heads: k must be a torch.Tensor, got list"):
        to_heads(q, [1], q, seq_dim=1, head_dim=2)


def _docs_example(rank: int, n: int) -> bool:
    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    code = re.search(r"<!-- example: head-switch -->\n```python\n(.*?)```", text, flags=re.S).group(1)
    exec(compile(code, "docs/api.md", "exec"), {"__name__": "__docs__"})  # noqa: S102 - our own docs
    return True


def test_the_api_example_runs_on_two_ranks(spawned: Callable[[int, str], list[Any]]) -> None:
    assert spawned(2, "docs") == [True, True]


#: what each world's one spawn runs, in turn on the same processes (starting processes dominates the cost)
_SPAWNS = {2: ("movement", "attention", "bad", "docs"), 4: ("movement", "attention", "counts")}


def _spawn(rank: int, n: int) -> dict[str, Any]:
    workers = {"movement": _movement, "attention": _attention, "counts": _counts, "bad": _bad,
               "docs": _docs_example}
    return {name: workers[name](rank, n) for name in _SPAWNS[n]}


@pytest.fixture(scope="module")
def spawned() -> Callable[[int, str], list[Any]]:
    """``spawned(n, part)``: that part's result on each rank, from one spawn per world size."""
    runs: dict[int, list[dict[str, Any]]] = {}

    def get(n: int, part: str) -> list[Any]:
        if n not in runs:
            runs[n] = run_distributed(_spawn, n)
        return [result[part] for result in runs[n]]

    return get


def test_straddling_kv_heads_are_repeated_without_an_index_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose query heads straddle K/V groups repeats its K/V heads to one per query head; no index tensor is
    built for it (on a GPU that is a blocking host-to-device copy on every call), and the result and its gradient
    are ``index_select``'s."""
    from dsp_plugin.head_switch.exchange import _local_kv_index, repeat_heads

    index = _local_kv_index(10, 2, 4, 1)  # H=10, H_kv=2 at N=4: rank 1 holds query heads 3-5, K/V heads 0-1
    assert index == [0, 0, 1]
    t = torch.randn(5, 2, 2, 3, requires_grad=True)
    built: list[object] = []
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: built.append(a) or real_tensor(*a, **k))
    ours = repeat_heads(t, index, 2)
    monkeypatch.undo()
    assert built == []
    expected = t.index_select(2, torch.tensor(index))
    assert torch.equal(ours, expected)
    grad = torch.randn(expected.shape)
    assert torch.equal(torch.autograd.grad(ours, t, grad)[0], torch.autograd.grad(expected, t, grad)[0])
