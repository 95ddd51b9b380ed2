"""r1fit: GRPO and SFT for vision-language models, with memory set by the micro-batch."""
__version__ = "0.1.0"
