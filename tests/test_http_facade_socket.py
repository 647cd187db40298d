"""The HTTP facade's listener must hand asyncio sockets it will set TCP_NODELAY on.

Without it every request/response exchange through the facade stalled ~43 ms on Nagle plus
delayed ACK, which skewed the peer-router comparison (issue #20).
"""

import asyncio
import socket

from workers.http_facade.server import _listen


def test_connections_accepted_on_the_facade_listener_have_nagle_disabled() -> None:
    async def scenario() -> int:
        sock = _listen("127.0.0.1", 0)
        port = sock.getsockname()[1]
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = writer.get_extra_info("socket")
            accepted.set_result(peer.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_conn, sock=sock)
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            value = await asyncio.wait_for(accepted, 5)
            w.close()
            return value
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(scenario()) != 0
