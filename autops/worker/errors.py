"""The errors a worker's agent raises: an error reply from the parameter service, or a
failure to reach it (``autops.worker.agent`` and ``autops.agent`` export them)."""
from __future__ import annotations


class AutoPSError(RuntimeError):
    """An error reply from the parameter service, or a failure to reach it."""


def as_autops_error(exc: BaseException, what: str) -> AutoPSError:
    """What the caller's handle reports for a failure of its ``what`` operation."""
    return exc if isinstance(exc, AutoPSError) else AutoPSError(f"{what} failed: {exc}")


class BadSetting(AutoPSError, ValueError):
    """A bad ``AUTOPS_*`` value where a worker reads its settings (``AgentConfig.from_env``):
    an ``AutoPSError`` like every error of the agent, and the ``ValueError`` that names the
    variable."""


class MasterUnreachable(AutoPSError):
    """pMaster did not answer (it may be restarting)."""


class PoolBusy(AutoPSError):
    """pMaster cannot take the job now (admission refused, the pool restarting): retry later."""


class AuthRefused(AutoPSError):
    """pMaster refused a request for want of the right secret or token (the text says which)."""
