#!/usr/bin/env python3
"""PyTorch + transformers side of `cargo bench -p ares-benches --bench vision_cpu`: the same
Qwen2.5-VL-3B vision tower (hidden 1280, 16 heads, SwiGLU 3420, window 112 px, merger to
2048; transformers' random init) on one 448 x 448 image (1024 patches of 1176 values), the
same work:

- forward: the tower under torch.no_grad (a multimodal prefill's vision part);
- forward+backward: the tower, then (merged * D).sum().backward() with a fixed D, gradients
  set to None between runs.

    /work/verl-venv/bin/python scripts/bench_torch_vision.py [--threads 1] [--runs 3] [--depth 4]

--depth N keeps N blocks with full attention in every 4th (3, 7, ...), as the Rust bench's
ARES_BENCH_VISION_DEPTH. Attention: sdpa (transformers' default). Prints the best and median
of the runs after one warm-up, in the Rust bench's format, and the peak RSS growth.
"""

import argparse
import resource
import time

import torch
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
)


def timed(runs, f):
    f()
    t = []
    for _ in range(runs):
        start = time.perf_counter()
        f()
        t.append(time.perf_counter() - start)
    t.sort()
    return t[0], t[runs // 2]


def report(what, units, unit, times):
    best, median = times
    print(
        f"{what}: {units / best:.0f} {unit}/s best ({best * 1e3:.1f} ms), "
        f"{units / median:.0f} {unit}/s median ({median * 1e3:.1f} ms)"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--depth", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = Qwen2_5_VLVisionConfig(
        depth=args.depth,
        hidden_size=1280,
        num_heads=16,
        intermediate_size=3420,
        out_hidden_size=2048,
        window_size=112,
        fullatt_block_indexes=[l for l in range(args.depth) if l % 4 == 3],
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        tokens_per_second=2,
    )
    cfg._attn_implementation = "sdpa"
    model = Qwen2_5_VisionTransformerPretrainedModel(cfg).float().eval()
    grid = torch.tensor([[1, 32, 32]])
    patches = 1024
    pixels = torch.rand(patches, 3 * 2 * 14 * 14) * 2 - 1
    d = torch.rand(patches // 4, 2048) - 0.5
    print(
        f"transformers {__import__('transformers').__version__}, torch {torch.__version__}: "
        f"{args.depth} blocks (full attention in {cfg.fullatt_block_indexes}), {patches} patches; "
        f"{torch.get_num_threads()} threads"
    )
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def forward():
        with torch.no_grad():
            model(pixels, grid_thw=grid)

    report("vision forward", patches, "patches", timed(args.runs, forward))

    def forward_backward():
        for p in model.parameters():
            p.grad = None
        out = model(pixels, grid_thw=grid).pooler_output
        (out * d).sum().backward()

    report("vision forward+backward", patches, "patches", timed(args.runs, forward_backward))
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"peak RSS growth while running: {(rss1 - rss0) / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
