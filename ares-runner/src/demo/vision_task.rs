//! The vision demo's task: count the shapes of one colour in a small synthetic picture, in
//! three difficulty levels, with worked solutions that carry optional redundant
//! verification lines — the visual counterpart of [`super::task`], with the same API
//! ([`Level`], [`Split`], `problems`, `worked_solution`, SFT examples, verl/EasyR1 JSONL).
//!
//! **Pictures**: [`IMAGE_SIZE`]² RGB (84 × 84: a multiple of 28, so the Qwen2-VL processor
//! keeps the size; 6 × 6 patches of 14 pixels, 9 tokens after the 2 × 2 merge). The picture
//! is a grid of [`GRID`]² cells of [`CELL`] pixels — exactly the vision tower's patches —
//! and every shape lies inside one cell with a pixel of margin, so no patch holds two shapes.
//! Shapes are squares (side 8–10) or discs (diameter 9–11) in red, green, blue or yellow
//! (a small per-shape shade), at a random offset in their cell, on a pale background with a
//! gentle horizontal or vertical gradient.
//!
//! **Problems**: `<image>How many red shapes are in the picture?`, graded by the integer in
//! `\boxed{}`:
//!
//! | level | shapes of the asked colour | distractors (other colours) |
//! |---|---|---|
//! | easy | 1–3 | 0–2 |
//! | medium | 4–6 | 1–3 |
//! | hard | 7–9 | 2–4 |
//!
//! **Worked solution**: the asked colour's squares and discs counted separately, their sum
//! as one addition, then `\boxed{n}`. `redundancy` extra `check …` lines restate the addition
//! in another true form (`b+a=n`, `n-b=a`, `n-a=b`), as the text demo's checks do: length
//! that carries no information, which a length-shaped reward can teach the model to drop.
//! Example, 2 red squares and 1 red disc, one check:
//!
//! ```text
//! red squares: 2
//! red discs: 1
//! 2+1=3
//! check 3-1=2
//! \boxed{3}
//! ```
//!
//! **Splits**: a picture's split is [`Split::of`] its [`Scene::layout_code`] (the asked colour
//! and every shape's cell, colour and kind; not the sizes, offsets, shades or background), so
//! train and eval pictures never share a layout whatever the seeds, and SFT pictures come
//! from the train split only. Each level draws from its own ChaCha20 stream: asking for more
//! problems of one level extends its list and changes no other.

use std::fmt::Write as _;
use std::path::Path;

use rand_chacha::ChaCha20Rng;
use rand_chacha::rand_core::Rng;
use serde_json::json;

use super::error::DemoError;
use super::rng::{self, Stream};
use super::task::write_text;
pub use super::task::{Level, MAX_REDUNDANCY, Split};
use crate::data::IMAGE_PLACEHOLDER;

/// Side of every picture, in pixels.
pub const IMAGE_SIZE: usize = 84;
/// Side of a grid cell (= the vision tower's patch), in pixels.
pub const CELL: usize = 14;
/// Cells per side of the picture.
pub const GRID: usize = IMAGE_SIZE / CELL;
/// Cells of the picture.
pub const CELLS: usize = GRID * GRID;
/// Patches of one picture for the vision tower (patch 14): `(84 / 14)²`.
pub const PATCHES_PER_IMAGE: usize = CELLS;
/// Language-model tokens of one picture after the 2 × 2 merge (`<|image_pad|>` count).
pub const TOKENS_PER_IMAGE: usize = PATCHES_PER_IMAGE / 4;
/// Longest question (`How many yellow shapes are in the picture?`), in characters, without
/// the `<image>` placeholder.
pub const MAX_QUESTION_CHARS: usize = 42;
/// Longest worked solution at redundancy [`MAX_REDUNDANCY`], in characters (one character
/// is one token of the demo tokenizer; add one for the end-of-turn token).
pub const MAX_RESPONSE_CHARS: usize = 85;

// A picture is whole cells, and whole 2 × 2 merge units of 14-pixel patches.
const _: () =
    assert!(IMAGE_SIZE.is_multiple_of(CELL) && IMAGE_SIZE.is_multiple_of(28) && CELL == 14);

/// The colours of the shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Colour {
    /// (210, 40, 40).
    Red,
    /// (40, 160, 60).
    Green,
    /// (40, 70, 210).
    Blue,
    /// (225, 185, 20).
    Yellow,
}

impl Colour {
    /// Every colour.
    pub const ALL: [Colour; 4] = [Colour::Red, Colour::Green, Colour::Blue, Colour::Yellow];

    /// `"red"`, `"green"`, `"blue"` or `"yellow"`.
    pub fn name(self) -> &'static str {
        match self {
            Colour::Red => "red",
            Colour::Green => "green",
            Colour::Blue => "blue",
            Colour::Yellow => "yellow",
        }
    }

    /// The base RGB value (each shape adds its shade).
    pub fn rgb(self) -> [u8; 3] {
        match self {
            Colour::Red => [210, 40, 40],
            Colour::Green => [40, 160, 60],
            Colour::Blue => [40, 70, 210],
            Colour::Yellow => [225, 185, 20],
        }
    }

    fn initial(self) -> char {
        self.name().chars().next().unwrap_or('?')
    }
}

/// The form of a shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShapeKind {
    /// An axis-aligned filled square.
    Square,
    /// A filled disc.
    Disc,
}

impl ShapeKind {
    /// `"squares"` or `"discs"` (as the worked solutions count them).
    pub fn plural(self) -> &'static str {
        match self {
            ShapeKind::Square => "squares",
            ShapeKind::Disc => "discs",
        }
    }

    fn initial(self) -> char {
        match self {
            ShapeKind::Square => 's',
            ShapeKind::Disc => 'd',
        }
    }
}

/// One shape of a picture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Its cell, `row · GRID + column`, in `0..CELLS`.
    pub cell: usize,
    /// Colour.
    pub colour: Colour,
    /// Square or disc.
    pub kind: ShapeKind,
    /// Side of the square or diameter of the disc, in pixels.
    pub size: usize,
    /// Offset of its bounding box from the cell's corner plus one pixel of margin.
    pub dx: usize,
    /// Vertical offset, as `dx`.
    pub dy: usize,
    /// Added to each channel of the colour, in `-12..=12`.
    pub shade: i16,
}

impl Shape {
    /// Top-left pixel of the bounding box.
    fn origin(&self) -> (usize, usize) {
        let (row, col) = (self.cell / GRID, self.cell % GRID);
        (col * CELL + 1 + self.dx, row * CELL + 1 + self.dy)
    }

    /// Whether pixel `(x, y)` (column, row) is inside the shape.
    fn covers(&self, x: usize, y: usize) -> bool {
        let (x0, y0) = self.origin();
        let s = self.size;
        if x < x0 || y < y0 || x >= x0 + s || y >= y0 + s {
            return false;
        }
        match self.kind {
            ShapeKind::Square => true,
            ShapeKind::Disc => {
                // pixel centre inside the circle inscribed in the box, in half-pixels
                let ex = (2 * (x - x0) + 1) as i64 - s as i64;
                let ey = (2 * (y - y0) + 1) as i64 - s as i64;
                ex * ex + ey * ey <= (s * s) as i64
            }
        }
    }

    fn rgb(&self) -> [u8; 3] {
        self.colour
            .rgb()
            .map(|c| (i16::from(c) + self.shade).clamp(0, 255) as u8)
    }
}

/// A picture: the asked colour and the shapes (sorted by cell), and the background.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scene {
    /// The colour the question asks about.
    pub target: Colour,
    /// Every shape, sorted by cell (at most one per cell).
    pub shapes: Vec<Shape>,
    /// The background's RGB at the gradient's light end.
    pub background: [u8; 3],
    /// Whether the gradient runs top to bottom (else left to right).
    pub vertical: bool,
    /// How much darker the background gets across the picture, per channel (0–16).
    pub gradient: u8,
}

impl Scene {
    /// Number of shapes of the asked colour: the answer.
    pub fn count(&self) -> usize {
        self.shapes
            .iter()
            .filter(|s| s.colour == self.target)
            .count()
    }

    /// Number of shapes of the asked colour and `kind`.
    pub fn count_kind(&self, kind: ShapeKind) -> usize {
        self.shapes
            .iter()
            .filter(|s| s.colour == self.target && s.kind == kind)
            .count()
    }

    /// The layout as text: the asked colour, then per shape its cell (two digits), colour
    /// and kind initials, e.g. `red:03rs.07bd.21rd`. Decides the split and names the problem.
    pub fn layout_code(&self) -> String {
        let mut out = format!("{}:", self.target.name());
        for (i, s) in self.shapes.iter().enumerate() {
            if i > 0 {
                out.push('.');
            }
            let _ = write!(
                out,
                "{:02}{}{}",
                s.cell,
                s.colour.initial(),
                s.kind.initial()
            );
        }
        out
    }

    /// The picture as 8-bit RGB, rows top to bottom, `IMAGE_SIZE² · 3` bytes.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(IMAGE_SIZE * IMAGE_SIZE * 3);
        for y in 0..IMAGE_SIZE {
            for x in 0..IMAGE_SIZE {
                let t = if self.vertical { y } else { x };
                let dim = (usize::from(self.gradient) * t / (IMAGE_SIZE - 1)) as u8;
                let mut px = self.background.map(|c| c.saturating_sub(dim));
                // at most one shape per cell
                let cell = (y / CELL) * GRID + x / CELL;
                if let Ok(i) = self.shapes.binary_search_by_key(&cell, |s| s.cell)
                    && self.shapes[i].covers(x, y)
                {
                    px = self.shapes[i].rgb();
                }
                out.extend_from_slice(&px);
            }
        }
        out
    }

    /// The picture as a PNG file's bytes (8-bit RGB, the `png` encoder's defaults: the same
    /// scene always gives the same bytes).
    ///
    /// # Errors
    /// The encoder's error (in practice none: the buffer has the size the header states).
    pub fn png(&self) -> Result<Vec<u8>, png::EncodingError> {
        let mut bytes = Vec::new();
        let side = IMAGE_SIZE as u32;
        let mut encoder = png::Encoder::new(&mut bytes, side, side);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(&self.render())?;
        writer.finish()?;
        Ok(bytes)
    }
}

/// Inclusive range of the number of shapes of the asked colour at `level`.
pub fn target_range(level: Level) -> (usize, usize) {
    match level {
        Level::Easy => (1, 3),
        Level::Medium => (4, 6),
        Level::Hard => (7, 9),
    }
}

/// Inclusive range of the number of shapes of other colours at `level`.
pub fn distractor_range(level: Level) -> (usize, usize) {
    match level {
        Level::Easy => (0, 2),
        Level::Medium => (1, 3),
        Level::Hard => (2, 4),
    }
}

fn uniform<R: Rng + ?Sized>(rng: &mut R, (lo, hi): (usize, usize)) -> usize {
    lo + rng::below(rng, hi - lo + 1)
}

/// One random scene of `level` (see the module docs).
pub fn draw_scene<R: Rng + ?Sized>(level: Level, rng: &mut R) -> Scene {
    let target = Colour::ALL[rng::below(rng, Colour::ALL.len())];
    let n = uniform(rng, target_range(level));
    let d = uniform(rng, distractor_range(level));
    let mut cells: Vec<usize> = (0..CELLS).collect();
    rng::shuffle(rng, &mut cells);
    let others: Vec<Colour> = Colour::ALL.into_iter().filter(|&c| c != target).collect();
    let mut shapes: Vec<Shape> = cells[..n + d]
        .iter()
        .enumerate()
        .map(|(i, &cell)| {
            let colour = if i < n {
                target
            } else {
                others[rng::below(rng, others.len())]
            };
            let kind = if rng::below(rng, 2) == 0 {
                ShapeKind::Square
            } else {
                ShapeKind::Disc
            };
            let size = match kind {
                ShapeKind::Square => uniform(rng, (8, 10)),
                ShapeKind::Disc => uniform(rng, (9, 11)),
            };
            // one pixel of margin on each side of the cell
            let room = CELL - 2 - size;
            let dx = rng::below(rng, room + 1);
            let dy = rng::below(rng, room + 1);
            let shade = rng::below(rng, 25) as i16 - 12;
            Shape {
                cell,
                colour,
                kind,
                size,
                dx,
                dy,
                shade,
            }
        })
        .collect();
    shapes.sort_by_key(|s| s.cell);
    let background = [0; 3].map(|_: u8| 205 + rng::below(rng, 36) as u8);
    let vertical = rng::below(rng, 2) == 1;
    let gradient = rng::below(rng, 17) as u8;
    Scene {
        target,
        shapes,
        background,
        vertical,
        gradient,
    }
}

/// The question about `colour`, without the placeholder.
pub fn question(colour: Colour) -> String {
    format!("How many {} shapes are in the picture?", colour.name())
}

/// One problem of the task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VisionProblem {
    /// Stable identifier, `"<level>:<layout code>"` (e.g. `easy:red:03rs.07bd.21rd`).
    pub global_id: String,
    /// The dataset's prompt: `<image>` then the question (EasyR1's placeholder convention).
    pub prompt: String,
    /// The number of shapes of the asked colour, as decimal text.
    pub answer: String,
    /// Difficulty level.
    pub level: Level,
    /// The picture.
    pub scene: Scene,
}

impl VisionProblem {
    /// The problem of `scene` at `level`.
    pub fn new(scene: Scene, level: Level) -> Self {
        Self {
            global_id: format!("{level}:{}", scene.layout_code()),
            prompt: format!("{IMAGE_PLACEHOLDER}{}", question(scene.target)),
            answer: scene.count().to_string(),
            level,
            scene,
        }
    }

    /// The split of the problem's picture ([`Split::of`] its layout code).
    pub fn split(&self) -> Split {
        Split::of(&self.scene.layout_code())
    }
}

/// The worked solution of `p` with `redundancy` verification lines (see the module docs):
/// distinct restatements of the addition in random order (from `rng`, which is advanced
/// even when `redundancy` is 0), repeating only when the distinct ones run out (`2+2=4` has
/// two, `0+n=n` three).
///
/// # Errors
/// [`DemoError::Setting`] when `p.answer` is not the scene's count.
pub fn worked_solution<R: Rng + ?Sized>(
    p: &VisionProblem,
    redundancy: usize,
    rng: &mut R,
) -> Result<String, DemoError> {
    let n = p.scene.count();
    if p.answer != n.to_string() {
        return Err(DemoError::Setting {
            field: "answer",
            value: p.answer.clone(),
            reason: format!(
                "problem {} shows {n} {} shapes",
                p.global_id,
                p.scene.target.name()
            ),
        });
    }
    let colour = p.scene.target.name();
    let a = p.scene.count_kind(ShapeKind::Square);
    let b = p.scene.count_kind(ShapeKind::Disc);
    let mut candidates: Vec<String> = Vec::with_capacity(3);
    for line in [
        format!("check {b}+{a}={n}"),
        format!("check {n}-{b}={a}"),
        format!("check {n}-{a}={b}"),
    ] {
        if !candidates.contains(&line) {
            candidates.push(line);
        }
    }
    rng::shuffle(rng, &mut candidates);
    let mut lines = vec![
        format!("{colour} {}: {a}", ShapeKind::Square.plural()),
        format!("{colour} {}: {b}", ShapeKind::Disc.plural()),
        format!("{a}+{b}={n}"),
    ];
    lines.extend((0..redundancy).map(|k| candidates[k % candidates.len()].clone()));
    lines.push(format!("\\boxed{{{n}}}"));
    Ok(lines.join("\n"))
}

/// Stream ids of the vision task, apart from the text demo's ([`Stream`]): `base + level`.
const PROBLEM_STREAM: u64 = 0x5649_0000;
const SFT_IMAGE_STREAM: u64 = 0x5649_0100;
const SFT_STREAM: u64 = 0x5649_0200;

/// The ChaCha20 stream `id` of `seed` (keyed as [`rng::seeded`]).
fn stream(seed: u64, id: u64) -> ChaCha20Rng {
    let mut r = rng::seeded(seed, Stream::Problems);
    r.set_stream(id);
    r
}

/// Draws scenes from the streams `base + level` until `per_level` distinct layouts of `split`
/// per level, levels interleaved (`easy, medium, hard, easy, …`).
fn collect(
    split: Split,
    seed: u64,
    per_level: usize,
    base: u64,
) -> Result<Vec<VisionProblem>, DemoError> {
    let mut by_level = Vec::with_capacity(Level::ALL.len());
    for (i, level) in Level::ALL.into_iter().enumerate() {
        let mut rng = stream(seed, base + i as u64);
        let mut seen = std::collections::HashSet::new();
        let mut list = Vec::with_capacity(per_level);
        // a quarter of the layouts are eval, duplicates are rare: far more than enough
        let budget = 64 * per_level + 1024;
        for _ in 0..budget {
            if list.len() == per_level {
                break;
            }
            let p = VisionProblem::new(draw_scene(level, &mut rng), level);
            if p.split() == split && seen.insert(p.scene.layout_code()) {
                list.push(p);
            }
        }
        if list.len() < per_level {
            return Err(DemoError::NotEnoughProblems {
                level: level.as_str(),
                split: split.as_str(),
                wanted: per_level,
                available: list.len(),
            });
        }
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

/// `per_level` problems of each level from `split` with distinct layouts, chosen with
/// `seed`, levels interleaved so that any prefix is balanced. The same `(split, seed,
/// per_level)` always gives the same list, and a longer list starts with the shorter one;
/// train and eval never share a layout.
///
/// # Errors
/// [`DemoError::NotEnoughProblems`] if `64 · per_level + 1024` draws of a level do not give
/// enough (never in practice).
pub fn problems(
    split: Split,
    seed: u64,
    per_level: usize,
) -> Result<Vec<VisionProblem>, DemoError> {
    collect(split, seed, per_level, PROBLEM_STREAM)
}

/// The pictures of the supervised warm start: `per_level` train-split problems per level,
/// drawn as [`problems`] but from other streams (so they are other pictures than the RL
/// prompts).
///
/// # Errors
/// As [`problems`].
pub fn sft_problems(seed: u64, per_level: usize) -> Result<Vec<VisionProblem>, DemoError> {
    collect(Split::Train, seed, per_level, SFT_IMAGE_STREAM)
}

/// One supervised example: a picture of the SFT pool and a worked solution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VisionSftExample {
    /// Index of the picture in the pool ([`sft_problems`]).
    pub image: usize,
    /// The prompt (`<image>` and the question).
    pub prompt: String,
    /// The worked solution, without an end-of-turn token (the trainer appends the EOS).
    pub response: String,
}

/// `count` supervised examples for the cold start: a uniformly random picture of `pool`
/// (with replacement) and its worked solution with a redundancy uniform in
/// `0..=`[`MAX_REDUNDANCY`].
///
/// # Errors
/// [`DemoError::Setting`] for an empty pool (with `count > 0`) or a problem whose answer is
/// not its count.
pub fn sft_examples(
    pool: &[VisionProblem],
    seed: u64,
    count: usize,
) -> Result<Vec<VisionSftExample>, DemoError> {
    if pool.is_empty() && count > 0 {
        return Err(DemoError::Setting {
            field: "sft_images_per_level",
            value: "0".into(),
            reason: "SFT examples need at least one picture".into(),
        });
    }
    let mut rng = stream(seed, SFT_STREAM);
    (0..count)
        .map(|_| {
            let image = rng::below(&mut rng, pool.len());
            let redundancy = rng::below(&mut rng, MAX_REDUNDANCY + 1);
            let response = worked_solution(&pool[image], redundancy, &mut rng)?;
            Ok(VisionSftExample {
                image,
                prompt: pool[image].prompt.clone(),
                response,
            })
        })
        .collect()
}

/// The path of picture `index` of a set named `prefix` (`train`, `eval`, `sft`), relative to
/// the dataset files: `images/<prefix>-<index, 6 digits>.png`.
pub fn image_path(prefix: &str, index: usize) -> String {
    format!("images/{prefix}-{index:06}.png")
}

/// Writes each problem's picture as `data_dir/`[`image_path`]`(prefix, i)`, creating the
/// directory.
///
/// # Errors
/// [`DemoError::Io`] when a file cannot be written.
pub fn write_images(
    problems: &[VisionProblem],
    data_dir: &Path,
    prefix: &str,
) -> Result<(), DemoError> {
    let dir = data_dir.join("images");
    std::fs::create_dir_all(&dir).map_err(|e| DemoError::io(&dir, e))?;
    for (i, p) in problems.iter().enumerate() {
        let path = data_dir.join(image_path(prefix, i));
        let bytes = p
            .scene
            .png()
            .map_err(|e| DemoError::io(&path, std::io::Error::other(e)))?;
        std::fs::write(&path, bytes).map_err(|e| DemoError::io(&path, e))?;
    }
    Ok(())
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

/// Writes `problems` as an EasyR1-style JSONL dataset, row `i` with picture
/// [`image_path`]`(prefix, i)` (relative to the file's directory):
/// `{"prompt": "<image>How many red shapes are in the picture?", "images":
/// ["images/train-000000.png"], "answer": "3", "difficulty": "easy", "global_id":
/// "easy:red:03rs.07bd.21rd"}`.
///
/// # Errors
/// [`DemoError::Io`] when the file or its directory cannot be written.
pub fn to_jsonl(problems: &[VisionProblem], prefix: &str, path: &Path) -> Result<(), DemoError> {
    let rows = problems.iter().enumerate().map(|(i, p)| {
        json!({
            "prompt": p.prompt,
            "images": [image_path(prefix, i)],
            "answer": p.answer,
            "difficulty": p.level.as_str(),
            "global_id": p.global_id,
        })
    });
    write_text(path, &jsonl(rows))
}

/// Writes SFT examples as JSONL rows `{"prompt": …, "response": …, "images":
/// ["images/<prefix>-<pool index>.png"]}`.
///
/// # Errors
/// [`DemoError::Io`] when the file or its directory cannot be written.
pub fn sft_to_jsonl(
    examples: &[VisionSftExample],
    prefix: &str,
    path: &Path,
) -> Result<(), DemoError> {
    let rows = examples.iter().map(|e| {
        json!({
            "prompt": e.prompt,
            "response": e.response,
            "images": [image_path(prefix, e.image)],
        })
    });
    write_text(path, &jsonl(rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scene(target: Colour, shapes: &[(usize, Colour, ShapeKind)]) -> Scene {
        Scene {
            target,
            shapes: shapes
                .iter()
                .map(|&(cell, colour, kind)| Shape {
                    cell,
                    colour,
                    kind,
                    size: 10,
                    dx: 1,
                    dy: 2,
                    shade: 0,
                })
                .collect(),
            background: [230, 230, 230],
            vertical: false,
            gradient: 0,
        }
    }

    #[test]
    fn worked_solution_counts_by_kind_and_checks_the_sum() {
        use Colour::*;
        use ShapeKind::*;
        let s = scene(
            Red,
            &[
                (3, Red, Square),
                (7, Blue, Disc),
                (20, Red, Disc),
                (30, Red, Square),
            ],
        );
        let p = VisionProblem::new(s, Level::Easy);
        assert_eq!(p.answer, "3");
        assert_eq!(p.global_id, "easy:red:03rs.07bd.20rd.30rs");
        assert_eq!(p.prompt, "<image>How many red shapes are in the picture?");
        let mut rng = rng::seeded(0, Stream::Sft);
        assert_eq!(
            worked_solution(&p, 0, &mut rng).unwrap(),
            "red squares: 2\nred discs: 1\n2+1=3\n\\boxed{3}"
        );
        let forms = ["check 1+2=3", "check 3-1=2", "check 3-2=1"];
        for r in 1..=3 {
            let s = worked_solution(&p, r, &mut rng).unwrap();
            let checks: Vec<&str> = s.lines().filter(|l| l.starts_with("check")).collect();
            assert_eq!(checks.len(), r, "{s}");
            let distinct: std::collections::HashSet<&&str> = checks.iter().collect();
            assert_eq!(distinct.len(), r, "{s}");
            assert!(checks.iter().all(|c| forms.contains(c)), "{s}");
            // the checks follow the addition, the answer comes last
            let lines: Vec<&str> = s.lines().collect();
            assert_eq!(lines[2], "2+1=3");
            assert_eq!(lines[3..3 + r], checks[..]);
            assert_eq!(lines[3 + r..], ["\\boxed{3}"]);
        }
        // 2 + 2: two distinct restatements, the third repeats
        let s = scene(
            Green,
            &[
                (0, Green, Square),
                (1, Green, Disc),
                (2, Green, Square),
                (3, Green, Disc),
            ],
        );
        let p = VisionProblem::new(s, Level::Medium);
        let out = worked_solution(&p, 3, &mut rng).unwrap();
        let checks: std::collections::HashSet<&str> =
            out.lines().filter(|l| l.starts_with("check")).collect();
        assert_eq!(checks.len(), 2, "{out}");
        let mut wrong = p.clone();
        wrong.answer = "5".into();
        let err = worked_solution(&wrong, 0, &mut rng)
            .unwrap_err()
            .to_string();
        assert!(err.contains("shows 4 green shapes"), "{err}");
    }

    #[test]
    fn every_solution_fits_the_documented_lengths() {
        let mut rng = rng::seeded(5, Stream::Sft);
        let (mut max_question, mut max_response) = (0, 0);
        for colour in Colour::ALL {
            max_question = max_question.max(question(colour).len());
            for a in 0..=9 {
                for b in 0..=9 - a {
                    let kinds = (0..a)
                        .map(|_| ShapeKind::Square)
                        .chain((0..b).map(|_| ShapeKind::Disc));
                    let shapes: Vec<(usize, Colour, ShapeKind)> =
                        kinds.enumerate().map(|(i, k)| (i, colour, k)).collect();
                    let p = VisionProblem::new(scene(colour, &shapes), Level::Hard);
                    let s = worked_solution(&p, MAX_REDUNDANCY, &mut rng).unwrap();
                    assert!(s.ends_with(&format!("\\boxed{{{}}}", a + b)), "{s}");
                    max_response = max_response.max(s.len());
                }
            }
        }
        assert_eq!(max_question, MAX_QUESTION_CHARS);
        assert_eq!(max_response, MAX_RESPONSE_CHARS);
    }

    #[test]
    fn render_draws_each_shape_inside_its_cell() {
        use Colour::*;
        use ShapeKind::*;
        let s = scene(Red, &[(0, Red, Square), (35, Blue, Disc)]);
        let px = s.render();
        assert_eq!(px.len(), IMAGE_SIZE * IMAGE_SIZE * 3);
        let at = |x: usize, y: usize| &px[(y * IMAGE_SIZE + x) * 3..(y * IMAGE_SIZE + x) * 3 + 3];
        // square of 10 at (1 + 1, 1 + 2) in cell 0: x 2..12, y 3..13
        assert_eq!(at(2, 3), [210, 40, 40]);
        assert_eq!(at(11, 12), [210, 40, 40]);
        assert_eq!(at(1, 3), [230, 230, 230]);
        assert_eq!(at(12, 12), [230, 230, 230]);
        // disc of 10 in cell 35 (row 5, col 5): box x 72..82, y 73..83; centre in, corner out
        assert_eq!(at(77, 78), [40, 70, 210]);
        assert_eq!(at(72, 73), [230, 230, 230]);
        let coloured = px.chunks(3).filter(|p| *p == [40, 70, 210]).count();
        // a disc of diameter 10 covers about π·25 ≈ 79 pixels
        assert!((70..=90).contains(&coloured), "{coloured}");
    }

    #[test]
    fn scenes_respect_their_level() {
        let mut rng = stream(4, 77);
        for level in Level::ALL {
            for _ in 0..300 {
                let s = draw_scene(level, &mut rng);
                let (lo, hi) = target_range(level);
                assert!((lo..=hi).contains(&s.count()));
                let (lo, hi) = distractor_range(level);
                assert!((lo..=hi).contains(&(s.shapes.len() - s.count())));
                assert!(s.shapes.windows(2).all(|w| w[0].cell < w[1].cell));
                for sh in &s.shapes {
                    let (x0, y0) = sh.origin();
                    let (cx, cy) = (sh.cell % GRID * CELL, sh.cell / GRID * CELL);
                    assert!(x0 > cx && x0 + sh.size < cx + CELL, "{sh:?}");
                    assert!(y0 > cy && y0 + sh.size < cy + CELL, "{sh:?}");
                }
            }
        }
    }
}
