"""What a device does per second, for the time model (:mod:`r1fit.memory.planner.timing`):
measured by ``r1fit doctor --calibrate`` and cached per device, else taken from data sheets.

:func:`calibrate` measures, in well under a minute:

- **matmul rate** (FLOP/s) of square products in the device's 16-bit dtype and in float32, at a
  few sizes (a small model's matrices run far below the peak on a CPU);
- **skinny matmul rate** of a decode step's products (a handful of rows times a wide matrix);
- **copy bandwidth** (bytes/s, read + write counted) of a large device-to-device copy: the rate
  at which a decode step reads weights and KV cache; on a CPU also into a tensor just allocated
  (its pages faulted in on first write, as FSDP2's buffers are);
- **launch cost** (seconds per kernel): a one-element in-place add, run many times; the floor
  of every small operation (Python and dispatch on a CPU, the kernel launch on a GPU);
- **layer step cost**: the seconds of one token step through a small decoder layer (attention
  with a KV cache, MLP, norms: the kernels a transformer layer launches) at two batch sizes; the
  fixed part per layer and step is what an eager decode step pays before any arithmetic;
- **logits**: seconds per logit of r1fit's sampler and of the training head (its log-probs,
  entropies and the loss's gradient over the vocabulary, its matmuls aside): with a
  151,936-token vocabulary these, not the matmuls, can be most of a small model's step;
- **a layer over many tokens**: the calibration layer's forward, and its forward and backward,
  over one row of ``LAYER_TOKENS`` tokens: beyond its matmul FLOPs (at the measured rate) and
  its fixed cost, what remains is the element-wise work (norms, activations, rotary, residuals,
  softmax) that grows with tokens x width and that the FLOP count leaves out;
- **an unmerged LoRA adapter**: what peft's adapter adds to one Linear's forward of one token
  (its Python and kernels: dropout, A, B, scale, add), its arithmetic aside;
- **optimizer step per tensor**: AdamW (fused where the device has it, as training builds it),
  the gradient-norm clip and zeroing over many small tensors: a model's many parameter tensors
  (a LoRA model's two per adapted matrix) each cost it a fixed time;
- **generate's step**: Hugging Face generate's own seconds per decode step (its loop, logits
  processors, stopping criteria) on a 1-layer model, as r1fit's HF engine calls it;
- **disk write rate** (bytes/s) of a file written and synced in the cache folder (checkpoints);
- **the link between processes** (:mod:`r1fit.memory.link`): an all-gather's and a
  reduce-scatter's bus bandwidth and fixed cost between two processes (gloo on a CPU, NCCL
  between two GPUs; a machine with one GPU keeps the data sheet's, ``GPU_LINK``).

They are saved to ``$R1FIT_CACHE/calibration/<device key>.json``, the key naming the device, its
driver and torch (another torch or driver measures again). Without a calibration,
:func:`device_rates` answers from data sheets for a GPU it knows (``GPU_PEAK_TFLOPS``, memory
bandwidth below) and from rough CPU figures otherwise, and says so (``source``).
"""

from __future__ import annotations

import json
import os
import platform
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from r1fit.memory.flops import gpu_peak_flops
from r1fit.rollout.prefill import cache_argument

#: data-sheet memory bandwidth (bytes/s) of GPUs, by name fragment as torch reports it (the
#: first match wins, so longer names first): HBM's peak; a copy reaches ~80-90% of it
GPU_BANDWIDTH: tuple[tuple[str, float], ...] = (
    ("GB200", 8.0e12), ("B200", 8.0e12), ("H200", 4.8e12), ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12), ("H800", 3.35e12), ("H20", 4.0e12), ("A100", 2.0e12), ("A800", 2.0e12),
    ("L40S", 0.864e12), ("L40", 0.864e12), ("L4", 0.3e12), ("A10G", 0.6e12), ("A10", 0.6e12),
    ("RTX 4090", 1.0e12), ("RTX 3090", 0.936e12), ("V100", 0.9e12), ("T4", 0.32e12),
)
#: a GPU kernel launch from eager PyTorch (seconds), the order of magnitude the field quotes
GPU_LAUNCH_SECONDS = 8e-6
#: an uncalibrated GPU's eager decoder layer step and peft adapter (seconds), as measured on one
#: H100 (benchmarks/RESULTS.md, 2026-11-26, Hugging Face generate of Qwen2.5-VL-3B at G=8): ~28
#: ms per token step over 36 layers fully fine-tuned, ~59 ms with LoRA r=16 on 7 Linears a layer
GPU_LAYER_STEP_SECONDS = 28e-3 / 36
GPU_LORA_SECONDS = (59e-3 - 28e-3) / (36 * 7)
#: the links between a machine's GPUs, by name fragment (the first match wins): the data
#: sheet's bandwidth per GPU and direction (half of the two-way total it quotes), NVLink on SXM
#: parts, PCIe (x16) on cards; NCCL's collectives reach about ``LINK_EFFICIENCY`` of it
GPU_LINK: tuple[tuple[str, float, str], ...] = (
    ("GB200", 900e9, "NVLink 5"), ("B200", 900e9, "NVLink 5"),
    ("H100 PCIe", 64e9, "PCIe 5"), ("H800", 200e9, "NVLink 4"), ("H200", 450e9, "NVLink 4"),
    ("H100", 450e9, "NVLink 4"), ("H20", 450e9, "NVLink 4"), ("A100-PCIE", 32e9, "PCIe 4"),
    ("A100", 300e9, "NVLink 3"), ("A800", 200e9, "NVLink 3"), ("V100-PCIE", 16e9, "PCIe 3"),
    ("V100", 150e9, "NVLink 2"), ("L40", 32e9, "PCIe 4"), ("L4", 32e9, "PCIe 4"),
    ("A10", 32e9, "PCIe 4"), ("RTX", 32e9, "PCIe 4"), ("T4", 16e9, "PCIe 3"),
)
#: the share of a link's bandwidth an all-gather or reduce-scatter reaches (a rough figure)
LINK_EFFICIENCY = 0.8
#: a collective's fixed cost between GPUs (seconds), the order of magnitude NCCL's small messages
#: take within a machine
GPU_COLLECTIVE_SECONDS = 30e-6
#: rough CPU figures for an uncalibrated plan (a 2-core cloud machine measured here, rounded;
#: ``link``: gloo between two processes over loopback, ``collective``: a few bytes' all-gather)
CPU_DEFAULTS = {"matmul": 4e10, "copy": 1e10, "launch": 5e-6, "layer_step": 5e-4, "disk": 2e8,
                "link": 5e8, "collective": 2e-4}
#: rough NVMe write rate for an uncalibrated GPU machine
GPU_DISK_DEFAULT = 1e9

#: the sizes the matmul rate is measured at (square products)
MATMUL_SIZES = (128, 256, 512, 1024, 2048)
#: the calibration's decoder layer (a Qwen2 layer): width, MLP width, key/value width
LAYER_WIDTH, LAYER_MLP, LAYER_KV = 256, 704, 128
#: tokens of the one row the calibration layer's forward and backward run over
LAYER_TOKENS = 512
#: bytes an uncalibrated plan takes a layer's element-wise work to move per token and unit of
#: width in a forward (about 30 passes, read and write, of 4-byte values); a backward twice that
ELEMENTWISE_BYTES = 240


@dataclass(frozen=True)
class DeviceRates:
    """One device's rates (see the module docstring). ``matmul``: per dtype name, ``[(size,
    FLOP/s)]`` for square products of that size; ``layer_step``: seconds of one token step
    through the calibration's decoder layer at ``layer_rows`` rows each; ``source``:
    "calibrated <date>" or what the figures were taken from."""

    device: str
    key: str
    matmul: dict[str, list[tuple[int, float]]]
    copy_bytes_per_s: float
    launch_s: float
    layer_step_s: list[tuple[int, float]]
    disk_bytes_per_s: float
    source: str
    notes: list[str] = field(default_factory=list)
    #: seconds per logit of r1fit's sampler (float32 conversion, exp, two-level cumsum): a
    #: decode step pays it on every row's whole vocabulary
    sample_s_per_logit: float = 0.0
    #: seconds per logit of the training head as a GRPO update runs it (log-probs, entropies,
    #: the loss's gradient over the vocabulary), its matmuls aside
    head_s_per_logit: float = 0.0
    #: per dtype name, ``[(rows, FLOP/s)]`` of a decode step's skinny products: ``rows`` x 1024
    #: times 1024 x 32768, a weight larger than a CPU's caches as a model's are (a handful of
    #: rows run far below a square product's rate)
    skinny: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    #: seconds Hugging Face generate spends per decode step outside the model's layers and the
    #: sampler (its loop, logits processors, stopping criteria), at 16 rows
    generate_step_s: float = 0.0
    #: seconds Hugging Face generate spends per logit of a decode step beyond the head's
    #: matmul (r1fit's sampler, generate's logits processors and copies over the vocabulary);
    #: charged instead of ``sample_s_per_logit`` on the HF engine
    generate_s_per_logit: float = 0.0
    #: per dtype name, (tokens, forward seconds, forward and backward seconds) of the
    #: calibration layer over one row (:meth:`elementwise_s` reads the element-wise part)
    layer_tokens_s: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    #: seconds of an optimizer step (AdamW, gradient clip, zeroing) per parameter tensor
    optimizer_s_per_tensor: float = 0.0
    #: seconds peft's unmerged adapter adds to one Linear's forward (0: not measured, the time
    #: model counts ``LORA_KERNELS`` launches)
    lora_s_per_linear: float = 0.0
    #: seconds a training micro-batch's forward and backward cost beyond the model's layers and
    #: arithmetic (the model's own positions, masks and embedding, r1fit's loss and its
    #: statistics), and an update beyond its micro-batches (clipping, the optimizer's call):
    #: measured by ``r1fit doctor --calibrate`` on r1fit's own GRPO step (r1fit/doctor/steps.py)
    micro_batch_s: float = 0.0
    update_s: float = 0.0
    #: the link between processes (FSDP2's collectives, :mod:`r1fit.memory.link`): bus
    #: bandwidth in bytes/s (a collective's whole tensor x (n-1)/n over its seconds), a
    #: collective's fixed seconds, and where they came from ("measured ..." or a data sheet)
    link_bytes_per_s: float = 0.0
    collective_s: float = 0.0
    link_source: str = ""
    #: bytes/s of a copy into memory just allocated (read + write counted): on a CPU the
    #: allocator maps a large tensor's pages afresh and the first write faults each in, as
    #: FSDP2's per-collective buffers are written; 0: as ``copy_bytes_per_s`` (a GPU's caching
    #: allocator hands back memory already mapped)
    fresh_copy_bytes_per_s: float = 0.0

    def fresh_copy_rate(self) -> float:
        """Bytes/s of a copy into a new large buffer (``fresh_copy_bytes_per_s``)."""
        return self.fresh_copy_bytes_per_s or self.copy_bytes_per_s

    @property
    def calibrated(self) -> bool:
        return self.source.startswith("calibrated")

    def matmul_rate(self, dtype: str, size: float) -> float:
        """FLOP/s of a product whose matrices are about ``size`` wide: the measured rate of the
        nearest size at or below it (the largest measured beyond; float32's where ``dtype`` was
        not measured)."""
        curve = self.matmul.get(dtype) or self.matmul["float32"]
        below = [rate for n, rate in curve if n <= size]
        return below[-1] if below else curve[0][1]

    def skinny_rate(self, dtype: str, rows: float, size: float) -> float:
        """FLOP/s of a decode step's products over ``rows`` rows: the measured skinny rates
        interpolated linearly in rows between the row counts measured (the first below them,
        the last beyond), never above the square rate at ``size``; the square rate where no
        skinny product was measured."""
        curve = self.skinny.get(dtype) or self.skinny.get("float32")
        square = self.matmul_rate(dtype, size)
        if not curve:
            return square
        rate = curve[0][1] if rows <= curve[0][0] else curve[-1][1]
        for (n1, r1), (n2, r2) in zip(curve, curve[1:]):
            if n1 <= rows <= n2:
                rate = r1 + (r2 - r1) * (rows - n1) / (n2 - n1)
                break
        return min(rate, square)

    def layer_overhead_s(self) -> float:
        """The fixed seconds of one token step through one decoder layer: the calibration
        layer's step time extrapolated to zero rows (its arithmetic grows with the rows)."""
        (r1, t1), (r2, t2) = self.layer_step_s[0], self.layer_step_s[-1]
        if r2 == r1:
            return t1
        slope = (t2 - t1) / (r2 - r1)
        return max(t1 - slope * r1, self.launch_s)

    def elementwise_s(self, dtype: str, hidden: int) -> tuple[float, float]:
        """(forward, forward and backward) seconds of a decoder layer's element-wise work per
        token at width ``hidden``: the calibration layer's time over a row of tokens less its
        matmul FLOPs at the measured rate and its fixed cost, per token, scaled from
        its width to ``hidden`` (element-wise work grows with the width, matmuls with its
        square). Data sheets: ``ELEMENTWISE_BYTES`` over the copy bandwidth."""
        measured = self.layer_tokens_s.get(dtype) or self.layer_tokens_s.get("float32")
        if not measured:
            forward = ELEMENTWISE_BYTES * hidden / self.copy_bytes_per_s
            return forward, 3 * forward
        tokens, forward_s, train_s = measured
        forward_flops, train_flops = calibration_layer_flops(tokens)
        rate = self.matmul_rate(dtype if dtype in self.layer_tokens_s else "float32",
                                LAYER_WIDTH)
        fixed = self.layer_overhead_s()
        per_width = hidden / LAYER_WIDTH / tokens
        return (max(forward_s - forward_flops / rate - fixed, 0.0) * per_width,
                max(train_s - train_flops / rate - 3 * fixed, 0.0) * per_width)

    def doubts(self) -> list[str]:
        """Measurements that contradict each other, as other load on the machine makes them (a
        layer's forward and backward faster than its forward alone, a rate or element-wise cost
        of zero, a larger square matmul slower by more than 4x): each a short reason."""
        found = []
        for dtype, (_, forward_s, train_s) in self.layer_tokens_s.items():
            if train_s <= forward_s:
                found.append(f"the {dtype} layer's forward and backward ({train_s * 1e3:.2f} ms) "
                             f"took no longer than its forward ({forward_s * 1e3:.2f} ms)")
            if self.elementwise_s(dtype, LAYER_WIDTH)[0] <= 0:
                found.append(f"the {dtype} layer's element-wise work came out at 0")
        for dtype, curve in self.matmul.items():
            rates = [rate for _, rate in curve]
            if any(rate <= 0 for rate in rates):
                found.append(f"a {dtype} matmul rate of 0")
            elif max(rates) > 4 * rates[-1]:
                found.append(f"the largest {dtype} matmul ran at {rates[-1] / 1e9:,.1f} GFLOP/s, "
                             f"under a quarter of a smaller one's {max(rates) / 1e9:,.1f}")
        return found

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceRates:
        matmul = {k: [(int(n), float(r)) for n, r in v] for k, v in data["matmul"].items()}
        steps = [(int(n), float(s)) for n, s in data["layer_step_s"]]
        return cls(device=data["device"], key=data["key"], matmul=matmul,
                   copy_bytes_per_s=float(data["copy_bytes_per_s"]),
                   launch_s=float(data["launch_s"]), layer_step_s=steps,
                   disk_bytes_per_s=float(data["disk_bytes_per_s"]), source=data["source"],
                   notes=list(data.get("notes", [])),
                   sample_s_per_logit=float(data.get("sample_s_per_logit", 0.0)),
                   head_s_per_logit=float(data.get("head_s_per_logit", 0.0)),
                   skinny={k: [(int(n), float(r)) for n, r in v]
                           for k, v in data.get("skinny", {}).items()},
                   generate_step_s=float(data.get("generate_step_s", 0.0)),
                   generate_s_per_logit=float(data.get("generate_s_per_logit", 0.0)),
                   layer_tokens_s={k: (int(v[0]), float(v[1]), float(v[2]))
                                   for k, v in data.get("layer_tokens_s", {}).items()},
                   optimizer_s_per_tensor=float(data.get("optimizer_s_per_tensor", 0.0)),
                   lora_s_per_linear=float(data.get("lora_s_per_linear", 0.0)),
                   micro_batch_s=float(data.get("micro_batch_s", 0.0)),
                   update_s=float(data.get("update_s", 0.0)),
                   link_bytes_per_s=float(data.get("link_bytes_per_s", 0.0)),
                   collective_s=float(data.get("collective_s", 0.0)),
                   link_source=str(data.get("link_source", "")),
                   fresh_copy_bytes_per_s=float(data.get("fresh_copy_bytes_per_s", 0.0)))


def calibration_layer_flops(tokens: int) -> tuple[int, int]:
    """(forward, forward and backward) FLOPs of the calibration layer over one row of
    ``tokens`` tokens: its seven matrices (2 per multiply-add, the backward twice the forward's,
    every weight trained) and causal attention (about half the scores, the backward twice)."""
    matrices = 2 * tokens * (2 * LAYER_WIDTH * LAYER_WIDTH + 2 * LAYER_WIDTH * LAYER_KV
                             + 3 * LAYER_WIDTH * LAYER_MLP)
    attention = 2 * LAYER_WIDTH * tokens * tokens  # 4 * width * tokens^2, causal: half
    forward = matrices + attention
    return forward, 3 * forward


def device_name(device: torch.device, threads: int | None = None) -> str:
    """The device's name: the GPU's, or the CPU's model name and the threads torch uses
    (``threads``: another process's, default this one's)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()} ({threads or torch.get_num_threads()} threads)"


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_key(device: torch.device, threads: int | None = None) -> str:
    """The calibration cache's key: device name (on a CPU with its ``threads``), driver (CUDA)
    and torch version, as a file name."""
    parts = [device_name(device, threads), f"torch {torch.__version__}"]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        parts += [f"cuda {torch.version.cuda}", f"sm {props.major}.{props.minor}"]
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", " ".join(parts)).strip("_")


def calibration_path(device: torch.device, threads: int | None = None) -> Path:
    """Where ``device``'s calibration is cached (a CPU's at ``threads`` threads, default this
    process's)."""
    from r1fit.models.builtin import cache_root

    return cache_root() / "calibration" / f"{device_key(device, threads)}.json"


def device_rates(device_type: str = "cuda", device_name_: str | None = None, *,
                 threads: int | None = None) -> DeviceRates:
    """The rates a plan for ``device_type`` uses: this machine's cached calibration of its
    first device of that type, else data-sheet figures (``device_name_``: the GPU planned for,
    default this machine's first, else an H100's). ``threads``: a CPU's threads per process
    (its calibration at that many; default this process's)."""
    device = torch.device("cuda" if device_type == "cuda" else "cpu")
    if device_type == "cpu" or torch.cuda.is_available():
        cached = load_calibration(device, threads)
        if cached is not None:
            return cached
    if device_type == "cpu":
        return _cpu_defaults(threads)
    name = device_name_ or (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                            else "NVIDIA H100 80GB HBM3")
    return datasheet_rates(name)


def load_calibration(device: torch.device, threads: int | None = None) -> DeviceRates | None:
    """``device``'s cached calibration (a CPU's at ``threads`` threads), or None (none yet, or
    unreadable: measured again)."""
    path = calibration_path(device, threads)
    if not path.is_file():
        return None
    try:
        rates = DeviceRates.from_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError):
        return None
    if not rates.link_bytes_per_s:  # cached before r1fit measured links: the figures unmeasured
        fallback = link_rates(device, measure=False)
        rates = replace(rates, **{**fallback, "link_source": fallback["link_source"].replace(
            "not measured", "not measured (calibrated before links were)")})
    return rates


def datasheet_rates(name: str) -> DeviceRates:
    """A GPU's rates from data sheets (bf16 and float32 peaks at every size, HBM bandwidth, a
    typical launch cost); an unknown GPU gets an H100's, said in ``source``."""
    bf16, fp32 = gpu_peak_flops(name, torch.bfloat16), gpu_peak_flops(name, torch.float32)
    bandwidth = next((bw for fragment, bw in GPU_BANDWIDTH if fragment in name), None)
    source = f"data sheet ({name}); not calibrated: r1fit doctor --calibrate measures it"
    if bf16 is None or fp32 is None or bandwidth is None:
        bf16, fp32, bandwidth = 989e12, 494e12, 3.35e12
        source = f"data sheet of an H100 ({name} unknown); r1fit doctor --calibrate measures it"
    logit = 16 / bandwidth  # a few float32 passes over each logit
    link, link_source = gpu_link(name)
    return DeviceRates(device=name, key=name, matmul={"bfloat16": [(MATMUL_SIZES[-1], bf16)],
                                                      "float32": [(MATMUL_SIZES[-1], fp32)]},
                       copy_bytes_per_s=bandwidth, launch_s=GPU_LAUNCH_SECONDS,
                       layer_step_s=[(1, GPU_LAYER_STEP_SECONDS), (64, GPU_LAYER_STEP_SECONDS)],
                       disk_bytes_per_s=GPU_DISK_DEFAULT, source=source,
                       sample_s_per_logit=logit, head_s_per_logit=2 * logit,
                       lora_s_per_linear=GPU_LORA_SECONDS, link_bytes_per_s=link,
                       collective_s=GPU_COLLECTIVE_SECONDS, link_source=link_source)


def gpu_link(name: str) -> tuple[float, str]:
    """(bus bandwidth in bytes/s, where it came from) of the links between GPUs named ``name``
    (``GPU_LINK`` at ``LINK_EFFICIENCY``); an unknown GPU gets a PCIe 4 card's."""
    bandwidth, kind = next(((bw, kind) for fragment, bw, kind in GPU_LINK if fragment in name),
                           (32e9, "PCIe 4, assumed"))
    return (LINK_EFFICIENCY * bandwidth,
            f"data sheet ({kind}: {bandwidth / 1e9:,.0f} GB/s a direction, "
            f"{LINK_EFFICIENCY:.0%} of it)")


def _cpu_defaults(threads: int | None = None) -> DeviceRates:
    d = CPU_DEFAULTS
    name = device_name(torch.device("cpu"), threads)
    return DeviceRates(device=name, key=name, matmul={"float32": [(MATMUL_SIZES[0], d["matmul"])]},
                       copy_bytes_per_s=d["copy"], launch_s=d["launch"],
                       layer_step_s=[(1, d["layer_step"]), (16, d["layer_step"])],
                       disk_bytes_per_s=d["disk"],
                       source=("rough CPU figures; not calibrated: r1fit doctor --calibrate"
                               if threads in (None, torch.get_num_threads()) else
                               f"rough CPU figures; not calibrated at {threads} threads: "
                               f"OMP_NUM_THREADS={threads} r1fit doctor --calibrate"),
                       sample_s_per_logit=16 / d["copy"], head_s_per_logit=32 / d["copy"],
                       link_bytes_per_s=d["link"], collective_s=d["collective"],
                       link_source="rough CPU figures (gloo over loopback)")


# --- measuring ---------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(run: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``run`` (after one untimed warm-up)."""
    run()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def measure_matmul(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...],
                   repeats: int = 3) -> list[tuple[int, float]]:
    """FLOP/s of square products at each size."""
    out = []
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        loops = max(1, int(1e9 // (2 * n ** 3)))  # ~1 GFLOP per timing: small sizes loop

        def run(a: torch.Tensor = a, b: torch.Tensor = b, loops: int = loops) -> None:
            for _ in range(loops):
                torch.matmul(a, b)

        out.append((n, 2 * n ** 3 * loops / _best(run, device, repeats)))
    return out


def measure_skinny(device: torch.device, dtype: torch.dtype, rows: tuple[int, ...],
                   width: int = 1024, out: int = 8192, repeats: int = 3) -> list[tuple[int, float]]:
    """FLOP/s of ``rows`` x ``width`` times ``width`` x ``out`` products (a decode step's)."""
    weight = torch.randn(width, out, device=device).to(dtype)
    result = []
    for n in rows:
        x = torch.randn(n, width, device=device).to(dtype)
        loops = max(1, int(2e8 // (2 * n * width * out)))

        def run(x: torch.Tensor = x, loops: int = loops) -> None:
            for _ in range(loops):
                torch.matmul(x, weight)

        result.append((n, 2 * n * width * out * loops / _best(run, device, repeats)))
    return result


def measure_copy(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes`` (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best(lambda: dst.copy_(src), device, repeats)


def measure_fresh_copy(device: torch.device, nbytes: int, repeats: int = 3) -> float:
    """Bytes/s of copying ``nbytes`` into a tensor allocated for it (read + write counted): on a
    CPU the first write of every page faults it in (FSDP2's buffers, new for each collective)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return 2 * src.numel() * 4 / _best(lambda: torch.empty_like(src).copy_(src), device, repeats)


def measure_launch(device: torch.device, ops: int = 2000) -> float:
    """Seconds per small kernel: ``ops`` one-element in-place adds, the best of 3."""
    x = torch.zeros(1, device=device)

    def run() -> None:
        for _ in range(ops):
            x.add_(1)

    return _best(run, device, 3) / ops


def calibration_layers(device: torch.device, dtype: torch.dtype, positions: int = 256) -> Any:
    """The calibration's layer stack: a 2-layer transformers Qwen2 model of ``LAYER_WIDTH``
    (``LAYER_MLP`` MLP, ``LAYER_KV`` key/value width), sdpa attention, in eval mode."""
    from transformers import Qwen2Config, Qwen2Model

    config = Qwen2Config(hidden_size=LAYER_WIDTH, intermediate_size=LAYER_MLP,
                         num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=LAYER_KV // 64, vocab_size=512,
                         max_position_embeddings=positions)
    config._attn_implementation = "sdpa"
    return Qwen2Model(config).to(device=device, dtype=dtype).eval()


def measure_layer_step(device: torch.device, dtype: torch.dtype,
                       rows: tuple[int, ...], repeats: int = 5) -> list[tuple[int, float]]:
    """Seconds of one token step through one small decoder layer of a transformers model (the
    calibration's 2-layer stack with a 64-token cache, the step divided by its layers): what an
    eager decode step costs per layer beyond its arithmetic."""
    from transformers import DynamicCache

    model = calibration_layers(device, dtype)
    config = model.config
    name = cache_argument(model)
    out = []
    with torch.no_grad():
        for n in rows:
            prompt = torch.randint(0, 512, (n, 64), device=device)
            cache = DynamicCache(config=config)
            model(input_ids=prompt, use_cache=True, **{name: cache})
            token = torch.randint(0, 512, (n, 1), device=device)
            position = torch.full((n, 1), 64, device=device)

            def steps(cache: Any = cache, token: torch.Tensor = token,
                      position: torch.Tensor = position) -> None:
                # the cache grows by a column a step (64 -> ~130): about the same cost
                for _ in range(10):
                    model(input_ids=token, position_ids=position, use_cache=True,
                          **{name: cache})

            out.append((n, _best(steps, device, repeats) / 10 / config.num_hidden_layers))
    return out


def measure_layer_tokens(device: torch.device, dtype: torch.dtype, tokens: int = LAYER_TOKENS,
                         repeats: int = 3) -> tuple[int, float, float]:
    """(``tokens``, forward seconds, forward and backward seconds) per layer of the calibration
    stack over one row of ``tokens`` tokens, every weight trained (the backward makes their
    gradients)."""
    model = calibration_layers(device, dtype, positions=max(tokens, 256))
    ids = torch.randint(0, 512, (1, tokens), device=device)

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=ids)

    def train() -> None:
        model(input_ids=ids).last_hidden_state.float().sum().backward()
        model.zero_grad(set_to_none=True)

    layers = model.config.num_hidden_layers
    return (tokens, _best(forward, device, repeats) / layers,
            _best(train, device, repeats) / layers)


def measure_optimizer(device: torch.device, tensors: int = 200, repeats: int = 3) -> float:
    """Seconds per parameter tensor of an optimizer step as training runs it (AdamW, fused where
    the device has it; the gradient norm clipped; gradients zeroed) over ``tensors`` tensors of
    256 elements each (their arithmetic is nothing: the cost is per tensor)."""
    params = [torch.nn.Parameter(torch.randn(256, device=device)) for _ in range(tensors)]
    try:
        optimizer = torch.optim.AdamW(params, lr=1e-6, fused=True)
    except (RuntimeError, ValueError):
        optimizer = torch.optim.AdamW(params, lr=1e-6)

    def step() -> None:
        for p in params:
            p.grad = torch.ones_like(p)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _best(step, device, repeats) / tensors


def measure_lora(device: torch.device, linears: int = 50, repeats: int = 5) -> float:
    """Seconds peft's unmerged LoRA adapter (r=8) adds to the forward of one 256-wide Linear
    over one token: a stack of ``linears`` plain Linears, then the same with adapters."""
    from peft import LoraConfig, inject_adapter_in_model

    stack = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(linears)))
    stack = stack.to(device).eval()
    x = torch.randn(1, 1, 256, device=device)
    with torch.no_grad():
        plain = _best(lambda: stack(x), device, repeats)
        inject_adapter_in_model(LoraConfig(r=8, lora_alpha=16,
                                           target_modules=[str(i) for i in range(linears)]),
                                stack)
        adapted = _best(lambda: stack(x), device, repeats)
    return max(adapted - plain, 0.0) / linears


def measure_logits(device: torch.device, rows: int, vocab: int,
                   repeats: int = 3) -> tuple[float, float]:
    """(sampler, training head) seconds per logit on ``rows`` x ``vocab`` float32 logits:
    r1fit's sampler (:func:`r1fit.rollout.generate.sample_rows`), and the training head as a
    GRPO update runs it (:func:`r1fit.algorithms.logprobs.fused_head_loss`: log-probs,
    entropies, the loss's gradient over the vocabulary) less its three matmuls, timed apart (the
    time model counts those as FLOPs), on a 32-wide hidden state."""
    from r1fit.algorithms.logprobs import fused_head_loss
    from r1fit.rollout.generate import sample_rows

    scores = torch.randn(rows, vocab, device=device)
    uniforms = torch.rand(rows, device=device, dtype=torch.float64)
    sample = _best(lambda: sample_rows(scores, uniforms, 1.0, 1.0), device, repeats)
    hidden = torch.randn(rows, 32, device=device, requires_grad=True)
    weight = torch.randn(vocab, 32, device=device, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), device=device)

    def head() -> None:
        loss, _, _ = fused_head_loss(hidden, weight, targets,
                                     lambda rows_, logp, entropy: -logp.sum() - entropy.sum())
        loss.backward()
        hidden.grad = weight.grad = None

    def matmuls() -> None:  # logits, and the gradients of the hidden state and the weight
        h, w = hidden.detach(), weight.detach()
        logits = h @ w.T
        logits @ w
        logits.T @ h

    per_logit = max(_best(head, device, repeats) - _best(matmuls, device, repeats), 0.0)
    return sample / scores.numel(), per_logit / scores.numel()


def measure_generate_step(device: torch.device, rows: int = 16, repeats: int = 3,
                          vocab: int = 131072) -> tuple[float, float]:
    """(seconds per decode step, seconds per logit) of Hugging Face generate as r1fit's HF
    engine runs it (its generation config, ``SeededSampler``), on a 1-layer model of width 64:
    the step at a 512-token vocabulary (:func:`calibrate` takes the layer's fixed part off,
    leaving the loop's own cost), and what each logit more costs at ``vocab`` tokens beyond the
    head's matmul (the sampler, generate's processors and copies: per logit, a large
    vocabulary's step is mostly these)."""
    from transformers import LogitsProcessorList, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    from r1fit.rollout.generate import (
        SamplingSettings,
        SeededSampler,
        TokenIds,
        generation_config,
    )

    ids = TokenIds(pad=0, eos=[1], blocked=[2])
    prompt = torch.randint(3, 512, (rows, 16), device=device)

    def per_step(size: int) -> tuple[float, Any]:
        config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, vocab_size=size,
                             max_position_embeddings=256)
        config._attn_implementation = "sdpa"
        model = Qwen2ForCausalLM(config).to(device).eval()

        def run(tokens: int) -> float:
            gen = generation_config(SamplingSettings(max_new_tokens=tokens,
                                                     min_new_tokens=tokens), ids)

            def call() -> None:
                sampler = SeededSampler(list(range(rows)), 1.0, 1.0)
                model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                               generation_config=gen,
                               logits_processor=LogitsProcessorList([sampler]))

            return _best(call, device, repeats)

        return (run(9) - run(1)) / 8, model

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # generate warns of min_length beside min_new_tokens
    try:
        with torch.no_grad():
            small, _ = per_step(512)
            large, model = per_step(vocab)
            hidden = torch.randn(rows, 64, device=device)
            head = _best(lambda: model.lm_head(hidden), device, repeats)
    finally:
        hf_logging.set_verbosity(verbosity)
    per_logit = max(large - small - head, 0.0) / (rows * (vocab - 512))
    return max(small, 0.0), per_logit


def measure_disk(folder: Path, nbytes: int) -> float:
    """Bytes/s of writing ``nbytes`` to a new file in ``folder`` and syncing it."""
    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20)
    with tempfile.NamedTemporaryFile(dir=folder) as f:
        start = time.perf_counter()
        for _ in range(max(1, nbytes >> 20)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        seconds = time.perf_counter() - start
    return max(1, nbytes >> 20) * (1 << 20) / max(seconds, 1e-9)


def calibrate(device: torch.device | None = None, *, quick: bool = False,
              save: bool = True) -> DeviceRates:
    """Measure ``device``'s rates (default: the first CUDA device, else the CPU) and cache them
    (``save``). ``quick``: the smallest sizes only (tests)."""
    from r1fit.models.builtin import cache_root

    calibrations = cache_root() / "calibration"  # a cache that cannot be: said before measuring
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    half = torch.bfloat16 if not cuda or torch.cuda.is_bf16_supported() else torch.float16
    sizes = MATMUL_SIZES[:2] if quick else (MATMUL_SIZES + ((4096, 8192) if cuda else ()))
    matmul = {"float32": measure_matmul(device, torch.float32, sizes)}
    matmul[str(half).removeprefix("torch.")] = measure_matmul(
        device, half, sizes[:3] if not cuda and not quick else sizes)
    copy_bytes = (1 << 30) if cuda else (64 << 20)
    sample, head = measure_logits(device, 16, 16384 if quick else 131072)
    loop_step, loop_logit = measure_generate_step(device, repeats=2 if quick else 3,
                                                  vocab=4096 if quick else 131072)
    skinny_rows = (1, 16) if quick else (1, 4, 16, 64, 256)
    skinny = {name: measure_skinny(device, dtype, skinny_rows, out=2048 if quick else 32768)
              for name, dtype in (("float32", torch.float32),
                                  (str(half).removeprefix("torch."), half))}
    rates = DeviceRates(
        device=device_name(device), key=device_key(device), matmul=matmul,
        sample_s_per_logit=sample, head_s_per_logit=head, skinny=skinny,
        generate_step_s=loop_step, generate_s_per_logit=loop_logit,
        copy_bytes_per_s=measure_copy(device, (8 << 20) if quick else copy_bytes),
        # a GPU's caching allocator reuses mapped memory: its fresh copies are its copies
        fresh_copy_bytes_per_s=0.0 if cuda else measure_fresh_copy(
            device, (64 << 20) if quick else (256 << 20)),
        launch_s=measure_launch(device, 200 if quick else 2000),
        layer_step_s=measure_layer_step(device, torch.float32 if not cuda else half,
                                        (1, 16) if not cuda else (1, 64),
                                        repeats=2 if quick else 5),
        disk_bytes_per_s=measure_disk(calibrations,
                                      (4 << 20) if quick else (256 << 20)),
        layer_tokens_s={name: measure_layer_tokens(device, dtype, 64 if quick else LAYER_TOKENS,
                                                   repeats=2 if quick else 7)
                        for name, dtype in (("float32", torch.float32),
                                            (str(half).removeprefix("torch."), half))},
        optimizer_s_per_tensor=measure_optimizer(device, 20 if quick else 200),
        lora_s_per_linear=measure_lora(device, 10 if quick else 50),
        source=f"calibrated {time.strftime('%Y-%m-%d')}",
        notes=[f"{platform.platform()}", f"torch {torch.__version__}"])
    # the measured step ran one decoder layer: what remains is generate's own loop
    rates = replace(rates, generate_step_s=max(rates.generate_step_s - rates.layer_overhead_s(),
                                               0.0), **link_rates(device, measure=not quick))
    if save:
        save_calibration(rates, device)
    return rates


def link_rates(device: torch.device, *, measure: bool = True) -> dict[str, Any]:
    """The calibration's link fields: measured between two processes where this machine can
    (:func:`r1fit.memory.link.measure_link`: gloo on a CPU, NCCL between two GPUs), else the data
    sheet's (one GPU) or the rough CPU figures (not ``measure``, or the measurement failed),
    said in ``link_source``."""
    from r1fit.memory.link import measure_link

    link = measure_link(device.type) if measure else None
    if link is not None:
        return {"link_bytes_per_s": link.bytes_per_s, "collective_s": link.collective_s,
                "link_source": f"measured ({link.backend}, 2 processes)"}
    if device.type == "cuda":
        bandwidth, source = gpu_link(torch.cuda.get_device_name(device))
        reason = ("one GPU here" if torch.cuda.device_count() < 2 else
                  "the measurement failed" if measure else "not asked")
        return {"link_bytes_per_s": bandwidth, "collective_s": GPU_COLLECTIVE_SECONDS,
                "link_source": f"{source}; not measured: {reason}"}
    return {"link_bytes_per_s": CPU_DEFAULTS["link"], "collective_s": CPU_DEFAULTS["collective"],
            "link_source": "rough CPU figures (gloo over loopback); not measured"
                           + ("" if not measure else ": the measurement failed")}


def save_calibration(rates: DeviceRates, device: torch.device) -> Path:
    """Cache ``rates`` as ``device``'s calibration; returns the file."""
    path = calibration_path(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rates.to_dict(), indent=2))
    return path
