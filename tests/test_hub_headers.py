"""Exact weights from a hub repo's safetensors headers, against a local hub-shaped HTTP server (HF_ENDPOINT)
and the real huggingface_hub client: the real hub is never asked."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.estimator.core import estimate
from helpers.estimator.hub_headers import HEADER_NOTE, clear_header_cache, read_hub_headers

COMMIT = "0123456789abcdef0123456789abcdef01234567"
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(/revision/(?P<rev>[^/]+))?$")


class FakeHub(BaseHTTPRequestHandler):
    """Serves ``root/<org>/<name>/<file>`` as the hub serves ``/<org>/<name>/resolve/<rev>/<file>``: HEAD and
    GET, byte ranges (206), the ETag and X-Repo-Commit headers huggingface_hub reads, and the X-Error-Code
    it maps to RepositoryNotFoundError / EntryNotFoundError."""

    root: Path
    requests: list[str]

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def _error(self, code: str, status: int = 404) -> None:
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _info(self, repo: Path) -> None:
        """``/api/models/<repo>[/revision/<rev>]``: what transformers resolves a revision to a commit with."""
        siblings = [{"rfilename": str(f.relative_to(repo))} for f in sorted(repo.rglob("*")) if f.is_file()]
        data = json.dumps({"id": str(repo.relative_to(self.root)), "sha": COMMIT, "siblings": siblings}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data if self.command == "GET" else b"")

    def _serve(self, body: bool) -> None:
        self.requests.append(f"{self.command} {self.path}")
        if (info := INFO.match(self.path.split("?")[0])) is not None:
            repo = self.root / info["repo"]
            return self._info(repo) if repo.is_dir() else self._error("RepoNotFound")
        m = RESOLVE.match(self.path.split("?")[0])
        if m is None:
            return self._error("RepoNotFound")
        repo, file = self.root / m["repo"], m["file"]
        if not repo.is_dir():
            return self._error("RepoNotFound")
        if (repo / ".gated").exists():  # what the hub answers before a license is accepted
            return self._error("GatedRepo", 403)
        path = repo / file
        if not path.is_file():
            return self._error("EntryNotFound")
        data = path.read_bytes()
        start, end, status = 0, len(data) - 1, 200
        if (r := re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "") or "")) is not None:
            start, end, status = int(r[1]), min(int(r[2] or end), end), 206
        self.send_response(status)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start + 1) if status == 206 else str(len(data)))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.end_headers()
        if body:
            self.wfile.write(data[start : end + 1])

    def do_HEAD(self):
        self._serve(body=False)

    def do_GET(self):
        self._serve(body=True)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A running fake hub: ``hub.root`` holds the repos, ``hub.requests`` what was asked. Any connection
    to another host fails the test (the real hub must never be asked)."""
    import socket

    import transformers.utils.hub
    from huggingface_hub import constants

    root = tmp_path / "hub"
    root.mkdir()
    handler = type("Handler", (FakeHub,), {"root": root, "requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    # constants are read at import: patch the endpoint and the URL template built from it
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_TOKEN", "")  # no saved token is sent to the fake hub
    # transformers keeps one HfApi, made with the endpoint of its first use: a fresh one takes ours
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", None)
    outside: list = []
    connect = socket.create_connection

    def loopback_only(address, *args, **kwargs):
        if address[0] not in ("127.0.0.1", "localhost"):
            outside.append(address)
            raise OSError(f"test: no connection to {address} (only the fake hub)")
        return connect(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", loopback_only)
    clear_header_cache()
    handler.root, handler.endpoint = root, endpoint
    yield handler
    assert outside == [], f"asked hosts other than the fake hub: {outside}"
    server.shutdown()
    server.server_close()
    clear_header_cache()


def _header_bytes(*files: Path) -> int:
    """Bytes of every tensor of these safetensors files, from their own headers (8-byte length + JSON)."""
    total = 0
    for f in files:
        raw = f.read_bytes()
        header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


def _repo(hub, repo_id: str, config: dict) -> Path:
    folder = hub.root / repo_id
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _numel(state: dict) -> int:
    return sum(t.numel() for t in state.values())


def test_unshipped_model_exact_from_headers(hub, tiny_llama):
    config = json.loads((tiny_llama / "config.json").read_text())
    folder = _repo(hub, "someone/tiny-unshipped", config)
    shutil.copy(tiny_llama / "model.safetensors", folder / "model.safetensors")
    stored = _header_bytes(folder / "model.safetensors")
    values = _numel(load_file(folder / "model.safetensors"))

    est = estimate("someone/tiny-unshipped", load="fp32", device="t4")
    row = est.row("weights.unquantized")
    assert row.bytes == stored  # the fp32 checkpoint loaded in fp32: exactly its tensors
    assert row.kind == "exact" and HEADER_NOTE in row.note
    assert est.weights == stored + est.row("weights.buffers").bytes
    assert est.replace(load="fp16").row("weights.unquantized").bytes == 2 * values
    assert not any("checkpoint" in w for w in est.warnings)  # header values == architecture parameters
    # only headers travel: range requests of the safetensors file, never a full GET of it
    gets = [r for r in hub.requests if r.startswith("GET") and r.endswith("model.safetensors")]
    assert gets and len(hub.requests) < 12


def test_sharded_repo_reads_every_shard(hub, tiny_llama):
    config = json.loads((tiny_llama / "config.json").read_text())
    folder = _repo(hub, "someone/tiny-sharded", config)
    state = load_file(tiny_llama / "model.safetensors")
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: state[k].to(torch.bfloat16) for k in keys}, folder / shard, metadata={"format": "pt"})
    weight_map = {k: s for s, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    headers, why = read_hub_headers("someone/tiny-sharded")
    assert why is None and headers.files == sorted(shards) and headers.tensors == len(state)
    assert headers.total_bytes == _header_bytes(*(folder / s for s in shards)) == 2 * _numel(state)
    est = estimate("someone/tiny-sharded", load="bf16", device="a100-40")
    assert est.row("weights.unquantized").bytes == headers.total_bytes
    assert "2 file(s)" in est.row("weights.unquantized").note


def _gptq_state(config: dict, bits: int = 4, group: int = 128) -> dict[str, torch.Tensor]:
    """A GPTQ checkpoint's tensors for a Llama config: int32-packed qweight/qzeros, fp16 scales, int32 g_idx
    per linear; embeddings, norms and lm_head in fp16."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd, kv = config["head_dim"], config["num_key_value_heads"]
    linears = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv * hd, h), "self_attn.v_proj": (kv * hd, h),
               "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
               "mlp.down_proj": (h, inter)}  # fmt: skip
    state = {"model.embed_tokens.weight": torch.zeros(vocab, h, dtype=torch.float16),
             "model.norm.weight": torch.zeros(h, dtype=torch.float16),
             "lm_head.weight": torch.zeros(vocab, h, dtype=torch.float16)}  # fmt: skip
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = torch.zeros(h, dtype=torch.float16)
        state[p + "post_attention_layernorm.weight"] = torch.zeros(h, dtype=torch.float16)
        for name, (out, k) in linears.items():
            groups = math.ceil(k / group)
            state[p + name + ".qweight"] = torch.zeros(k * bits // 32, out, dtype=torch.int32)
            state[p + name + ".qzeros"] = torch.zeros(groups, out * bits // 32, dtype=torch.int32)
            state[p + name + ".scales"] = torch.zeros(groups, out, dtype=torch.float16)
            state[p + name + ".g_idx"] = torch.zeros(k, dtype=torch.int32)
    return state


def test_gptq_repo_exact_from_headers(hub, tiny_llama):
    config = json.loads((tiny_llama / "config.json").read_text())
    config |= {"dtype": "float16", "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                           "desc_act": False, "sym": True}}  # fmt: skip
    folder = _repo(hub, "someone/tiny-GPTQ", config)
    state = _gptq_state(config)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    stored = _header_bytes(folder / "model.safetensors")

    est = estimate("someone/tiny-GPTQ", device="t4")  # T4: fp16 compute, as GPTQ stores its fp16 tensors
    assert est.load == "gptq" and est.quantized_by == "gptq"
    assert est.weights - est.row("weights.buffers").bytes == stored
    packed = sum(t.numel() * 4 for k, t in state.items() if k.endswith(".qweight"))
    assert est.row("weights.quantized").bytes == packed
    assert all(r.kind == "exact" for r in est.rows if r.group == "weights")
    assert HEADER_NOTE in est.row("weights.quant_state").note
    # the config-only formula (what an offline estimate gives) agrees on this regular layout
    formula = estimate(config, device="t4")
    assert formula.row("weights.quantized").bytes == packed
    assert formula.weights == est.weights


def test_bnb_repo_state_blob_not_counted(hub, tiny_llama):
    config = json.loads((tiny_llama / "config.json").read_text())
    config |= {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                       "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False}}  # fmt: skip
    folder = _repo(hub, "someone/tiny-bnb-4bit", config)
    h, vocab = config["hidden_size"], config["vocab_size"]
    w = "model.layers.0.mlp.up_proj.weight"
    state = {
        "model.embed_tokens.weight": torch.zeros(vocab, h, dtype=torch.bfloat16),
        w: torch.zeros(h * 256 // 2, 1, dtype=torch.uint8),
        w + ".absmax": torch.zeros(h * 256 // 64, dtype=torch.float32),
        w + ".quant_map": torch.zeros(16, dtype=torch.float32),
        w + ".quant_state.bitsandbytes__nf4": torch.zeros(90, dtype=torch.uint8),
    }
    save_file(state, folder / "model.safetensors")
    est = estimate("someone/tiny-bnb-4bit", device="t4")  # fp16 compute on a T4
    assert est.row("weights.quantized").bytes == h * 256 // 2
    assert est.row("weights.quant_state").bytes == 4 * (h * 256 // 64 + 16)
    assert est.row("weights.unquantized").bytes == vocab * h * 2


def test_offline_asks_nothing(hub, tiny_llama, monkeypatch):
    from huggingface_hub import constants

    folder = _repo(hub, "someone/tiny-offline", json.loads((tiny_llama / "config.json").read_text()))
    shutil.copy(tiny_llama / "model.safetensors", folder / "model.safetensors")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert read_hub_headers("someone/tiny-offline") == (None, None)
    est = estimate("Qwen/Qwen2.5-0.5B", load="fp16")  # a shipped config: the offline path, as before
    assert HEADER_NOTE not in est.row("weights.unquantized").note
    assert hub.requests == []


def test_missing_and_bin_only_repos_fall_back_with_a_note(hub, tiny_llama):
    config = json.loads((tiny_llama / "config.json").read_text())
    folder = _repo(hub, "someone/tiny-bin", config)
    torch.save(load_file(tiny_llama / "model.safetensors"), folder / "pytorch_model.bin")
    est = estimate("someone/tiny-bin", load="fp16", device="t4")
    assert HEADER_NOTE not in est.row("weights.unquantized").note
    assert any(".bin weights only" in w for w in est.warnings)
    gated = _repo(hub, "someone/tiny-gated", config)
    (gated / ".gated").touch()
    headers, why = read_hub_headers("someone/tiny-gated")
    assert headers is None and "is gated: accept its license" in why
    headers, why = read_hub_headers("someone/no-such-repo")
    assert headers is None and ".bin weights only?" in why  # the hub answers a missing repo's files as missing


def test_gptq_repo_whose_layout_the_config_does_not_say(hub, tiny_llama):
    """A GPTQ repo that quantized lm_head too: the config formula counts it in fp16, the headers as packed."""
    config = json.loads((tiny_llama / "config.json").read_text())
    config |= {"dtype": "float16", "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}
    folder = _repo(hub, "someone/tiny-GPTQ-lm-head", config)
    state = _gptq_state(config)
    h, vocab = config["hidden_size"], config["vocab_size"]
    del state["lm_head.weight"]
    state |= {"lm_head.qweight": torch.zeros(h * 4 // 32, vocab, dtype=torch.int32),
              "lm_head.qzeros": torch.zeros(1, vocab * 4 // 32, dtype=torch.int32),
              "lm_head.scales": torch.zeros(1, vocab, dtype=torch.float16),
              "lm_head.g_idx": torch.zeros(h, dtype=torch.int32)}  # fmt: skip
    save_file(state, folder / "model.safetensors")
    stored = _header_bytes(folder / "model.safetensors")

    est = estimate("someone/tiny-GPTQ-lm-head", device="t4")
    assert est.weights - est.row("weights.buffers").bytes == stored
    formula = estimate(config, device="t4")
    assert formula.weights - est.weights == vocab * h * 2 - (h * vocab // 2 + vocab // 2 + 2 * vocab + 4 * h)


def test_a_4bit_load_of_an_ordinary_checkpoint_asks_nothing(hub, tiny_llama):
    folder = _repo(hub, "someone/tiny-nf4", json.loads((tiny_llama / "config.json").read_text()))
    shutil.copy(tiny_llama / "model.safetensors", folder / "model.safetensors")
    est = estimate("someone/tiny-nf4", load="nf4", device="t4")
    assert HEADER_NOTE not in est.row("weights.unquantized").note  # bitsandbytes' layout, from the config
    assert not any("safetensors" in r for r in hub.requests)  # only the config was read
