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
    """py-grpc-prometheus' server interceptor (the Python counterpart of
    go-grpc-prometheus), its counters served by prometheus_client on a free loopback
    port: returns the interceptor and the port.

    grpc_server_started_total counts a call when it reaches the server,
    grpc_server_handled_total{grpc_code} when it is answered. The interceptor registers
    handled before started, and the registry renders families in that order, as Go's
    client does by sorting them: a page never shows more calls handled than started.
    `on_render`, if given, is called each time the page renders, between the two
    families (it adds nothing to the page): a test notes its true count at the instant
    of the scrape."""
    import socket

    import prometheus_client as prom
    from py_grpc_prometheus.prometheus_server_interceptor import PromServerInterceptor

    interceptor = PromServerInterceptor()
    served = prom.REGISTRY
    if on_render is not None:

        class Page:
            """The default registry's families in its order, `on_render` called right
            after the handled family's snapshot and before the started one's."""

            def collect(self):
                handled = False
                for family in prom.REGISTRY.collect():
                    if family.name == "grpc_server_started" and not handled:
                        raise RuntimeError(
                            "grpc_server_started renders before grpc_server_handled: "
                            "a page could show more calls handled than started"
                        )
                    yield family
                    if family.name == "grpc_server_handled":
                        handled = True
                        on_render()

            def describe(self):
                return []

        served = prom.CollectorRegistry(auto_describe=False)
        served.register(Page())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prom.start_http_server(port, addr="127.0.0.1", registry=served)
    return interceptor, port
