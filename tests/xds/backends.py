"""Real gRPC backends for the xDS test.

Starts one grpcio server per name given on the command line, each on a free port of
127.0.0.1 (or of the address given with `--host ADDRESS` before the names), answering every unary method with its own name (raw bytes, so no .proto is
compiled). Prints one JSON line, {"name": port, ...}, once all are serving, then serves
until its standard input closes: the test holding the pipe ends it by dropping it.
"""

import json
import sys
from concurrent import futures

import grpc


class Named(grpc.GenericRpcHandler):
    """Answers any method with the backend's name."""

    def __init__(self, name):
        self.name = name.encode()

    def service(self, handler_call_details):
        return grpc.unary_unary_rpc_method_handler(lambda request, context: self.name)


def main():
    names = sys.argv[1:]
    host = "127.0.0.1"
    if names[:1] == ["--host"]:
        if len(names) < 2:
            sys.exit("usage: backends.py [--host ADDRESS] NAME...")
        host, names = names[1], names[2:]
    if not names:
        sys.exit("usage: backends.py [--host ADDRESS] NAME...")
    servers = []
    ports = {}
    for name in names:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        server.add_generic_rpc_handlers((Named(name),))
        port = server.add_insecure_port(f"{host}:0")
        if port == 0:
            sys.exit(f"backend {name}: cannot bind a port on {host}")
        server.start()
        servers.append(server)
        ports[name] = port
    print(json.dumps(ports), flush=True)
    sys.stdin.read()
    for server in servers:
        server.stop(grace=None)


if __name__ == "__main__":
    main()
