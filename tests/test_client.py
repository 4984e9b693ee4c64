"""stream.client's discovery: HOST:PORT to every address, connections following the addresses as they change."""

from __future__ import annotations

import pytest

from stream.client import Discovery, dns_resolver, iter_messages, split_target


class FakeSocket:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def connect(self, ep: str) -> None:
        self.calls.append(("connect", ep))

    def disconnect(self, ep: str) -> None:
        self.calls.append(("disconnect", ep))


@pytest.mark.parametrize(
    ("target", "want"),
    [
        ("stream.video.svc.cluster.local:5556", ("stream.video.svc.cluster.local", 5556)),
        ("127.0.0.1:1", ("127.0.0.1", 1)),
        ("[::1]:5556", ("::1", 5556)),
    ],
)
def test_split_target(target: str, want: tuple[str, int]) -> None:
    assert split_target(target) == want


@pytest.mark.parametrize("target", ["stream", "stream:", ":5556", "stream:port", "stream:0", "stream:70000"])
def test_bad_targets_say_host_port(target: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_target(target)


def test_the_dns_resolver_uses_getaddrinfo() -> None:
    assert dns_resolver("127.0.0.1", 5556) == [("127.0.0.1", 5556)]
    assert ("127.0.0.1", 7) in dns_resolver("localhost", 7)


def test_refresh_connects_new_addresses_and_disconnects_gone_ones() -> None:
    answers = [
        [("10.0.0.1", 5556), ("10.0.0.2", 5556)],
        [("10.0.0.2", 5556), ("fd00::3", 5556)],  # pod 0 restarted elsewhere... and an IPv6 pod
        OSError("Name or service not known"),  # DNS down (or no pod ready): keep what is connected
        [("10.0.0.2", 5556), ("fd00::3", 5556)],
    ]
    seen: list[tuple[str, int]] = []

    def resolver(host: str, port: int) -> list[tuple[str, int]]:
        seen.append((host, port))
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    sock = FakeSocket()
    found = Discovery("stream.video.svc:5556", 0.5, resolver)
    found.refresh(sock)  # type: ignore[arg-type]
    assert sock.calls == [("connect", "tcp://10.0.0.1:5556"), ("connect", "tcp://10.0.0.2:5556")]
    sock.calls.clear()
    found.refresh(sock)  # type: ignore[arg-type]
    assert sock.calls == [("connect", "tcp://[fd00::3]:5556"), ("disconnect", "tcp://10.0.0.1:5556")]
    sock.calls.clear()
    found.refresh(sock)  # type: ignore[arg-type]
    found.refresh(sock)  # type: ignore[arg-type]
    assert sock.calls == [] and found.connected == {"tcp://10.0.0.2:5556", "tcp://[fd00::3]:5556"}
    assert seen == [("stream.video.svc", 5556)] * 4
    assert 0 < found.wait_ms(-1) <= 500 and found.wait_ms(100) <= 100


def test_an_interval_of_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="interval"):
        Discovery("a:1", 0)


def test_timeout_names_the_discover_target() -> None:
    def nobody(host: str, port: int) -> list[tuple[str, int]]:
        raise OSError("no such host")

    with pytest.raises(TimeoutError, match=r"nowhere\.invalid:5556 \(no address resolved\)"):
        next(
            iter_messages([], discover="nowhere.invalid:5556", discover_interval_s=0.1, resolver=nobody, timeout_s=0.5)
        )


def test_async_subscribe_discovers_a_publisher() -> None:
    """The asyncio iterator follows discovery as the blocking one does: a bare PUB on 127.0.0.1, found through
    a resolver, is connected to and read until its eos."""
    import asyncio
    import threading

    import zmq

    from stream import messages
    from stream.client import subscribe
    from tests.conftest import free_port

    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    done = threading.Event()

    def publish() -> None:  # until the subscriber has it (a PUB drops what it sends before a subscriber joins)
        while not done.wait(0.05):
            pub.send_multipart([b"cam", messages.encode(messages.eos("cam", 0))])

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()

    async def first() -> dict[str, object]:
        async for msg in subscribe(
            [],
            until_eos=True,
            expect=1,
            timeout_s=20,
            discover="pods.test:5556",
            discover_interval_s=0.1,
            resolver=lambda h, p: [("127.0.0.1", port)],
        ):
            return msg
        raise AssertionError("no message")

    try:
        assert asyncio.run(first()) == messages.eos("cam", 0)
    finally:
        done.set()
        thread.join()
        pub.close(0)
        ctx.term()
