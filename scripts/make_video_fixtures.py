#!/usr/bin/env python3
"""Fixtures for decoding video files through ffmpeg (ares-model/tests/vision_video.rs).

Run with the verl venv (transformers 5.24, torch, torchvision, PyAV):

    /work/verl-venv/bin/python scripts/make_video_fixtures.py

The encoder is the ffmpeg binary of the `imageio-ffmpeg` wheel (the one CI pins in
.ci/ffmpeg-requirements.txt); the script installs it into the running venv when missing
(`pip install imageio-ffmpeg==0.8.1`), or takes `$ARES_FFMPEG`.

Writes into ares-model/tests/fixtures/vision/video/:
  - moving_rgb_10fps.mp4: 16 frames of 64×48 moving shapes at 10 fps, H.264 lossless RGB
    (libx264rgb, -qp 0, decoded as gbrp): every decoder gives the encoded pixels bit for bit;
  - moving_rgb_12fps.webm: 15 frames of 64×48 at 12 fps, VP9 lossless RGB (gbrp);
  - moving_yuv420_10fps.mp4: 16 frames at 10 fps, ordinary lossy H.264 4:2:0 (BT.709 tagged):
    the YUV → RGB conversion of ffmpeg's CLI and PyAV may differ, the test measures how much;
  - video.safetensors and video.json: what transformers gives for each case. Frames are
    decoded with PyAV (transformers' default video backend, `to_ndarray(format="rgb24")`), the
    frame count is the number of decoded frames and the rate PyAV's `average_rate` (transformers'
    `read_video_pyav` takes both from the stream; for mp4 the count is the same, checked here, and
    webm has no count in the container); the sampled indices come from
    `Qwen2VLVideoProcessor.sample_frames` and the outputs from the processor called on all frames
    with `do_sample_frames=True`, `fps`, `video_metadata` (as scripts/make_vision_fixtures.py does,
    with its video pixel bounds 784..3136, so a 64×48 frame becomes 56×56). For the mp4s,
    transformers' own `load_video(path, backend="pyav")` must pick the same frames.

Tensors (`<case>` is a key of video.json's "cases"):
  - `<case>.pixel_values_videos` (f32, only for "rgb_mp4_fps3"),
  - `<case>.levels` (u8, same shape as pixel_values_videos): the pixel level 0..255 each value
    came from, so that `(level − mean·255) / (std·255)` in f32 is transformers' value exactly
    (checked here for every value); four times smaller than the f32 values, which keeps the
    fixture under 300 KB;
  - `<case>.grid_thw` (i64), `<case>.frame_indices` (i64),
  - `<case>.decoded` (u8 [n, h, w, 3], only for the 4:2:0 case): PyAV's RGB of the sampled frames.
"""

import json
import os
import shutil
import subprocess
import sys

import av
import numpy as np
import torch
import transformers
from safetensors.numpy import save_file
from transformers import Qwen2VLVideoProcessor
from transformers.video_utils import VideoMetadata, load_video

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "ares-model", "tests", "fixtures", "vision", "video")

VIDEO_MIN_PIXELS = 784  # 28 * 28, as scripts/make_vision_fixtures.py
VIDEO_MAX_PIXELS = 3136
IMAGEIO_FFMPEG = "imageio-ffmpeg==0.8.1"
H, W = 48, 64

# file -> (frames, fps, encoder arguments, lossless)
VIDEOS = {
    "moving_rgb_10fps.mp4": (
        16,
        10,
        ["-c:v", "libx264rgb", "-qp", "0", "-preset", "veryslow", "-pix_fmt", "rgb24"],
        True,
    ),
    "moving_rgb_12fps.webm": (
        15,
        12,
        ["-c:v", "libvpx-vp9", "-lossless", "1", "-pix_fmt", "gbrp", "-row-mt", "0"],
        True,
    ),
    "moving_yuv420_10fps.mp4": (
        16,
        10,
        ["-c:v", "libx264", "-crf", "20", "-pix_fmt", "yuv420p", "-colorspace", "bt709",
         "-color_primaries", "bt709", "-color_trc", "bt709", "-color_range", "tv"],
        False,
    ),
}

# case -> (file, sampling fps or None, what is stored)
CASES = {
    # 16 frames at 10 fps, 3 fps wanted: 4.8 -> 4 frames, step 4: 0, 4, 8, 12
    "rgb_mp4_fps3": ("moving_rgb_10fps.mp4", 3.0, "f32"),
    # 15 frames at 12 fps, 5 fps wanted: 6.25 -> 6 frames, step 2.5: 0, 2, 5, 7, 10, 12
    "rgb_webm_fps5": ("moving_rgb_12fps.webm", 5.0, "levels"),
    # 16 frames at 10 fps, 2 fps wanted: 3.2 -> min_frames 4, step 4
    "yuv420_mp4_fps2": ("moving_yuv420_10fps.mp4", 2.0, "decoded"),
}


def ffmpeg_exe():
    if os.environ.get("ARES_FFMPEG"):
        return os.environ["ARES_FFMPEG"]
    try:
        import imageio_ffmpeg
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", IMAGEIO_FFMPEG], check=True)
        import imageio_ffmpeg
    return imageio_ffmpeg.get_ffmpeg_exe()


def moving_shapes(n, seed):
    """n frames of H×W: a drifting two-colour gradient, a checkerboard patch, a red box moving
    right, a blue disc moving diagonally and a thin green bar moving down (sharp edges and smooth
    areas for the bicubic resize)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:H, 0:W].astype(np.float64)
    frames = np.zeros((n, H, W, 3), dtype=np.uint8)
    tint = rng.uniform(40, 200, size=3)
    for t in range(n):
        img = np.zeros((H, W, 3))
        img[..., 0] = 255 * (xx + 3 * t) % 256 / 255 * 0.6 + 30
        img[..., 1] = 255 * (yy / (H - 1)) * 0.5 + 20 + 4 * t
        img[..., 2] = tint[2] * (1 - xx / (W - 1)) + 10
        checker = ((xx // 3).astype(int) + (yy // 3).astype(int)) % 2 == 0
        region = (xx >= 40) & (xx < 58) & (yy >= 4) & (yy < 16)
        img[checker & region] = [250, 250, 250]
        img[~checker & region] = [5, 5, 5]
        x0 = 2 + 3 * t
        img[(xx >= x0) & (xx < x0 + 10) & (yy >= 26) & (yy < 36)] = [230, 20, 30]
        cy, cx = 8 + 2 * t, 6 + 2.5 * t
        img[(yy - cy) ** 2 + (xx - cx) ** 2 < 36] = [20, 40, 240]
        bar = int(t * (H - 2) / max(n - 1, 1))
        img[bar : bar + 2, :, :] = [tint[0], 220, tint[1]]
        frames[t] = np.clip(np.round(img), 0, 255).astype(np.uint8)
    return frames


def encode(ffmpeg, frames, fps, args, path):
    cmd = [
        ffmpeg, "-hide_banner", "-loglevel", "error", "-y",
        "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{W}x{H}", "-r", str(fps), "-i", "-",
        *args, "-threads", "1", "-map_metadata", "-1", "-fflags", "+bitexact", "-flags:v", "+bitexact",
        path,
    ]
    subprocess.run(cmd, input=frames.tobytes(), check=True)


def pyav_decode(path):
    """All frames as transformers' PyAV backend decodes them, the stream's rate and frame count."""
    with av.open(path) as c:
        s = c.streams.video[0]
        rate, declared = s.average_rate, s.frames
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    return frames, rate, declared


def levels_of(values, frames_used, vproc):
    """The pixel level behind each normalised value: invert `(x − m) / s` per channel (values are
    rows of 3·tp·p·p ordered (channel, t, y, x)) and check that the inversion is exact."""
    inv = np.float32(1.0 / vproc.rescale_factor)
    m = np.asarray(vproc.image_mean, dtype=np.float32) * inv
    s = np.asarray(vproc.image_std, dtype=np.float32) * inv
    x = np.arange(256, dtype=np.float32)
    table = (x[None, :] - m[:, None]) / s[:, None]  # [3, 256], f32 as the torchvision backend
    tp, p = vproc.temporal_patch_size, vproc.patch_size
    v = values.reshape(values.shape[0], 3, tp * p * p)
    levels = np.zeros(v.shape, dtype=np.uint8)
    for c in range(3):
        idx = np.searchsorted(table[c], v[:, c])
        idx = np.clip(idx, 0, 255)
        assert np.array_equal(table[c][idx], v[:, c]), "a value is not a normalised pixel level"
        levels[:, c] = idx
    return levels.reshape(values.shape)


def main():
    ffmpeg = ffmpeg_exe()
    version = subprocess.run([ffmpeg, "-version"], capture_output=True, text=True, check=True).stdout.split("\n")[0]
    print(version, file=sys.stderr)
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)

    vproc = Qwen2VLVideoProcessor(min_pixels=VIDEO_MIN_PIXELS, max_pixels=VIDEO_MAX_PIXELS)
    meta = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "pyav": av.__version__,
        "pyav_ffmpeg": {k: ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
                        for k, v in av.library_versions.items()},
        "encoder_ffmpeg": version,
        "video_min_pixels": VIDEO_MIN_PIXELS,
        "video_max_pixels": VIDEO_MAX_PIXELS,
        "min_frames": vproc.min_frames,
        "max_frames": vproc.max_frames,
        "videos": {},
        "cases": {},
    }
    decoded = {}
    for i, (name, (n, fps, args, lossless)) in enumerate(VIDEOS.items()):
        src = moving_shapes(n, seed=300 + i)
        path = os.path.join(OUT, name)
        encode(ffmpeg, src, fps, args, path)
        frames, rate, declared = pyav_decode(path)
        assert frames.shape == (n, H, W, 3), frames.shape
        if lossless:
            assert np.array_equal(frames, src), f"{name}: not lossless"
        if name.endswith(".mp4"):
            assert declared == n, (name, declared)
        decoded[name] = (frames, rate)
        meta["videos"][name] = {
            "frames": n,
            "height": H,
            "width": W,
            "average_rate": f"{rate.numerator}/{rate.denominator}",
            "fps": float(rate),
            "lossless": lossless,
            "container_frames": int(declared),
            "bytes": os.path.getsize(path),
        }

    tensors = {}
    for case, (name, fps, store) in CASES.items():
        frames, rate = decoded[name]
        total = len(frames)
        md = VideoMetadata(total_num_frames=total, fps=float(rate), width=W, height=H)
        indices = [int(i) for i in vproc.sample_frames(md, fps=fps)]
        out = vproc(
            videos=[frames],
            do_sample_frames=True,
            fps=fps,
            video_metadata=[{"fps": float(rate), "total_num_frames": total}],
            cap_pixels_per_frame=False,
            return_tensors="pt",
        )
        values = out["pixel_values_videos"].numpy().astype(np.float32)
        grid = out["video_grid_thw"].numpy().astype(np.int64)
        # The same sampled frames without sampling give the same values.
        again = vproc(videos=[frames[indices]], do_sample_frames=False, cap_pixels_per_frame=False,
                      return_tensors="pt")
        assert np.array_equal(again["pixel_values_videos"].numpy(), values), case
        if name.endswith(".mp4"):
            # transformers' own PyAV loader (its processors default to torchcodec, not installed
            # here) picks the same frames from the file.
            loaded, lmd = load_video(
                os.path.join(OUT, name),
                backend="pyav",
                sample_indices_fn=lambda metadata, **kw: vproc.sample_frames(metadata, fps=fps),
            )
            assert [int(i) for i in lmd.frames_indices] == indices, case
            assert np.array_equal(loaded, frames[indices]), case
        if "f32" in store:
            tensors[f"{case}.pixel_values_videos"] = values
        if "levels" in store:
            tensors[f"{case}.levels"] = levels_of(values, frames[indices], vproc)
        if "decoded" in store:
            tensors[f"{case}.decoded"] = np.ascontiguousarray(frames[indices])
        tensors[f"{case}.grid_thw"] = grid
        tensors[f"{case}.frame_indices"] = np.asarray(indices, dtype=np.int64)
        meta["cases"][case] = {"file": name, "fps": fps, "frame_indices": indices,
                               "grid_thw": grid[0].tolist()}
        print(f"{case}: {name} indices {indices} grid {grid[0].tolist()}", file=sys.stderr)

    save_file(tensors, os.path.join(OUT, "video.safetensors"))
    with open(os.path.join(OUT, "video.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(OUT, f)) for f in os.listdir(OUT))
    print(f"wrote {OUT}: {total} bytes", file=sys.stderr)
    assert total < 300_000, total


if __name__ == "__main__":
    main()
