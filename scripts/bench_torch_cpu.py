#!/usr/bin/env python3
"""PyTorch CPU side of `cargo bench -p ares-benches --bench model_cpu`: the same small
Qwen2-shaped model (4 layers, hidden 256, 4 query / 2 KV heads of 64, MLP 704, vocab 8192,
tied embeddings, q/k/v biases; transformers' random init), the same work:

- train: forward, log_softmax(logits / T) gathered at the next tokens, loss
  sum(c * log pi) with c = -1/N, backward (gradients set to None between steps), on 8 x 256
  tokens; the AdamW step (clip_grad_norm_ + torch.optim.AdamW) timed on its own.
- generate: greedy `model.generate` with the KV cache, 16 prompts of 32 tokens, exactly 128
  new tokens each.
- rollout (`--only rollout`, the workload of `cargo bench -p ares-benches --bench rollout`):
  8 prompts of 90–110 random tokens × n = 8 samples, left-padded into one batch, sampled at
  T = 1 (no top-k / top-p), the same 82 EOS ids (≈ 1 % of a random model's mass per token),
  at most 256 new tokens; at the bench model's shape and the demo's (`--shape demo`), f32 or
  bf16 weights (`--dtype`). New tokens count each row up to and including its first EOS.
  `--shape qwen05`: the Qwen2.5-0.5B shape (24 layers, hidden 896, 14 / 2 heads, MLP 4864,
  vocab 151 936, 1 520 EOS ids) with `--prompts 1` × 8 and at most 64 new tokens, as the
  Rust bench runs it with `ARES_BENCH_05B=1`.

    python3 scripts/bench_torch_cpu.py [--threads 2] [--runs 5] [--attn sdpa|eager]
    python3 scripts/bench_torch_cpu.py --only rollout --shape demo --dtype bf16

Prints the best and median of the runs after one warm-up, in the format of the Rust bench.
"""

import argparse
import os
import time

# ARES_CPU_ISA (as the Rust benches read it) limits PyTorch's own kernels, MKL and oneDNN to
# the same instruction-set path; it must be set before torch is imported.
_ISA_LIMITS = {
    "avx512": ("avx512", "AVX512", "AVX512_CORE"),
    "avx2": ("avx2", "AVX2", "AVX2"),
    "portable": ("default", "SSE4_2", "SSE41"),
}
_isa = os.environ.get("ARES_CPU_ISA", "").strip().lower()
if _isa in _ISA_LIMITS:
    aten, mkl, onednn = _ISA_LIMITS[_isa]
    os.environ.setdefault("ATEN_CPU_CAPABILITY", aten)
    os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", mkl)
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
elif _isa not in ("", "native"):
    raise SystemExit(f"ARES_CPU_ISA={_isa!r} is not a CPU path: use avx512, avx2, portable or native")

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from torch_lora import with_lora  # noqa: E402

TRAIN_BATCH, TRAIN_SEQ = 8, 256
GEN_PROMPTS, GEN_PROMPT_LEN, GEN_NEW = 16, 32, 128


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
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--only", choices=["train", "generate", "rollout"])
    ap.add_argument("--shape", default="bench", choices=["bench", "demo", "qwen05"])
    ap.add_argument("--prompts", type=int, help="rollout prompts (default 8; qwen05: 1)")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(7)
    # (hidden, MLP, layers, rope theta, vocab, query heads, KV heads)
    hidden, mlp, layers, theta, vocab, heads, kv_heads = {
        "bench": (256, 704, 4, 1e6, 8192, 4, 2),
        "demo": (128, 352, 3, 1e4, 8192, 4, 2),
        "qwen05": (896, 4864, 24, 1e6, 151936, 14, 2),
    }[args.shape]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=theta,
        tie_word_embeddings=True,
        attn_implementation=args.attn,
    )
    model = Qwen2ForCausalLM(config).float()
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
        f"{torch.get_num_threads()} threads, attention {args.attn}, "
        f"{params / 1e6:.1f} M parameters"
    )

    if args.only in (None, "train"):
        model.train()
        n = TRAIN_BATCH * TRAIN_SEQ
        ids = torch.randint(0, 8192, (TRAIN_BATCH, TRAIN_SEQ))
        mask = torch.ones_like(ids)
        targets = torch.zeros_like(ids)
        targets[:, :-1] = ids[:, 1:]
        coeffs = torch.full((TRAIN_BATCH, TRAIN_SEQ), -1.0 / n)
        coeffs[:, -1] = 0.0

        def step():
            model.zero_grad(set_to_none=True)
            logits = model(input_ids=ids, attention_mask=mask).logits
            logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]
            (coeffs * logp).sum().backward()

        report(f"train forward+backward ({TRAIN_BATCH} × {TRAIN_SEQ})", n, "tokens", timed(args.runs, step))

        def forward():
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)

        report("  of which forward (no_grad)", n, "tokens", timed(args.runs, forward))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

        def opt_step():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        report("AdamW step (clip + update)", 1, "steps", timed(args.runs, opt_step))

        # LoRA r = 16 on every linear layer, the base frozen (peft when installed, else the
        # same pair by hand: lora_linear below)
        lora_model = with_lora(Qwen2ForCausalLM(config).float(), r=16, alpha=32)
        lora_model.train()

        def lora_step():
            lora_model.zero_grad(set_to_none=True)
            logits = lora_model(input_ids=ids, attention_mask=mask).logits
            logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]
            (coeffs * logp).sum().backward()

        report("train forward+backward, LoRA r=16 all-linear", n, "tokens", timed(args.runs, lora_step))
        trainable = [p for p in lora_model.parameters() if p.requires_grad]
        lora_opt = torch.optim.AdamW(trainable, lr=1e-6)

        def lora_opt_step():
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            lora_opt.step()

        report("AdamW step, LoRA pairs", 1, "steps", timed(args.runs, lora_opt_step))

    if args.only in (None, "generate"):
        model.eval()
        prompts = torch.randint(0, 8192, (GEN_PROMPTS, GEN_PROMPT_LEN))
        attention = torch.ones_like(prompts)

        def generate():
            with torch.no_grad():
                out = model.generate(
                    input_ids=prompts,
                    attention_mask=attention,
                    max_new_tokens=GEN_NEW,
                    min_new_tokens=GEN_NEW,
                    do_sample=False,
                    pad_token_id=0,
                    eos_token_id=None,
                )
            assert out.shape == (GEN_PROMPTS, GEN_PROMPT_LEN + GEN_NEW)

        report(
            f"generate greedy ({GEN_PROMPTS} × {GEN_NEW} new, prompts of {GEN_PROMPT_LEN})",
            GEN_PROMPTS * GEN_NEW,
            "tokens",
            timed(min(args.runs, 3), generate),
        )

    if args.only == "rollout":
        rollout(model, args)


def rollout(model, args):
    """The RL rollout workload (module docs), as transformers' `generate` runs it."""
    model.eval()
    gen = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    count = args.prompts or (1 if args.shape == "qwen05" else 8)
    max_new = 64 if args.shape == "qwen05" else 256
    prompts = []
    for _ in range(count):
        length = 90 + int(torch.randint(0, 21, (1,), generator=gen))
        p = torch.randint(0, vocab, (length,), generator=gen)
        prompts += [p] * 8
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        attention[i, width - len(p):] = 1
    eos = [100 + 97 * i for i in range(-(-vocab // 100))]
    eos_set = torch.tensor(eos)
    new_tokens = [0]

    def run():
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=attention,
                max_new_tokens=max_new,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
                eos_token_id=eos,
            )
        new = out[:, width:]
        count = 0
        for row in new:
            hit = torch.isin(row, eos_set).nonzero()
            count += int(hit[0]) + 1 if len(hit) else len(row)
        new_tokens[0] = count

    times = timed(min(args.runs, 3), run)
    report(
        f"rollout ({args.shape} shape, {args.dtype}: {count} prompts × 8, {new_tokens[0]} new tokens)",
        new_tokens[0],
        "tokens",
        times,
    )


if __name__ == "__main__":
    main()
