"""The partner ring of the in-memory copies (--save-local-every): one TCP stream from each rank to its partner.

Every rank sends each copy to its partner and files the one its source sends it (local_checkpoint.py). The
copies go over a plain socket, one stream per pair kept for the run, each copy one frame (step, length, bytes)
received by a thread of its own straight into the file it is kept in (mapped_file.py).

Why not gloo's send/recv, which the copies used before: a copy is sent after every step when N = 1, and gloo
costs far more CPU per message than a stream. `python bench/copy_transport.py` (4 ranks on one core of this CPU,
a 0.7 MB copy): gloo's three messages per copy (sizes, header, payload) 3.0 ms of CPU per rank and copy, one
gloo message 0.94 ms, the stream 0.24 ms; the exchange had been most of the copies' overhead on a step of
bench/local_recovery.py's model. A stream also keeps the copies out of gloo's lost-send stall (in_place.py).

The addresses are gathered over the copies' gloo group (so building the ring is collective). A connection
proves which rank it comes from with a random token that rank put in the gather: a stray connection to the
listening port is closed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

FRAME = struct.Struct("<qq")  # a copy's step, and how many bytes of it follow
HELLO = struct.Struct("<q16s")  # the connecting rank and its token


def _route_to(host: str) -> str | None:
    """The local address the kernel would send from to `host` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return None


def reachable_address() -> str:
    """This host's address as the other hosts of the job reach it: the interface that routes to MASTER_ADDR
    (loopback when the job is on one machine, or when there is no MASTER_ADDR: the launcher's own ranks). On
    the master's own host MASTER_ADDR may name it by a loopback alias (127.0.1.1 for its hostname, as some
    distributions set up /etc/hosts); when torchrun says the job spans hosts (LOCAL_WORLD_SIZE < WORLD_SIZE) a
    loopback address is no answer, and the interface of the default route is taken instead."""
    found = _route_to(os.environ.get("MASTER_ADDR", "127.0.0.1")) or "127.0.0.1"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if found.startswith("127.") and int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world:
        found = _route_to("192.0.2.1") or found  # (a documentation address: only the route is looked up)
    return found


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from `sock`. False: the peer closed the stream before the first byte (a clean end)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError(f"copy stream closed after {got} of {len(view)} bytes")
        got += n
    return True


def accept_from(listener: socket.socket, rank: int, token: bytes, deadline: float) -> socket.socket:
    """The connection that says it is `rank` with `token`; others are closed. socket.timeout past `deadline`."""
    hello = bytearray(HELLO.size)
    while True:
        listener.settimeout(max(0.001, deadline - time.monotonic()))
        conn, _ = listener.accept()
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            ok = _recv_exactly(conn, memoryview(hello)) and HELLO.unpack(hello) == (rank, token)
        except OSError:
            ok = False
        if ok:
            conn.settimeout(None)  # between copies the stream is idle for as long as a step takes
            return conn
        conn.close()


class CopyRing:
    """This rank's two streams: to `partner` (sent by the caller's thread) and from `source` (received by a thread
    of its own into `buffer_for(step, nbytes)`, then handed to `on_copy(step, nbytes)`). Built collectively over
    `group`."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        partner: int,
        source: int,
        buffer_for: Callable[[int, int], memoryview],
        on_copy: Callable[[int, int], None],
        timeout_s: float,
    ):
        self.source, self.timeout_s = source, timeout_s
        self.buffer_for, self.on_copy = buffer_for, on_copy
        self.error: BaseException | None = None
        self.received = threading.Condition()
        self.last_received: int | None = None  # the newest step filed from the source
        token = os.urandom(16)
        listener = socket.create_server(("", 0))
        listener.settimeout(timeout_s)
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, (reachable_address(), listener.getsockname()[1], token), group=group)
        host, port, _ = everyone[partner]
        self.out = socket.create_connection((host, port), timeout=timeout_s)  # sends time out: a hung partner
        self.out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.out.sendall(HELLO.pack(dist.get_rank(), token))
        self.inc = accept_from(listener, source, everyone[source][2], time.monotonic() + timeout_s)
        listener.close()
        self._thread = threading.Thread(target=self._receive_each, name="lmt-copy-receive", daemon=True)
        self._thread.start()

    def send(self, step: int, parts: list) -> None:
        """One copy to the partner (blocks until the kernel took it all; times out on a partner that reads none)."""
        self.out.sendall(FRAME.pack(step, sum(memoryview(p).nbytes for p in parts)))
        for part in parts:
            self.out.sendall(part)

    def _receive_each(self) -> None:
        frame = bytearray(FRAME.size)
        try:
            while _recv_exactly(self.inc, memoryview(frame)):
                step, size = FRAME.unpack(frame)
                _recv_exactly(self.inc, self.buffer_for(step, size))
                self.on_copy(step, size)
                with self.received:
                    self.last_received = step
                    self.received.notify_all()
            raise ConnectionError("the stream ended")
        except BaseException as e:  # noqa: BLE001 - read by the copier (wait_for), raised in the training thread
            with self.received:
                self.error = e
                self.received.notify_all()

    def wait_for(self, step: int) -> None:
        """Until the source's copy of `step` (or a newer one) is filed; raises what stopped the receiving, or a
        timeout (a source host gone without closing its connection never ends the stream)."""
        with self.received:
            arrived = self.received.wait_for(
                lambda: self.error is not None or (self.last_received is not None and self.last_received >= step),
                self.timeout_s,
            )
            if self.error is not None and (self.last_received is None or self.last_received < step):
                raise ConnectionError(f"no copy of step {step} from rank {self.source}: {self.error}")
            if not arrived:
                raise TimeoutError(f"no copy of step {step} from rank {self.source} in {self.timeout_s:g} s")

    def close(self) -> None:
        """End both streams. Called once every copy handed out was received (or the run failed): nothing is
        cut short that anyone waits for."""
        for sock, how in ((self.out, socket.SHUT_WR), (self.inc, socket.SHUT_RDWR)):
            with contextlib.suppress(OSError):
                sock.shutdown(how)
        self._thread.join()
        self.out.close()
        self.inc.close()
