"""Failures of worker processes, told apart from failures of the code they run.

A process that *died* (killed, OOM-killed, segfault, its node lost) is gone with its state;
building the workers again and continuing from the last checkpoint is expected to work. An
exception *raised* by the code in a worker (a bad shape, a CUDA OOM inside a step, a model path
missing in an actor's ``__init__``) would happen again after a rebuild, so it is not a death.

A rank whose collective lost its peer (gloo's "Connection reset by peer", an NCCL error) raises
rather than dies; ``ModelGroup`` then looks at the other ranks, and when one of them is dead the
failure is that death (``lost_peer``).
"""

from __future__ import annotations

__all__ = ["WorkerDied", "is_process_death", "lost_peer"]

# What a rank raises when the other end of a collective went away.
_PEER_LOSS_TYPES = ("DistBackendError", "DistNetworkError")
_PEER_LOSS_TEXT = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "NCCL communicator was aborted",
    "remote process exited",
    "Socket Timeout",
)


class WorkerDied(RuntimeError):
    """A model rank or rollout engine process died; the group or pool is unusable now."""


def is_process_death(exc: BaseException) -> bool:
    """True if ``exc`` (or what it wraps) says a Ray worker process is gone."""
    import ray.exceptions as rex

    deaths = (
        rex.RayActorError,  # ActorDiedError, ActorUnavailableError
        rex.WorkerCrashedError,
        rex.NodeDiedError,
        rex.OutOfMemoryError,  # Ray's memory monitor killed the worker
        rex.ObjectLostError,  # OwnerDiedError, ObjectReconstructionFailedError, ...
    )
    cause: BaseException | None = exc
    for _ in range(8):  # RayTaskError -> .cause -> __cause__ chains are short; never loop forever
        if cause is None:
            return False
        if getattr(cause, "actor_init_failed", False):
            return False  # its __init__ raised: the same error would come back
        if isinstance(cause, (WorkerDied, *deaths)) or type(cause).__name__ == "EngineDeadError":
            return True
        cause = getattr(cause, "cause", None) or cause.__cause__
    return False


def lost_peer(exc: BaseException) -> bool:
    """True if ``exc`` (or what it wraps) is a collective failing because a peer went away."""
    cause: BaseException | None = exc
    for _ in range(8):
        if cause is None:
            return False
        if type(cause).__name__ in _PEER_LOSS_TYPES or any(t in str(cause) for t in _PEER_LOSS_TEXT):
            return True
        cause = getattr(cause, "cause", None) or cause.__cause__
    return False
