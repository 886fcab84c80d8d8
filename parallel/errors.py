"""The one failure of a tensor-parallel group: it cannot run another step."""


class TensorParallelError(RuntimeError):
    """A worker died, a collective failed or timed out, or a step broke off half way: the ranks no longer
    agree on where they are, so the group is finished and the process must be restarted."""
