#!/usr/bin/env python3
"""The PyTorch + transformers side of scripts/bench_grpo_step.sh: the RL step of
examples/configs/bench_grpo_step.yaml on the same model directory and prompts, done the
way a plain PyTorch GRPO trainer does it:

1. rollout: `model.generate` (sampling, T = 1, top-p 1, KV cache), N prompts x n samples,
   up to R new tokens, stopping at the tokenizer's EOS;
2. scoring: old log-probs (the actor, no grad) and reference log-probs (a frozen copy) of
   the response tokens, in micro-batches, log_softmax over the vocabulary in f32;
3. update: rewards (random here: the work does not depend on them) -> GRPO advantages ->
   per micro-batch the clipped PPO loss plus the k3 KL loss (coefficient 1e-3), token-mean
   over the whole batch, backward; then grad-norm clipping (1.0) and one AdamW step.

    python3 scripts/bench_torch_grpo_step.py runs/bench-grpo/assets [--dtype bf16] [--steps 3]
    python3 scripts/bench_torch_grpo_step.py DIR --device cpu --prompts 4 --n 2 --response 16

DIR is what `ares-runner demo-data` wrote (DIR/model, DIR/data/train.jsonl). Prints the
time of each phase and step, and peak memory: PyTorch's allocator peak and the device's
used memory (what nvidia-smi shows, CUDA context included).
"""

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def response_logp(model, seqs, attention, prompt_len, micro, autocast):
    """log pi(token) of every response token, [B, R], in f32."""
    out = []
    for i in range(0, seqs.shape[0], micro):
        ids, mask = seqs[i : i + micro], attention[i : i + micro]
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, attention_mask=mask).logits
        logits = logits[:, prompt_len - 1 : -1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, ids[:, prompt_len:, None])[..., 0])
    return torch.cat(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("assets", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32",
                    help="bf16: autocast for scoring and update over f32 weights, bf16 generation")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(1)

    model_dir = args.assets / "model"
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    ref.requires_grad_(False)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-6, weight_decay=0.01)
    rows = [json.loads(line) for line in open(args.assets / "data" / "train.jsonl")]
    texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                     add_generation_prompt=True) for r in rows]
    bf16 = args.dtype == "bf16"
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    params = sum(p.numel() for p in actor.parameters())
    print(f"torch {torch.__version__}, {name}, {params / 1e6:.1f} M parameters, {args.dtype}, "
          f"{args.prompts} prompts x {args.n} samples, <= {args.response} new tokens")

    for step in range(args.steps):
        batch = texts[step * args.prompts : (step + 1) * args.prompts]
        enc = tok(batch, return_tensors="pt", padding=True, return_token_type_ids=False).to(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        times = {}
        sync()
        t0 = time.perf_counter()

        actor.eval()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            seqs = actor.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                  max_new_tokens=args.response, num_return_sequences=args.n,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        sync()
        times["rollout"] = time.perf_counter() - t0
        prompt_len = enc.input_ids.shape[1]
        prompt_mask = enc.attention_mask.repeat_interleave(args.n, 0)
        response = seqs[:, prompt_len:]
        # response tokens up to and including the first EOS
        after_eos = (response == tok.eos_token_id).int().cumsum(-1) - (response == tok.eos_token_id).int()
        response_mask = (after_eos == 0).to(prompt_mask.dtype)
        attention = torch.cat([prompt_mask, response_mask], 1)
        new_tokens = int(response_mask.sum())

        t1 = time.perf_counter()
        with torch.no_grad():
            old = response_logp(actor, seqs, attention, prompt_len, args.micro, bf16)
            ref_lp = response_logp(ref, seqs, attention, prompt_len, args.micro, bf16)
        sync()
        times["scoring"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        rewards = torch.rand(args.prompts, args.n, device=device)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).reshape(-1)
        actor.train()
        opt.zero_grad(set_to_none=True)
        mask_f = response_mask.float()
        total = mask_f.sum()
        for i in range(0, seqs.shape[0], args.micro):
            sl = slice(i, i + args.micro)
            logp = response_logp(actor, seqs[sl], attention[sl], prompt_len, args.micro, bf16)
            ratio = torch.exp(logp - old[sl])
            a = adv[sl, None]
            pg = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.3))
            d = ref_lp[sl] - logp
            kl = torch.exp(d) - d - 1
            loss = ((pg + 1e-3 * kl) * mask_f[sl]).sum() / total
            loss.backward()
        torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
        opt.step()
        sync()
        times["update"] = time.perf_counter() - t2
        wall = time.perf_counter() - t0

        phases = ", ".join(f"{k} {v:.2f} s" for k, v in times.items())
        print(f"step {step + 1}: {wall:.2f} s ({phases}); {new_tokens} response tokens, "
              f"{new_tokens / times['rollout']:.0f} generated tokens/s")
        if cuda:
            free, total_mem = torch.cuda.mem_get_info(device)
            print(f"  peak memory: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated "
                  f"by PyTorch; device used now {(total_mem - free) / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
