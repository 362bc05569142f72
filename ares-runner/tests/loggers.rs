//! EasyR1's experiment loggers through their own Python packages (`trainer.logger`): a
//! two-step run with wandb (offline) and tensorboard writes runs that their readers open,
//! with the step metrics the trainer wrote to metrics.jsonl. Skipped unless the Python of
//! `ARES_TEST_PYTHON` (default `python3`) has wandb, tensorboard and tensorboardX or torch;
//! CI installs pinned versions into its venv and runs this test with it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use ares_runner::backend::cpu::CpuBackend;
use ares_runner::config::Config;
use ares_runner::demo::model::TinyModelSpec;
use ares_runner::demo::{DemoOptions, write_demo_assets_with};
use ares_runner::metrics::read_metrics;
use ares_runner::trainer::Trainer;
use serde_json::{Map, Value};

fn python() -> String {
    std::env::var("ARES_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn has_packages(python: &str) -> bool {
    let probe = "import wandb, tensorboard\ntry:\n import torch.utils.tensorboard\nexcept ImportError:\n import tensorboardX";
    let ok = Command::new(python)
        .args(["-c", probe])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("{python} lacks wandb / tensorboard: skipping (set ARES_TEST_PYTHON)");
    }
    ok
}

/// Runs `script` with `python` and parses what it prints as JSON.
fn python_json(python: &str, script: &str, arg: &Path) -> Value {
    let out = Command::new(python)
        .args(["-c", script])
        .arg(arg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// TensorBoard's own reader: every scalar as {tag: [[step, value], ...]}.
const READ_TENSORBOARD: &str = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1]); acc.Reload()
print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}))
"#;

/// wandb's offline run file: the records of the `.wandb` file (LevelDB log framing) parsed
/// with wandb's own protobuf definitions; the history rows as dicts.
const READ_WANDB: &str = r#"
import glob, json, struct, sys
from wandb.proto import wandb_internal_pb2
path = glob.glob(sys.argv[1] + "/wandb/offline-run-*/run-*.wandb")[0]
data = open(path, "rb").read()
assert data[:4] == b":W&B", data[:8]
records, buf, pos = [], b"", 7
while pos + 7 <= len(data):
    left = 32768 - pos % 32768
    if left < 7:
        pos += left
        continue
    crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    payload = data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind == 1:
        records.append(payload)
    elif kind == 2:
        buf = payload
    elif kind == 3:
        buf += payload
    elif kind == 4:
        records.append(buf + payload)
rows = []
for r in records:
    rec = wandb_internal_pb2.Record()
    rec.ParseFromString(r)
    if rec.HasField("history"):
        rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
print(json.dumps(rows))
"#;

#[test]
fn wandb_offline_and_tensorboard_runs_open_in_their_readers() {
    let python = python();
    if !has_packages(&python) {
        return;
    }
    // SAFETY: the only test of this binary; the worker inherits the environment.
    unsafe {
        std::env::set_var("WANDB_MODE", "offline");
        std::env::set_var("WANDB_SILENT", "true");
        std::env::remove_var("TENSORBOARD_DIR");
    }
    let dir = tempfile::tempdir().unwrap();
    let a = write_demo_assets_with(
        &dir.path().join("assets"),
        &DemoOptions {
            seed: 3,
            train_per_level: 4,
            eval_per_level: 2,
            sft_examples: 8,
            model: TinyModelSpec {
                hidden: 32,
                layers: 1,
                heads: 2,
                kv_heads: 1,
                intermediate: 64,
                ..TinyModelSpec::default()
            },
            ..DemoOptions::default()
        },
    )
    .unwrap();
    let run: PathBuf = dir.path().join("run");
    let overrides: Vec<String> = vec![
        format!("data.train_files={}", a.train.display()),
        format!("data.val_files={}", a.eval.display()),
        "data.max_prompt_length=40".into(),
        "data.max_response_length=12".into(),
        "data.rollout_batch_size=2".into(),
        "data.bootstrap=false".into(),
        "algorithm.online_filtering=false".into(),
        format!("worker.actor.model.model_path={}", a.model_dir.display()),
        "worker.actor.global_batch_size=2".into(),
        "worker.actor.micro_batch_size_per_device_for_update=4".into(),
        "worker.rollout.n=4".into(),
        format!("worker.reward.python={python}"),
        "trainer.logger=[console, file, wandb, tensorboard]".into(),
        "trainer.project_name=proj".into(),
        "trainer.experiment_name=exp".into(),
        format!("trainer.save_checkpoint_path={}", run.display()),
        "trainer.max_steps=2".into(),
        "trainer.val_freq=1".into(),
        "trainer.val_generations_to_log=2".into(),
    ];
    let cfg = Config::load(None, &overrides).unwrap();
    let mut t = Trainer::new(cfg, CpuBackend, Arc::new(AtomicBool::new(false))).unwrap();
    let summary = t.run().unwrap();
    let lines: Vec<Map<String, Value>> = read_metrics(&summary.metrics).unwrap();
    let want = |step: usize, key: &str| lines[step - 1][key].as_f64().unwrap();

    let tb = python_json(&python, READ_TENSORBOARD, &run.join("tensorboard/proj/exp"));
    for key in ["reward/mean", "actor/pg_loss", "response_length/mean"] {
        let series = tb[key]
            .as_array()
            .unwrap_or_else(|| panic!("no {key} in {tb}"));
        assert_eq!(series.len(), 2, "{key}: {series:?}");
        for (i, point) in series.iter().enumerate() {
            assert_eq!(point[0].as_u64(), Some(i as u64 + 1));
            // TensorBoard keeps f32
            let got = point[1].as_f64().unwrap();
            assert!((got - want(i + 1, key)).abs() <= 1e-6 * want(i + 1, key).abs().max(1.0));
        }
    }

    let rows = python_json(&python, READ_WANDB, &run);
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(row["_step"].as_u64(), Some(i as u64 + 1));
        assert_eq!(
            row["reward/mean"].as_f64(),
            Some(want(i + 1, "reward/mean"))
        );
        assert!(row.get("step").is_none(), "the step is wandb's own");
        assert!(row["eval/accuracy/all"].is_number(), "{row:?}");
        // the validation generations, as a wandb table
        assert_eq!(row["val/generations/_type"], "table-file", "{row:?}");
        assert_eq!(row["val/generations/nrows"], 2, "{row:?}");
    }
}
