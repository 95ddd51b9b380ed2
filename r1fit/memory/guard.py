"""The OOM guard: when a step runs out of memory, halve the chunk that failed and redo the step.

Where the OOM is raised decides what is halved: inside generation, ``memory.generation_batch``;
inside log-prob or gradient micro-batches, ``memory.micro_batch`` (``memory.micro_batch_tokens``
when micro-batches are packed by tokens). The redo starts the step from
its beginning (same prompts, gradients zeroed, the RNG states and counters put back), so it is
deterministic. Once an optimizer update of the step has been applied, a whole-step redo would apply
it twice; an OOM in a later update (``num_iterations`` > 1) redoes only that update's gradient
accumulation. At size 1 the guard gives up with a message saying what to change.

On CUDA the error is the allocator's ``torch.OutOfMemoryError``; with ``memory.budget`` the caching
allocator is capped at the budget less the CUDA context the planner assumes
(``torch.cuda.set_per_process_memory_fraction``), so a run that outgrows its budget meets the same
error on a card with room to spare, and the guard also checks the peak reserved bytes when each
phase ends. On CPU, ``memory.budget`` caps the process's peak RSS over its RSS before the model was
loaded; the guard checks it when each phase ends and raises the same ``torch.OutOfMemoryError``,
so the recovery is the same code.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from r1fit.errors import R1fitError, one_line
from r1fit.memory.planner.estimate import CUDA_CONTEXT_BYTES
from r1fit.memory.sizes import ChunkSizes
from r1fit.memory.telemetry import glibc, peak_rss_bytes, reset_peak
from r1fit.processes import world
from r1fit.units import format_bytes, parse_bytes

log = logging.getLogger("r1fit.memory")
T = TypeVar("T")
_SIZE_OF_PHASE = {"generation": "generation_batch", "micro_batch": "micro_batch"}

#: torch's message when the CPU allocator cannot get memory (a RuntimeError, not an
#: OutOfMemoryError)
CPU_ALLOCATOR_FAILED = "DefaultCPUAllocator: can't allocate memory"


class OutOfMemory(R1fitError, RuntimeError):
    """Out of memory even at chunk size 1; the message says what to change."""


class OOMGuard:
    """Lowers the run's chunk sizes (``sizes``, shared by the run's phases and saved in its
    checkpoints) when memory runs out; ``budget`` is ``memory.budget`` ('' for none)."""

    def __init__(self, sizes: ChunkSizes, budget: str, device: torch.device,
                 optimizer: torch.optim.Optimizer, *, baseline_rss_bytes: int) -> None:
        self.sizes, self.device, self.optimizer = sizes, device, optimizer
        self.budget_text = budget
        self.budget = parse_bytes(budget) if budget else None
        self.baseline = baseline_rss_bytes
        self.cuda_cap = (cap_cuda_allocator(self.budget, device)
                         if self.budget is not None and device.type == "cuda" else None)
        self.failed_phase: str | None = None
        self.updates_done = 0   # optimizer updates applied in the current attempt
        self.retries = 0        # redos in the current step (logged as oom_retries)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Marks generation or micro-batch work, so an OOM inside it shrinks the right size; on
        CPU with ``memory.budget``, checks the budget when the phase ends."""
        try:
            yield
        except torch.OutOfMemoryError:
            self.failed_phase = name
            raise
        except RuntimeError as exc:
            if CPU_ALLOCATOR_FAILED not in str(exc):
                raise
            # the CPU's out of memory (torch raises it as a plain RuntimeError): shrunk and
            # redone as CUDA's is
            self.failed_phase = name
            raise torch.OutOfMemoryError(f"CPU out of memory: {one_line(exc, 200)}") from None
        if self.budget is not None and self.device.type == "cpu":
            used = peak_rss_bytes() - self.baseline
            if used > self.budget:
                self.failed_phase = name
                raise torch.OutOfMemoryError(
                    f"CPU out of memory: peak RSS {format_bytes(used)} over the pre-load baseline "
                    f"exceeds memory.budget={self.budget_text}")
        if self.cuda_cap is not None:
            reserved = torch.cuda.max_memory_reserved(self.device)
            if reserved > self.cuda_cap:  # the allocator's cap did not hold (it should)
                self.failed_phase = name
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory: {format_bytes(reserved)} reserved exceeds "
                    f"memory.budget={self.budget_text} less the CUDA context "
                    f"({format_bytes(self.cuda_cap)})")

    def run_step(self, attempt: Callable[[], T], restore: list[Any]) -> T:
        """Run ``attempt()`` (one step from its start); on OOM shrink and redo it with the
        ``state_dict()`` of every object in ``restore`` put back first."""
        saved = [obj.state_dict() for obj in restore]
        self.retries = 0
        while True:
            self.updates_done, self.failed_phase = 0, None
            try:
                return attempt()
            except torch.OutOfMemoryError as exc:
                message = one_line(exc, 300, first_line=True)
            # the exception and its frames (which hold the step's tensors) are gone here
            self._shrink(self.failed_phase or "micro_batch", message, "redoing the step")
            for obj, state in zip(restore, saved):
                obj.load_state_dict(state)

    def run_update(self, accumulate: Callable[[], T]) -> T:
        """One update's gradient accumulation. Before any update of the step was applied an OOM
        goes up to ``run_step``; after, only this accumulation is redone."""
        while True:
            try:
                with self.phase("micro_batch"):
                    return accumulate()
            except torch.OutOfMemoryError as exc:
                if not self.updates_done:
                    raise
                message = one_line(exc, 300, first_line=True)
            self._shrink("micro_batch", message,
                         f"redoing update {self.updates_done + 1} of this step")

    def _shrink(self, phase: str, message: str, action: str) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        free_memory(self.device)
        key = _SIZE_OF_PHASE[phase]
        if key == "micro_batch":
            key = self.sizes.training_key
        size = self.sizes[key]
        w = world()
        if w.distributed:  # the other ranks are inside collectives of this step: no redo alone
            raise OutOfMemory(
                f"out of memory in {phase.replace('_', '-')} work on rank {w.rank} ({message}); "
                f"over {w.size} processes a step cannot be redone on one rank. Rerun with "
                f"memory.{key}={max(1, size // 2)} (the run resumes from its last checkpoint)")
        if size <= self.sizes.smallest[key]:
            raise OutOfMemory(
                f"out of memory in {phase.replace('_', '-')} work even with memory.{key}={size} "
                f"({message}). Lower data.max_pixels or algo.max_new_tokens, keep "
                "memory.gradient_checkpointing=true, use LoRA (model.lora.r=16) or a smaller "
                "memory.logits_chunk, or give the run more memory")
        self.sizes.halve(key)
        self.retries += 1
        log.warning("out of memory in %s (%s): memory.%s %d -> %d, %s", phase, message, key, size,
                    size // 2, action)
        reset_peak(self.device)


def cap_cuda_allocator(budget: int, device: torch.device) -> int:
    """Cap the caching allocator of ``device`` at ``budget`` less :data:`CUDA_CONTEXT_BYTES` (the
    context lives outside the allocator; the planner adds the same figure) and return the cap in
    bytes. The cap is a fraction of the card, so a budget over the card's memory is no cap."""
    if budget <= CUDA_CONTEXT_BYTES:
        raise OutOfMemory(f"memory.budget={format_bytes(budget)} does not cover the CUDA context "
                          f"({format_bytes(CUDA_CONTEXT_BYTES)}); give the run more memory")
    total = torch.cuda.get_device_properties(device).total_memory
    cap = min(budget - CUDA_CONTEXT_BYTES, total)
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    log.info("memory.budget=%s on %s: the CUDA allocator may hold %s (the budget less %s for the "
             "CUDA context)", format_bytes(budget), device, format_bytes(cap),
             format_bytes(CUDA_CONTEXT_BYTES))
    return cap


def free_memory(device: torch.device) -> None:
    """Give freed memory back: Python garbage, the CUDA cache, glibc's free heap pages."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    # glibc keeps freed heap pages; RSS (what memory.budget measures) only drops after this
    if (malloc_trim := glibc("malloc_trim")) is not None:
        malloc_trim(0)
