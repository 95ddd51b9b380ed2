"""Prompt data: JSONL readers, built-in tasks, the image pixel budget and the resumable sampler."""

from r1fit.data.dataset import PromptDataset, PromptSampler, load_dataset
from r1fit.data.errors import BadRowError, DataError
from r1fit.data.images import fit_pixel_budget, load_image
from r1fit.data.sample import Sample
from r1fit.data.shapes import ShapesSpec, answer_space

__all__ = [
    "BadRowError",
    "DataError",
    "PromptDataset",
    "PromptSampler",
    "Sample",
    "ShapesSpec",
    "answer_space",
    "fit_pixel_budget",
    "load_dataset",
    "load_image",
]
