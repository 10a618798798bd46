"""Every hub read is bounded: a hostile mirror (HF_ENDPOINT pointed at a local server started here) gets one
note and the config formula, never a hang or gigabytes in RAM. Cases: a huge shard index, a server that
ignores Range and streams forever, slow-loris answers (a byte a second, in the headers and in the body),
a redirect loop, a declared header length of 2**60. The slow-loris cases shrink the deadline to a second;
the others end on their bound (bytes, shards, redirects, header length) long before their deadline, which
stays generous so a busy machine cannot turn them into a deadline; a thread join is only the hang guard
(no assertion on time)."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
from test_hub_headers import FakeHub, hub  # noqa: F401 - the fake hub fixture, reused

from helpers import estimate
from helpers.core.errors import LoadRefused, ModelNotFoundError
from helpers.core.sources import NET_TIMEOUT_ENV, NetBudget, NetError, checkpoint_size, http_get, net_timeout_s
from helpers.estimator.hub_headers import FIRST_READ, MAX_SHARDS, read_hub_headers
from helpers.estimator.rows import EstimateError
from helpers.loading.checks import check_model_source

HANG_GUARD_S = 120  # a hang guard only: each case ends on its bound, or on a deadline of 1-2 s


def _within_guard(fn):
    """``fn()``'s result, run in a thread the test waits for at most HANG_GUARD_S (a hang fails, not blocks)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    assert not t.is_alive(), f"still running after {HANG_GUARD_S} s: the read is not bounded"
    return out[0]


class Hostile(FakeHub):
    """The fake hub, except for the repos named ``hostile/<case>``: there each safetensors file is answered
    the way that case names. ``sent`` counts the body bytes the server managed to write."""

    sent: list[int]

    def do_GET(self):
        path = self.path.split("?")[0]
        parts = path.split("/")
        case = parts[parts.index("hostile") + 1] if "hostile" in parts[:4] else None
        hostile = path.endswith((".safetensors", ".index.json")) or case in ("slow-config", "slow-listing", "slow-auth")
        if case is None or not hostile:
            return super().do_GET()
        self.requests.append(f"GET {self.path}")
        getattr(self, "_" + case.replace("-", "_"))(path)

    def _slow_config(self, path):
        self._slow_body(path)

    def _slow_listing(self, path):
        self._slow_body(path)

    def _slow_auth(self, path):
        self._slow_body(path)

    def _start(self, status: int = 200, length: int | None = None, **headers) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k.replace("_", "-"), v)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def _huge_index(self, path):
        if path.endswith("model.safetensors"):
            return self._error("EntryNotFound")
        weight_map = {f"w{i}": f"model-{i:05d}-of-20000.safetensors" for i in range(20_000)}
        data = json.dumps({"weight_map": weight_map}).encode()
        self._start(length=len(data))
        self.wfile.write(data)

    def _stream(self, first: bytes) -> None:
        """Write ``first`` then zeros until the client hangs up (1 GiB at most, so a failed test ends)."""
        self.wfile.write(first)
        self.sent.append(len(first))
        try:
            for _ in range(16_384):
                self.wfile.write(bytes(64 * 1024))
                self.sent.append(64 * 1024)
        except OSError:  # the client cut the connection: what is wanted
            pass

    def _ignores_range(self, path):
        header = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}).encode()
        self._start()  # 200, no length: the whole "file", whatever Range asked
        self._stream(len(header).to_bytes(8, "little") + header)

    def _bad_shard(self, path):
        """An index of two shards: the first a sound header, the second declaring 2**60 bytes."""
        if path.endswith("model.safetensors"):
            return self._error("EntryNotFound")
        if path.endswith(".index.json"):
            data = json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                              "b": "model-00002-of-00002.safetensors"}}).encode()  # fmt: skip
        elif path.endswith("model-00001-of-00002.safetensors"):
            header = json.dumps({"a": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}}).encode()
            data = len(header).to_bytes(8, "little") + header + bytes(8)
        else:
            data = (2**60).to_bytes(8, "little") + b"{}"
        self._start(200, len(data))
        self.wfile.write(data)

    def _huge_length(self, path):
        data = (2**60).to_bytes(8, "little") + b"{}"
        self._start(206, len(data))
        self.wfile.write(data)

    def _slow_body(self, path):
        self._start(206, 1000)
        try:
            for _ in range(1000):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.5)
        except OSError:  # the client hung up at its deadline
            pass

    def _slow_headers(self, path):
        try:
            for c in b"HTTP/1.1 206 Partial Content\r\nContent-Length: 10\r\n" * 100:
                self.wfile.write(bytes([c]))
                self.wfile.flush()
                time.sleep(0.5)
        except OSError:
            pass

    def _redirect_loop(self, path):
        other = path.replace("/resolve/main/", "/resolve/other/") if "/main/" in path else path.replace("other", "main")
        self._start(302, 0, Location=other)


@pytest.fixture
def hostile(hub, tmp_path):  # noqa: F811 - the fixture imported above
    """The fake hub fixture, answering as :class:`Hostile`: ``hostile.requests``, ``hostile.sent``."""
    hub.__bases__ = (Hostile,)  # the fixture's handler class: swap in the hostile answers
    hub.sent = []
    yield hub


@pytest.fixture
def short_deadline(monkeypatch):
    """Cases that end on their bound: the deadline is a hang guard here (OOMKIT_NET_TIMEOUT, 30 s)."""
    monkeypatch.setenv(NET_TIMEOUT_ENV, "30")


def test_huge_shard_index_is_refused_without_a_request_per_shard(hostile, short_deadline):
    headers, why = _within_guard(lambda: read_hub_headers("hostile/huge-index"))
    assert headers is None and f"lists 20,000 shard files (over {MAX_SHARDS})" in why
    assert len(hostile.requests) == 2  # the single file (missing) and the index: no shard was asked


def test_a_server_ignoring_range_is_cut_off_after_the_bytes_asked(hostile, short_deadline):
    headers, why = _within_guard(lambda: read_hub_headers("hostile/ignores-range"))
    # the header sits in the first bytes, so it is read; the endless rest is never taken in
    assert why is None and headers.tensors == 1 and headers.total_bytes == 24
    assert len(hostile.requests) == 1
    # what the server wrote before it saw the hang-up: the bytes asked plus what socket buffers held,
    # never the gigabyte it would stream
    assert sum(hostile.sent) < FIRST_READ + (64 << 20)


def test_a_declared_header_of_2_pow_60_bytes_is_refused(hostile, short_deadline):
    headers, why = _within_guard(lambda: read_hub_headers("hostile/huge-length"))
    assert headers is None and "declares a header of 1,152,921,504,606,846,976 bytes" in why
    assert len(hostile.requests) == 1


@pytest.mark.parametrize("case", ["slow-body", "slow-headers"])
def test_slow_loris_answers_end_at_the_deadline(hostile, case):
    headers, why = _within_guard(lambda: read_hub_headers(f"hostile/{case}", timeout_s=1.0))
    assert headers is None and "no complete answer within 1 s" in why and "OOMKIT_NET_TIMEOUT" in why


def test_a_redirect_loop_is_refused(hostile, short_deadline):
    headers, why = _within_guard(lambda: read_hub_headers("hostile/redirect-loop"))
    assert headers is None and "redirects in a loop" in why
    assert len(hostile.requests) == 2  # main -> other -> main: seen, refused


def test_an_estimate_falls_back_to_the_config_with_the_reason(hostile, tiny_llama, monkeypatch):
    """What a user sees: the estimate of a repo on a stalled mirror comes back from the config formula,
    with a note that says why, within the deadline."""
    monkeypatch.setenv(NET_TIMEOUT_ENV, "1.5")
    config = json.loads((tiny_llama / "config.json").read_text())
    folder = hostile.root / "hostile" / "slow-body"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    est = _within_guard(lambda: estimate("hostile/slow-body", load="fp32", device="t4"))
    assert any("weights counted from the config" in w and "no complete answer within 1.5 s" in w for w in est.warnings)
    assert est.weights == estimate(config, load="fp32", device="t4").weights
    # the breach is remembered: a second estimate does not ask for the headers again
    asked = [r for r in hostile.requests if ".safetensors" in r]
    estimate("hostile/slow-body", load="fp32", device="t4")
    assert (
        [r for r in hostile.requests if ".safetensors" in r]
        == asked
        == ["GET /hostile/slow-body/resolve/main/model.safetensors"]
    )


def test_an_ordinary_repo_still_reads_exactly(hostile, tiny_llama, short_deadline):
    folder = hostile.root / "someone" / "plain"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text((tiny_llama / "config.json").read_text())
    shutil.copy(tiny_llama / "model.safetensors", folder / "model.safetensors")
    headers, why = read_hub_headers("someone/plain")
    assert why is None and headers.tensors > 0


def test_the_budget_counts_requests_and_bytes(hub):  # noqa: F811
    """http_get alone: the request and byte limits of one budget, whatever the server."""
    folder = hub.root / "someone" / "bytes"
    folder.mkdir(parents=True)
    (folder / "blob.safetensors").write_bytes(bytes(4096))
    url = f"{hub.endpoint}/someone/bytes/resolve/main/blob.safetensors"
    reply = http_get(url, NetBudget(2, max_requests=5), max_bytes=100)
    assert reply.status == 200 and len(reply.body) == 100 and reply.cut
    budget = NetBudget(2, max_bytes=150, max_requests=5)
    http_get(url, budget, max_bytes=100)
    with pytest.raises(NetError, match="more than 150 bytes") as e:
        http_get(url, budget, max_bytes=100)
    assert e.value.kind == "size"
    budget = NetBudget(2, max_requests=1)
    http_get(url, budget, max_bytes=10)
    with pytest.raises(NetError, match="more than 1 requests"):
        http_get(url, budget, max_bytes=10)


def test_the_deadline_is_set_in_one_place(monkeypatch):
    monkeypatch.delenv(NET_TIMEOUT_ENV, raising=False)
    assert net_timeout_s() == 15.0
    monkeypatch.setenv(NET_TIMEOUT_ENV, "2.5")
    assert net_timeout_s() == 2.5 and NetBudget().seconds == 2.5
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv(NET_TIMEOUT_ENV, bad)
        with pytest.raises(NetError, match=f"{NET_TIMEOUT_ENV}=.* is not a number of seconds"):
            net_timeout_s()


def test_a_stalled_config_read_is_one_clear_error(hostile, monkeypatch):
    """The config itself comes from the hub in one bounded read: a mirror trickling config.json ends in
    EstimateError at the deadline (transformers' own read would wait on every byte)."""
    monkeypatch.setenv(NET_TIMEOUT_ENV, "1")
    (hostile.root / "hostile" / "slow-config").mkdir(parents=True)

    def estimate_it():
        with pytest.raises(EstimateError, match="could not read the config of 'hostile/slow-config'") as e:
            estimate("hostile/slow-config", load="fp16")
        return str(e.value)

    assert "no complete answer within 1 s" in _within_guard(estimate_it)


def test_a_stalled_file_listing_gives_no_size_and_the_reason(hostile, monkeypatch):
    """checkpoint_size (preflight's RAM line) asks the hub's file list in one bounded request."""
    monkeypatch.setenv(NET_TIMEOUT_ENV, "1")
    (hostile.root / "hostile" / "slow-listing").mkdir(parents=True)
    total, largest, why = _within_guard(lambda: checkpoint_size("hostile/slow-listing"))
    assert total is None and largest is None and "could not ask the hub (no complete answer within 1 s" in why


def test_a_stalled_auth_check_is_a_refusal_with_the_fix(hostile, monkeypatch):
    """load()'s "does this hub id exist" question (auth-check) is bounded too; the hub's own answers keep
    their meaning (a missing repo is an unknown model id)."""
    monkeypatch.setenv(NET_TIMEOUT_ENV, "1")

    def ask(model):
        def run():
            with pytest.raises((LoadRefused, ModelNotFoundError)) as e:
                check_model_source(model)
            return e.value

        return _within_guard(run)

    stalled = ask("hostile/slow-auth")
    assert type(stalled) is LoadRefused and "no complete answer within 1 s" in str(stalled)
    assert "check the network" in stalled.fix
    missing = ask("someone/no-such-repo")  # the fake hub answers 404 RepoNotFound
    assert type(missing) is ModelNotFoundError and "Unknown model id 'someone/no-such-repo'" in str(missing)


def test_one_bad_shard_of_an_index_is_the_note(hostile, short_deadline):
    headers, why = _within_guard(lambda: read_hub_headers("hostile/bad-shard"))
    assert headers is None and "model-00002-of-00002.safetensors declares a header of" in why
    assert len(hostile.requests) == 4  # the single file (missing), the index, one request per shard


def test_the_hub_check_speaks_the_http_library_of_the_installed_hub(monkeypatch):
    """huggingface_hub 2.x reads httpx2 responses, 1.x (the lowest supported transformers, Colab's) httpx:
    without httpx2 the check builds its response with httpx instead of failing on the import."""
    import sys
    import types

    from helpers.loading.checks import _hub_http_library  # noqa: PLC2701 - the choice under test

    fake = types.ModuleType("httpx")
    monkeypatch.setitem(sys.modules, "httpx2", None)  # not installed
    monkeypatch.setitem(sys.modules, "httpx", fake)
    assert _hub_http_library() is fake
