//! Python reward functions in EasyR1's interface through ares-runner's worker process
//! (`worker.reward.reward_function`): the inputs and keyword arguments they see, batch and
//! sequential calls, the ARES fields giving the built-in shaping's rewards, and a clear
//! error for each way a function can go wrong. Skipped where `python3` is missing (CI has
//! it).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ares_core::difficulty::{Difficulty, PerBucket};
use ares_core::shaping::{ShapingConfig, entropy_reward};
use ares_runner::reward::{CallMode, PythonWorker, RewardError, RewardInput, parse_spec};
use serde_json::{Map, Value, json};

fn has_python() -> bool {
    let ok = Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("python3 not found: skipping");
    }
    ok
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/reward_fn")
        .join(name)
}

fn start(spec: &str, kwargs: Value, mode: Option<CallMode>) -> Result<PythonWorker, RewardError> {
    let kwargs: Map<String, Value> = serde_json::from_value(kwargs).unwrap();
    PythonWorker::start_function(spec, "python3", &kwargs, mode, Duration::from_secs(30))
}

fn spec(file: &str, name: &str) -> String {
    format!("{}:{name}", fixture(file).display())
}

fn input<'a>(response: &'a str, ground_truth: &'a str) -> RewardInput<'a> {
    RewardInput {
        response,
        response_length: response.len(),
        ground_truth,
        accuracy: 1.0,
        difficulty: "easy",
        high_entropy_token_num: 0,
        target_high_entropy_token_num: 0.0,
        alpha_entropy: 0.5,
        entropies: 0.1,
    }
}

fn message(e: RewardError) -> String {
    assert!(matches!(e, RewardError::Function { .. }), "{e:?}");
    e.to_string()
}

#[test]
fn spec_splits_at_the_last_colon_and_defaults_to_main() {
    assert_eq!(
        parse_spec("./r/math.py:compute_score"),
        ("./r/math.py".into(), "compute_score".into())
    );
    assert_eq!(parse_spec("math.py"), ("math.py".into(), "main".into()));
    assert_eq!(parse_spec("a:b/c.py"), ("a:b/c.py".into(), "main".into()));
}

#[test]
fn sequential_function_sees_easyr1_inputs_and_kwargs() {
    if !has_python() {
        return;
    }
    // no mode given: the module's REWARD_TYPE = "sequential" decides
    let mut f = start(&spec("echo_kwargs.py", "main"), json!({"bonus": 0.5}), None).unwrap();
    assert_eq!(f.mode(), CallMode::Sequential);
    let scores = f
        .score(&[input("abc", "12"), input("abcdef", "1")])
        .unwrap();
    assert_eq!(scores[0]["overall"], 3.5);
    assert_eq!(scores[1]["overall"], 6.5);
    assert_eq!(scores[0]["is_dict"], 1.0);
    assert_eq!(scores[0]["ground_truth_len"], 2.0);
    // response, response_length, ground_truth and the six ARES fields
    assert_eq!(scores[0]["keys"], 9.0);
    // the worker stays up between calls
    assert_eq!(f.score(&[input("x", "")]).unwrap()[0]["overall"], 1.5);
    assert!(f.score(&[]).unwrap().is_empty());
}

#[test]
fn ares_fields_give_the_builtin_shaping() {
    if !has_python() {
        return;
    }
    let mut f = start(
        &format!(
            "{}:compute_score",
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../examples/reward_function/ares_entropy_shaping.py")
                .display()
        ),
        json!({}),
        None,
    )
    .unwrap();
    assert_eq!(f.mode(), CallMode::Batch);
    let cfg = ShapingConfig::<f64>::default();
    let targets = PerBucket::new(4.0, 7.0, 12.0);
    let alphas = PerBucket::new(0.5, 0.3, 0.8);
    let mut inputs = Vec::new();
    let mut want = Vec::new();
    for d in Difficulty::ALL {
        for correct in [true, false] {
            for g in [0usize, 3, 4, 6, 9, 15, 30] {
                let mut x = input("r", "a");
                x.accuracy = f64::from(u8::from(correct));
                x.difficulty = d.name();
                x.high_entropy_token_num = g;
                x.target_high_entropy_token_num = targets[d];
                x.alpha_entropy = alphas[d];
                let s = entropy_reward(d, correct, g as f64, targets[d], alphas[d], &cfg).unwrap();
                want.push(x.accuracy + s);
                inputs.push(x);
            }
        }
    }
    let scores = f.score(&inputs).unwrap();
    for (i, (s, w)) in scores.iter().zip(&want).enumerate() {
        assert!(
            (s["overall"] - w).abs() <= 1e-12,
            "sample {i} ({:?}): {} vs {w}",
            inputs[i],
            s["overall"]
        );
    }
}

#[test]
fn every_failure_is_a_clear_error() {
    if !has_python() {
        return;
    }
    let batch = [input("first response", "1"), input("second", "2")];
    let call = |name: &str| {
        let mut f = start(
            &spec("misbehave.py", name),
            json!({}),
            Some(CallMode::Batch),
        )
        .unwrap();
        message(f.score(&batch).unwrap_err())
    };
    let e = call("raises");
    assert!(
        e.contains("raised ZeroDivisionError")
            && e.contains("Python traceback")
            && e.contains("misbehave.py")
            && e.contains("first response"),
        "{e}"
    );
    assert!(call("not_a_list").contains("expected a list of dicts"));
    assert!(call("wrong_count").contains("returned 1 scores for 2 responses"));
    let e = call("no_overall");
    assert!(
        e.contains("no 'overall' key (keys: score)") && e.contains("sample 0"),
        "{e}"
    );
    let e = call("not_a_number");
    assert!(
        e.contains("'label' is str") && e.contains("expected a number"),
        "{e}"
    );
    assert!(call("nan").contains("expected a finite number"));

    // a crash: this call and every later one fail
    let mut f = start(&spec("misbehave.py", "crashes"), json!({}), None).unwrap();
    let e = message(f.score(&batch).unwrap_err());
    assert!(
        e.contains("closed its output") && e.contains("exit status: 7"),
        "{e}"
    );
    assert!(message(f.score(&batch).unwrap_err()).contains("unusable after an earlier failure"));

    // a hang: killed at the timeout
    let kwargs = Map::new();
    let mut f = PythonWorker::start_function(
        &spec("misbehave.py", "hangs"),
        "python3",
        &kwargs,
        None,
        Duration::from_millis(500),
    )
    .unwrap();
    let t = Instant::now();
    let e = message(f.score(&batch).unwrap_err());
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(
        e.contains("no reply within 0.5 s") && e.contains("killed"),
        "{e}"
    );

    // prints of the user's code go to stderr, not into the protocol
    let mut f = start(&spec("misbehave.py", "prints"), json!({}), None).unwrap();
    assert_eq!(f.score(&batch).unwrap()[1]["overall"], 0.5);

    // sequential calls name the sample that raised
    let mut f = start(
        &spec("misbehave.py", "sequential_fails_on_second"),
        json!({}),
        Some(CallMode::Sequential),
    )
    .unwrap();
    let e = message(f.score(&batch).unwrap_err());
    assert!(
        e.contains("cannot grade this one") && e.contains("sample 1") && e.contains("\"second\""),
        "{e}"
    );
    // an exception is an error for its call only
    assert_eq!(f.score(&batch[..1]).unwrap()[0]["overall"], 1.0);
}

#[test]
fn start_errors_name_the_file_and_the_cause() {
    if !has_python() {
        return;
    }
    let e = message(start("/nonexistent/reward.py:f", json!({}), None).unwrap_err());
    assert!(e.contains("/nonexistent/reward.py is not a file"), "{e}");
    let e = message(start(&spec("broken_import.py", "f"), json!({}), None).unwrap_err());
    assert!(e.contains("importing") && e.contains("SyntaxError"), "{e}");
    let e = message(start(&spec("misbehave.py", "missing"), json!({}), None).unwrap_err());
    assert!(
        e.contains("no function 'missing'") && e.contains("raises"),
        "{e}"
    );
    let kwargs = Map::new();
    let e = message(
        PythonWorker::start_function(
            &spec("misbehave.py", "raises"),
            "/nonexistent/python",
            &kwargs,
            None,
            Duration::from_secs(5),
        )
        .unwrap_err(),
    );
    assert!(
        e.contains("cannot start") && e.contains("worker.reward.python"),
        "{e}"
    );
}
