"""What the gRPC test servers share: a unary method with no protoc, on a thread pool.

The method is registered with a generic handler and carries raw bytes, so no generated
code is needed. The pool has enough workers that no call waits for a thread: the number
of calls inside the handler is then the number the service has received and not yet
answered, which is the true in-flight count the tests compare the agent's with.
"""

from concurrent import futures

import grpc


def identity(b):
    return b


def start(service, work, workers, port=0, interceptors=()):
    """Serves `/<service>/Work` with `work(request, context)` on 127.0.0.1:`port` (0:
    any free port), through `interceptors`; returns the started server and the port it
    listens on (0 if none could be bound)."""
    handler = grpc.method_handlers_generic_handler(
        service,
        {
            "Work": grpc.unary_unary_rpc_method_handler(
                work, request_deserializer=identity, response_serializer=identity
            )
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers),
        handlers=[handler],
        maximum_concurrent_rpcs=None,
        interceptors=list(interceptors),
    )
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    if bound:
        server.start()
    return server, bound
