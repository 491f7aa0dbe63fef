"""The stand-in Hub behind a link (tests/hub_stub.py, `latency` and `bandwidth`: issue 71's ordinary network), as
huggingface_hub's client meets it: every request costs at least the latency (a new connection one more), every
body its bytes at the rate, which concurrent answers share, the other origin's included; connections are kept
open between requests. Only lower bounds are asserted: a busy machine makes everything slower, never faster.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import pytest
from hub_stub import HubStub

SIZE = 1 << 20  # the weight file's bytes


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("linked")
    (out / "model.safetensors").write_bytes(os.urandom(SIZE))
    (out / "config.json").write_text("{}")
    return out


def _get(url: str, asked: str | None = None) -> tuple[float, bytes]:
    from huggingface_hub.utils import get_session

    start = time.monotonic()
    answer = get_session().get(url, headers={"Range": asked} if asked else {}, follow_redirects=True)
    assert answer.status_code == (206 if asked else 200)
    return time.monotonic() - start, answer.content


@pytest.mark.quick
def test_a_request_costs_at_least_the_latency_and_a_new_connection_a_round_trip_more(folder):
    from huggingface_hub import hf_hub_url

    with HubStub({"org/m": [folder]}, lifetime=300, latency=0.2) as stub:
        url = hf_hub_url("org/m", "config.json", revision=stub.shas["org/m"][0], endpoint=stub.url)
        first, data = _get(url)
        again = [_get(url)[0] for _ in range(3)]
        assert data == b"{}"
        assert first >= 0.4  # the connection's handshake, then the request
        assert min(again) >= 0.2
        assert stub.link.requests == 4 and stub.link.connections == 1  # kept open, as the Hub's
        assert stub.link.bandwidth is None


@pytest.mark.parametrize("redirect", [False, True])
def test_a_body_costs_its_bytes_at_the_rate_shared_by_concurrent_answers_and_both_origins(folder, redirect):
    from huggingface_hub import hf_hub_url

    data = (folder / "model.safetensors").read_bytes()
    rate = 2 * SIZE  # bytes per second: the whole file in 0.5 s
    with HubStub({"org/m": [folder]}, lifetime=300, bandwidth=rate, redirect=redirect) as stub:
        url = hf_hub_url("org/m", "model.safetensors", revision=stub.shas["org/m"][0], endpoint=stub.url)
        took, got = _get(url)
        assert got == data and took >= SIZE / rate
        half = SIZE // 2
        took, got = _get(url, f"bytes={half}-{SIZE - 1}")
        assert got == data[half:] and took >= half / rate
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # four whole answers share the one link
            found = list(pool.map(lambda _: _get(url)[1], range(4)))
        assert found == [data] * 4 and time.monotonic() - start >= 4 * SIZE / rate
        assert stub.link.latency == 0 and stub.link.requests >= (6 if not redirect else 12)


def test_without_a_link_nothing_is_shaped(folder):
    with HubStub({"org/m": [folder]}, lifetime=300) as stub:
        assert stub.link is None
