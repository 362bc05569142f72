//! The tool-use demo's pipeline on a very small model: its assets load through the
//! runner's own loaders, the warm start learns from its traces, and RL over calculator
//! episodes trains with the calls counted in the metrics and in the evaluation.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use ares_runner::backend::cpu::CpuBackend;
use ares_runner::commands::demo::evaluate_model;
use ares_runner::commands::{SftOptions, read_sft_pairs, run_sft};
use ares_runner::config::Config;
use ares_runner::data::SftTarget;
use ares_runner::demo::model::TinyModelSpec;
use ares_runner::demo::tools_task::{ToolsDemoOptions, call_text, write_tools_demo_assets};
use ares_runner::metrics::read_metrics;
use ares_runner::trainer::Trainer;

fn config(dir: &Path, model: &Path, a: &ares_runner::demo::tools_task::ToolsDemoAssets) -> Config {
    let yaml = format!(
        "\
data:
  train_files: {train}
  val_files: {val}
  max_prompt_length: 48
  max_response_length: 72
  rollout_batch_size: 2
  bootstrap: false
algorithm:
  online_filtering: false
worker:
  actor:
    model_path: {model}
    global_batch_size: 2
    micro_batch_size_per_device_for_update: 8
    optim: {{lr: 1.0e-3}}
  rollout:
    n: 4
    multi_turn: {{enable: true, max_assistant_turns: 2}}
    val_override_config: {{temperature: 1.0, n: 2}}
trainer:
  save_checkpoint_path: {run}
  max_steps: 2
  save_freq: 2
",
        train = a.train.display(),
        val = a.eval.display(),
        model = model.display(),
        run = dir.join("run").display(),
    );
    Config::from_yaml_str(&yaml, "test").unwrap()
}

/// Traces read back as traces; a warm start on them lowers the loss; two RL steps of
/// episodes run with the calculator, their calls in the metrics; the evaluation counts
/// calls per answer.
#[test]
fn the_tools_demo_warm_starts_and_trains_on_episodes() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_tools_demo_assets(
        &dir.path().join("assets"),
        &ToolsDemoOptions {
            seed: 4,
            train_per_level: 4,
            eval_per_level: 2,
            sft_examples: 64,
            model: TinyModelSpec {
                hidden: 32,
                layers: 1,
                heads: 2,
                kv_heads: 1,
                intermediate: 64,
                ..TinyModelSpec::default()
            },
        },
    )
    .unwrap();
    let cfg = config(dir.path(), &a.model_dir, &a);
    let pairs = read_sft_pairs(&a.sft, &cfg).unwrap();
    let calls = pairs
        .iter()
        .filter(|(_, t)| matches!(t, SftTarget::Turns(t) if t.len() == 3))
        .count();
    assert!(
        calls > 0 && calls < pairs.len(),
        "{calls} of {}",
        pairs.len()
    );
    let (ex, t) = pairs
        .iter()
        .find(|(_, t)| matches!(t, SftTarget::Turns(t) if t.len() == 3))
        .unwrap();
    let SftTarget::Turns(t) = t else {
        unreachable!()
    };
    assert_eq!(t[0]["content"], call_text(ex.prompt.question()));

    let options = SftOptions {
        epochs: 4,
        batch_size: 16,
        micro_batch: 8,
        lr: 1e-2,
        max_length: 128,
        seed: 1,
    };
    let sft = dir.path().join("sft");
    let report = run_sft(&cfg, CpuBackend, &a.model_dir, &pairs, &options, &sft, None).unwrap();
    assert!(report.last_loss < report.first_loss, "{report:?}");

    let cfg = config(dir.path(), &sft, &a);
    let mut trainer =
        Trainer::new(cfg.clone(), CpuBackend, Arc::new(AtomicBool::new(false))).unwrap();
    let summary = trainer.run().unwrap();
    let lines = read_metrics(&summary.metrics).unwrap();
    assert_eq!(lines.len(), 2);
    for line in &lines {
        let calls = line["tools/calls_per_response"].as_f64().unwrap();
        let turns = line["tools/turns_per_response"].as_f64().unwrap();
        assert!(
            (0.0..=1.0).contains(&calls) && (1.0..=2.0).contains(&turns),
            "{line:?}"
        );
    }
    let val = a.eval.to_string_lossy().into_owned();
    let report = evaluate_model(&cfg, CpuBackend, &sft, None, &val).unwrap();
    let all = report["all"];
    assert_eq!(all.responses, 6 * 2);
    assert!((0.0..=1.0).contains(&all.calls_per_response), "{all:?}");
    for level in ["easy", "medium", "hard"] {
        assert_eq!(report[level].responses, 4);
    }
}
