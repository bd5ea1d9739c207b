"""For ``megatron.py dsp2`` only: gloo's coalesced all-reduce on CUDA tensors, one tensor at a time.

Two ranks on one GPU must talk over gloo (NCCL refuses them), and gloo has no
``allreduce_coalesced`` for CUDA tensors ("ProcessGroupGloo::allreduce_coalesced:
unsupported device type cuda", seen on an H200), which Megatron's DDP uses for
every gradient bucket. This replaces only that refusal by gloo's plain
``allreduce`` on each tensor (same sum, same tensors, in place); put this
folder on ``PYTHONPATH`` and Python imports it at start-up. Nothing of
dsp_plugin or Megatron is changed; NCCL runs never see it.
"""

from torch._C._distributed_c10d import AllreduceOptions, ProcessGroup

_coalesced = ProcessGroup.allreduce_coalesced


class _Done:
    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _allreduce_coalesced(self, tensors, opts=None):  # noqa: ANN001, ANN202
    if not tensors or tensors[0].device.type != "cuda":
        return _coalesced(self, tensors, opts) if opts is not None else _coalesced(self, tensors)
    try:
        return _coalesced(self, tensors, opts) if opts is not None else _coalesced(self, tensors)
    except RuntimeError as exc:
        if "unsupported device type cuda" not in str(exc):
            raise
    for t in tensors:
        one = AllreduceOptions()
        if opts is not None:
            one.reduceOp = opts.reduceOp
        self.allreduce([t], one).wait()
    return _Done()


ProcessGroup.allreduce_coalesced = _allreduce_coalesced
