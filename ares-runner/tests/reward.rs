//! Rewards end to end: math grading of whole responses, the format reward, the keyword
//! grader on the rubric fixture, and the external grader command (JSON lines over
//! stdin/stdout) with scripts run by `sh` and `python3`.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use ares_runner::data::{Criterion, DataKeys, load_dataset};
use ares_runner::reward::{
    CommandGrader, KeywordGrader, RewardError, RubricGrader, format_reward, grade_math,
    rubric_reward, rubric_score,
};

fn crit(text: &str, points: f64) -> Criterion {
    Criterion {
        criterion: text.into(),
        points,
        keywords: vec![],
        regex: None,
    }
}

#[test]
fn math_grading_of_responses() {
    let cases = [
        (
            r"<think>6*7=42</think> So the answer is $\boxed{42}$.",
            "42",
            true,
        ),
        (
            r"<think>…</think> \boxed{\dfrac{3}{4}}",
            r"\frac{3}{4}",
            true,
        ),
        (r"\boxed{0.75}", r"\frac{3}{4}", true),
        (r"\boxed{\left(1, -\frac{1}{2}\right)}", "(1,-0.5)", true),
        (r"\boxed{x = -1}", "-1", true),
        (r"\boxed{\text{18 dollars}}", "18", false),
        (r"\boxed{42} wait, no: \boxed{41}", "42", false),
        (r"The answer is 42.", "42", false),
        (r"\boxed{42", "42", false),
        (r"\boxed{-42}", "42", false),
    ];
    for (response, truth, want) in cases {
        let g = grade_math(response, truth);
        assert_eq!(g.correct, want, "{response} vs {truth}: {g:?}");
    }
}

#[test]
fn format_reward_of_responses() {
    assert_eq!(format_reward(r"<think>a</think> \boxed{1}"), 1.0);
    assert_eq!(format_reward(r"\boxed{1}"), 1.0);
    assert_eq!(format_reward(r"<think>a \boxed{1}"), 0.0);
    assert_eq!(format_reward("1"), 0.0);
}

#[test]
fn keyword_grader_on_the_rubric_fixture() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data/rubrics.jsonl");
    let ex = load_dataset(&path, &DataKeys::default()).unwrap();
    let mut g = KeywordGrader::new();
    let c = &ex[0].rubrics;
    KeywordGrader::check(c).unwrap();
    let q = ex[0].prompt.question();
    let good = "Probably a viral infection; rest and drink fluids.";
    assert_eq!(g.grade(q, good, c).unwrap(), [true, true, false]);
    assert_eq!(rubric_reward(&mut g, q, good, c).unwrap(), 1.0);
    let bad = "Take antibiotics.";
    // −2 / (8 + 6)
    assert!((rubric_reward(&mut g, q, bad, c).unwrap() + 2.0 / 14.0).abs() < 1e-15);
    let c = &ex[1].rubrics;
    assert_eq!(
        g.grade("", "Plants turn light into sugar using chlorophyll.", c)
            .unwrap(),
        [true, true]
    );
    assert_eq!(g.grade("", "Chlorophyll.", c).unwrap(), [false, false]);
}

fn has(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A judge in Python: a criterion is met iff its text's first word occurs in the response;
/// it echoes what it was sent so the request can be checked.
const JUDGE: &str = r#"
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    met = [c["criterion"].split()[0].lower() in r["response"].lower() for c in r["criteria"]]
    print(json.dumps({"met": met, "echo": r}), flush=True)
"#;

#[test]
fn command_grader_with_a_python_judge() {
    if !has("python3") {
        eprintln!("python3 not found: skipping the python judge test");
        return;
    }
    let command = format!("python3 -c '{JUDGE}'");
    let mut g = CommandGrader::spawn(&command).unwrap();
    let c = [
        crit("Sunlight is mentioned", 5.0),
        crit("Chlorophyll named", 3.0),
        crit("Wrong claim", -2.0),
    ];
    let met = g
        .grade(
            "Explain \"photosynthesis\".",
            "sunlight → sugar\nvia chlorophyll",
            &c,
        )
        .unwrap();
    assert_eq!(met, [true, true, false]);
    // several calls on one process
    for _ in 0..3 {
        assert_eq!(g.grade("q", "wrong", &c).unwrap(), [false, false, true]);
    }
    // (5 + 3) / 8
    assert_eq!(
        rubric_reward(&mut g, "q", "sunlight chlorophyll", &c).unwrap(),
        1.0
    );
    assert_eq!(rubric_score(&c, &[false, false, true]).unwrap(), -0.25);
    assert_eq!(g.grade("q", "x", &[]).unwrap(), Vec::<bool>::new());
}

#[test]
fn command_grader_request_format() {
    if !has("python3") {
        eprintln!("python3 not found: skipping the request format test");
        return;
    }
    // replies with the request's shape: keys of the request and of each criterion
    let script = r#"
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    ok = sorted(r) == ["criteria", "prompt", "response"] and r["prompt"] == "P \"q\"" \
        and r["response"] == "R\nline" \
        and all(sorted(c) == ["criterion", "points"] for c in r["criteria"]) \
        and [c["points"] for c in r["criteria"]] == [1.5, -2.0] \
        and r["criteria"][0]["criterion"] == "first"
    print(json.dumps({"met": [ok, ok]}), flush=True)
"#;
    let mut g = CommandGrader::spawn(&format!("python3 -c '{script}'")).unwrap();
    let c = [crit("first", 1.5), crit("second", -2.0)];
    assert_eq!(g.grade("P \"q\"", "R\nline", &c).unwrap(), [true, true]);
}

fn command_error(e: RewardError) -> String {
    assert!(matches!(e, RewardError::Command { .. }), "{e:?}");
    e.to_string()
}

#[test]
fn command_grader_errors() {
    let c = [crit("a", 1.0), crit("b", 2.0)];

    // wrong number of verdicts: an error for the call, the grader stays usable
    let cmd = r#"sh -c 'while read line; do echo "{\"met\": [true]}"; done'"#;
    let mut g = CommandGrader::spawn(cmd).unwrap();
    let e = command_error(g.grade("q", "r", &c).unwrap_err());
    assert!(
        e.contains(cmd) && e.contains("replied 1 verdicts for 2 criteria"),
        "{e}"
    );
    assert_eq!(g.grade("q", "r", &c[..1]).unwrap(), [true]);

    // malformed replies (blank lines are skipped)
    let cmd = r#"sh -c 'while read line; do echo; echo "met: yes"; done'"#;
    let mut g = CommandGrader::spawn(cmd).unwrap();
    let e = command_error(g.grade("q", "r", &c).unwrap_err());
    assert!(
        e.contains("expected one line {\"met\"") && e.contains("got `met: yes`"),
        "{e}"
    );
    let cmd = r#"sh -c 'while read line; do echo "{\"met\": [1, 0]}"; done'"#;
    let e = command_error(
        CommandGrader::spawn(cmd)
            .unwrap()
            .grade("q", "r", &c)
            .unwrap_err(),
    );
    assert!(e.contains("expected one line"), "{e}");

    // the process exits after reading: the call fails and so does every later one
    let cmd = "sh -c 'read line; exit 3'";
    let mut g = CommandGrader::spawn(cmd).unwrap();
    let e = command_error(g.grade("q", "r", &c).unwrap_err());
    assert!(
        e.contains("closed its output without replying") && e.contains("exit status: 3"),
        "{e}"
    );
    let e = command_error(g.grade("q", "r", &c).unwrap_err());
    assert!(e.contains("unusable after an earlier failure"), "{e}");

    // a process that exited before the request
    let mut g = CommandGrader::spawn("true").unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let e = command_error(g.grade("q", "r", &c).unwrap_err());
    assert!(e.contains("`true`"), "{e}");

    // a timeout stops the process
    let mut g = CommandGrader::spawn("sh -c 'read line; sleep 30'")
        .unwrap()
        .with_timeout(Duration::from_millis(200));
    let t = Instant::now();
    let e = command_error(g.grade("q", "r", &c).unwrap_err());
    assert!(
        e.contains("no reply within 0.2 s") && e.contains("killed"),
        "{e}"
    );
    assert!(t.elapsed() < Duration::from_secs(10));

    // cannot start
    for (cmd, want) in [
        ("", "empty command"),
        ("   ", "empty command"),
        ("judge 'unclosed", "unbalanced quotes"),
        (
            "/nonexistent/judge --x",
            "cannot start `/nonexistent/judge`",
        ),
    ] {
        let e = command_error(CommandGrader::spawn(cmd).unwrap_err());
        assert!(e.contains(want), "{cmd}: {e}");
    }
}

#[test]
fn dropping_a_grader_ends_its_process() {
    // `cat` answers nothing but exits when its stdin closes
    let t = Instant::now();
    drop(CommandGrader::spawn("cat").unwrap());
    // a grader that ignores EOF is killed after the grace period
    drop(CommandGrader::spawn("sh -c 'trap \"\" TERM; sleep 30'").unwrap());
    assert!(t.elapsed() < Duration::from_secs(10));
}

/// A helper that writes a line longer than 64 MiB gets an error, not an ever-growing buffer.
#[test]
fn an_endless_line_of_output_is_an_error() {
    if !has("python3") {
        eprintln!("python3 not found: skipping");
        return;
    }
    let script = "import sys, time\nsys.stdin.readline()\nsys.stdout.write('x' * (65 << 20))\nsys.stdout.flush()\ntime.sleep(30)";
    let mut g = CommandGrader::spawn(&format!("python3 -c \"{script}\"")).unwrap();
    let t = Instant::now();
    let e = command_error(g.grade("q", "r", &[crit("a", 1.0)]).unwrap_err());
    assert!(e.contains("longer than 64 MiB"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
}
