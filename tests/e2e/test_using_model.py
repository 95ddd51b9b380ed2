"""docs/using.md, run as written: a short LoRA run and a short full fine-tuning run of
builtin:tiny-hd32 (heads of 32, which vLLM's CPU attention runs), then the page's `r1fit export`
command and its python snippets, taken from the page with its folder names replaced by this
test's (so the page cannot drift from what runs): transformers on the export and on both runs'
final/, peft, `r1fit eval`, vLLM offline and its OpenAI server. The merged model's logits equal
the adapter's up to float rounding; vLLM's greedy answers equal transformers' (a weak check on a
random-weight model, whose answer repeats a token: the numerics are tests/rollout's)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw
from transformers import AutoModelForImageTextToText, AutoProcessor

from r1fit.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_docs import ROOT  # noqa: E402
from test_docs_commands import commands_in, fenced_blocks  # noqa: E402

PAGE = ROOT / "docs" / "using.md"
# the page's names, each replaced by this test's folder or file
FOLDER, MERGED, FINAL = '"my-model"', '"my-merged-model"', '"runs/qwen2.5-vl-3b-grpo/final"'
BASE, PHOTO = '"Qwen/Qwen2.5-VL-3B-Instruct"', '"photo.jpg"'
CHECKPOINT = "runs/qwen2.5-vl-3b-grpo/checkpoint-1000"
SHORT = {"max_new_tokens=512": "max_new_tokens=16", "max_tokens=512": "max_tokens=16"}

RUN = ["model.path=builtin:tiny-hd32", "train.max_steps=1", "train.prompts_per_step=2",
       "algo.num_generations=4", "sft.format_warmup_steps=2", "eval.every=0",
       "eval.before_train=false", "data.eval_size=4", "memory.micro_batch=4",
       "memory.generation_batch=8", "data.shapes.train_size=50", "data.shapes.image_size=56",
       "data.max_pixels=3136", "checkpoint.every=1"]
# a high warm-up learning rate, so the adapter (whose B matrices start at 0) moves the model
LORA = ["model.lora.r=4", "sft.learning_rate=5e-2"]


def snippet(kind: str, names: dict[str, str]) -> str:
    """The page's python block of ``kind`` (the package it is about) with each of ``names``
    replaced (each must be there), and its lengths shortened."""
    blocks = python_blocks()
    assert kind in blocks, f"docs/using.md has no {kind} snippet"
    code = blocks[kind]
    for old, new in names.items():
        assert old in code, f"the {kind} snippet no longer names {old}"
        code = code.replace(old, new)
    for old, new in SHORT.items():  # a few tokens are enough to compare
        code = code.replace(old, new)
    return code


def python_blocks() -> dict[str, str]:
    """The page's python blocks by kind: vllm, openai, peft, else transformers."""
    blocks = {}
    for lang, body in fenced_blocks(PAGE.read_text()):
        if lang == "python":
            kind = next((k for k in ("vllm", "openai", "peft") if f"from {k} import" in body),
                        "transformers")
            assert kind not in blocks, f"two {kind} snippets in docs/using.md"
            blocks[kind] = body
    return blocks


def literal(path: Path) -> str:
    return json.dumps(str(path))


def run_snippet(code: str) -> tuple[dict, str]:
    """(namespace, stdout) of ``code`` run in this process."""
    namespace: dict = {"__name__": "__main__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out), torch.no_grad():
        exec(compile(code, str(PAGE), "exec"), namespace)  # noqa: S102 - the page's own code
    return namespace, out.getvalue()


def logits_of(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


@pytest.fixture(scope="module")
def runs(hd32_dir, tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The LoRA and the full fine-tuning run's folders, the base model, a photo, a scratch dir."""
    root = tmp_path_factory.mktemp("using")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R1FIT_CACHE", str(tiny_cache))
        assert main(["train", f"train.output_dir={root / 'lora'}", *RUN, *LORA]) == 0
        assert main(["train", f"train.output_dir={root / 'full'}", *RUN]) == 0
    image = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(image).ellipse((8, 8, 40, 40), fill="red")
    image.save(root / "photo.jpg")
    return {"lora": root / "lora", "full": root / "full", "base": hd32_dir,
            "photo": root / "photo.jpg", "root": root}


@pytest.fixture(scope="module")
def merged(runs, tiny_cache: Path) -> Path:
    """The page's `r1fit export ... --merge-lora`, on the LoRA run's last checkpoint."""
    (command,) = [args for args in commands_in(PAGE.read_text()) if args[0] == "export"]
    assert CHECKPOINT in command and "my-model" in command and "--merge-lora" in command
    out = runs["root"] / "my-model"
    names = {CHECKPOINT: str(runs["lora"] / "checkpoint-1"), "my-model": str(out)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R1FIT_CACHE", str(tiny_cache))
        assert main([names.get(word, word) for word in command]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in (runs["full"] / "final").iterdir())  # the files of a full final/
    return out


def transformers_run(folder: Path, runs) -> tuple[dict, str]:
    return run_snippet(snippet("transformers", {FOLDER: literal(folder),
                                                PHOTO: literal(runs["photo"])}))


@pytest.fixture(scope="module")
def greedy(runs, merged) -> tuple[dict, str]:
    """The transformers snippet on the merged export: (namespace, printed answer)."""
    return transformers_run(merged, runs)


def test_the_page_names_what_a_run_leaves(runs):
    text = PAGE.read_text()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (runs["lora"] / "final" / name).is_file() and name in text
    assert not (runs["lora"] / "final" / "config.json").exists()  # the adapter alone
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "processor_config.json"):
        assert (runs["full"] / "final" / name).is_file() and f"`{name}`" in text
    assert "`README.md`" in text and (runs["lora"] / "final" / "README.md").is_file()


def test_transformers_on_the_export_and_on_both_final_folders(runs, merged, greedy):
    ns, printed = greedy
    prompt_len = ns["inputs"]["input_ids"].shape[1]
    assert ns["output"].shape[1] > prompt_len and printed == ns["answer"] + "\n"
    merged_logits = logits_of(ns["model"], ns["inputs"])

    lora_ns, _ = transformers_run(runs["lora"] / "final", runs)  # the adapter, through peft
    assert getattr(lora_ns["model"], "_hf_peft_config_loaded", False)
    adapter_logits = logits_of(lora_ns["model"], ns["inputs"])
    base = AutoModelForImageTextToText.from_pretrained(runs["base"]).eval()
    assert (adapter_logits - logits_of(base, ns["inputs"])).abs().max() > 1e-3  # it moved
    torch.testing.assert_close(merged_logits, adapter_logits, atol=1e-5, rtol=0)

    full_ns, _ = transformers_run(runs["full"] / "final", runs)
    assert full_ns["output"].shape[1] > prompt_len


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft's probe
def test_peft_loads_and_merges_the_adapter(runs, merged, greedy):
    out = runs["root"] / "peft-merged"
    ns, _ = run_snippet(snippet("peft", {BASE: literal(runs["base"]),
                                         FINAL: literal(runs["lora"] / "final"),
                                         MERGED: literal(out)}))
    inputs = greedy[0]["inputs"]
    from_peft = AutoModelForImageTextToText.from_pretrained(out).eval()
    AutoProcessor.from_pretrained(out)
    exported = AutoModelForImageTextToText.from_pretrained(merged).eval()
    torch.testing.assert_close(logits_of(from_peft, inputs), logits_of(exported, inputs),
                               atol=1e-5, rtol=0)


def test_eval_scores_the_export_as_its_adapter(runs, merged, tiny_cache, monkeypatch):
    monkeypatch.setenv("R1FIT_CACHE", str(tiny_cache))
    found = {}
    for name, model in (("merged", merged), ("adapter", runs["lora"] / "final")):
        out = runs["root"] / f"eval-{name}"
        assert main(["eval", *RUN, *LORA, "--model", str(model), "--out", str(out)]) == 0
        summary = json.loads((out / "summary.json").read_text())
        answers = [[a["text"] for a in json.loads(line)["answers"]]
                   for line in (out / "eval.jsonl").read_text().splitlines()]
        found[name] = (summary["accuracy"], summary["format"], summary["size"], answers)
    assert found["merged"] == found["adapter"] and found["merged"][2] == 4


def vllm_env() -> dict[str, str]:
    """The environment the page says a CPU needs: a 1 GiB KV cache."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    return {**env, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CONFIGURE_LOGGING": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.vllm
def test_vllm_server_answers_as_transformers(runs, merged, greedy, vllm_installed):
    """`vllm serve my-model` as the CPU build starts it (its `vllm` command cannot find the
    package `vllm`: the page says so), then the page's OpenAI client."""
    (serve,) = [shlex.split(line) for lang, body in fenced_blocks(PAGE.read_text())
                if lang == "bash" for line in body.splitlines() if line.startswith("vllm serve ")]
    assert serve[2] == "my-model"
    port = free_port()
    log = (runs["root"] / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                               "--model", str(merged), *serve[3:], "--port", str(port)],
                              env=vllm_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 400
        while True:
            assert server.poll() is None, (runs["root"] / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the vLLM server did not start in 400 s"
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            time.sleep(2)
        code = snippet("openai", {FOLDER: literal(merged), PHOTO: literal(runs["photo"]),
                                  "http://localhost:8000": f"http://127.0.0.1:{port}"})
        _, printed = run_snippet(code)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    assert printed == greedy[1]


def test_snippets_name_what_the_test_replaces():
    """Each snippet's folder and file names are the ones this test replaces (a renamed folder
    on the page fails here, not silently)."""
    blocks = python_blocks()
    assert set(blocks) == {"transformers", "peft", "vllm", "openai"}
    assert re.search(r"^r1fit export \S+ my-model --merge-lora$", PAGE.read_text(), re.M)
    for kind, names in (("transformers", (FOLDER, PHOTO, "max_new_tokens=512")),
                        ("peft", (BASE, FINAL, MERGED)),
                        ("vllm", (FOLDER, PHOTO, "max_tokens=512")),
                        ("openai", (FOLDER, PHOTO, "max_tokens=512", "http://localhost:8000"))):
        for name in names:
            assert name in blocks[kind], (kind, name)
