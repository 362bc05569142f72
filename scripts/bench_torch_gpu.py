#!/usr/bin/env python3
"""PyTorch + transformers side of `bench-model_cuda`, on the same GPU: the same
Qwen2.5-0.5B-shaped model (24 layers, hidden 896, 14 query / 2 KV heads of 64, MLP 4864,
vocab 151 936, tied embeddings, q/k/v biases; random weights), the same work:

- train: forward, log_softmax(logits) gathered at the next tokens, loss sum(c * log pi) with
  c = -1/N, backward (gradients set to None between steps), on BATCH x SEQ tokens (4 x 512);
  in f32, TF32 and bf16 (autocast over f32 master weights, as mixed-precision trainers do),
  eager and, with --compile, torch.compile; achieved TFLOP/s counted as the Rust bench does;
- generate: `model.generate` with the KV cache, greedy and sampled (T = 1, top-p 1), 32
  prompts of 32 tokens, exactly 64 new tokens each (--gen 64x512 for 64 x 512), f32 / TF32 / bf16 weights;
- the physical floors, measured in the same run: dense GEMM rate (8192^3) per precision and
  device-to-device copy bandwidth; MFU is reported against the measured GEMM rate;
- peak memory (torch.cuda.max_memory_allocated) of each piece.

    python3 scripts/bench_torch_gpu.py [--runs 3] [--compile] [--gen 32x64] [--gen-dtypes bf16] [--only train]
        [--train-dtypes bf16] [--no-lora]
    python3 scripts/bench_torch_gpu.py --device cpu --tiny   # checks the script, no GPU

Prints the best and median of the runs after one warm-up, in the format of the Rust bench.
"""

import argparse
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from torch_lora import with_lora  # noqa: E402

from bench_torch_cpu import report

TRAIN_BATCH, TRAIN_SEQ = 4, 512


def timed(runs, f, sync):
    f()
    sync()
    t = []
    for _ in range(runs):
        start = time.perf_counter()
        f()
        sync()
        t.append(time.perf_counter() - start)
    t.sort()
    return t[0], t[runs // 2]


def config(tiny):
    if tiny:
        shape = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    else:
        shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                     num_attention_heads=14, num_key_value_heads=2, vocab_size=151936)
    return Qwen2Config(max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
                       tie_word_embeddings=True, attn_implementation="sdpa", **shape)


def floors(device, sync, runs, tiny):
    """Dense GEMM TFLOP/s per precision and copy GB/s, measured now on this device."""
    n = 512 if tiny else 8192
    rates = {}
    for name, dtype, tf32 in [("f32", torch.float32, False), ("TF32", torch.float32, True),
                              ("bf16", torch.bfloat16, False)]:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        best, _ = timed(runs, lambda: a @ b, sync)
        rates[name] = 2 * n**3 / best / 1e12
        print(f"floor: {name} GEMM {n}^3: {rates[name]:.1f} TFLOP/s")
    torch.backends.cuda.matmul.allow_tf32 = False
    src = torch.empty(256 << 20 if not tiny else 1 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best, _ = timed(runs, lambda: dst.copy_(src), sync)
    print(f"floor: device-to-device copy: {2 * src.numel() / best / 1e9:.0f} GB/s (read + write)")
    return rates


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (train)")
    ap.add_argument("--gen", default="32x64", help="PROMPTSxNEW for generation")
    ap.add_argument("--gen-dtypes", default="f32,TF32,bf16", help="generation's weights, comma-separated")
    ap.add_argument("--train-dtypes", default="f32,TF32,bf16",
                    help="training's precisions, comma-separated (bf16: autocast over f32 weights)")
    ap.add_argument("--no-lora", action="store_true", help="skip the LoRA step (train)")
    ap.add_argument("--only", choices=["train", "generate", "attention"])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (checks the script)")
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(7)
    cfg = config(args.tiny)
    model = Qwen2ForCausalLM(cfg).float().to(device)
    params = sum(p.numel() for p in model.parameters())
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"torch {torch.__version__}, device {name}, {params / 1e6:.1f} M parameters")
    rates = floors(device, sync, args.runs, args.tiny)

    def peak(what):
        if cuda:
            print(f"  peak memory ({what}): {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
            torch.cuda.reset_peak_memory_stats(device)

    vocab, h, layers = cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers
    if args.only in (None, "train"):
        model.train()
        b, s = (2, 64) if args.tiny else (TRAIN_BATCH, TRAIN_SEQ)
        n = b * s
        ids = torch.randint(0, vocab, (b, s), device=device)
        mask = torch.ones_like(ids)
        targets = torch.zeros_like(ids)
        targets[:, :-1] = ids[:, 1:]
        coeffs = torch.full((b, s), -1.0 / n, device=device)
        coeffs[:, -1] = 0.0
        flops = 6.0 * params * n + 6.0 * layers * h * s * n

        def loss(m):
            logits = m(input_ids=ids, attention_mask=mask).logits.float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]
            return (coeffs * logp).sum()

        variants = [("f32", False, None), ("TF32", True, None), ("bf16 autocast", False, torch.bfloat16)]
        wanted = args.train_dtypes.split(",")
        unknown = sorted(set(wanted) - {"f32", "TF32", "bf16"})
        if unknown:
            ap.error(f"--train-dtypes: unknown {unknown}; choose from f32, TF32, bf16")
        for label, tf32, autocast in [v for v in variants if v[0].split()[0] in wanted]:
            for compiled in [False, True] if args.compile else [False]:
                torch.backends.cuda.matmul.allow_tf32 = tf32
                m = torch.compile(model) if compiled else model

                def step():
                    model.zero_grad(set_to_none=True)
                    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                        out = loss(m)
                    out.backward()

                kind = "compile" if compiled else "eager"
                t = timed(args.runs, step, sync)
                report(f"[{label} {kind}] train forward+backward ({b} × {s})", n, "tokens", t)
                achieved = flops / t[0] / 1e12
                floor = rates["bf16" if autocast else ("TF32" if tf32 else "f32")]
                print(f"  = {achieved:.2f} TFLOP/s (best), MFU {100 * achieved / floor:.0f} % of the measured GEMM rate")
                peak(f"{label} {kind} train")
        torch.backends.cuda.matmul.allow_tf32 = False

    if args.only in (None, "train") and not args.no_lora:
        # (the batch and `loss` of the train section above)
        # LoRA r = 16 on every linear layer, the base frozen, bf16 autocast, gradient
        # checkpointing on (the issue's baseline for `model_cuda`'s LoRA step)
        lora_model = with_lora(Qwen2ForCausalLM(cfg).float().to(device), r=16, alpha=32)
        lora_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lora_model.enable_input_require_grads()
        lora_model.train()
        peak("before the LoRA step")

        def lora_step():
            lora_model.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = loss(lora_model)
            out.backward()

        t = timed(args.runs, lora_step, sync)
        report(f"[bf16 autocast eager] LoRA r=16 all-linear, checkpointed ({b} × {s})", n, "tokens", t)
        peak("LoRA step, checkpointed")

    if args.only in (None, "attention") and cuda:
        # causal SDPA at bench-model_cuda's attention shapes (4 x 2048, MHA, 2048 features);
        # TFLOP/s of the causal products as it counts them: forward 4*B*T^2*H*D/2, backward 2.5x
        F = torch.nn.functional
        b, t = 4, 2048
        for heads, d in ((16, 128), (32, 64)):
            for dtype in (torch.bfloat16, torch.float32):
                q, k, v = (torch.randn(b, heads, t, d, device=device, dtype=dtype, requires_grad=True)
                           for _ in range(3))
                dout = torch.randn(b, heads, t, d, device=device, dtype=dtype)
                fwd = 4 * b * t * t * heads * d / 2
                with torch.no_grad():
                    best, med = timed(max(args.runs, 5), lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), sync)
                name = "bf16" if dtype == torch.bfloat16 else "f32"
                print(f"[attention {b} x {t}, {heads} heads of {d}] torch SDPA {name} forward: "
                      f"{fwd / best / 1e12:.1f} TFLOP/s best ({best * 1e3:.2f} ms), median {med * 1e3:.2f} ms")
                def fwd_bwd():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)
                best2, med2 = timed(max(args.runs, 5), fwd_bwd, sync)
                bwd = max(best2 - best, 1e-9)
                print(f"[attention {b} x {t}, {heads} heads of {d}] torch SDPA {name} backward: "
                      f"{2.5 * fwd / bwd / 1e12:.1f} TFLOP/s best ({bwd * 1e3:.2f} ms, forward+backward {best2 * 1e3:.2f} ms)")
                del q, k, v, dout
    if args.only in (None, "generate"):
        model.eval()
        prompts_n, new = (int(x) for x in args.gen.split("x"))
        if args.tiny:
            prompts_n, new = 4, 8
        prompts = torch.randint(0, vocab, (prompts_n, 32), device=device)
        attention = torch.ones_like(prompts)
        dtypes = [("f32", torch.float32, False), ("TF32", torch.float32, True), ("bf16", torch.bfloat16, False)]
        wanted = args.gen_dtypes.split(",")
        unknown = sorted(set(wanted) - {d[0] for d in dtypes})
        if unknown:
            ap.error(f"--gen-dtypes: unknown {unknown}; choose from f32, TF32, bf16")
        for label, dtype, tf32 in [d for d in dtypes if d[0] in wanted]:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            gen_model = model.to(dtype)

            sampled = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
            for how, mode in [("greedy", dict(do_sample=False)), ("sampled (T = 1, top-p 1)", sampled)]:
                def generate():
                    with torch.no_grad():
                        out = gen_model.generate(input_ids=prompts, attention_mask=attention,
                                                 max_new_tokens=new, min_new_tokens=new,
                                                 pad_token_id=0, eos_token_id=None, **mode)
                    assert out.shape == (prompts_n, 32 + new)

                t = timed(min(args.runs, 3), generate, sync)
                report(f"[{label}] generate {how} ({prompts_n} × {new} new, prompts of 32)",
                       prompts_n * new, "tokens", t)
                peak(f"{label} generate {how}")
        model.float()
        torch.backends.cuda.matmul.allow_tf32 = False


if __name__ == "__main__":
    main()
