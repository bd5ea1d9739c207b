"""Per-call cost of the default DSP_CHECK ('first') path once a signature is agreed: ``agree._agree`` on a seen call.

    PYTHONPATH=. python scripts/check_cost.py [label]

One process; the exchange is faked once to seed the signature as agreed by two
ranks, then must not run again. To compare two trees, run it with PYTHONPATH at
each, alternating, in the same session (the machine's load moves the figure).
"""
import sys
import tempfile
import timeit

import torch
import torch.distributed as dist

from dsp_plugin.comm import agree

dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
x = torch.randn(2, 4, 16, 8)            # this rank's [B, T/2, S, D] shard of T = 8 on a group of 2
group = dist.group.WORLD
agree._exchange = lambda fp, device, g, n: [fp] * n          # seed the signature as agreed by 2 ranks
call = lambda: agree._agree("dynamic_switch", x, cur=1, tgt=2, known_len=8, group=group, n=2, rank=0, error=None)
call()
agree._exchange = lambda *a: (_ for _ in ()).throw(AssertionError("exchanged on a seen signature"))
call()
n = 20000
best = min(timeit.repeat(call, number=n, repeat=7)) / n
print(f"{sys.argv[1] if len(sys.argv) > 1 else 'this tree'}: {best * 1e6:.2f} us per call (best of 7 x {n})")
dist.destroy_process_group()
