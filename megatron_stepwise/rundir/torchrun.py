"""torchrun whose rendezvous store listens on one address only: `python -m megatron_stepwise.rundir.torchrun`.

torch's TCPStore listens on every interface whatever host it is given, and answers anyone who
connects (no authentication), so a plain `torchrun --rdzv-endpoint=127.0.0.1:P` still exposes
the store on the node's public addresses. The `bound-static` rendezvous backend registered here
is torch's static rendezvous with the store's socket bound first to the endpoint's address and
handed to the store (`master_listen_fd`): a single-node launch uses 127.0.0.1, a multi-node one
the address the cluster uses (the Ray head's, launch/plan.py). Port 0 picks a free port (single
node only: the other nodes could not know it). The workers reuse this store
(TORCHELASTIC_USE_AGENT_STORE), so no other store listens. The node's rank goes in
`--rdzv-conf=rank=N` (torchrun passes `--node-rank` to its own static backend only).
"""

from __future__ import annotations

import socket
import sys

BACKEND = "bound-static"
_LISTEN_BACKLOG = 2048  # torch's own TCPStore backlog


def single_node_args() -> list[str]:
    """torchrun's rendezvous for one node: the store on loopback, on a free port (concurrent runs
    do not collide), instead of `--standalone`'s store on every interface."""
    return [f"--rdzv-backend={BACKEND}", "--rdzv-endpoint=127.0.0.1:0", "--nnodes=1"]


def listen_on(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to `host` (a name or an address) and `port` (0: any free one)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(_LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def _handler_class():
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class BoundStaticRendezvous(StaticTCPRendezvous):
        """Static rendezvous; node 0's store listens on the endpoint's address only."""

        def get_backend(self) -> str:
            return BACKEND

        def next_rendezvous(self):
            if self._store is None and self.rank == 0:
                listener = listen_on(self.master_addr, self.master_port)
                self.master_port = listener.getsockname()[1]  # the port workers connect to (0 resolved)
                self._store = TCPStore(
                    self.master_addr,
                    self.master_port,
                    self.world_size,
                    True,
                    self.timeout,
                    multi_tenant=True,
                    master_listen_fd=listener.detach(),  # the store owns the socket from here on
                )
            return super().next_rendezvous()

    return BoundStaticRendezvous


def create_handler(params):
    """torchrun's handler creator for `--rdzv-backend=bound-static`."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint.strip(), -1)
    if not params.endpoint.strip() or port == -1:
        raise ValueError(f"--rdzv-endpoint: {params.endpoint!r} needs HOST:PORT for the {BACKEND} rendezvous")
    if params.max_nodes > 1 and ("rank" not in params.config or port == 0):
        raise ValueError(
            f"--rdzv-endpoint={params.endpoint}: {params.max_nodes} nodes need --rdzv-conf=rank=N and a fixed port"
        )
    timeout = int(params.config.get("timeout", 600))
    rank = int(params.config.get("rank", 0))
    return _handler_class()(host, port, rank, params.max_nodes, params.run_id, timeout)


def register() -> None:
    """Make `--rdzv-backend=bound-static` known to torchrun in this process (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, create_handler)  # the same creator again is accepted


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.run import main as torchrun_main

    register()
    torchrun_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
