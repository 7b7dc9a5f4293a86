"""Publishing: export to vLLM and FasterDecoding Medusa formats and back, and pushing to a Hub.

Key names checked against the loaders that read them: vLLM's vllm/model_executor/models/medusa.py
(`blocks.{h}.layers.{layer}.weight`, `lm_heads.{h}.weight`, `lm_head.weight` with original_lm_head)
and TensorRT-LLM's load_medusa_hf (`{h}.{layer}.linear.weight/bias`, `{h}.{num_layers}.weight`).
"""

import base64
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from helpers import env, saved_heads, snapshot, tiny_chat_target, tiny_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from gorgon.heads import GorgonError, MedusaHeads, load_target
from gorgon.heads.cli import main as gorgon
from gorgon.heads.methods.medusa.formats import export_heads


def trained_like(model, shared=True, layers=2):
    heads = MedusaHeads.for_target(model, num_heads=3, num_layers=layers, shared_lm_head=shared)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return heads


@pytest.mark.parametrize("fmt", ["vllm", "medusa"])
@pytest.mark.parametrize("shared", [True, False])
def test_export_then_import_gives_identical_logits(tmp_path, fmt, shared):
    model = tiny_model("llama")
    heads = trained_like(model, shared)
    export_heads(heads, fmt, tmp_path / fmt, base_model="tiny")
    back = MedusaHeads.from_pretrained(tmp_path / fmt, target=model)
    hidden = torch.randn(4, 32)
    torch.testing.assert_close(back(hidden), heads(hidden), rtol=0, atol=0)


def vllm_medusa_refusal(folder) -> str | None:
    """What vLLM 0.32's Medusa loader (vllm/model_executor/models/medusa.py) says of a folder, None when it loads:
    every parameter listed before `load_weights` must be loaded, and `load_weights` makes `token_map` one more
    (where truncated_vocab_size < vocab_size) that it never reports loaded."""
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(folder / "model.safetensors")
    heads, layers = config["num_heads"], config["num_hidden_layers"]
    params = {f"blocks.{h}.layers.{i}.{p}" for h in range(heads) for i in range(layers) for p in ("weight", "bias")}
    params |= {"lm_head.weight"} if config["original_lm_head"] else {f"lm_heads.{h}.weight" for h in range(heads)}
    if config["truncated_vocab_size"] < config["vocab_size"]:
        if "token_map" not in weights:
            return "AssertionError: a truncated vocabulary without a token_map"
        params.add("token_map")
    missing = params - (set(weights) - {"token_map"})
    return f"Following weights were not initialized from checkpoint: {missing}" if missing else None


def test_a_vllm_export_of_heads_with_a_draft_vocabulary_loads_in_vllm_032(tmp_path, capsys):
    """vLLM 0.32 refused the export of heads with a draft vocabulary (every SmolLM2 Medusa recipe's) for its
    token_map; heads over the whole vocabulary load, and the export says what it changed."""
    model = tiny_model("llama")
    for shared in (True, False):
        heads = trained_like(model, shared)
        heads.set_draft_vocab(torch.arange(0, 64, 2))
        out = export_heads(heads, "vllm", tmp_path / f"v-{shared}")
        assert vllm_medusa_refusal(out) is None
        config = json.loads((out / "config.json").read_text())
        assert config["truncated_vocab_size"] == config["vocab_size"] == 64
        assert "token_map" not in load_file(out / "model.safetensors")
        assert "exported drafting from every token, as vLLM" in capsys.readouterr().err
        # Imported back, the heads draft as the engine does: from every token, with the same blocks and LM heads.
        back = MedusaHeads.from_pretrained(out, target=model)
        hidden = torch.randn(3, 32)
        whole = trained_like(model, shared)
        whole.load_state_dict({k: v for k, v in heads.state_dict().items() if k != "token_map"})
        assert back.config.draft_vocab_size is None
        assert torch.equal(back.draft_topk(hidden, 4), whole.draft_topk(hidden, 4))


def test_a_vllm_folder_with_a_token_map_still_imports(tmp_path):
    """Checkpoints written for older vLLM releases (and by earlier gorgons) keep their draft vocabulary."""
    from safetensors.torch import save_file

    model = tiny_model("llama")
    heads = trained_like(model)
    heads.set_draft_vocab(torch.arange(0, 64, 2))
    out = export_heads(heads, "vllm", tmp_path / "v")
    config = json.loads((out / "config.json").read_text())
    save_file({**load_file(out / "model.safetensors"), "token_map": heads.token_map},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**config, "truncated_vocab_size": 32}))
    back = MedusaHeads.from_pretrained(out, target=model)
    hidden = torch.randn(3, 32)
    assert back.config.draft_vocab_size == 32
    assert torch.equal(back.draft_topk(hidden, 4), heads.draft_topk(hidden, 4))


def test_exported_key_names_and_shapes(tmp_path):
    model = tiny_model("llama")
    heads = trained_like(model, shared=True)
    export_heads(heads, "vllm", tmp_path / "v", base_model="tiny")
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert (config["num_heads"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"],
            config["truncated_vocab_size"], config["original_lm_head"], config["medusa_fc_bias"]) == \
        (3, 2, 32, 64, 64, True, True)
    weights = load_file(tmp_path / "v" / "model.safetensors")
    expected = {f"blocks.{h}.layers.{layer}.{p}": (32, 32) if p == "weight" else (32,)
                for h in range(3) for layer in range(2) for p in ("weight", "bias")}
    expected["lm_head.weight"] = (64, 32)
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected
    # Square blocks: only their values tell a transposed export (that its import transposes back) from vLLM's layout.
    block = heads.blocks[1][0].linear
    assert torch.equal(weights["blocks.1.layers.0.weight"], block.weight)
    assert torch.equal(weights["blocks.1.layers.0.bias"], block.bias)

    export_heads(trained_like(model, shared=False, layers=1), "vllm", tmp_path / "v2")
    assert {k for k in load_file(tmp_path / "v2" / "model.safetensors") if "lm_head" in k} == \
        {"lm_heads.0.weight", "lm_heads.1.weight", "lm_heads.2.weight"}

    export_heads(heads, "medusa", tmp_path / "m", base_model="tiny")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["medusa_num_heads"], config["medusa_num_layers"],
            config["base_model_name_or_path"]) == (3, 2, "tiny")
    weights = load_file(tmp_path / "m" / "medusa_lm_head.safetensors")
    expected = {f"{h}.{layer}.linear.{p}": (32, 32) if p == "weight" else (32,)
                for h in range(3) for layer in range(2) for p in ("weight", "bias")}
    expected.update({f"{h}.2.weight": (64, 32) for h in range(3)})
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected
    assert torch.equal(weights["1.0.linear.weight"], block.weight)
    assert torch.equal(weights["1.0.linear.bias"], block.bias)


def test_a_vllm_checkpoint_without_block_biases_loads_with_zero_biases(tmp_path):
    """vLLM's `medusa_fc_bias: false` layout has no bias tensors: they are zero, not left as they were."""
    from safetensors.torch import save_file

    model = tiny_model("llama")
    heads = trained_like(model)
    export_heads(heads, "vllm", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "medusa_fc_bias": False}))
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.endswith(".bias")}, tmp_path / "model.safetensors")
    back = MedusaHeads.from_pretrained(tmp_path, target=model)
    with torch.no_grad():
        for block in heads.blocks:
            for res in block:
                res.linear.bias.zero_()
    hidden = torch.randn(4, 32)
    torch.testing.assert_close(back(hidden), heads(hidden), rtol=0, atol=0)


def test_a_hub_download_fetches_every_layout_the_loader_reads(tmp_path, monkeypatch):
    """The download's file patterns against each layout: gorgon's, vLLM's (its weights sharded, as an
    engine's checkpoint may be), FasterDecoding's safetensors and legacy .pt."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects
    from safetensors.torch import save_file

    def snapshot_download(repo_id, allow_patterns):  # the hub: copies only the files the patterns match
        repo, cache = tmp_path / repo_id, tmp_path / "cache" / repo_id
        for name in filter_repo_objects([str(f.relative_to(repo)) for f in repo.rglob("*") if f.is_file()],
                                        allow_patterns=allow_patterns):
            (cache / name).parent.mkdir(parents=True, exist_ok=True)
            (cache / name).write_bytes((repo / name).read_bytes())
        return str(cache)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model = tiny_model("llama")
    heads = trained_like(model, shared=False)
    heads.save_pretrained(tmp_path / "user" / "gorgon")
    export_heads(heads, "vllm", tmp_path / "user" / "vllm")
    shards = tmp_path / "user" / "vllm"
    weights = load_file(shards / "model.safetensors")
    (shards / "model.safetensors").unlink()
    names = sorted(weights)
    save_file({k: weights[k] for k in names[::2]}, shards / "model-00001-of-00002.safetensors")
    save_file({k: weights[k] for k in names[1::2]}, shards / "model-00002-of-00002.safetensors")
    export_heads(heads, "medusa", tmp_path / "user" / "medusa")
    legacy = tmp_path / "user" / "legacy"
    export_heads(heads, "medusa", legacy)
    torch.save(load_file(legacy / "medusa_lm_head.safetensors"), legacy / "medusa_lm_head.pt")
    (legacy / "medusa_lm_head.safetensors").unlink()
    hidden = torch.randn(2, 32)
    for repo in ("gorgon", "vllm", "medusa", "legacy"):
        back = MedusaHeads.from_pretrained(f"user/{repo}", target=model)
        torch.testing.assert_close(back(hidden), heads(hidden), rtol=0, atol=0)


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_legacy_pt_is_read_safely_and_code_is_refused(tmp_path):
    model = tiny_model("llama")
    heads = trained_like(model, shared=False, layers=1)
    export_heads(heads, "medusa", tmp_path / "m")
    state = load_file(tmp_path / "m" / "medusa_lm_head.safetensors")
    (tmp_path / "m" / "medusa_lm_head.safetensors").unlink()
    torch.save(state, tmp_path / "m" / "medusa_lm_head.pt")
    back = MedusaHeads.from_pretrained(tmp_path / "m", target=model)
    hidden = torch.randn(2, 32)
    torch.testing.assert_close(back(hidden), heads(hidden), rtol=0, atol=0)
    with open(tmp_path / "m" / "medusa_lm_head.pt", "wb") as f:
        pickle.dump({"0.0.linear.weight": Evil()}, f)
    with pytest.raises(GorgonError, match="refused .*holds more than tensors"):
        MedusaHeads.from_pretrained(tmp_path / "m", target=model)


def test_export_in_bfloat16_writes_bfloat16_weights(tmp_path):
    """--dtype bfloat16: the target loads (an 8B one needed 32 GB in float32) and the weights are written in it."""
    from gorgon.heads.cli import main as gorgon

    target = tiny_chat_target(tmp_path)
    MedusaHeads.for_target(load_target(str(target), device="cpu").model, num_heads=2).save_pretrained(tmp_path / "h")
    assert gorgon(["export", "--heads", str(tmp_path / "h"), "--target", str(target), "--format", "vllm",
                   "--dtype", "bfloat16", "--out", str(tmp_path / "x")]) == 0
    floats = [t.dtype for f in (tmp_path / "x").glob("*.safetensors") for t in load_file(f).values()
              if t.is_floating_point()]
    assert floats and set(floats) == {torch.bfloat16}


def test_export_of_shared_heads_needs_the_target(tmp_path):
    heads = MedusaHeads.for_target(tiny_model("llama"))
    object.__setattr__(heads, "_target", None)
    with pytest.raises(GorgonError, match="pass --target"):
        export_heads(heads, "vllm", tmp_path / "x")


class FakeHub(BaseHTTPRequestHandler):
    """The few Hub endpoints an upload uses; records every call. `fail_commit` makes commits fail."""

    calls: list = []
    files: dict = {}
    fail_commit = False

    def log_message(self, *args):
        pass

    def reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.calls.append(("POST", self.path))
        if self.path == "/api/repos/create":
            req = json.loads(body)
            return self.reply(200, {"url": f"http://{self.headers['Host']}/{req.get('organization')}/{req['name']}"})
        if self.path == "/api/validate-yaml":  # the client checks the model card's metadata
            return self.reply(200, {})
        if "/preupload/" in self.path:
            files = json.loads(body)["files"]
            return self.reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                              for f in files], "commitOid": "0" * 40})
        if "/commit/" in self.path:
            if self.fail_commit:
                return self.reply(403, {"error": "You have no write access to someone/tiny-heads"})
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    self.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                if item["key"] == "deletedFile":
                    del self.files[item["value"]["path"]]
            repo = self.path.split("/api/models/")[1].split("/commit/")[0]
            return self.reply(200, {"commitUrl": f"http://{self.headers['Host']}/{repo}/commit/{'1' * 40}",
                                    "commitOid": "1" * 40})
        return self.reply(404, {"error": f"unexpected {self.path}"})

    def do_GET(self):
        self.calls.append(("GET", self.path))
        if "/tree/" in self.path:  # the repo's files, which the client lists to find the ones to delete
            return self.reply(200, [{"type": "file", "path": path, "oid": "0" * 40, "size": len(data)}
                                    for path, data in self.files.items()])
        self.reply(404, {"error": f"unexpected {self.path}"})


@pytest.fixture
def hub():
    FakeHub.calls, FakeHub.files, FakeHub.fail_commit = [], {}, False
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def push(endpoint, folder, repo_id="someone/tiny-heads"):
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_TOKEN": "hf_test", "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    return subprocess.run([sys.executable, "-m", "gorgon.heads.cli", "push", "--heads", str(folder),
                           "--repo-id", repo_id], env=env, capture_output=True, text=True, timeout=120)


def heads_folder(tmp_path):
    target = load_target(str(tiny_chat_target(tmp_path)), device="cpu")
    folder = tmp_path / "heads"
    MedusaHeads.for_target(target.model, target_name="tiny").save_pretrained(folder)
    (folder / "README.md").write_text("---\nlibrary_name: gorgon\ntags:\n- medusa\n---\n# card\n")
    (folder / "checkpoints" / "step-5").mkdir(parents=True)
    (folder / "checkpoints" / "step-5" / "optimizer.bin").write_bytes(b"x")
    return folder


@pytest.mark.slow
def test_push_creates_the_repo_and_uploads_in_one_commit(tmp_path, hub):
    folder = heads_folder(tmp_path)
    run = push(hub, folder)
    assert run.returncode == 0, run.stderr[-2000:]
    posts = [p for m, p in FakeHub.calls if m == "POST"]
    assert posts[0] == "/api/repos/create" and "/api/validate-yaml" in posts
    assert sum("/commit/" in p for p in posts) == 1 and posts[-1] == "/api/models/someone/tiny-heads/commit/main"
    assert set(FakeHub.files) == {"config.json", "model.safetensors", "README.md"}  # no checkpoints
    assert FakeHub.files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert b"tags:\n- medusa" in FakeHub.files["README.md"]


@pytest.mark.slow
def test_a_push_removes_what_an_earlier_push_left_that_would_change_what_loads(tmp_path, hub):
    """Medusa-2 heads pushed, then Medusa-1 heads to the same repo: the old LoRA adapter would merge into the
    target of whoever loads the repo. It goes in the same commit; the repo's other files stay."""
    FakeHub.files.update({"adapter/adapter_model.safetensors": b"lora", "adapter/adapter_config.json": b"{}",
                          "trees.json": b"{}", "notes.txt": b"the user's"})
    run = push(hub, heads_folder(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    assert set(FakeHub.files) == {"config.json", "model.safetensors", "README.md", "notes.txt"}


@pytest.mark.slow
def test_failed_upload_leaves_the_folder_and_says_why(tmp_path, hub):
    folder = heads_folder(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    FakeHub.fail_commit = True
    run = push(hub, folder)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("gorgon push: error: upload to someone/tiny-heads failed") and "unchanged" in last
    assert "hf auth login" in last  # the Hub refused the write (403)
    # Each other failure names its own fix, not a login: a malformed repo id, a Hub that cannot be reached.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    unreachable = f"http://127.0.0.1:{closed.getsockname()[1]}"
    for endpoint, repo_id, fix in ((hub, "not a/valid/id", "is not a Hub repo id: pass user/name"),
                                   (unreachable, "someone/tiny-heads", "check the connection to the Hub")):
        run = push(endpoint, folder, repo_id)
        last = run.stderr.strip().splitlines()[-1]
        assert run.returncode == 2 and fix in last and "hf auth login" not in last, run.stderr[-2000:]
    closed.close()
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before


@pytest.mark.slow
def test_heads_push_to_hub_uploads_what_save_pretrained_writes(tmp_path, hub):
    """The Python API: `MedusaHeads.push_to_hub` saves to a temporary folder and uploads it in one commit."""
    folder = heads_folder(tmp_path)
    code = ("import sys; from gorgon.heads import MedusaHeads; "
            "print(MedusaHeads.from_pretrained(sys.argv[1]).push_to_hub('someone/tiny-heads'))")
    env = {**os.environ, "HF_ENDPOINT": hub, "HF_TOKEN": "hf_test", "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    run = subprocess.run([sys.executable, "-c", code, str(folder)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith(f"someone/tiny-heads/commit/{'1' * 40}")
    assert sum("/commit/" in p for m, p in FakeHub.calls if m == "POST") == 1
    assert set(FakeHub.files) == {"config.json", "model.safetensors", "README.md"}
    assert json.loads(FakeHub.files["config.json"]) == json.loads((folder / "config.json").read_text())
    # A short card, where the repo had none (the Hub showed no base model, license or usage); a card there, a
    # training run's, is not replaced.
    card = FakeHub.files["README.md"].decode()
    assert front_matter(card) == {"base_model": "tiny", "library_name": "gorgon", "pipeline_tag": "text-generation",
                                  "tags": ["medusa", "speculative-decoding"]}  # the heads' target_name, a Hub id
    assert 'load_heads("someone/tiny-heads")' in card and "gorgon generate --heads someone/tiny-heads" in card
    FakeHub.files["README.md"] = b"the full card"
    assert subprocess.run([sys.executable, "-c", code, str(folder)], env=env, capture_output=True,
                          timeout=120).returncode == 0
    assert FakeHub.files["README.md"] == b"the full card"
    # A failed upload named the temporary folder as "unchanged": the user has no such folder. Offline, it said
    # huggingface_hub's "unset HF_HUB_OFFLINE" even where gorgon had set it, finding no network.
    for unreachable, says in [({}, "HF_HUB_OFFLINE is set: unset it, then retry"),
                              ({"GORGON_HUB_UNREACHABLE": "huggingface.co"},
                               "the Hub's huggingface.co does not resolve: connect, then retry")]:
        run = subprocess.run([sys.executable, "-c", code, str(folder)],
                             env={**env, "HF_HUB_OFFLINE": "1", **unreachable}, capture_output=True, text=True,
                             timeout=120)
        last = run.stderr.strip().splitlines()[-1]
        assert last.endswith(f"upload to someone/tiny-heads needs the Hub, but {says}"), run.stderr[-2000:]


def test_push_names_a_missing_folder_or_a_file_for_what_it_is(tmp_path, capsys):
    from gorgon.heads.cli import main as gorgon

    (tmp_path / "file").write_text("x")
    for heads, says in [(tmp_path / "nope", "nope not found"), (tmp_path / "file", "file is a file"),
                        (tmp_path, "is not a heads folder (no config.json)")]:
        assert gorgon(["push", "--heads", str(heads), "--repo-id", "you/x"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err and "pass the folder training wrote" in err


@pytest.mark.slow
def test_a_medusa2_export_says_its_heads_need_their_adapter(tmp_path, capsys):
    """The export holds the heads only: served on the plain target they read hidden states they were not
    trained on, which nothing said."""
    from helpers import toy_data

    from gorgon.heads.cli import main as gorgon
    from gorgon.train.heads import HeadsTrainConfig, train

    out = train(HeadsTrainConfig(data=toy_data(tmp_path / "toy.jsonl", n=8), out=str(tmp_path / "run"),
                                 target=str(tiny_chat_target(tmp_path)), mode="medusa2", lora_r=2, max_steps=1,
                                 save_every=0, report_to="none"))
    capsys.readouterr()
    assert gorgon(["export", "--heads", str(out), "--format", "vllm", "--out", str(tmp_path / "e")]) == 0
    err = capsys.readouterr().err
    assert f"these Medusa-2 heads were trained on the target with the LoRA adapter in {out / 'adapter'}" in err


MEDUSA_RECIPE = {"num_heads": 2, "num_layers": 1, "shared_lm_head": True, "mode": "medusa1", "loss": "kl",
                 "data": "d.jsonl", "cpu_tree_size": 8, "gpu_tree_size": 64, "target": None, "push_to_hub": None}
MEDUSA_METRICS = {"top1": [0.3, 0.2], "top5": [0.5, 0.4], "expected_tau": {"cpu": 1.4, "cuda": 1.6}, "steps": 5}


def front_matter(card: str) -> dict:
    from huggingface_hub import ModelCard

    return ModelCard(card).data.to_dict()  # as the Hub's client reads it before an upload


def test_a_card_names_the_base_model_and_license_the_hub_can_take(tmp_path, monkeypatch):
    """base_model was the embedded target's Hub id or a local path (the Hub refuses a path there, and with it the
    whole push); no card named a license (the heads learn from the target's outputs: its terms are theirs) or a
    pipeline tag."""
    import huggingface_hub.constants

    from gorgon.heads.card import card_text

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read when it is used
    embedded = card_text(tmp_path, MEDUSA_RECIPE, {**MEDUSA_METRICS, "target_name": "SmolLM2-135M-Instruct"})
    assert front_matter(embedded) == {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "license": "apache-2.0",
                                      "library_name": "gorgon", "pipeline_tag": "text-generation",
                                      "tags": ["medusa", "speculative-decoding"]}
    local = tmp_path / "my-target"
    local.mkdir()
    (local / "README.md").write_text("---\nlicense: other\nlicense_name: llama3\nlicense_link: LICENSE\n---\n# m\n")
    mine = front_matter(card_text(tmp_path, MEDUSA_RECIPE, {**MEDUSA_METRICS, "target_name": str(local)}))
    assert "base_model" not in mine and (mine["license"], mine["license_name"]) == ("other", "llama3")
    # A Hub target: its base_model, and the license its card in the Hub cache states; none when not cached.
    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B-Instruct" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "README.md").write_text("---\nlicense: llama3.1\n---\n")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    hub = front_matter(card_text(tmp_path, MEDUSA_RECIPE, {**MEDUSA_METRICS,
                                                           "target_name": "meta-llama/Llama-3.1-8B-Instruct"}))
    assert (hub["base_model"], hub["license"]) == ("meta-llama/Llama-3.1-8B-Instruct", "llama3.1")
    other = front_matter(card_text(tmp_path, MEDUSA_RECIPE, {**MEDUSA_METRICS, "target_name": "someone/model"}))
    assert other["base_model"] == "someone/model" and "license" not in other


def test_a_card_lists_the_hub_datasets_the_heads_learnt_from(tmp_path, monkeypatch):
    """The Hub links a model to the datasets its card lists: training data read from the Hub, and the Hub
    prompts `gorgon data` answered; local files, folders and the target's own prompts are not listed."""
    from gorgon.heads.card import card_text
    from gorgon.train.data import METADATA_NAME, DataSettings, hub_datasets, make_dataset

    def data_folder(name: str, prompts: str, from_hub: bool) -> str:  # as `gorgon data` records them
        (tmp_path / name).mkdir()
        (tmp_path / name / METADATA_NAME).write_text(json.dumps({"settings": {"prompts": prompts},
                                                                  "prompts_from_hub": from_hub}))
        return str(tmp_path / name)

    assert hub_datasets(data_folder("hub", "anon8231489123/ShareGPT_Vicuna_unfiltered", True)) == [
        "anon8231489123/ShareGPT_Vicuna_unfiltered"]
    assert hub_datasets(data_folder("older", "someone/prompts", False)) == []  # recorded before it was recorded
    assert hub_datasets("someone/distilled-data") == ["someone/distilled-data"]
    # A local prompts file, named relative to where `gorgon data` ran (it looks like a Hub id from elsewhere).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prompts.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    local = make_dataset(DataSettings(prompts="data/prompts.jsonl", target=str(tiny_chat_target(tmp_path)),
                                      max_new_tokens=2), tmp_path / "local", progress=False)
    assert hub_datasets(str(local)) == []
    card = card_text(tmp_path, MEDUSA_RECIPE, {**MEDUSA_METRICS, "target_name": "SmolLM2-135M-Instruct",
                                               "datasets": ["someone/distilled-data"]})
    assert front_matter(card)["datasets"] == ["someone/distilled-data"]
    assert "datasets" not in front_matter(card_text(tmp_path, MEDUSA_RECIPE, {**MEDUSA_METRICS, "datasets": []}))


@pytest.mark.slow
def test_a_card_names_its_folder_and_the_pushed_card_the_repo(tmp_path, hub):
    """The card's commands said THIS_FOLDER: they name the folder training wrote, and `gorgon push` uploads the
    card made again naming the repo (the folder's own card unchanged); a card the user edited goes up as is."""
    from gorgon.heads.card import write_model_card

    folder = heads_folder(tmp_path)
    (folder / "recipe.json").write_text(json.dumps(MEDUSA_RECIPE))
    (folder / "metrics.json").write_text(json.dumps({**MEDUSA_METRICS, "target_name": "tiny"}))
    write_model_card(folder, MEDUSA_RECIPE, {**MEDUSA_METRICS, "target_name": "tiny"})
    card = (folder / "README.md").read_text()
    assert f"gorgon generate --heads {folder} --prompt" in card and "THIS_FOLDER" not in card
    for spelled in (folder, os.path.relpath(folder)):  # the folder however the push names it
        FakeHub.files.clear()
        assert push(hub, spelled).returncode == 0
        pushed = FakeHub.files["README.md"].decode()
        assert pushed == card.replace(str(folder), "someone/tiny-heads") and (folder / "README.md").read_text() == card
    assert FakeHub.files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert not any(name.startswith("checkpoints") for name in FakeHub.files)
    (folder / "README.md").write_text(card + "\nMy notes.\n")
    run = push(hub, folder)
    assert run.returncode == 0 and "README.md is not the card training wrote (edited?): it goes up" in run.stderr
    assert FakeHub.files["README.md"].decode() == card + "\nMy notes.\n"
    metrics = json.loads((folder / "metrics.json").read_text())
    del metrics["card"]  # a run from before cards were recorded
    (folder / "metrics.json").write_text(json.dumps(metrics))
    assert "README.md was written by an earlier gorgon: it goes up as it is" in push(hub, folder).stderr


@pytest.mark.slow
@pytest.mark.parametrize("arch, mode", [("medusa", "medusa1"), ("medusa", "medusa2"), ("eagle", "medusa1")])
def test_the_python_on_a_card_runs(tmp_path, monkeypatch, arch, mode):
    """What a card shows how to use the heads with in Python, run as written on the folder training wrote (with
    fewer new tokens): gorgon's blocks, not the engines' (vLLM does not install here). It decodes what
    `gorgon generate` does: the Medusa card's loaded the target alone, without a Medusa-2 adapter."""
    import re

    from helpers import toy_data

    from gorgon.decode import from_options, speculative_generate
    from gorgon.train.heads import HeadsTrainConfig, train

    monkeypatch.setenv("GORGON_CACHE", str(tmp_path / "cache"))  # the tree sized for this machine: timed, cached
    out = tmp_path / "heads"
    train(HeadsTrainConfig(data=toy_data(tmp_path / "toy.jsonl", n=8), out=str(out),
                           target=str(tiny_chat_target(tmp_path)), arch=arch, mode=mode, max_steps=1, batch_size=4,
                           report_to="none", save_every=0))
    blocks = re.findall(r"```python\n(.*?)```", (out / "README.md").read_text(), re.S)
    ours = [b for b in blocks if "import vllm" not in b and "from vllm" not in b]
    assert len(ours) == 1 and "max_new_tokens=128" in ours[0], blocks
    scope = {}
    exec(ours[0].replace("max_new_tokens=128", "max_new_tokens=8"), scope)
    target, drafter = from_options(heads=str(out))  # as `gorgon generate --heads` loads them
    assert all(torch.equal(a, b) for a, b in zip(scope["target"].model.parameters(), target.model.parameters()))
    assert scope["result"].tokens == speculative_generate(target.model, drafter, scope["ids"], max_new_tokens=8).tokens


def test_a_draft_cards_base_model_is_the_model_it_was_distilled_from(tmp_path):
    from gorgon.heads.card import card_text

    metrics = {"target_name": "SmolLM2-135M-Instruct", "before": {"kl": 1.0, "top1": 0.5},
               "after": {"kl": 0.5, "top1": 0.6}, "expected_tau": {"before": 1.5, "after": 1.7}, "steps": 3,
               "student": "`HuggingFaceTB/SmolLM2-360M`", "student_parameters": 3e8, "target_parameters": 1.3e8,
               "eval_conversations": 2, "eval_tokens": 10, "draft_tokens": 4, "kind": "draft"}
    recipe = {"beta": 0.0, "lmbda": 0.0, "lora": False, "data": "d.jsonl", "push_to_hub": None}
    for student, base in [(None, "HuggingFaceTB/SmolLM2-135M-Instruct"), ("someone/small", "someone/small")]:
        card = card_text(tmp_path, {**recipe, "student": student}, metrics)
        assert front_matter(card)["base_model"] == base and front_matter(card)["library_name"] == "transformers"


def test_an_export_to_out_dot_writes_into_the_current_folder(tmp_path, monkeypatch):
    """`--out .` staged the export inside the folder (`.`'s parent is `.`) and failed at the move, after the
    work."""
    from gorgon.heads.cli import main as gorgon

    target = tiny_chat_target(tmp_path)
    MedusaHeads.for_target(load_target(str(target), device="cpu").model).save_pretrained(tmp_path / "heads")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert gorgon(["export", "--heads", str(tmp_path / "heads"), "--target", str(target), "--format", "medusa",
                   "--out", "."]) == 0
    assert (tmp_path / "here" / "config.json").is_file() and not list((tmp_path / "here").glob(".*.tmp"))


def test_an_eagle_export_records_the_dtype_it_writes(tmp_path):
    """`--dtype bfloat16` wrote bfloat16 weights under a config saying float32 (the target's when the head
    trained): SGLang runs the draft in its config's dtype and fails when it differs from the served target's."""
    from safetensors import safe_open

    from gorgon.heads import EagleHead
    from gorgon.heads.cli import main as gorgon

    target = tiny_chat_target(tmp_path, layers=6)
    EagleHead.for_target(load_target(str(target), device="cpu").model).save_pretrained(tmp_path / "head")
    for dtype, expected in ((None, "float32"), ("bf16", "bfloat16")):
        out = tmp_path / f"e3-{dtype}"
        assert gorgon(["export", "--heads", str(tmp_path / "head"), "--target", str(target), "--format", "eagle3",
                       "--out", str(out)] + (["--dtype", dtype] if dtype else [])) == 0
        with safe_open(out / "model.safetensors", "pt") as weights:
            assert str(weights.get_tensor("fc.weight").dtype) == f"torch.{expected}"
        assert json.loads((out / "config.json").read_text())["dtype"] == expected


def test_an_export_ends_with_the_command_that_serves_it(tmp_path, capsys):
    """Like data and training, an export says what to run next: the engine's command for its format, drafting
    the tokens the heads are trained for (an EAGLE head's depth, one per Medusa head)."""
    from gorgon.heads import EagleHead
    from gorgon.heads.cli import main as gorgon

    target = tiny_chat_target(tmp_path, layers=6)
    model = load_target(str(target), device="cpu").model
    head = EagleHead.for_target(model)
    head.save_pretrained(tmp_path / "head")
    MedusaHeads.for_target(model, num_heads=3).save_pretrained(tmp_path / "medusa")
    expected = {"eagle3": ("head", f"vllm serve {target} --speculative-config '{{\"method\": \"eagle3\", \"model\": "
                                   f"\"{tmp_path / 'eagle3'}\", \"num_speculative_tokens\": {head.config.depth}}}'"),
                "speculators": ("head", f"vllm serve {target} --speculative-config '{{\"method\": \"eagle3\", "
                                        f"\"model\": \"{tmp_path / 'speculators'}\", \"num_speculative_tokens\": "
                                        f"{head.config.depth}}}'"),
                "vllm": ("medusa", f"vllm serve {target} --speculative-config '{{\"method\": \"medusa\", \"model\": "
                                   f"\"{tmp_path / 'vllm'}\", \"num_speculative_tokens\": 3}}'"),
                "medusa": ("medusa", f"text-generation-launcher --model-id {tmp_path / 'medusa-export'}")}
    for fmt, (heads, command) in expected.items():
        out = tmp_path / ("medusa-export" if fmt == "medusa" else fmt)
        assert gorgon(["export", "--heads", str(tmp_path / heads), "--target", str(target), "--format", fmt,
                       "--out", str(out)]) == 0
        assert f"gorgon export: next, serve them: {command}" in capsys.readouterr().out, fmt


def test_an_engine_layout_loads_onto_the_target_it_names(tmp_path, capsys):
    """Heads in an engine's layout (vLLM's Medusa, EAGLE-3, speculators) named their target only there
    (base_model_name_or_path, the verifier): without --target the embedded target loaded, and the heads
    failed on its shapes. The embedded target's Hub id loads the embedded build, and says so."""
    from gorgon.heads import EagleHead, load_heads
    from gorgon.heads.methods.eagle.formats import export_head
    from gorgon.heads.target import EMBEDDED_HUB_ID, EMBEDDED_NAME, recorded_target, target_for_heads

    target = tiny_chat_target(tmp_path, layers=6)  # EAGLE-3 mixes 3 layers below the last
    model = load_target(str(target), device="cpu").model
    export_heads(MedusaHeads.for_target(model, num_heads=2), "vllm", tmp_path / "vllm", base_model=str(target))
    for fmt in ("eagle3", "speculators"):
        export_head(EagleHead.for_target(model, feature_layers=[1, 3, 5]), fmt, tmp_path / fmt, base_model=str(target))
    for folder in ("vllm", "eagle3", "speculators"):
        loaded, _ = load_heads(tmp_path / folder)
        assert loaded.name == str(target), folder
        assert f"gorgon: target {target}, which the heads were trained for" in capsys.readouterr().err
    assert recorded_target({"speculators_config": {"verifier": {"name_or_path": EMBEDDED_HUB_ID}}}) == EMBEDDED_NAME
    assert recorded_target({"speculators_config": "odd"}) is None and recorded_target([]) is None
    assert target_for_heads({"base_model_name_or_path": EMBEDDED_HUB_ID}, None) is None
    assert f"target {EMBEDDED_HUB_ID}, which the heads name, as the embedded build of it" in capsys.readouterr().err
    assert target_for_heads({"target_name": EMBEDDED_NAME}, None) is None and not capsys.readouterr().err
    # gorgon's own heads trained on the Hub model load onto it, not onto the embedded (quantised) build.
    assert target_for_heads({"target_name": EMBEDDED_HUB_ID}, None) == EMBEDDED_HUB_ID


def test_an_export_names_the_embedded_target_by_its_hub_id_and_imports_back_to_it(tmp_path, capsys,
                                                                                   monkeypatch):
    """Exports recorded "SmolLM2-135M-Instruct", which no engine can load (vLLM loads the speculators verifier's
    name, TGI the base_model_name_or_path); imported back, the Hub id is the embedded target again."""
    from gorgon.heads.target import EMBEDDED_HUB_ID, EMBEDDED_NAME, gorgon_name, hub_name

    assert hub_name(EMBEDDED_NAME) == EMBEDDED_HUB_ID and gorgon_name(EMBEDDED_HUB_ID) == EMBEDDED_NAME
    assert hub_name("someone/model") == gorgon_name("someone/model") == "someone/model"
    model = tiny_model()
    export_heads(trained_like(model), "medusa", tmp_path / "m", base_model=EMBEDDED_HUB_ID)
    assert MedusaHeads.from_pretrained(tmp_path / "m").config.target_name == EMBEDDED_NAME
    # Through `gorgon export`: the embedded target's Hub id; a local target's path, said to need --base-model.
    import dataclasses

    import gorgon.heads.export as export_command
    from gorgon.heads.cli import main as gorgon

    target = tiny_chat_target(tmp_path)
    MedusaHeads.for_target(load_target(str(target), device="cpu").model, shared_lm_head=False).save_pretrained(
        tmp_path / "heads")
    command = ["export", "--heads", str(tmp_path / "heads"), "--target", str(target), "--format", "medusa"]
    assert gorgon(command + ["--out", str(tmp_path / "local")]) == 0
    assert json.loads((tmp_path / "local" / "config.json").read_text())["base_model_name_or_path"] == str(target)
    assert "names its target by the local path" in capsys.readouterr().err
    loaded = export_command.load_heads

    def as_embedded(*args, **kwargs):
        target, heads = loaded(*args, **kwargs)
        return dataclasses.replace(target, name=EMBEDDED_NAME), heads

    monkeypatch.setattr(export_command, "load_heads", as_embedded)
    assert gorgon(command + ["--out", str(tmp_path / "embedded")]) == 0
    assert json.loads((tmp_path / "embedded" / "config.json").read_text())["base_model_name_or_path"] == EMBEDDED_HUB_ID
    assert "local path" not in capsys.readouterr().err


def test_a_checkpoint_in_an_engines_layout_is_not_taken_for_an_export(tmp_path, capsys):
    """A downloaded Medusa checkpoint with the user's notes beside it is not gorgon's to replace, even
    though it is in a layout gorgon exports to; a refused export leaves no empty --out behind."""
    heads = saved_heads(tmp_path)
    downloaded = tmp_path / "medusa-vicuna"
    downloaded.mkdir()
    (downloaded / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 1}))
    (downloaded / "NOTES.md").write_text("mine")
    before = snapshot(downloaded)
    assert gorgon(["export", "--heads", str(heads), "--format", "medusa", "--out", str(downloaded), "--overwrite"]) == 2
    assert "already holds files this command did not write" in capsys.readouterr().err
    assert snapshot(downloaded) == before
    assert gorgon(["export", "--heads", str(tmp_path / "nowhere"), "--format", "vllm",
                   "--out", str(tmp_path / "new" / "v")]) == 2
    assert "nowhere" in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_export_overwrite_replaces_the_earlier_exports_files_only(tmp_path, capsys):
    """--overwrite swaps an earlier export for a new one, in the other format too, and keeps the files
    the user put beside it; a file the new export would write over is refused."""
    target = tiny_chat_target(tmp_path)
    heads = tmp_path / "heads"
    MedusaHeads.for_target(AutoModelForCausalLM.from_pretrained(target), shared_lm_head=False).save_pretrained(heads)
    out = tmp_path / "export"
    export = ["export", "--heads", str(heads), "--target", str(target), "--out", str(out)]
    assert gorgon(export + ["--format", "medusa"]) == 0
    assert not list(tmp_path.glob(".export*"))  # written beside --out, then renamed into place
    (out / "README.md").write_text("how we serve it")
    assert gorgon(export + ["--format", "vllm", "--overwrite"]) == 0
    assert sorted(f.name for f in out.iterdir()) == [".gorgon-export", "README.md", "config.json", "model.safetensors"]
    assert (out / "README.md").read_text() == "how we serve it"
    (out / "medusa_lm_head.safetensors").write_text("mine")
    before = snapshot(out)
    assert gorgon(export + ["--format", "medusa", "--overwrite"]) == 2
    assert "holds medusa_lm_head.safetensors, which the earlier export did not write" in capsys.readouterr().err
    assert snapshot(out) == before and not list(tmp_path.glob(".export*"))
    (out / "medusa_lm_head.safetensors").unlink()
    (out / ".gorgon-export").write_text("")  # an older gorgon's marker, which lists nothing: refused, nothing removed
    before = snapshot(out)
    assert gorgon(export + ["--format", "medusa", "--overwrite"]) == 2
    assert "holds an export by an older gorgon, whose .gorgon-export does not list its files" in capsys.readouterr().err
    assert snapshot(out) == before and not list(tmp_path.glob(".export*"))


@pytest.mark.slow
def test_a_hub_that_does_not_resolve_is_not_retried(tmp_path):
    """With no network and HF_HUB_OFFLINE unset, huggingface_hub retried every file five times (48 s for a missing
    target) before its error or the cache: a command now finds the Hub's host unknown and works from the cache at
    once, saying why. The user's HF_HUB_OFFLINE, either way, is left as set."""
    from gorgon.heads.hub import PROXIES, resolves

    if resolves("hub.invalid"):  # a resolver that answers (or hangs) for the reserved .invalid
        pytest.skip("this machine's resolver does not fail on hub.invalid")
    unset = {**{k: v for k, v in env().items() if k not in ("HF_HUB_OFFLINE", *PROXIES)},
             "HF_ENDPOINT": "https://hub.invalid"}
    run = subprocess.run([sys.executable, "-m", "gorgon.heads.cli", "generate", "--target", "someone/model",
                          "--context-draft", "--prompt", "hi"], env=unset, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Retrying" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "gorgon generate: error: no target 'someone/model': no local folder by that name, and the local hub cache "
        "(the Hub's hub.invalid does not resolve) has none (OSError): check the path or the hub id")
    probe = ("import os; from gorgon.heads.hub import offline_if_hub_unreachable as f; f(); "
             "print(os.environ.get('HF_HUB_OFFLINE'))")
    for extra, expected in [({}, "1"), ({"HF_HUB_OFFLINE": "0"}, "0"), ({"HTTPS_PROXY": "http://proxy:3128"}, "None")]:
        out = subprocess.run([sys.executable, "-c", probe], env={**unset, **extra}, capture_output=True, text=True,
                             check=True).stdout.strip()
        assert out == expected, extra


def test_an_export_format_for_the_other_method_is_refused_before_the_target_loads(tmp_path, capsys):
    heads = tmp_path / "heads"
    MedusaHeads.for_target(tiny_model()).save_pretrained(heads)
    assert gorgon(["export", "--heads", str(heads), "--target", str(tmp_path / "no-target"), "--format", "eagle3",
                   "--out", str(tmp_path / "e3")]) == 2  # the target does not exist: the format's error came first
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.strip().endswith("holds Medusa heads, which export as vllm or medusa, not "
                                                         "eagle3")
