#!/usr/bin/env python3
"""Fixtures for the Qwen2-VL image / video processor (ares-model/tests/vision_processor.rs).

Run with the verl venv (transformers 5.24, torch, torchvision, pillow):

    /work/verl-venv/bin/python scripts/make_vision_fixtures.py

Writes into ares-model/tests/fixtures/vision/:
  - small synthetic PNG images (several sizes and aspect ratios, one grayscale, one RGBA),
    two JPEGs (4:2:0 and 4:4:4 chroma) and one lossless WebP, and two short videos as PNG frame directories;
  - processor.safetensors: transformers' outputs for each image (`image.<name>.pixel_values`,
    `image.<name>.grid_thw`) and video (`video.<name>.pixel_values_videos`,
    `video.<name>.grid_thw`), and PIL's decoding of the JPEG / WebP (`decoded.<name>`,
    uint8 [h, w, 3]);
  - meta.json: versions, the image processor backend used, the processor settings, the
    images' sizes and the video sampling arguments;
  - processor_config.json / preprocessor_config.json written by transformers itself (the
    5.x layout and the per-processor layout), for the config-parsing test.

Images are opened with PIL and converted with `convert("RGB")` before they reach
transformers, as verl's data pipeline does (alpha dropped, not composited).
"""

import json
import os
import shutil
import sys

import numpy as np
import torch
import torchvision
import transformers
from PIL import Image
from safetensors.numpy import save_file
from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "ares-model", "tests", "fixtures", "vision")

MIN_PIXELS = 3136  # 56 * 56
MAX_PIXELS = 6272  # 28 * 28 * 8
VIDEO_MIN_PIXELS = 784  # 28 * 28
VIDEO_MAX_PIXELS = 3136


def synthetic(h, w, seed, channels=3):
    """Sharp edges (a checkerboard and a disc), smooth gradients and noise: every kind of
    pixel neighbourhood the bicubic kernel treats differently."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.zeros((h, w, channels), dtype=np.float64)
    for c in range(channels):
        grad = 255.0 * ((xx / max(w - 1, 1)) * (c % 2) + (yy / max(h - 1, 1)) * (1 - c % 2))
        checker = ((xx // (3 + c)).astype(int) + (yy // (4 + c)).astype(int)) % 2 * 255.0
        disc = (((yy - h / 2) ** 2 + (xx - w / 3) ** 2) < (min(h, w) / 3) ** 2) * 255.0
        noise = rng.uniform(0, 255, size=(h, w))
        mix = [grad, checker, disc, noise]
        wts = rng.dirichlet(np.ones(4))
        img[..., c] = sum(wi * m for wi, m in zip(wts, mix))
        # a few hard black/white pixels: overshoot of the bicubic kernel is clamped there
        img[rng.integers(0, h, 5), rng.integers(0, w, 5), c] = rng.choice([0.0, 255.0], 5)
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


# name -> (height, width, PIL mode)
IMAGES = {
    "rgb_56x56": (56, 56, "RGB"),
    "rgb_126x70": (126, 70, "RGB"),  # round half to even: 4.5 -> 4, 2.5 -> 2 => 112 x 56
    "rgb_300x97": (300, 97, "RGB"),  # above max_pixels: scaled down, floored to 28
    "rgb_20x400": (20, 400, "RGB"),  # height upscaled 20 -> 28 (the max(factor, ..) clamp)
    "gray_30x40": (30, 40, "L"),  # below min_pixels: scaled up, ceiled to 28
    "rgba_50x60": (50, 60, "RGBA"),  # alpha dropped by convert("RGB")
}

# name -> (frame height, frame width, number of frames, source fps, sampling fps or None)
VIDEOS = {
    # 9 frames at 6 fps sampled at 3 fps -> 4.5 -> floor to a multiple of 2 = 4 frames
    "clip9_fps6": (30, 60, 9, 6.0, 3.0),
    # 5 frames, no sampling: padded to 6 by repeating the last frame
    "clip5_all": (26, 50, 5, None, None),
}


def main():
    # everything but video/ (scripts/make_video_fixtures.py writes that)
    os.makedirs(OUT, exist_ok=True)
    for name in os.listdir(OUT):
        if name == "video":
            continue
        path = os.path.join(OUT, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    tensors = {}
    meta = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "pillow": Image.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "video_min_pixels": VIDEO_MIN_PIXELS,
        "video_max_pixels": VIDEO_MAX_PIXELS,
        "images": {},
        "videos": {},
    }

    proc = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    backend = [c.__name__ for c in type(proc).__mro__ if c.__name__.endswith("Backend")]
    meta["image_processor_class"] = type(proc).__name__
    meta["image_processor_backend"] = backend[0] if backend else "unknown"
    print("image processor backend:", meta["image_processor_backend"], file=sys.stderr)

    for i, (name, (h, w, mode)) in enumerate(IMAGES.items()):
        arr = synthetic(h, w, seed=100 + i, channels={"RGB": 3, "L": 1, "RGBA": 4}[mode])
        if mode == "L":
            arr = arr[..., 0]
        if mode == "RGBA":
            # alpha from transparent to opaque, so a composite would differ visibly
            arr[..., 3] = np.linspace(0, 255, w).astype(np.uint8)[None, :]
        path = os.path.join(OUT, name + ".png")
        Image.fromarray(arr, mode=mode).save(path, optimize=True)
        img = Image.open(path).convert("RGB")
        out = proc(images=[img], return_tensors="pt")
        tensors[f"image.{name}.pixel_values"] = out["pixel_values"].numpy().astype(np.float32)
        tensors[f"image.{name}.grid_thw"] = out["image_grid_thw"].numpy().astype(np.int64)
        meta["images"][name] = {"file": name + ".png", "height": h, "width": w, "mode": mode}

    # JPEG and lossless WebP: decoding only (PIL's RGB pixels).
    # JPEG with 4:2:0 chroma (PIL's default, most photos) and with 4:4:4.
    for name, ext, kwargs in [
        ("photo_40x48", "jpg", {"quality": 90}),
        ("photo444_40x48", "jpg", {"quality": 90, "subsampling": 0}),
        ("lossless_36x44", "webp", {"lossless": True}),
    ]:
        h, w = (int(s) for s in name.split("_")[1].split("x"))
        arr = synthetic(h, w, seed=7 if ext == "jpg" else 8)  # same picture for both JPEGs
        path = os.path.join(OUT, f"{name}.{ext}")
        Image.fromarray(arr).save(path, **kwargs)
        tensors[f"decoded.{name}"] = np.asarray(Image.open(path).convert("RGB"), dtype=np.uint8)
        meta["images"][name] = {"file": f"{name}.{ext}", "height": h, "width": w, "mode": "RGB"}

    vproc = Qwen2VLVideoProcessor(min_pixels=VIDEO_MIN_PIXELS, max_pixels=VIDEO_MAX_PIXELS)
    for i, (name, (h, w, n, src_fps, fps)) in enumerate(VIDEOS.items()):
        frames = np.stack([synthetic(h, w, seed=200 + 10 * i + t) for t in range(n)])
        d = os.path.join(OUT, name)
        os.makedirs(d)
        for t in range(n):
            Image.fromarray(frames[t]).save(os.path.join(d, f"frame_{t:03d}.png"), optimize=True)
        kwargs = {"cap_pixels_per_frame": False, "return_tensors": "pt"}
        if fps is not None:
            kwargs.update(do_sample_frames=True, fps=fps, video_metadata={"fps": src_fps, "total_num_frames": n})
        else:
            kwargs.update(do_sample_frames=False)
        out = vproc(videos=[frames], **kwargs)
        tensors[f"video.{name}.pixel_values_videos"] = out["pixel_values_videos"].numpy().astype(np.float32)
        tensors[f"video.{name}.grid_thw"] = out["video_grid_thw"].numpy().astype(np.int64)
        meta["videos"][name] = {
            "dir": name,
            "frames": n,
            "height": h,
            "width": w,
            "source_fps": src_fps,
            "fps": fps,
            "min_frames": vproc.min_frames,
            "max_frames": vproc.max_frames,
        }

    save_file(tensors, os.path.join(OUT, "processor.safetensors"))
    with open(os.path.join(OUT, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")

    # The two config layouts as transformers writes them.
    cfg_dir = os.path.join(OUT, "config_hub")
    os.makedirs(cfg_dir)
    proc.save_pretrained(cfg_dir)  # preprocessor_config.json (size.shortest_edge / longest_edge)
    try:
        from transformers import AutoTokenizer, Qwen2VLProcessor

        tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "ares-model", "tests", "fixtures", "tokenizer", "qwen_style"))
        full = Qwen2VLProcessor(image_processor=proc, video_processor=vproc, tokenizer=tok)
        cfg5 = os.path.join(OUT, "config_v5")
        os.makedirs(cfg5)
        full.save_pretrained(cfg5)
        for f in os.listdir(cfg5):  # keep only the processor's own config
            if f != "processor_config.json":
                os.remove(os.path.join(cfg5, f))
    except Exception as e:  # noqa: BLE001 - the fixture still has the hub layout
        print("processor_config.json not written:", e, file=sys.stderr)

    total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(OUT) for f in fs)
    print(f"wrote {OUT}: {total} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
