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


def metrics_interceptor(on_render=None):
    """go-grpc-prometheus' server counters, served by prometheus_client on a free
    loopback port: returns the interceptor and the port.

    grpc_server_started_total counts a call when it reaches the server,
    grpc_server_handled_total{grpc_code} when it is answered. `on_render`, if given,
    is called each time the page renders, between the two families (it adds nothing
    to the page): a test notes its true count at the instant of the scrape."""
    import socket

    import prometheus_client as prom

    # Go's client renders families sorted by name: handled before started. So does this
    # registry, by registration order, so that a page never shows more calls handled
    # than started.
    handled = prom.Counter(
        "grpc_server_handled",
        "Total number of RPCs completed on the server, regardless of success or failure.",
        ["grpc_type", "grpc_service", "grpc_method", "grpc_code"],
    )
    if on_render is not None:

        class Rendering:
            def collect(self):
                on_render()
                return []

            def describe(self):
                return []

        prom.REGISTRY.register(Rendering())
    started = prom.Counter(
        "grpc_server_started",
        "Total number of RPCs started on the server.",
        ["grpc_type", "grpc_service", "grpc_method"],
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prom.start_http_server(port, addr="127.0.0.1")

    class Counting(grpc.ServerInterceptor):
        def intercept_service(self, continuation, details):
            handler = continuation(details)
            if handler is None or handler.unary_unary is None:
                return handler
            _, service, method = details.method.split("/")
            inner = handler.unary_unary

            def behavior(request, context):
                started.labels("unary", service, method).inc()
                code = "OK"
                try:
                    return inner(request, context)
                except Exception:
                    code = "Unknown"
                    raise
                finally:
                    handled.labels("unary", service, method, code).inc()

            return grpc.unary_unary_rpc_method_handler(
                behavior,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

    return Counting(), port
