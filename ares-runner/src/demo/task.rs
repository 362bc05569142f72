//! The demo's task: small integer arithmetic whose answer is checked exactly, in three
//! difficulty levels, with worked solutions that carry optional redundant verification lines.
//!
//! **Problems** (the prompt is the bare expression, operands in `1..=9` unless stated):
//!
//! | level | kinds (weight within the level) | steps |
//! |---|---|---|
//! | easy | `a+b`, `a` in `1..=29`, `b` in `1..=9` (261 prompts) | 1 |
//! | medium | `a+b+c` (729) ×3, `a*b` with `a, b` in `2..=9` (64) ×1 | 2 / 1 |
//! | hard | `a+b+c+d` (6561) ×1, `(a+b)*c` with `c` in `2..=9` (648) ×1 | 3 / 2 |
//!
//! **Worked solution**: one line per step in evaluation order (`x+y=z`, `x*y=z`), then the
//! answer as `\boxed{z}`. `redundancy` extra lines `check …` each restate one step in
//! another true form (`y+x=z`, `z-y=x`, `z-x=y`; for products `y*x=z`, `z/y=x`, `z/x=y`)
//! and are placed right after the step they check: reasoning that adds length and
//! decision points but no information, which a length- or entropy-shaped reward can teach the
//! model to drop. Example, `(3+4)*5` with one check:
//!
//! ```text
//! 3+4=7
//! check 7-4=3
//! 7*5=35
//! \boxed{35}
//! ```
//!
//! **Splits**: every prompt belongs to exactly one split, fixed by a hash of its text (a
//! quarter of the prompts are [`Split::Eval`]), so train and eval sets never share a problem
//! whatever the seeds, and SFT data is drawn from the train split only.

use std::fmt;
use std::path::Path;

use rand_chacha::rand_core::Rng;
use serde_json::json;

use super::error::DemoError;
use super::rng::{self, Stream};

/// Most verification lines an SFT solution gets (drawn uniformly from `0..=MAX_REDUNDANCY`).
pub const MAX_REDUNDANCY: usize = 3;
/// Longest prompt of the task, in characters (`(9+9)*9`, `9+9+9+9`).
pub const MAX_PROMPT_CHARS: usize = 7;
/// Longest worked solution at redundancy [`MAX_REDUNDANCY`], in characters (`9+9+9+9`; one
/// character is one token of the demo tokenizer, so add one for the end-of-turn token).
pub const MAX_RESPONSE_CHARS: usize = 75;

/// Difficulty level of a problem (the dataset's `difficulty` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Level {
    /// One addition.
    Easy,
    /// Two additions or one product.
    Medium,
    /// Three additions, or an addition then a product.
    Hard,
}

impl Level {
    /// Every level, easiest first.
    pub const ALL: [Level; 3] = [Level::Easy, Level::Medium, Level::Hard];

    /// `"easy"`, `"medium"` or `"hard"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Easy => "easy",
            Level::Medium => "medium",
            Level::Hard => "hard",
        }
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which dataset a prompt belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    /// Training prompts (RL and SFT); three quarters of each kind.
    Train,
    /// Held-out prompts for evaluation; a quarter of each kind.
    Eval,
}

impl Split {
    /// `"train"` or `"eval"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Eval => "eval",
        }
    }

    /// The split of `prompt`: [`Split::Eval`] when a 64-bit hash of its bytes (FNV-1a, then
    /// the SplitMix64 finaliser to mix the low bits) is divisible by 4.
    pub fn of(prompt: &str) -> Split {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in prompt.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        h ^= h >> 31;
        if h.is_multiple_of(4) {
            Split::Eval
        } else {
            Split::Train
        }
    }
}

/// One problem of the task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Stable identifier, `"<level>:<prompt>"` (e.g. `easy:23+7`).
    pub global_id: String,
    /// The expression, e.g. `(3+4)*5`.
    pub prompt: String,
    /// The value of the expression, as decimal text (graded by exact match of `\boxed{}`).
    pub answer: String,
    /// Difficulty level.
    pub level: Level,
}

impl Problem {
    /// The problem of `prompt` at `level`, its answer computed.
    ///
    /// # Errors
    /// [`DemoError::Expression`] when `prompt` is not an expression of the task's grammar.
    pub fn new(prompt: &str, level: Level) -> Result<Self, DemoError> {
        let (value, _) = evaluate(prompt)?;
        Ok(Self {
            global_id: format!("{level}:{prompt}"),
            prompt: prompt.to_string(),
            answer: value.to_string(),
            level,
        })
    }
}

/// The kinds of problem, each with its level and integer weight within the level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Add2,
    Add3,
    Mul2,
    Add4,
    AddMul,
}

const KINDS: [(Kind, Level, usize); 5] = [
    (Kind::Add2, Level::Easy, 1),
    (Kind::Add3, Level::Medium, 3),
    (Kind::Mul2, Level::Medium, 1),
    (Kind::Add4, Level::Hard, 1),
    (Kind::AddMul, Level::Hard, 1),
];

/// Largest first operand of easy additions: the running sums of the harder chains reach 27,
/// so every easy fact also occurs as a step of a harder problem and easy stays easiest.
const EASY_MAX: u64 = 29;

impl Kind {
    /// The kinds of `level` with their weights.
    fn of(level: Level) -> impl Iterator<Item = (Kind, usize)> {
        KINDS
            .into_iter()
            .filter(move |&(_, l, _)| l == level)
            .map(|(k, _, w)| (k, w))
    }

    /// The prompt of these operands (`ops` has this kind's arity).
    fn format(self, ops: &[u64]) -> String {
        match (self, ops) {
            (Kind::Add2, [a, b]) => format!("{a}+{b}"),
            (Kind::Add3, [a, b, c]) => format!("{a}+{b}+{c}"),
            (Kind::Mul2, [a, b]) => format!("{a}*{b}"),
            (Kind::Add4, [a, b, c, d]) => format!("{a}+{b}+{c}+{d}"),
            (Kind::AddMul, [a, b, c]) => format!("({a}+{b})*{c}"),
            _ => String::new(),
        }
    }

    /// The inclusive range of each operand.
    fn ranges(self) -> &'static [(u64, u64)] {
        match self {
            Kind::Add2 => &[(1, EASY_MAX), (1, 9)],
            Kind::Add3 => &[(1, 9), (1, 9), (1, 9)],
            Kind::Mul2 => &[(2, 9), (2, 9)],
            Kind::Add4 => &[(1, 9), (1, 9), (1, 9), (1, 9)],
            Kind::AddMul => &[(1, 9), (1, 9), (2, 9)],
        }
    }

    /// Every prompt of this kind, in a fixed order.
    fn all(self) -> Vec<String> {
        let ranges = self.ranges();
        let mut out = Vec::new();
        let mut ops: Vec<u64> = ranges.iter().map(|r| r.0).collect();
        loop {
            out.push(self.format(&ops));
            // Odometer increment, last operand fastest.
            let mut i = ops.len();
            loop {
                if i == 0 {
                    return out;
                }
                i -= 1;
                if ops[i] < ranges[i].1 {
                    ops[i] += 1;
                    break;
                }
                ops[i] = ranges[i].0;
            }
        }
    }

    /// One uniformly random prompt of this kind.
    fn draw<R: Rng + ?Sized>(self, rng: &mut R) -> String {
        let ops: Vec<u64> = self
            .ranges()
            .iter()
            .map(|&(lo, hi)| lo + rng::below(rng, (hi - lo + 1) as usize) as u64)
            .collect();
        self.format(&ops)
    }
}

/// A binary operation of an expression.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Add,
    Mul,
}

/// One step of a worked solution: `lhs op rhs = value`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Step {
    lhs: u64,
    op: Op,
    rhs: u64,
    value: u64,
}

impl Step {
    fn line(&self) -> String {
        let op = if self.op == Op::Add { '+' } else { '*' };
        format!("{}{op}{}={}", self.lhs, self.rhs, self.value)
    }

    /// The step restated in its other true forms: commuted, and each operand recovered by
    /// the inverse operation (division only by a non-zero operand).
    fn checks(&self) -> Vec<String> {
        let Step {
            lhs, rhs, value, ..
        } = *self;
        match self.op {
            Op::Add => vec![
                format!("check {rhs}+{lhs}={value}"),
                format!("check {value}-{rhs}={lhs}"),
                format!("check {value}-{lhs}={rhs}"),
            ],
            Op::Mul => {
                let mut out = vec![format!("check {rhs}*{lhs}={value}")];
                if rhs != 0 {
                    out.push(format!("check {value}/{rhs}={lhs}"));
                }
                if lhs != 0 {
                    out.push(format!("check {value}/{lhs}={rhs}"));
                }
                out
            }
        }
    }
}

/// Deepest parenthesis nesting [`evaluate`] accepts (bounds its recursion on user text).
const MAX_DEPTH: usize = 16;

/// A recursive-descent evaluator of `expr := term ('+' term)*`, `term := atom ('*' atom)*`,
/// `atom := digits | '(' expr ')'`, recording each operation as a [`Step`].
struct Evaluator<'a> {
    text: &'a str,
    bytes: &'a [u8],
    pos: usize,
    steps: Vec<Step>,
}

impl Evaluator<'_> {
    fn error(&self, reason: impl Into<String>) -> DemoError {
        DemoError::Expression {
            prompt: self.text.to_string(),
            reason: reason.into(),
        }
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    fn apply(&mut self, lhs: u64, op: Op, rhs: u64) -> Result<u64, DemoError> {
        let value = match op {
            Op::Add => lhs.checked_add(rhs),
            Op::Mul => lhs.checked_mul(rhs),
        }
        .ok_or_else(|| self.error("the value overflows 64 bits"))?;
        self.steps.push(Step {
            lhs,
            op,
            rhs,
            value,
        });
        Ok(value)
    }

    fn expr(&mut self, depth: usize) -> Result<u64, DemoError> {
        let mut value = self.term(depth)?;
        while self.peek() == Some(b'+') {
            self.pos += 1;
            let rhs = self.term(depth)?;
            value = self.apply(value, Op::Add, rhs)?;
        }
        Ok(value)
    }

    fn term(&mut self, depth: usize) -> Result<u64, DemoError> {
        let mut value = self.atom(depth)?;
        while self.peek() == Some(b'*') {
            self.pos += 1;
            let rhs = self.atom(depth)?;
            value = self.apply(value, Op::Mul, rhs)?;
        }
        Ok(value)
    }

    fn atom(&mut self, depth: usize) -> Result<u64, DemoError> {
        match self.peek() {
            Some(b'(') => {
                if depth >= MAX_DEPTH {
                    return Err(self.error(format!("parentheses nest deeper than {MAX_DEPTH}")));
                }
                self.pos += 1;
                let value = self.expr(depth + 1)?;
                if self.peek() != Some(b')') {
                    return Err(self.error(format!("expected `)` at byte {}", self.pos)));
                }
                self.pos += 1;
                Ok(value)
            }
            Some(b) if b.is_ascii_digit() => {
                let start = self.pos;
                while self.peek().is_some_and(|b| b.is_ascii_digit()) {
                    self.pos += 1;
                }
                self.text[start..self.pos]
                    .parse::<u64>()
                    .map_err(|_| self.error("a number overflows 64 bits"))
            }
            Some(_) => {
                let ch = self.text[self.pos..].chars().next().unwrap_or(' ');
                Err(self.error(format!(
                    "unexpected {ch:?} at byte {} (expected a number or `(`)",
                    self.pos
                )))
            }
            None => Err(self.error("ends where a number or `(` was expected")),
        }
    }
}

/// The value of a task expression and its steps in evaluation order.
fn evaluate(prompt: &str) -> Result<(u64, Vec<Step>), DemoError> {
    let mut ev = Evaluator {
        text: prompt,
        bytes: prompt.as_bytes(),
        pos: 0,
        steps: Vec::new(),
    };
    let value = ev.expr(0)?;
    if ev.pos != prompt.len() {
        let ch = prompt[ev.pos..].chars().next().unwrap_or(' ');
        return Err(ev.error(format!(
            "unexpected {ch:?} at byte {} (only digits, `+`, `*` and parentheses)",
            ev.pos
        )));
    }
    Ok((value, ev.steps))
}

/// The worked solution of `p` with `redundancy` verification lines (see the module docs).
///
/// The check lines are distinct restatements drawn at random from `rng`; when `redundancy`
/// exceeds the number of distinct ones (3 per addition step, up to 3 per product, fewer when
/// operands are equal), they repeat. An expression without an operation has nothing to check
/// and gets none.
///
/// # Errors
/// [`DemoError::Expression`] when `p.prompt` is not a task expression or `p.answer` is not
/// its value.
pub fn worked_solution<R: Rng + ?Sized>(
    p: &Problem,
    redundancy: usize,
    rng: &mut R,
) -> Result<String, DemoError> {
    let (value, steps) = evaluate(&p.prompt)?;
    if p.answer != value.to_string() {
        return Err(DemoError::Expression {
            prompt: p.prompt.clone(),
            reason: format!(
                "its value is {value}, the problem's answer is {:?}",
                p.answer
            ),
        });
    }
    let mut candidates: Vec<(usize, String)> = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        for line in step.checks() {
            if !candidates.iter().any(|(_, l)| *l == line) {
                candidates.push((i, line));
            }
        }
    }
    rng::shuffle(rng, &mut candidates);
    let mut chosen: Vec<&(usize, String)> = if candidates.is_empty() {
        Vec::new()
    } else {
        (0..redundancy)
            .map(|k| &candidates[k % candidates.len()])
            .collect()
    };
    // Each check right after its step; stable, so checks of one step keep their random order.
    chosen.sort_by_key(|(step, _)| *step);
    let mut lines = Vec::with_capacity(steps.len() + chosen.len() + 1);
    let mut next = chosen.iter().peekable();
    for (i, step) in steps.iter().enumerate() {
        lines.push(step.line());
        while let Some((_, line)) = next.next_if(|(s, _)| *s == i) {
            lines.push(line.clone());
        }
    }
    lines.push(format!("\\boxed{{{value}}}"));
    Ok(lines.join("\n"))
}

/// `per_level` distinct problems of each level from `split`, chosen with `seed`.
///
/// Within a level, kinds are drawn by their weights (see the module docs) without
/// replacement (Efraimidis–Spirakis keys `ln(u)/w`, `w` = the kind's weight over its number of
/// prompts in the split), so a kind that runs out leaves its share to the others. Levels are
/// interleaved (`easy, medium, hard, easy, …`) so that any prefix is balanced. The same
/// `(split, seed, per_level)` always gives the same list; train and eval lists never share a
/// prompt ([`Split::of`]).
///
/// # Errors
/// [`DemoError::NotEnoughProblems`] when a level's split has fewer than `per_level` prompts
/// (the smallest, easy eval, has 67; easy train has 194).
pub fn problems(split: Split, seed: u64, per_level: usize) -> Result<Vec<Problem>, DemoError> {
    let mut rng = rng::seeded(seed, Stream::Problems);
    let mut by_level: Vec<Vec<Problem>> = Vec::with_capacity(Level::ALL.len());
    for level in Level::ALL {
        let mut keyed: Vec<(f64, String)> = Vec::new();
        for (kind, weight) in Kind::of(level) {
            let pool: Vec<String> = kind
                .all()
                .into_iter()
                .filter(|p| Split::of(p) == split)
                .collect();
            let w = weight as f64 / pool.len().max(1) as f64;
            for prompt in pool {
                keyed.push((rng::unit_open0(&mut rng).ln() / w, prompt));
            }
        }
        if keyed.len() < per_level {
            return Err(DemoError::NotEnoughProblems {
                level: level.as_str(),
                split: split.as_str(),
                wanted: per_level,
                available: keyed.len(),
            });
        }
        keyed.sort_by(|a, b| b.0.total_cmp(&a.0));
        let list = keyed
            .into_iter()
            .take(per_level)
            .map(|(_, prompt)| Problem::new(&prompt, level))
            .collect::<Result<Vec<_>, _>>()?;
        by_level.push(list);
    }
    let mut out = Vec::with_capacity(per_level * Level::ALL.len());
    for i in 0..per_level {
        for list in &by_level {
            out.push(list[i].clone());
        }
    }
    Ok(out)
}

/// `count` supervised examples `(prompt, response)` for the cold start: level uniform, kind
/// by weight, a uniformly random prompt of that kind from the train split (with
/// replacement), and its worked solution with a redundancy uniform in
/// `0..=`[`MAX_REDUNDANCY`]. The response has no end-of-turn token (the trainer appends the
/// tokenizer's EOS).
///
/// # Errors
/// None in practice (the prompts are the task's own); a failure would be a
/// [`DemoError::Expression`].
pub fn sft_examples(seed: u64, count: usize) -> Result<Vec<(String, String)>, DemoError> {
    let mut rng = rng::seeded(seed, Stream::Sft);
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let level = Level::ALL[rng::below(&mut rng, Level::ALL.len())];
        let kinds: Vec<(Kind, usize)> = Kind::of(level).collect();
        let mut pick = rng::below(&mut rng, kinds.iter().map(|k| k.1).sum());
        let mut kind = kinds[0].0;
        for &(k, w) in &kinds {
            if pick < w {
                kind = k;
                break;
            }
            pick -= w;
        }
        let prompt = loop {
            let p = kind.draw(&mut rng);
            if Split::of(&p) == Split::Train {
                break p;
            }
        };
        let problem = Problem::new(&prompt, level)?;
        let redundancy = rng::below(&mut rng, MAX_REDUNDANCY + 1);
        let response = worked_solution(&problem, redundancy, &mut rng)?;
        out.push((prompt, response));
    }
    Ok(out)
}

/// Writes `text` to `path`, creating its parent directories.
pub(crate) fn write_text(path: &Path, text: &str) -> Result<(), DemoError> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| DemoError::io(parent, e))?;
    }
    std::fs::write(path, text).map_err(|e| DemoError::io(path, e))
}

/// One JSON line per row.
fn jsonl(rows: impl Iterator<Item = serde_json::Value>) -> String {
    let mut text = String::new();
    for row in rows {
        text.push_str(&row.to_string());
        text.push('\n');
    }
    text
}

/// Writes `problems` as a verl-style JSONL dataset, one row per problem:
/// `{"prompt": "23+7", "answer": "30", "difficulty": "easy", "global_id": "easy:23+7"}`.
///
/// # Errors
/// [`DemoError::Io`] when the file or its directory cannot be written.
pub fn to_jsonl(problems: &[Problem], path: &Path) -> Result<(), DemoError> {
    let rows = problems.iter().map(|p| {
        json!({
            "prompt": p.prompt,
            "answer": p.answer,
            "difficulty": p.level.as_str(),
            "global_id": p.global_id,
        })
    });
    write_text(path, &jsonl(rows))
}

/// Writes SFT examples as JSONL rows `{"prompt": …, "response": …}`.
///
/// # Errors
/// [`DemoError::Io`] when the file or its directory cannot be written.
pub fn sft_to_jsonl(examples: &[(String, String)], path: &Path) -> Result<(), DemoError> {
    let rows = examples
        .iter()
        .map(|(prompt, response)| json!({"prompt": prompt, "response": response}));
    write_text(path, &jsonl(rows))
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn problem(prompt: &str) -> Problem {
        Problem::new(prompt, Level::Hard).unwrap()
    }

    /// Evaluates a check line `check x?y=z` with `?` in `+ - * /` (exact integer division).
    fn check_holds(line: &str) -> bool {
        let body = line.strip_prefix("check ").unwrap();
        let (lhs, rhs) = body.split_once('=').unwrap();
        let z: u64 = rhs.parse().unwrap();
        let at = lhs.find(['+', '-', '*', '/']).unwrap();
        let (x, y): (u64, u64) = (lhs[..at].parse().unwrap(), lhs[at + 1..].parse().unwrap());
        match &lhs[at..=at] {
            "+" => x + y == z,
            "-" => x.checked_sub(y) == Some(z),
            "*" => x * y == z,
            "/" => y != 0 && x % y == 0 && x / y == z,
            _ => false,
        }
    }

    #[test]
    fn evaluates_with_steps_in_order() {
        let (v, steps) = evaluate("(3+4)*5").unwrap();
        assert_eq!(v, 35);
        let lines: Vec<String> = steps.iter().map(Step::line).collect();
        assert_eq!(lines, ["3+4=7", "7*5=35"]);
        let (v, steps) = evaluate("12+7+30+5").unwrap();
        assert_eq!(v, 54);
        let lines: Vec<String> = steps.iter().map(Step::line).collect();
        assert_eq!(lines, ["12+7=19", "19+30=49", "49+5=54"]);
        // Precedence: the product first.
        let (v, _) = evaluate("2+3*4").unwrap();
        assert_eq!(v, 14);
        assert_eq!(evaluate("8").unwrap(), (8, vec![]));
    }

    #[test]
    fn bad_expressions_name_the_prompt_and_the_fault() {
        for (text, needle) in [
            ("", "ends where"),
            ("3+", "ends where"),
            ("(3+4", "expected `)`"),
            ("3-4", "unexpected '-'"),
            ("3 + 4", "unexpected ' '"),
            ("3+4)", "unexpected ')'"),
            ("99999999999999999999+1", "overflows"),
            ("4294967296*4294967296", "overflows"),
        ] {
            let err = evaluate(text).unwrap_err().to_string();
            assert!(err.contains(&format!("{text:?}")), "{err}");
            assert!(err.contains(needle), "{text:?}: {err}");
        }
        let deep = format!("{}1{}", "(".repeat(40), ")".repeat(40));
        assert!(evaluate(&deep).unwrap_err().to_string().contains("nest"));
    }

    #[test]
    fn worked_solution_without_redundancy() {
        let mut rng = rng::seeded(0, Stream::Sft);
        assert_eq!(
            worked_solution(&problem("(3+4)*5"), 0, &mut rng).unwrap(),
            "3+4=7\n7*5=35\n\\boxed{35}"
        );
        assert_eq!(
            worked_solution(&problem("23+7"), 0, &mut rng).unwrap(),
            "23+7=30\n\\boxed{30}"
        );
    }

    #[test]
    fn redundant_lines_are_distinct_true_checks_after_their_step() {
        let mut rng = rng::seeded(1, Stream::Sft);
        let p = problem("23+7");
        let forms: HashSet<&str> = ["check 7+23=30", "check 30-7=23", "check 30-23=7"].into();
        for r in 0..=3 {
            let s = worked_solution(&p, r, &mut rng).unwrap();
            let lines: Vec<&str> = s.lines().collect();
            assert_eq!(lines.len(), r + 2, "{s}");
            assert_eq!(lines[0], "23+7=30");
            assert_eq!(*lines.last().unwrap(), "\\boxed{30}");
            let checks: HashSet<&str> = lines[1..=r].iter().copied().collect();
            assert_eq!(checks.len(), r, "repeated check: {s}");
            assert!(checks.is_subset(&forms), "{s}");
        }
        // Two steps: every check sits after the step whose numbers it restates.
        let p = problem("(3+4)*5");
        for _ in 0..20 {
            let s = worked_solution(&p, 3, &mut rng).unwrap();
            let lines: Vec<&str> = s.lines().collect();
            let second = lines.iter().position(|l| *l == "7*5=35").unwrap();
            for (i, l) in lines
                .iter()
                .enumerate()
                .filter(|(_, l)| l.starts_with("check"))
            {
                assert!(check_holds(l), "{l}");
                let about_product = l.contains("35");
                assert_eq!(i > second, about_product, "{s}");
            }
        }
    }

    #[test]
    fn checks_repeat_only_when_distinct_ones_run_out() {
        // 3+3=6 has two distinct restatements: `3+3=6` and `6-3=3`.
        let mut rng = rng::seeded(2, Stream::Sft);
        let s = worked_solution(&problem("3+3"), 3, &mut rng).unwrap();
        let checks: Vec<&str> = s.lines().filter(|l| l.starts_with("check")).collect();
        assert_eq!(checks.len(), 3);
        let distinct: HashSet<&&str> = checks.iter().collect();
        assert_eq!(distinct.len(), 2, "{s}");
        // No operation, nothing to check.
        let s = worked_solution(&problem("8"), 3, &mut rng).unwrap();
        assert_eq!(s, "\\boxed{8}");
    }

    #[test]
    fn wrong_answer_is_refused() {
        let mut p = problem("2*3");
        p.answer = "5".into();
        let err = worked_solution(&p, 0, &mut rng::seeded(0, Stream::Sft)).unwrap_err();
        assert!(err.to_string().contains("its value is 6"), "{err}");
    }

    #[test]
    fn kinds_enumerate_their_documented_sizes_and_draw_inside_them() {
        let sizes: Vec<usize> = KINDS.iter().map(|(k, _, _)| k.all().len()).collect();
        assert_eq!(sizes, [261, 729, 64, 6561, 648]);
        let mut rng = rng::seeded(4, Stream::Problems);
        for (kind, _, _) in KINDS {
            let all: HashSet<String> = kind.all().into_iter().collect();
            for _ in 0..200 {
                assert!(all.contains(&kind.draw(&mut rng)));
            }
        }
    }

    #[test]
    fn every_prompt_fits_the_documented_lengths() {
        let mut rng = rng::seeded(5, Stream::Sft);
        let (mut max_prompt, mut max_response) = (0, 0);
        for (kind, level, _) in KINDS {
            for prompt in kind.all() {
                let p = Problem::new(&prompt, level).unwrap();
                let s = worked_solution(&p, MAX_REDUNDANCY, &mut rng).unwrap();
                assert!(s.ends_with(&format!("\\boxed{{{}}}", p.answer)));
                for l in s.lines().filter(|l| l.starts_with("check")) {
                    assert!(check_holds(l), "{prompt}: {l}");
                }
                max_prompt = max_prompt.max(prompt.len());
                max_response = max_response.max(s.len());
            }
        }
        assert_eq!(max_prompt, MAX_PROMPT_CHARS);
        assert_eq!(max_response, MAX_RESPONSE_CHARS);
    }

    #[test]
    fn split_holds_out_about_a_quarter_of_each_kind() {
        // Eval counts per kind, cross-checked with an independent Python implementation of
        // the hash: a change of hash or ranges shows here.
        let expected = [67, 178, 17, 1678, 180];
        for ((kind, _, _), want) in KINDS.into_iter().zip(expected) {
            let all = kind.all();
            let eval = all.iter().filter(|p| Split::of(p) == Split::Eval).count();
            assert_eq!(eval, want, "{kind:?}");
        }
        assert_eq!(Split::of("23+7"), Split::Eval);
        assert_eq!(Split::of("7+23"), Split::Train);
    }

    #[test]
    fn problems_are_deterministic_balanced_and_from_their_split() {
        let a = problems(Split::Train, 9, 40).unwrap();
        assert_eq!(a, problems(Split::Train, 9, 40).unwrap());
        assert_ne!(a, problems(Split::Train, 10, 40).unwrap());
        assert_eq!(a.len(), 120);
        for (i, p) in a.iter().enumerate() {
            assert_eq!(p.level, Level::ALL[i % 3]);
            assert_eq!(Split::of(&p.prompt), Split::Train);
            assert_eq!(p.answer, evaluate(&p.prompt).unwrap().0.to_string());
            assert_eq!(p.global_id, format!("{}:{}", p.level, p.prompt));
        }
        let distinct: HashSet<&str> = a.iter().map(|p| p.prompt.as_str()).collect();
        assert_eq!(distinct.len(), a.len());
        // Medium is 3:1 additions to products; hard 1:1 (binomial, 2 sd margins).
        let hard_products = a
            .iter()
            .filter(|p| p.level == Level::Hard && p.prompt.contains('*'))
            .count();
        assert!((13..=27).contains(&hard_products), "{hard_products}");
    }

    #[test]
    fn a_kind_that_runs_out_leaves_its_share() {
        // Eval has 17 medium products; asking for every medium eval prompt still works.
        let medium_eval = KINDS
            .iter()
            .filter(|(_, l, _)| *l == Level::Medium)
            .flat_map(|(k, _, _)| k.all())
            .filter(|p| Split::of(p) == Split::Eval)
            .count();
        let easy_eval = Kind::Add2
            .all()
            .into_iter()
            .filter(|p| Split::of(p) == Split::Eval)
            .count();
        let n = medium_eval.min(easy_eval);
        let list = problems(Split::Eval, 1, n).unwrap();
        assert_eq!(list.len(), 3 * n);
        let err = problems(Split::Eval, 1, easy_eval + 1).unwrap_err();
        assert!(
            matches!(err, DemoError::NotEnoughProblems { level: "easy", split: "eval", available, .. } if available == easy_eval),
            "{err}"
        );
    }

    #[test]
    fn sft_examples_mix_redundancy_and_stay_in_train() {
        let ex = sft_examples(3, 2000).unwrap();
        assert_eq!(ex, sft_examples(3, 2000).unwrap());
        let mut per_redundancy = [0usize; MAX_REDUNDANCY + 1];
        for (prompt, response) in &ex {
            assert_eq!(Split::of(prompt), Split::Train, "{prompt}");
            let (value, _) = evaluate(prompt).unwrap();
            assert!(
                response.ends_with(&format!("\\boxed{{{value}}}")),
                "{response}"
            );
            per_redundancy[response.lines().filter(|l| l.starts_with("check")).count()] += 1;
        }
        // Uniform over 0..=3: 500 each, sd ~19.
        assert!(
            per_redundancy.iter().all(|&c| (420..580).contains(&c)),
            "{per_redundancy:?}"
        );
    }

    #[test]
    fn jsonl_rows_have_the_verl_columns() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d/train.jsonl");
        to_jsonl(&[problem("(3+4)*5")], &path).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"prompt\":\"(3+4)*5\",\"answer\":\"35\",\"difficulty\":\"hard\",\"global_id\":\"hard:(3+4)*5\"}\n"
        );
        let path = dir.path().join("sft.jsonl");
        sft_to_jsonl(&[("1+2".into(), "1+2=3\n\\boxed{3}".into())], &path).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"prompt\":\"1+2\",\"response\":\"1+2=3\\n\\\\boxed{3}\"}\n"
        );
    }
}
