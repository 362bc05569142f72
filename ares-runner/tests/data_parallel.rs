//! Data parallelism with threads as ranks: a run's numbers do not depend on the world size.
//! Worlds of 1, 2 and 4 ranks train the demo's task for three steps (bootstrap, the ARES
//! controllers, the dynamic KL against a reference, two optimizer steps a step in
//! micro-batches); their metrics, checkpoints (weights, optimizer moments, controller
//! state) are the same bytes; a run resumed at another world size equals the straight one.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use ares_runner::backend::cpu::CpuBackend;
use ares_runner::config::Config;
use ares_runner::demo::model::TinyModelSpec;
use ares_runner::demo::{DemoAssets, DemoOptions, write_demo_assets_with};
use ares_runner::metrics::read_metrics;
use ares_runner::parallel::Ranks;
use ares_runner::parallel::threads::ThreadGroup;
use ares_runner::trainer::{RunSummary, TrainError, Trainer};
use serde_json::{Map, Value};

mod common;
use common::{assert_same_files, checkpoint_files, free_port};

fn assets(dir: &Path) -> DemoAssets {
    write_demo_assets_with(
        dir,
        &DemoOptions {
            seed: 5,
            train_per_level: 4,
            eval_per_level: 2,
            sft_examples: 8,
            model: TinyModelSpec {
                hidden: 32,
                layers: 2,
                heads: 2,
                kv_heads: 1,
                intermediate: 64,
                max_positions: 256,
                ..TinyModelSpec::default()
            },
            ..DemoOptions::default()
        },
    )
    .unwrap()
}

/// Four prompts × four samples a step (16 rows); mini-batches of two prompts (8 rows), so
/// two optimizer steps a step, each over four micro-batches of two rows.
fn config(a: &DemoAssets, run: &Path, overrides: &[&str]) -> Config {
    let base = format!(
        "\
data:
  train_files: {train}
  val_files: {val}
  max_prompt_length: 40
  max_response_length: 10
  rollout_batch_size: 4
  bootstrap: true
algorithm:
  online_filtering: false
  kl_type: dual_ascent
worker:
  actor:
    model: {{model_path: {model}}}
    global_batch_size: 2
    micro_batch_size_per_device_for_update: 2
    optim: {{lr: 1.0e-3}}
  rollout:
    n: 4
trainer:
  save_checkpoint_path: {run}
  max_steps: 3
  save_freq: 0
  logger: [file]
",
        train = a.train.display(),
        val = a.eval.display(),
        model = a.model_dir.display(),
        run = run.display()
    );
    let path = run.with_extension("yaml");
    std::fs::create_dir_all(run.parent().unwrap()).unwrap();
    std::fs::write(&path, base).unwrap();
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    Config::load(Some(&path), &overrides).unwrap()
}

/// Runs `cfg` at `world` ranks (threads); every rank's summary.
fn run_world(cfg: &Config, world: usize) -> Vec<Result<RunSummary, TrainError>> {
    run_world_with(cfg, world)
        .into_iter()
        .map(|r| r.map(|(s, _)| s))
        .collect()
}

/// [`run_world`], with the optimizer-state bytes each rank held.
fn run_world_with(cfg: &Config, world: usize) -> Vec<Result<(RunSummary, u64), TrainError>> {
    let ranks = ThreadGroup::ranks(world, Duration::from_secs(120));
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|rank| {
                let cfg = cfg.clone();
                s.spawn(move || {
                    let mut t = Trainer::new(cfg, CpuBackend, Arc::new(AtomicBool::new(false)))?;
                    // rollout chunks of four sequences: four chunks a step to share out
                    t.settings.rollout_chunk = 4;
                    t.join(Ranks::new(Arc::new(rank)))?;
                    let bytes = t.optimizer_state_bytes();
                    Ok((t.run()?, bytes))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A run's metrics lines and checkpoint files.
type Outcome = (Vec<Map<String, Value>>, Vec<(String, Vec<u8>)>);

/// The metrics of `path` that do not depend on the wall clock.
fn metrics(path: &Path) -> Vec<Map<String, Value>> {
    common::deterministic(read_metrics(path).unwrap())
}

/// One world's run: its metrics and final checkpoint's files (from rank 0), after
/// checking every rank ended well and pointed at the same checkpoint.
fn outcome(dir: &Path, a: &DemoAssets, world: usize) -> Outcome {
    outcome_with(dir, a, world, &[]).0
}

/// [`outcome`] with `overrides`, and the optimizer-state bytes each rank held.
fn outcome_with(
    dir: &Path,
    a: &DemoAssets,
    world: usize,
    overrides: &[&str],
) -> (Outcome, Vec<u64>) {
    let run = dir.join(format!("world{world}-{}", overrides.join("-")));
    let (summaries, bytes): (Vec<RunSummary>, Vec<u64>) =
        run_world_with(&config(a, &run, overrides), world)
            .into_iter()
            .map(Result::unwrap)
            .unzip();
    let checkpoint: PathBuf = summaries[0].checkpoint.clone().expect("a checkpoint");
    for s in &summaries {
        assert_eq!(s.steps, 3);
        assert_eq!(s.checkpoint.as_ref(), Some(&checkpoint));
    }
    (
        (
            metrics(&summaries[0].metrics),
            checkpoint_files(&checkpoint),
        ),
        bytes,
    )
}

#[test]
fn worlds_of_one_two_and_four_give_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let (m1, c1) = outcome(dir.path(), &a, 1);
    assert_eq!(m1.len(), 3);
    assert!(
        c1.iter().any(|(n, _)| n.ends_with("model.safetensors")),
        "{:?}",
        c1.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    // the run learned: two optimizer steps a step, none skipped
    assert!(
        m1[2]["actor/grad_norm"].as_f64().unwrap() > 0.0,
        "{:?}",
        m1[2]
    );
    assert_eq!(m1[2]["actor/skipped_updates"].as_f64(), Some(0.0));
    let state = &c1
        .iter()
        .find(|(n, _)| n == "trainer_state.json")
        .expect("a trainer state")
        .1;
    let state: Value = serde_json::from_slice(state).unwrap();
    assert_eq!(state["optimizer_steps"], 6, "{state}");
    for world in [2, 4] {
        let (m, c) = outcome(dir.path(), &a, world);
        assert_eq!(m, m1, "world {world}: metrics");
        assert_same_files(&c, &c1, &format!("world {world}"));
    }
}

/// Gradients stored in bf16 on ranks: each micro-batch's stochastic rounding is keyed by
/// the micro-batch (not by the rank that runs it), and the ranks' sums are made in f32 from
/// the widened values and rounded once to nearest. So with `gradient_sum: slices` the run
/// is the same bits at any world size; with `ranks` a world of one is the run without
/// ranks, and the sums overlapped with the backward or reduce-scattered (ZeRO-1) are the
/// bits of the plain sum after it. The setting changes the run (it is not f32 unseen).
#[test]
fn bf16_gradients_sum_over_ranks_as_on_one() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let g16 = "trainer.grad_dtype=bf16";
    let ((m1, c1), _) = outcome_with(dir.path(), &a, 1, &[g16]);
    let (f32s, _) = outcome(dir.path(), &a, 1);
    assert_ne!(m1, f32s, "bf16 gradients change the run");
    assert!(
        m1[2]["actor/grad_norm"].as_f64().unwrap() > 0.0,
        "{:?}",
        m1[2]
    );
    for world in [2, 3] {
        let ((m, c), _) = outcome_with(dir.path(), &a, world, &[g16]);
        assert_eq!(m, m1, "slices, world {world}: metrics");
        assert_same_files(&c, &c1, &format!("slices, world {world}"));
    }

    let sum = "trainer.gradient_sum=ranks";
    let plain_run = dir.path().join("plain16");
    let mut t = Trainer::new(
        config(&a, &plain_run, &[g16]),
        CpuBackend,
        Arc::new(AtomicBool::new(false)),
    )
    .unwrap();
    t.settings.rollout_chunk = 4;
    let s = t.run().unwrap();
    let plain = (
        metrics(&s.metrics),
        checkpoint_files(&s.checkpoint.unwrap()),
    );
    let ((one, c_one), _) = outcome_with(dir.path(), &a, 1, &[g16, sum]);
    assert_eq!(one, plain.0, "ranks, a world of one: metrics");
    assert_same_files(&c_one, &plain.1, "ranks, a world of one");

    let after = ["trainer.zero_stage=0", "trainer.overlap_gradient_sum=false"];
    let ((want, c_want), _) = outcome_with(dir.path(), &a, 2, &[g16, sum, after[0], after[1]]);
    for (zero, overlap) in [
        ("trainer.zero_stage=0", "trainer.overlap_gradient_sum=true"),
        ("trainer.zero_stage=1", "trainer.overlap_gradient_sum=false"),
        ("trainer.zero_stage=1", "trainer.overlap_gradient_sum=true"),
    ] {
        let ((m, c), _) = outcome_with(dir.path(), &a, 2, &[g16, sum, zero, overlap]);
        let what = format!("ranks, world 2, {zero}, {overlap}");
        assert_eq!(m, want, "{what}: metrics");
        assert_same_files(&c, &c_want, &what);
    }
    // through the host the linear layers' gradients travel as the bf16 values they are:
    // 2 bytes a value where f32 gradients take 4
    let sent = |overrides: &[&str]| -> f64 {
        let run = dir.path().join(format!("sent-{}", overrides.join("-")));
        let s = run_world(&config(&a, &run, overrides), 2);
        let lines = read_metrics(&s[0].as_ref().unwrap().metrics).unwrap();
        lines
            .iter()
            .map(|l| l["perf/collective_bytes_sent"].as_f64().unwrap())
            .sum()
    };
    let b16 = sent(&[g16, sum, after[0], after[1]]);
    let b32 = sent(&[sum, after[0], after[1]]);
    // (0.84× here: the rollout's exchanges and the f32 gradients — embedding, norms —
    // are unchanged)
    assert!(b16 < 0.9 * b32, "bf16 {b16} vs f32 {b32}");
}

/// ZeRO-1: each rank holds the moments of its share of the weights (together, all of
/// them once), and the run is the unsharded one's to the bit — f32, bf16 and 8-bit moments,
/// and linear weights stored in bf16 (their stochastic rounding keyed by tensor, never by
/// rank; the updated weights cross the ranks as bf16 values), the checkpoint's optimizer
/// file whole.
#[test]
fn zero_1_shards_the_moments_and_changes_no_bit() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    for (dtype, base) in [
        (
            "f32",
            [
                "worker.actor.optim.state_dtype=f32",
                "trainer.precision=f32",
            ],
        ),
        (
            "int8",
            [
                "worker.actor.optim.state_dtype=int8",
                "trainer.precision=f32",
            ],
        ),
        // rounded stochastically, keyed by tensor and step, never by rank
        (
            "bf16 moments",
            [
                "worker.actor.optim.state_dtype=bf16",
                "trainer.precision=f32",
            ],
        ),
        (
            "bf16 weights",
            [
                "worker.actor.optim.state_dtype=int8",
                "trainer.precision=bf16",
            ],
        ),
    ] {
        let (want, full) = outcome_with(dir.path(), &a, 1, &base);
        for world in [2, 4] {
            let zero = [base[0], base[1], "trainer.zero_stage=1"];
            let (got, held) = outcome_with(dir.path(), &a, world, &zero);
            assert_eq!(got.0, want.0, "{dtype} world {world}: metrics");
            assert_same_files(&got.1, &want.1, &format!("{dtype} world {world}"));
            assert_eq!(
                held.iter().sum::<u64>(),
                full[0],
                "{dtype} world {world}: {held:?}"
            );
            assert!(
                held.iter().all(|&h| h < full[0]),
                "{dtype} world {world}: {held:?}"
            );
        }
    }
    // the ranks' accumulated gradients, reduce-scattered to each buffer's owner: the bits
    // of the all-reduced run at the same world
    let sum = "trainer.gradient_sum=ranks";
    for world in [2, 3] {
        let (want, _) = outcome_with(dir.path(), &a, world, &[sum]);
        let (got, _) = outcome_with(dir.path(), &a, world, &[sum, "trainer.zero_stage=1"]);
        assert_eq!(got.0, want.0, "ranks world {world}: metrics");
        assert_same_files(&got.1, &want.1, &format!("ranks world {world}"));
    }
}

/// `trainer.gradient_sum: ranks`: a world of one is a run without ranks to the bit; more
/// ranks add their accumulated gradients (one a rank, fewer bytes than every slice) and
/// agree with it to rounding — the first step's rollout and rewards exactly, the updates'
/// metrics to f32 noise.
#[test]
fn summing_the_ranks_gradients_is_the_plain_run_at_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let plain_run = dir.path().join("plain");
    let mut t = Trainer::new(
        config(&a, &plain_run, &[]),
        CpuBackend,
        Arc::new(AtomicBool::new(false)),
    )
    .unwrap();
    t.settings.rollout_chunk = 4;
    let s = t.run().unwrap();
    let plain = (
        metrics(&s.metrics),
        checkpoint_files(&s.checkpoint.unwrap()),
    );
    let sum = "trainer.gradient_sum=ranks";
    let (one, _) = outcome_with(dir.path(), &a, 1, &[sum]);
    assert_eq!(one.0, plain.0, "a world of one: metrics");
    assert_same_files(&one.1, &plain.1, "a world of one");
    let sent = |world: usize, how: &str| -> f64 {
        let run = dir.path().join(format!("bytes{world}{how}"));
        let s = run_world(
            &config(&a, &run, &[&format!("trainer.gradient_sum={how}")]),
            world,
        );
        let lines = read_metrics(&s[0].as_ref().unwrap().metrics).unwrap();
        lines
            .iter()
            .map(|l| l["perf/collective_bytes_sent"].as_f64().unwrap())
            .sum()
    };
    for world in [2, 4] {
        let ((m, _), _) = outcome_with(dir.path(), &a, world, &[sum]);
        for (step, (x, y)) in one.0.iter().zip(&m).enumerate() {
            for (k, v) in x {
                let (p, q) = (v.as_f64(), y[k].as_f64());
                let close = match (p, q) {
                    (Some(p), Some(q)) => (p - q).abs() <= 1e-3 * p.abs().max(1e-2),
                    _ => v == &y[k],
                };
                // the first step's rollout and rewards come before any update; its second
                // mini-batch already sees the first one's rounding
                let exact = step == 0 && !k.starts_with("actor/");
                assert!(
                    if exact { v == &y[k] } else { close },
                    "world {world} step {}: {k}: {v} vs {}",
                    step + 1,
                    y[k]
                );
            }
        }
    }
    // two micro-batches a rank at world 2: the slices send twice what the sums do
    let (slices, sums) = (sent(2, "slices"), sent(2, "ranks"));
    assert!(
        sums < 0.7 * slices,
        "bytes sent: slices {slices}, ranks {sums}"
    );
}

/// `trainer.overlap_gradient_sum: true`: with `gradient_sum: ranks` each decoder
/// layer's sum over the ranks starts in the rank's last backward, as soon as the layer is
/// done, and the run is the bits of summing after the backward — with ZeRO-1's
/// reduce-scatter too, and at a world where a rank has no micro-batch (five ranks, four
/// micro-batches a mini-batch: its zeros join each sum).
#[test]
fn overlapping_the_gradient_sum_with_the_backward_changes_no_bit() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let sum = "trainer.gradient_sum=ranks";
    let overlapped = |world: usize, zero: &str, on: Option<bool>| {
        let how = on.map_or("trainer.overlap_gradient_sum=null".into(), |on| {
            format!("trainer.overlap_gradient_sum={on}")
        });
        let run = dir.path().join(format!("w{world}-{zero}-{on:?}"));
        let cfg = config(&a, &run, &[sum, zero, &how]);
        let summaries: Vec<RunSummary> = run_world(&cfg, world)
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let lines = read_metrics(&summaries[0].metrics).unwrap();
        let ops: Vec<f64> = lines
            .iter()
            .map(|l| l["perf/collective_overlapped_ops"].as_f64().unwrap())
            .collect();
        let checkpoint = summaries[0].checkpoint.clone().unwrap();
        (
            metrics(&summaries[0].metrics),
            checkpoint_files(&checkpoint),
            ops,
        )
    };
    for world in [2, 5] {
        for zero in ["trainer.zero_stage=0", "trainer.zero_stage=1"] {
            let (m_on, c_on, ops_on) = overlapped(world, zero, Some(true));
            let (m_off, c_off, ops_off) = overlapped(world, zero, Some(false));
            let what = format!("world {world}, {zero}");
            assert_eq!(m_on, m_off, "{what}: metrics");
            assert_same_files(&c_on, &c_off, &what);
            // rank 0 runs micro-batch 0 of each mini-batch last or not, and hands both
            // layers over during its backward: two mini-batches a step
            assert_eq!(ops_on, vec![4.0; 3], "{what}: overlapped sums");
            assert_eq!(ops_off, vec![0.0; 3], "{what}: none without the overlap");
        }
    }
    // by default, off through the host (threads here)
    let (_, _, ops) = overlapped(2, "trainer.zero_stage=0", None);
    assert_eq!(ops, vec![0.0; 3], "the default through the host");
}

#[test]
fn a_run_resumes_exactly_at_another_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let straight = dir.path().join("straight");
    let s = run_world(&config(&a, &straight, &[]), 2).remove(0).unwrap();
    let want = (
        metrics(&s.metrics),
        checkpoint_files(&s.checkpoint.unwrap()),
    );
    // (world, ZeRO stage) before and after the resume
    for ((first, z1), (second, z2)) in [
        ((2, 0), (1, 0)),
        ((1, 0), (2, 0)),
        ((2, 1), (1, 0)),
        ((1, 0), (4, 1)),
    ] {
        let run = dir.path().join(format!("from{first}z{z1}to{second}z{z2}"));
        let zero = |z: u8| format!("trainer.zero_stage={z}");
        let part = run_world(
            &config(
                &a,
                &run,
                &["trainer.max_steps=2", "trainer.save_freq=2", &zero(z1)],
            ),
            first,
        );
        assert_eq!(part[0].as_ref().unwrap().steps, 2);
        let resume = config(&a, &run, &["trainer.find_last_checkpoint=true", &zero(z2)]);
        let s = run_world(&resume, second).remove(0).unwrap();
        let got = (
            metrics(&s.metrics),
            checkpoint_files(&s.checkpoint.unwrap()),
        );
        assert_eq!(got.0, want.0, "{first} → {second}: metrics");
        assert_same_files(&got.1, &want.1, &format!("{first} → {second}"));
    }
}

/// Runs `cfg` at a world of two threads with rank 1 broken by `break_it`: each rank's
/// outcome (`finished` or its error's message).
fn run_with_rank_1_broken(
    cfg: &Config,
    break_it: impl Fn(&mut Trainer<CpuBackend>) + Sync,
) -> Vec<String> {
    let ranks = ThreadGroup::ranks(2, Duration::from_secs(60));
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|rank| {
                let (cfg, break_it) = (cfg.clone(), &break_it);
                s.spawn(move || {
                    let mut t =
                        Trainer::new(cfg, CpuBackend, Arc::new(AtomicBool::new(false))).unwrap();
                    if rank_index(&rank) == 1 {
                        break_it(&mut t);
                    }
                    t.settings.rollout_chunk = 4;
                    t.join(Ranks::new(Arc::new(rank))).unwrap();
                    match t.run() {
                        Ok(_) => "finished".to_string(),
                        Err(e) => e.to_string(),
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_failing_rank_stops_every_rank_with_its_message() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let cfg = config(&a, &dir.path().join("run"), &[]);
    // rank 1 is broken: its rollout cannot fit a response
    let results = run_with_rank_1_broken(&cfg, |t| t.settings.max_new_tokens = 100_000);
    assert!(results[0].starts_with("rank 1 failed: unit"), "{results:?}");
    assert!(!results[1].contains("rank 1 failed"), "{results:?}");
    assert_ne!(results[1], "finished");
}

/// A rank whose micro-batch fails while the gradient sum is overlapped with the backward
/// still completes the sum (its other ranks are summing its layers), then reports: every
/// rank stops with its message, none waits for the timeout.
#[test]
fn a_rank_failing_in_an_overlapped_update_stops_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let overrides = [
        "trainer.gradient_sum=ranks",
        "trainer.overlap_gradient_sum=true",
    ];
    let cfg = config(&a, &dir.path().join("run"), &overrides);
    let started = std::time::Instant::now();
    // rank 1's policy loss refuses its clip: its first micro-batch fails
    let results = run_with_rank_1_broken(&cfg, |t| t.settings.policy.clip.clip_ratio_low = -1.0);
    assert!(results[0].starts_with("rank 1 failed: unit"), "{results:?}");
    assert!(results[0].contains("clip"), "{results:?}");
    assert!(results[1].contains("clip"), "{results:?}");
    assert!(started.elapsed() < Duration::from_secs(50), "{results:?}");
}

fn rank_index(r: &ares_runner::parallel::threads::ThreadRank) -> usize {
    use ares_runner::parallel::Collective;
    r.rank()
}

/// `ares-runner train -c <cfg>` as rank `rank` of `world` launched the torchrun way
/// (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), started.
fn spawn_rank(cfg: &Path, rank: usize, world: usize, port: &str) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_ares-runner"))
        .args(["train", "--device", "cpu", "-c"])
        .arg(cfg)
        .arg("trainer.logger=[console,file]")
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port)
        .env("ARES_COLLECTIVE_TIMEOUT", "60")
        .env("ARES_NO_PROGRESS", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// `world` ranks of `cfg` meeting over TCP on this machine; each process's output.
fn launch(cfg: &Path, world: usize) -> Vec<std::process::Output> {
    let port = free_port();
    let children: Vec<_> = (0..world)
        .map(|r| spawn_rank(cfg, r, world, &port))
        .collect();
    children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

#[test]
fn processes_launched_like_torchrun_equal_threads_and_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let mut outcomes = Vec::new();
    // the third: two processes under ZeRO-1, the gradients reduce-scattered through rank 0
    for (world, zero) in [(1, 0), (2, 0), (2, 1)] {
        let run = dir.path().join(format!("procs{world}z{zero}"));
        config(&a, &run, &[&format!("trainer.zero_stage={zero}")]);
        let outs = launch(&run.with_extension("yaml"), world);
        for (rank, o) in outs.iter().enumerate() {
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(o.status.success(), "world {world} rank {rank}: {err}");
            assert!(err.contains(&format!("rank {rank} of {world}")), "{err}");
            // one set of step lines: rank 0's
            assert_eq!(err.contains("step 1/3"), rank == 0, "rank {rank}: {err}");
        }
        let ck = run.join("checkpoints");
        let latest = std::fs::read_dir(&ck)
            .unwrap()
            .map(|e| e.unwrap().path())
            .max()
            .unwrap();
        outcomes.push((
            metrics(&run.join("metrics.jsonl")),
            checkpoint_files(&latest),
        ));
    }
    for (i, o) in outcomes.iter().enumerate().skip(1) {
        assert_eq!(o.0, outcomes[0].0, "metrics of launch {i}");
        assert_same_files(&o.1, &outcomes[0].1, &format!("processes, launch {i}"));
    }
}

#[test]
fn bad_launch_environments_fail_with_what_to_set() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let run = dir.path().join("run");
    config(&a, &run, &[]);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ares-runner"))
        .args(["train", "--device", "cpu", "-c"])
        .arg(run.with_extension("yaml"))
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", "0")
        .env_remove("MASTER_ADDR")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("MASTER_ADDR is not set"), "{err}");
    // a transport that does not exist
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ares-runner"))
        .args(["train", "--device", "cpu", "-c"])
        .arg(run.with_extension("yaml"))
        .env("RANK", "0")
        .env("WORLD_SIZE", "1")
        .env("LOCAL_RANK", "0")
        .env("ARES_TRANSPORT", "carrier-pigeon")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ARES_TRANSPORT=\"carrier-pigeon\""), "{err}");
    // two ranks that disagree on the world size
    let port = free_port();
    let cfg = run.with_extension("yaml");
    let (r0, r1) = (spawn_rank(&cfg, 0, 2, &port), spawn_rank(&cfg, 1, 3, &port));
    let (o0, o1) = (
        r0.wait_with_output().unwrap(),
        r1.wait_with_output().unwrap(),
    );
    assert!(!o0.status.success() && !o1.status.success());
    let e0 = String::from_utf8_lossy(&o0.stderr);
    assert!(e0.contains("rank 1 says the world has 3 ranks"), "{e0}");
}
