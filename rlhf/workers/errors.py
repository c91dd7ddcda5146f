"""Failures of worker processes, told apart from failures of the code they run.

A process that *died* (killed, OOM-killed, segfault, its node lost) is gone with its state;
building the workers again and continuing from the last checkpoint is expected to work. An
exception *raised* by the code in a worker (a bad shape, a CUDA OOM inside a step) would
happen again after a rebuild, so it is not a death.
"""

from __future__ import annotations

__all__ = ["WorkerDied", "is_process_death"]


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
        if isinstance(cause, (WorkerDied, *deaths)) or type(cause).__name__ == "EngineDeadError":
            return True
        cause = getattr(cause, "cause", None) or cause.__cause__
    return False
