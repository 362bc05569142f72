"""PyTorch baselines for ares' fused log-prob + entropy on the same GPU.

Eager: logsumexp − Σ softmax·z for the entropy, plus log_softmax + gather for the log-prob,
as trainers (verl's entropy_from_logits, logprobs_from_logits) compute them; and the same
function under torch.compile. Logits: 8192 × 151 936 bf16 (as ares-cuda/benches/gpu_kernels.rs),
math in f32.
Also a device-to-device copy of the logits, the bandwidth reference. Prints one line per
measurement: name, median ms over 20 runs, GB/s of one read of the logits, peak extra
memory.
"""
import torch

ROWS, VOCAB, REPEATS = 8192, 151_936, 20


def entropy_and_logprob(logits, targets):
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    logp = torch.log_softmax(z, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    return logp, entropy


def timed(fn):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    logits = (torch.rand(ROWS, VOCAB, device=dev) * 20 - 10).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (ROWS,), device=dev)
    nbytes = logits.numel() * logits.element_size()
    dst = torch.empty_like(logits)
    copy_ms = timed(lambda: dst.copy_(logits))
    print(f"dtod_copy: {copy_ms:.3f} ms, {2 * nbytes / copy_ms / 1e6:.0f} GB/s (read+write)")
    del dst
    for name, fn in [("eager", entropy_and_logprob), ("compile", torch.compile(entropy_and_logprob))]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = timed(lambda: fn(logits, targets))
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(f"{name}: {ms:.3f} ms, {nbytes / ms / 1e6:.0f} GB/s of logits, peak extra {peak:.2f} GiB")


if __name__ == "__main__":
    main()
