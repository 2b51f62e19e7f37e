"""A sync gRPC service whose worker pool comes from its agent (``RpcAgent.thread_pool``), so that
a handler's wait for a worker is a wait the detector sees: the pool deadlocks of the breaking tests."""

from __future__ import annotations

from typing import Any

import grpc
from rpc_harness import SERVICE

from stablewatch.agents.rpc import RpcAgent


class PoolService:
    """A sync gRPC server on 127.0.0.1 with the given raw-bytes unary handlers (or method handlers of
    any kind), ``workers`` workers from its agent's ``thread_pool``, and its agent's interceptor
    over that pool."""

    def __init__(self, handlers: dict[str, Any], agent: RpcAgent, workers: int = 1) -> None:
        self.pool = agent.thread_pool(workers)
        self.server = grpc.server(self.pool, interceptors=[agent.server_interceptor(workers=self.pool)])
        methods = {
            name: fn if isinstance(fn, grpc.RpcMethodHandler) else grpc.unary_unary_rpc_method_handler(fn)
            for name, fn in handlers.items()
        }
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, methods)])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=0).wait(10)
        self.pool.shutdown(wait=True, cancel_futures=True)
