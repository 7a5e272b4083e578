"""Errors of the executors: a cluster that cannot be reached, a worker that cannot see the store."""

from __future__ import annotations

from ..errors import PipelineError


class ExecutorError(PipelineError, OSError):
    """The build's executor cannot do its job: no scheduler at the address, a worker that disagrees.

    An ``OSError`` because the cause is the environment (network, other machines), not the
    recipe's values. Constructed from one message only, so it crosses process boundaries
    (Dask pickles a worker's exception back to the client) unchanged.
    """


class WorkerStoreError(ExecutorError):
    """A Dask worker cannot open the store (or the staging directory) at the path the client uses.

    Workers write chunks straight into the store, so every worker must see the store's
    filesystem at the same path as the client (a shared or network filesystem).
    """
