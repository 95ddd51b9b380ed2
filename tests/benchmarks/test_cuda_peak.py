"""benchmarks/cuda_peak.py on made-up allocator histories: the peak, the bytes before the
history, what is live at the peak by call site."""

from __future__ import annotations

from benchkit import load_script

cp = load_script("cuda_peak")

SITE_PACKAGES = "/usr/lib/python3/site-packages/"
LINEAR = [{"filename": SITE_PACKAGES + "torch/nn/modules/linear.py", "line": 125, "name": "forward"},
          {"filename": SITE_PACKAGES + "peft/tuners/lora/layer.py", "line": 700, "name": "forward"},
          {"filename": "/work/main/r1fit/train/forward.py", "line": 90, "name": "logprobs"}]
CACHE = [{"filename": SITE_PACKAGES + "transformers/cache_utils.py", "line": 40, "name": "update"},
         {"filename": "/work/main/r1fit/rollout/generate.py", "line": 210, "name": "generate"}]
OURS = [{"filename": "/work/main/r1fit/train/grpo.py", "line": 300, "name": "step"}]


def alloc(addr, size, frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def free(addr, size):
    return {"action": "free_completed", "addr": addr, "size": size}


def test_the_peak_and_what_is_live_there():
    trace = [alloc(1, 100, CACHE), alloc(2, 40, LINEAR),
             {"action": "free_requested", "addr": 1, "size": 100},  # not yet free
             free(1, 100), alloc(3, 30, LINEAR), alloc(4, 150, OURS),  # peak: 1000 + 220
             free(7, 20),  # a block from before the history (the weights, say)
             free(4, 150), alloc(5, 10, CACHE)]
    # at the end: 1000 + 100 + 40 - 100 + 30 + 150 - 20 - 150 + 10 = 1060 allocated
    got = cp.peak_breakdown(trace, allocated_at_end=1060)
    assert (got.start_bytes, got.peak_bytes, got.peak_event, got.events) == (1000, 1220, 5, 9)
    lora = "peft/tuners/lora/layer.py:700 forward < r1fit/train/forward.py:90 logprobs"
    assert got.sites == [(cp.BEFORE, 1000, 0), ("r1fit/train/grpo.py:300 step", 150, 1),
                         (lora, 70, 2)]
    assert sum(b for _, b, _ in got.sites) == got.peak_bytes
    out = got.to_dict(top=2)
    assert [s["where"] for s in out["sites"]] == [cp.BEFORE, "r1fit/train/grpo.py:300 step"]
    assert out["other_sites_bytes"] == 70


def test_a_history_that_lost_its_start_counts_earlier_blocks_as_before():
    # the ring dropped the allocation of block 9 (60 bytes): its free lowers "before"
    trace = [free(9, 60), alloc(1, 500, CACHE), free(1, 500)]
    got = cp.peak_breakdown(trace, allocated_at_end=940)
    assert (got.start_bytes, got.peak_bytes) == (1000, 1440)
    assert got.sites == [(cp.BEFORE, 940, 0),
                         ("transformers/cache_utils.py:40 update < r1fit/rollout/generate.py:210 "
                          "generate", 500, 1)]
    assert cp.peak_breakdown([], allocated_at_end=7).sites == [(cp.BEFORE, 7, 0)]


def test_call_sites_without_r1fit_or_outside_frames():
    assert cp.call_site(LINEAR[:2]) == "peft/tuners/lora/layer.py:700 forward"
    assert cp.call_site(LINEAR[:1]) == "torch/nn/modules/linear.py:125 forward"
    assert cp.call_site([]) == "(no frames)"
