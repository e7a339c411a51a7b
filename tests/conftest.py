import socket

import pytest


@pytest.fixture
def free_port() -> int:
    """A TCP port nobody listens on right now (for servers and launchers started by a test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
