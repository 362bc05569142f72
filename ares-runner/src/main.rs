//! `ares-runner`: the trainer's command-line entry point.
//!
//! The trainer (rollout, RL loop, built-in demo) is not built yet; until it is, every command
//! says so plainly and exits with status 2 instead of pretending to work.

use std::process::ExitCode;

const NOT_BUILT: &str = "\
ares-runner: the trainer is not built yet.

What exists today: `ares-core`, the complete math of ARES/AEPO, GRPO-λ, graded rubric
prompts and REINFORCE Pro Max; the CPU and CUDA token kernels; and the first half of the
model runtime (Hugging Face loading and saving, tokenizer, chat templates, and a
Qwen2/Qwen3/Llama forward, backward and batched generation that match transformers). `cargo test --workspace`
checks all of it. The optimizer step, rollout, RL loop and the built-in demo behind
`ares-runner train` are the next milestones; the README's status table says where each
stands.";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("--version" | "-V") => {
            println!("ares-runner {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("{NOT_BUILT}");
            ExitCode::from(2)
        }
    }
}
