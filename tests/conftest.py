"""Fixtures for the whole suite: `builtin:tiny` built once per session into a private cache."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from r1fit.models.builtin import ensure_builtin

# One torch thread in each test process and in the runs it starts (they inherit the variable),
# unless OMP_NUM_THREADS says otherwise: the suite's models are tiny, so a second thread gains
# nothing on a quiet 2-core machine (15.3 s either way for two whole-run tests), and beside other
# work it made them 4-6x slower (its threads wait for each other); with pytest-xdist's workers
# (pyproject's addopts) each worker has a core of its own.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _auto_engine_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rollout.engine=auto`` resolves as on a machine without vLLM, in this process: a CUDA
    plan would otherwise depend on whether the vllm extra is installed (CI installs it). Tests of
    the vLLM engine name it (``rollout.engine=vllm``); tests/config/test_engines.py sets it."""
    monkeypatch.setattr("r1fit.config.engines.vllm_installed", lambda: False)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root (for R1FIT_CACHE) holding a freshly built builtin:tiny."""
    root = tmp_path_factory.mktemp("r1fit_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R1FIT_CACHE", str(root))
        ensure_builtin("tiny")
    return root


@pytest.fixture(scope="session")
def tiny_dir(tiny_cache: Path) -> Path:
    """The built tiny model folder."""
    folder = next((tiny_cache / "models").glob("tiny-v*"))
    assert (folder / "config.json").is_file()
    return folder


@pytest.fixture
def use_tiny_cache(tiny_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point R1FIT_CACHE at the session cache for one test, so `builtin:tiny` needs no rebuild."""
    monkeypatch.setenv("R1FIT_CACHE", str(tiny_cache))
    return tiny_cache


@pytest.fixture(scope="session")
def builtin_folder(tiny_cache: Path) -> Callable[[str], Path]:
    """``builtin_folder(name)``: the folder of built-in ``name``, built once into the session
    cache (for the architectures other than builtin:tiny)."""

    def build(name: str) -> Path:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("R1FIT_CACHE", str(tiny_cache))
            return ensure_builtin(name)

    return build


@pytest.fixture(scope="session")
def realvocab_cache(tiny_cache: Path) -> Path:
    """The session cache with builtin:small-realvocab (Qwen's 151,936-token vocabulary) built."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R1FIT_CACHE", str(tiny_cache))
        ensure_builtin("small-realvocab")
    return tiny_cache


def float64_setup(folder: Path, *, lora_r: int = 0, checkpointing: bool = True,
                  max_pixels: int = 3136, indices: tuple[int, ...] = (0, 1, 2)):
    """``(model, processor, prompts)``: the model in ``folder`` in float64 (with gradient
    checkpointing when asked), and builtin:shapes prompts ``indices`` with float64 pixels, for
    exactness tests of log-probs and gradients."""
    import torch

    from r1fit.data.batch import encode_prompts
    from r1fit.data.dataset import load_dataset
    from r1fit.models.load import load_policy

    model, processor = load_policy(str(folder), lora_r=lora_r, lora_alpha=16, lora_dropout=0.0,
                                   lora_target="all-linear", freeze_vision=False, dtype="float32",
                                   device=torch.device("cpu"), gradient_checkpointing=checkpointing)
    data = load_dataset("builtin:shapes", split="train", min_pixels=784, max_pixels=max_pixels,
                        max_images=1, max_bad_fraction=0.0, seed=0, size=16)
    prompts = encode_prompts(processor, [data[i] for i in indices], "Think, then answer.")
    for p in prompts:  # pixels in float64 like the model under test
        p.image_inputs["pixel_values"] = p.image_inputs["pixel_values"].double()
    return model.double(), processor, prompts


def random_completions(vocab: int, lengths: list[int]):
    """Completions of random ordinary tokens (no specials), of the given lengths."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab - 30, (n,), generator=gen) for n in lengths]


@pytest.fixture
def float64_tiny(tiny_dir: Path):
    """``make(lora_r=0) -> (model, processor, rows, completions)``: builtin:tiny in float64 with
    gradient checkpointing, and 3 builtin:shapes prompts x 2 rows with random completions of
    different lengths (so padding and masks matter), for exactness tests of log-probs and
    gradients."""

    def make(lora_r: int = 0):
        model, processor, prompts = float64_setup(tiny_dir, lora_r=lora_r)
        rows = [p for p in prompts for _ in range(2)]
        completions = random_completions(len(processor.tokenizer),
                                         [3 + (i * 5) % 7 for i in range(len(rows))])
        return model, processor, rows, completions

    return make


@pytest.fixture(scope="session")
def float64_model():
    """:func:`float64_setup`, for tests of other models than builtin:tiny."""
    return float64_setup


@pytest.fixture
def completions_for():
    """:func:`random_completions`."""
    return random_completions


@pytest.fixture(scope="session")
def hd32_dir(tiny_cache: Path) -> Path:
    """builtin:tiny-hd32 (tiny with 32-dim attention heads, which vLLM's CPU attention runs),
    built into the session cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R1FIT_CACHE", str(tiny_cache))
        return ensure_builtin("tiny-hd32")


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    """Skip the test when vLLM is not installed (CI installs it: .ci/install_vllm_cpu.sh)."""
    pytest.importorskip("vllm", reason="rollout.engine=vllm tests need vLLM: pip install -e "
                        "'.[vllm]' (GPU) or bash .ci/install_vllm_cpu.sh (CPU)")


@pytest.fixture(scope="session")
def start_vllm(vllm_installed):
    """``start_vllm(folder, model, processor, max_images)``: a vLLM engine of the model in
    ``folder`` (its loaded ``model`` and ``processor`` give the config and the image token) on
    CPU, float32, 512 tokens per request, a 64 MiB KV cache; the caller closes it."""
    import torch

    from r1fit.models.load import special_token_ids
    from r1fit.rollout.vllm_engine import EngineSpec, VllmEngine

    def start(folder: Path, model, processor, max_images: int):
        spec = EngineSpec(folder=folder, dtype=torch.float32, device=torch.device("cpu"), seed=0,
                          max_model_len=512, kv_cache_memory=64 << 20,
                          gpu_memory_utilization=0.3, sleep_level=1, enforce_eager=None,
                          max_images=max_images,
                          image_token_id=special_token_ids(model, processor)["image_pad"],
                          distributed=False)
        return VllmEngine(spec, model.config.get_text_config())

    return start


@pytest.fixture(scope="session")
def nearly_all_stop():
    """``nearly_all_stop(model, ids)``: ``ids`` (a ``TokenIds``) with every token of the vocabulary
    an end-of-sequence token but 8 (and the blocked placeholders), so a completion ends at its
    first token unless a minimum length holds it open."""
    from r1fit.rollout.generate import TokenIds

    def make(model, ids, keep: int = 8):
        vocab = model.config.get_text_config().vocab_size
        kept = [t for t in range(vocab) if t not in ids.blocked][:keep]
        eos = [t for t in range(vocab) if t not in kept and t not in ids.blocked]
        return TokenIds(ids.pad, eos, ids.blocked)

    return make


CHROMIUM = Path("/usr/bin/chromium")


def chromium(tmp_path: Path, page: Path, *options: str) -> subprocess.CompletedProcess:
    """Headless Chromium (skips the test where it is missing: CI installs it, apt-get install
    chromium) run on ``page`` (an HTML file, from disk) with ``options``, in a 1200 x 900 window
    with a profile of its own, nothing from the network."""
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium (apt-get install chromium)")
    profile = tmp_path / "chromium-profile"
    args = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
            "--enable-logging=stderr", "--v=0", "--window-size=1200,900", *options,
            page.resolve().as_uri()]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    shutil.rmtree(profile, ignore_errors=True)
    return done


@pytest.fixture
def headless_chromium(tmp_path: Path) -> Callable[[Path], tuple[Path, list[str]]]:
    """``shoot(page)``: ``page`` (an HTML file) opened from disk in headless Chromium; returns its
    screenshot (1200 x 900) and the console lines (messages and uncaught errors)."""

    def shoot(page: Path) -> tuple[Path, list[str]]:
        shot = tmp_path / "shot.png"
        done = chromium(tmp_path, page, f"--screenshot={shot}")
        assert shot.is_file(), done.stderr[-2000:]
        return shot, [line for line in done.stderr.splitlines()
                      if "CONSOLE" in line or "Uncaught" in line]

    return shoot


@pytest.fixture
def chromium_dom(tmp_path: Path) -> Callable[[Path], str]:
    """``dom(page)``: the document Chromium made of ``page`` (an HTML file, from disk) once
    loaded and its scripts run (``--dump-dom``): what it shows, not what the file says."""

    def dom(page: Path) -> str:
        done = chromium(tmp_path, page, "--dump-dom")
        assert done.returncode == 0 and "<body" in done.stdout, done.stderr[-2000:]
        return done.stdout

    return dom


@contextmanager
def shape_rounding(model: torch.nn.Module, size: float) -> Iterator[None]:
    """Make the model's numbers depend on the batch's shape, as a GPU kernel's rounding does
    (another tiling for another number of rows): every last hidden state moved by ``size`` times
    the number of rows in the batch. The per-row path batched, one row at a time, and the packed
    path (one row per group) then all differ, by amounts in proportion to their row counts."""
    norm = model.model.language_model.norm  # the last hidden states, which the head reads
    hook = norm.register_forward_hook(lambda _m, _i, out: out + size * out.shape[0])
    try:
        yield
    finally:
        hook.remove()


@pytest.fixture
def batch_shape_rounding():
    """:func:`shape_rounding`."""
    return shape_rounding
