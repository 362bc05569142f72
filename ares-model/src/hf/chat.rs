//! Chat templates: found where transformers finds them and rendered as transformers renders
//! them.
//!
//! Where the template comes from (as transformers 4.5x loads it):
//!
//! - `chat_template.jinja` next to `tokenizer_config.json` (newer checkpoints) — wins over
//!   the config's field, plus named extras in `chat_templates/<name>.jinja`;
//! - otherwise `chat_template` in `tokenizer_config.json`: a string, or HF's list of named
//!   templates `[{"name": "default", "template": …}, {"name": "tool_use", …}]`.
//!
//! With several named templates, a render with tools uses `tool_use` when there is one, else
//! `default`.
//!
//! Rendering uses [`minijinja`] configured as transformers configures Jinja2: `trim_blocks`
//! and `lstrip_blocks` on, the trailing newline of the template dropped, no auto-escaping, the
//! globals `raise_exception` and `strftime_now`, a `tojson` filter that writes what Python's
//! `json.dumps` writes (insertion order, `", "`/`": "` separators, `ensure_ascii`, `indent`,
//! `separators`, `sort_keys`), Python string/dict/list methods (`.strip()`, `.split()`,
//! `.items()`, …) from `minijinja-contrib`'s pycompat, and Python's way of printing values
//! (`True`, `None`, `{'a': 1}`). The variables are transformers': `messages`, `tools`
//! (`None` when not given), `documents` (`None`), `add_generation_prompt`, the special tokens
//! of `tokenizer_config.json` (`bos_token`, `eos_token`, …; as transformers 5, not the list
//! `additional_special_tokens`) and
//! any extra variables the caller passes (e.g. `enable_thinking`).
//!
//! Not supported: the `{% generation %}` tag (assistant masks) and `continue_final_message`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error as JinjaError, ErrorKind, Output, State};
use serde::{Deserialize, Serialize};
use serde_json::{Map as JsonMap, Value as Json};

use super::tokenizer::{
    SpecialTokens, TOKENIZER_CONFIG_FILE, TokenizerConfig, TokenizerError, json_kind,
};

/// File name of the separate chat template of newer checkpoints.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
/// Directory of additional named templates (`chat_templates/<name>.jinja`).
pub const CHAT_TEMPLATES_DIR: &str = "chat_templates";

/// Most instructions one render of a template may run: a chat template comes from a
/// downloaded model folder and is a program; a loop that does not end stops here. A
/// conversation of a few hundred messages with tools takes well under 1 % of it.
pub const TEMPLATE_FUEL: u64 = 50_000_000;
/// Longest text one render may produce (64 MiB): far past any prompt a model takes.
pub const TEMPLATE_OUTPUT_CAP: usize = 64 << 20;

/// Sets the instruction budget ([`TEMPLATE_FUEL`]) of every render in `env`.
pub fn limit_environment(env: &mut Environment<'_>) {
    env.set_fuel(Some(TEMPLATE_FUEL));
}

/// Why a bounded render failed.
#[derive(Debug)]
pub enum RenderFailure {
    /// minijinja's error (syntax, undefined value, a raised exception, ...).
    Jinja(JinjaError),
    /// The template used up its [`TEMPLATE_FUEL`] or passed [`TEMPLATE_OUTPUT_CAP`]: the
    /// message says which.
    Limit(String),
}

/// Renders `template` with `ctx` within the limits: the environment's fuel (see
/// [`limit_environment`]) and [`TEMPLATE_OUTPUT_CAP`] bytes of output, which are counted as
/// they are written, so an overlong output is stopped rather than built.
///
/// # Errors
/// [`RenderFailure`].
pub fn render_bounded(
    template: &minijinja::Template<'_, '_>,
    ctx: Value,
) -> std::result::Result<String, RenderFailure> {
    /// The output so far; `over` once a write would pass the cap.
    struct Capped {
        bytes: Vec<u8>,
        over: bool,
    }
    impl std::io::Write for Capped {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.bytes.len() + buf.len() > TEMPLATE_OUTPUT_CAP {
                self.over = true;
                return Err(std::io::Error::other("output cap"));
            }
            self.bytes.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut out = Capped {
        bytes: Vec::new(),
        over: false,
    };
    match template.render_captured_to(ctx, &mut out) {
        Ok(_) => String::from_utf8(out.bytes)
            .map_err(|e| RenderFailure::Limit(format!("the output is not UTF-8: {e}"))),
        Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(RenderFailure::Limit(format!(
            "the template ran more than {TEMPLATE_FUEL} instructions (a loop that does not \
             end?) and was stopped"
        ))),
        Err(_) if out.over => Err(RenderFailure::Limit(format!(
            "the template's output passed {} MiB and was stopped",
            TEMPLATE_OUTPUT_CAP >> 20
        ))),
        Err(e) => Err(RenderFailure::Jinja(e)),
    }
}

/// Errors from finding, compiling or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// `tokenizer_config.json` could not be read or parsed.
    #[error(transparent)]
    Config(#[from] TokenizerError),
    /// A template file could not be read.
    #[error("{}: cannot read: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The model directory has no chat template at all.
    #[error(
        "{}: the model has no chat template (no `chat_template` in {TOKENIZER_CONFIG_FILE} and no {CHAT_TEMPLATE_FILE}); \
         pass a template explicitly or use a chat/instruct checkpoint",
        dir.display()
    )]
    NoTemplate {
        /// The model directory.
        dir: PathBuf,
    },
    /// `chat_template` in `tokenizer_config.json` has the wrong shape.
    #[error("{}: `{field}`: {reason}", path.display())]
    Field {
        /// The file.
        path: PathBuf,
        /// The field (`chat_template` or an entry of it).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Several named templates and none is called `default` (nor `tool_use` when rendering
    /// with tools).
    #[error("{origin}: several chat templates ({}) and none is named `default`", names.join(", "))]
    NoDefault {
        /// Where the templates came from.
        origin: String,
        /// The names found.
        names: Vec<String>,
    },
    /// The template does not compile.
    #[error("{origin}: chat template syntax error: {message}")]
    Syntax {
        /// Which template (file and name).
        origin: String,
        /// minijinja's message, with the line.
        message: String,
    },
    /// The template called `raise_exception(message)` (e.g. on an unsupported role).
    #[error("{origin}: the chat template raised an exception: {message}")]
    Raised {
        /// Which template (file and name).
        origin: String,
        /// The message the template passed.
        message: String,
    },
    /// Rendering failed for another reason (undefined attribute, bad operand, …).
    #[error("{origin}: rendering the chat template failed: {message}")]
    Render {
        /// Which template (file and name).
        origin: String,
        /// minijinja's message, with the line.
        message: String,
    },
    /// Rendering was stopped at a bound: the instruction budget or the output size.
    #[error("{origin}: {message}")]
    Limit {
        /// Which template (file and name).
        origin: String,
        /// Which bound.
        message: String,
    },
    /// A conversation cannot be continued token by token after tool messages: the
    /// template renders the earlier turns differently once they follow, or does not end
    /// the assistant's turn with the model's end-of-turn text.
    #[error("{origin}: cannot continue the conversation after tool messages: {message}")]
    Continuation {
        /// Which template (file and name).
        origin: String,
        /// What does not hold.
        message: String,
    },
    /// The messages, tools or extra variables could not be turned into template values.
    #[error("chat messages: {message}")]
    Messages {
        /// What went wrong.
        message: String,
    },
}

/// Result alias of this module.
pub type Result<T, E = ChatError> = std::result::Result<T, E>;

/// One chat message with just a role and a text content (what the trainer builds). Templates
/// also accept richer messages (`tool_calls`, `reasoning_content`, …): render
/// [`serde_json::Value`]s for those.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A wall-clock date and time for `strftime_now` (no time zone: the template sees it as
/// "now").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CivilDateTime {
    year: i32,
    month: u32,
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
}

impl CivilDateTime {
    /// A validated date and time (proleptic Gregorian calendar); None when a field is out of
    /// range (month 1–12, day within the month, hour < 24, minute < 60, second < 60).
    pub fn new(
        year: i32,
        month: u32,
        day: u32,
        hour: u32,
        minute: u32,
        second: u32,
    ) -> Option<Self> {
        let ok = (1..=12).contains(&month)
            && day >= 1
            && day <= days_in_month(year, month)
            && hour < 24
            && minute < 60
            && second < 60;
        ok.then_some(Self {
            year,
            month,
            day,
            hour,
            minute,
            second,
        })
    }

    /// The current time in UTC (transformers uses the local time; the runner has no time
    /// zone database, and a container's local time is usually UTC).
    pub fn now_utc() -> Self {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400) as u32;
        let (year, month, day) = civil_from_days(days);
        Self {
            year,
            month,
            day,
            hour: rem / 3600,
            minute: rem / 60 % 60,
            second: rem % 60,
        }
    }

    /// Formats like Python's `datetime.strftime` (C locale) for the directives `%a %A %b %B
    /// %d %e %H %I %j %m %M %p %S %y %Y %%`, with glibc's `%-d`-style unpadded forms; other
    /// directives are copied as written.
    pub fn strftime(&self, format: &str) -> String {
        const DAYS: [&str; 7] = [
            "Sunday",
            "Monday",
            "Tuesday",
            "Wednesday",
            "Thursday",
            "Friday",
            "Saturday",
        ];
        const MONTHS: [&str; 12] = [
            "January",
            "February",
            "March",
            "April",
            "May",
            "June",
            "July",
            "August",
            "September",
            "October",
            "November",
            "December",
        ];
        let weekday = (days_from_civil(self.year, self.month, self.day) + 4).rem_euclid(7) as usize;
        let month_name = MONTHS[(self.month - 1) as usize];
        let day_of_year: u32 = (1..self.month)
            .map(|m| days_in_month(self.year, m))
            .sum::<u32>()
            + self.day;
        let hour12 = match self.hour % 12 {
            0 => 12,
            h => h,
        };
        let mut out = String::with_capacity(format.len() + 16);
        let mut chars = format.chars();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let mut spec = chars.next();
            let unpadded = spec == Some('-');
            if unpadded {
                spec = chars.next();
            }
            let num = |out: &mut String, v: u32, width: usize| {
                if unpadded {
                    let _ = write!(out, "{v}");
                } else {
                    let _ = write!(out, "{v:0width$}");
                }
            };
            match spec {
                Some('a') => out.push_str(&DAYS[weekday][..3]),
                Some('A') => out.push_str(DAYS[weekday]),
                Some('b') | Some('h') => out.push_str(&month_name[..3]),
                Some('B') => out.push_str(month_name),
                Some('d') => num(&mut out, self.day, 2),
                Some('e') => {
                    let _ = write!(out, "{:>2}", self.day);
                }
                Some('H') => num(&mut out, self.hour, 2),
                Some('I') => num(&mut out, hour12, 2),
                Some('j') => num(&mut out, day_of_year, 3),
                Some('m') => num(&mut out, self.month, 2),
                Some('M') => num(&mut out, self.minute, 2),
                Some('p') => out.push_str(if self.hour < 12 { "AM" } else { "PM" }),
                Some('S') => num(&mut out, self.second, 2),
                Some('y') => num(&mut out, self.year.rem_euclid(100) as u32, 2),
                Some('Y') => {
                    let _ = write!(out, "{}", self.year);
                }
                Some('%') => out.push('%'),
                Some(other) => {
                    out.push('%');
                    if unpadded {
                        out.push('-');
                    }
                    out.push(other);
                }
                None => {
                    out.push('%');
                    if unpadded {
                        out.push('-');
                    }
                }
            }
        }
        out
    }
}

fn is_leap(year: i32) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i32, month: u32) -> u32 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if is_leap(year) => 29,
        2 => 28,
        _ => 0,
    }
}

/// Days since 1970-01-01 (H. Hinnant's algorithm).
fn days_from_civil(year: i32, month: u32, day: u32) -> i64 {
    let y = i64::from(year) - i64::from(month <= 2);
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(days: i64) -> (i32, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = (yoe + era * 400 + i64::from(month <= 2)) as i32;
    (year, month, day)
}

/// Options of one render.
#[derive(Debug, Clone, Copy, Default)]
pub struct RenderOptions<'a> {
    /// Append the header of an assistant turn (transformers' `add_generation_prompt`).
    pub add_generation_prompt: bool,
    /// Tool schemas (JSON objects), passed as `tools`; None renders `tools` as `None`.
    pub tools: Option<&'a [Json]>,
    /// Extra template variables (transformers' `**kwargs`, e.g. `enable_thinking`); they
    /// override special tokens of the same name.
    pub extra: Option<&'a JsonMap<String, Json>>,
}

impl RenderOptions<'_> {
    /// Options for a prompt the model continues: `add_generation_prompt = true`, no tools.
    pub fn generation() -> Self {
        Self {
            add_generation_prompt: true,
            ..Self::default()
        }
    }
}

/// The template variables a render sets itself; extra variables may not be named so.
pub const RENDER_VARIABLES: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// Reads a JSON file of tool schemas — a list of objects, as transformers'
/// `apply_chat_template(tools=…)` takes them (`{"type": "function", "function": {"name",
/// "description", "parameters"}}`), passed to the template as they are.
///
/// # Errors
/// [`ChatError::Io`] when unreadable; [`ChatError::Field`] when not JSON, not a list, or an
/// entry is not an object.
pub fn read_tools(path: &Path) -> Result<Vec<Json>> {
    let text = std::fs::read_to_string(path).map_err(|source| ChatError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let field = |field: String, reason: String| ChatError::Field {
        path: path.to_path_buf(),
        field,
        reason,
    };
    let tools = match serde_json::from_str::<Json>(&text) {
        Ok(Json::Array(tools)) => tools,
        Ok(other) => {
            return Err(field(
                "tools".into(),
                format!(
                    "expected a list of tool schemas, found {}",
                    json_kind(&other)
                ),
            ));
        }
        Err(e) => return Err(field("tools".into(), format!("not JSON: {e}"))),
    };
    if let Some((i, t)) = tools.iter().enumerate().find(|(_, t)| !t.is_object()) {
        return Err(field(
            format!("tools[{i}]"),
            format!(
                "expected a tool schema (an object with `type` and `function`), found {}",
                json_kind(t)
            ),
        ));
    }
    Ok(tools)
}

/// Puts `system` in front of a conversation: replaces the content of a leading `system`
/// message, or inserts one. A template's default system turn (Qwen2.5's) is only written
/// when no system message is given, so it is replaced, never doubled.
pub fn set_system_message(messages: &mut Vec<Json>, system: &str) {
    if let Some(Json::Object(first)) = messages.first_mut()
        && first.get("role").and_then(Json::as_str) == Some("system")
    {
        first.insert("content".to_string(), Json::String(system.to_string()));
        return;
    }
    let mut msg = JsonMap::new();
    msg.insert("role".to_string(), Json::String("system".to_string()));
    msg.insert("content".to_string(), Json::String(system.to_string()));
    messages.insert(0, Json::Object(msg));
}

/// The error `raise_exception` returns, found again in the render error's source chain.
#[derive(Debug)]
struct RaisedException(String);

impl std::fmt::Display for RaisedException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

/// A model's chat template(s), compiled, with the special tokens they see.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    /// (name, source); names are unique.
    templates: Vec<(String, String)>,
    /// Where the templates came from (for errors), e.g. `model/chat_template.jinja`.
    origin: String,
    special: SpecialTokens,
    fixed_now: Option<CivilDateTime>,
    env: Environment<'static>,
}

impl ChatTemplate {
    /// Finds the chat template of a model directory (see the module docs for the order) and
    /// reads the special tokens from its `tokenizer_config.json` (optional when a
    /// `chat_template.jinja` is present).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config = if config_path.exists() {
            Some(TokenizerConfig::from_file(&config_path)?)
        } else {
            None
        };
        let jinja_path = dir.join(CHAT_TEMPLATE_FILE);
        if jinja_path.exists() {
            let mut templates = vec![("default".to_string(), read_text(&jinja_path)?)];
            templates.extend(read_named_templates(&dir.join(CHAT_TEMPLATES_DIR))?);
            let special = config.map(|c| c.special).unwrap_or_default();
            return Self::build(templates, jinja_path.display().to_string(), special, None);
        }
        let extras = read_named_templates(&dir.join(CHAT_TEMPLATES_DIR))?;
        let Some(config) = config else {
            if extras.is_empty() {
                return Err(ChatError::NoTemplate {
                    dir: dir.to_path_buf(),
                });
            }
            let origin = dir.join(CHAT_TEMPLATES_DIR).display().to_string();
            return Self::build(extras, origin, SpecialTokens::default(), None);
        };
        let mut templates = templates_from_config(&config)?;
        templates.extend(extras);
        if templates.is_empty() {
            return Err(ChatError::NoTemplate {
                dir: dir.to_path_buf(),
            });
        }
        Self::build(
            templates,
            config.path.display().to_string(),
            config.special,
            None,
        )
    }

    /// The template in the jinja file `template` (named `default`) in place of a model's own,
    /// with the special tokens of `dir`'s `tokenizer_config.json` when it has one (EasyR1's
    /// `data.override_chat_template`).
    pub fn from_file_for_dir(template: &Path, dir: &Path) -> Result<Self> {
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let special = if config_path.exists() {
            TokenizerConfig::from_file(&config_path)?.special
        } else {
            SpecialTokens::default()
        };
        let source = read_text(template)?;
        Self::build(
            vec![("default".to_string(), source)],
            template.display().to_string(),
            special,
            None,
        )
    }

    /// A single template from a string (named `default`), with the given special tokens.
    pub fn from_source(source: &str, special: SpecialTokens) -> Result<Self> {
        Self::build(
            vec![("default".to_string(), source.to_string())],
            "chat template".to_string(),
            special,
            None,
        )
    }

    /// Makes `strftime_now` return this time instead of the clock's (for reproducible
    /// prompts and tests).
    pub fn with_fixed_time(self, now: CivilDateTime) -> Result<Self> {
        Self::build(self.templates, self.origin, self.special, Some(now))
    }

    /// The time `strftime_now` is pinned to, if any.
    pub fn fixed_time(&self) -> Option<CivilDateTime> {
        self.fixed_now
    }

    /// The special tokens the templates see.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// The names of the templates (`default`, and e.g. `tool_use`).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.templates.iter().map(|(n, _)| n.as_str())
    }

    /// The source of the template a render with (`with_tools = true`) or without tools uses.
    pub fn source(&self, with_tools: bool) -> Result<&str> {
        let name = self.select(with_tools)?;
        Ok(self
            .templates
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| s.as_str())
            .unwrap_or_default())
    }

    fn select(&self, with_tools: bool) -> Result<&str> {
        let has = |name: &str| self.templates.iter().any(|(n, _)| n == name);
        if with_tools && has("tool_use") {
            Ok("tool_use")
        } else if has("default") {
            Ok("default")
        } else {
            Err(ChatError::NoDefault {
                origin: self.origin.clone(),
                names: self.templates.iter().map(|(n, _)| n.clone()).collect(),
            })
        }
    }

    fn origin_of(&self, name: &str) -> String {
        if self.templates.len() == 1 {
            self.origin.clone()
        } else {
            format!("{} (template `{name}`)", self.origin)
        }
    }

    fn build(
        templates: Vec<(String, String)>,
        origin: String,
        special: SpecialTokens,
        fixed_now: Option<CivilDateTime>,
    ) -> Result<Self> {
        let mut env = Environment::new();
        limit_environment(&mut env);
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| ChatError::Syntax {
                origin: origin.clone(),
                message: e.to_string(),
            })?;
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(python_methods);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson_filter);
        env.add_filter("trim", trim_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", move |format: String| {
            fixed_now
                .unwrap_or_else(CivilDateTime::now_utc)
                .strftime(&format)
        });
        for (name, source) in &templates {
            env.add_template_owned(name.clone(), source.clone())
                .map_err(|e| ChatError::Syntax {
                    origin: if templates.len() == 1 {
                        origin.clone()
                    } else {
                        format!("{origin} (template `{name}`)")
                    },
                    message: jinja_message(&e),
                })?;
        }
        Ok(Self {
            templates,
            origin,
            special,
            fixed_now,
            env,
        })
    }

    /// Renders a conversation as transformers' `apply_chat_template(messages, tools=…,
    /// tokenize=False, add_generation_prompt=…, **extra)` does.
    pub fn render<M: Serialize>(
        &self,
        messages: &[M],
        options: &RenderOptions<'_>,
    ) -> Result<String> {
        let messages = serde_json::to_value(messages).map_err(|e| ChatError::Messages {
            message: e.to_string(),
        })?;
        self.render_json(messages, options)
    }

    /// The text between the end of the assistant turn a model generated (the last message
    /// of `conversation`, whose final token's text is `end_of_turn`, e.g. `<|im_end|>`) and
    /// the model's next turn, when `tool_messages` answer it: what the template writes
    /// after `end_of_turn` in the assistant's turn, the tool messages' turn(s) and the
    /// generation prompt. The model's own tokens are kept as generated and this text is
    /// appended to them, so a multi-turn trajectory is the model's tokens and the
    /// template's, never the model's re-tokenized.
    ///
    /// # Errors
    /// [`ChatError::Continuation`] when the conversation rendered with the tool messages
    /// does not begin with the conversation rendered without them (the template rewrites
    /// earlier turns), or `end_of_turn` is not in it; rendering errors.
    pub fn tool_continuation(
        &self,
        conversation: &[Json],
        tool_messages: &[Json],
        end_of_turn: &str,
        options: &RenderOptions<'_>,
    ) -> Result<String> {
        let before = self.render_json(Json::Array(conversation.to_vec()), &closed(options))?;
        self.continuation_after(&before, conversation, tool_messages, end_of_turn, options)
    }

    /// The rendering of `conversation` (closed: no generation prompt) when the template
    /// writes `end_of_turn` (the text of the token that ended the model's turn, its last
    /// message) in it, so that a tool's answer can follow
    /// ([`ChatTemplate::continuation_after`]); `None` when it does not: a turn ended by
    /// another end-of-sequence token (Qwen's `<|endoftext|>` under its ChatML template)
    /// cannot be continued, the model stopped writing.
    ///
    /// # Errors
    /// Rendering errors.
    pub fn closed_turn(
        &self,
        conversation: &[Json],
        end_of_turn: &str,
        options: &RenderOptions<'_>,
    ) -> Result<Option<String>> {
        let before = self.render_json(Json::Array(conversation.to_vec()), &closed(options))?;
        Ok((!end_of_turn.is_empty() && before.contains(end_of_turn)).then_some(before))
    }

    /// [`ChatTemplate::tool_continuation`] with the closed rendering of `conversation`,
    /// `before`, already made ([`ChatTemplate::closed_turn`]).
    ///
    /// # Errors
    /// As [`ChatTemplate::tool_continuation`].
    pub fn continuation_after(
        &self,
        before: &str,
        conversation: &[Json],
        tool_messages: &[Json],
        end_of_turn: &str,
        options: &RenderOptions<'_>,
    ) -> Result<String> {
        let origin = self.origin_of(self.select(options.tools.is_some())?);
        let fail = |message: String| ChatError::Continuation {
            origin: origin.clone(),
            message,
        };
        let mut all = conversation.to_vec();
        all.extend_from_slice(tool_messages);
        let open = RenderOptions {
            add_generation_prompt: true,
            ..*options
        };
        let after = self.render_json(Json::Array(all), &open)?;
        let Some(added) = after.strip_prefix(before) else {
            return Err(fail(
                "the template renders the earlier turns differently once tool messages \
                 follow them"
                    .into(),
            ));
        };
        let Some(end) = (!end_of_turn.is_empty())
            .then(|| before.rfind(end_of_turn))
            .flatten()
        else {
            return Err(fail(format!(
                "the assistant's turn does not end with {end_of_turn:?} in the template"
            )));
        };
        Ok(format!("{}{added}", &before[end + end_of_turn.len()..]))
    }

    /// Renders `messages` with `system` as the system message (see [`set_system_message`]):
    /// how the trainer puts a rubric in front of a prompt.
    pub fn render_with_system<M: Serialize>(
        &self,
        system: &str,
        messages: &[M],
        options: &RenderOptions<'_>,
    ) -> Result<String> {
        let mut list = match serde_json::to_value(messages) {
            Ok(Json::Array(list)) => list,
            Ok(other) => {
                return Err(ChatError::Messages {
                    message: format!("expected a list of messages, found {}", json_kind(&other)),
                });
            }
            Err(e) => {
                return Err(ChatError::Messages {
                    message: e.to_string(),
                });
            }
        };
        set_system_message(&mut list, system);
        self.render_json(Json::Array(list), options)
    }

    fn render_json(&self, messages: Json, options: &RenderOptions<'_>) -> Result<String> {
        let name = self.select(options.tools.is_some())?;
        // Same variables, in the same order, as transformers:
        // {**special_tokens_map, **kwargs} then messages/tools/documents/add_generation_prompt
        // (transformers 5's special_tokens_map holds the named tokens only, not
        // `additional_special_tokens`).
        let mut ctx = JsonMap::new();
        for (k, v) in self.special.named() {
            ctx.insert(k.to_string(), Json::String(v.to_string()));
        }
        if let Some(extra) = options.extra {
            for (k, v) in extra {
                ctx.insert(k.clone(), v.clone());
            }
        }
        ctx.insert("messages".to_string(), messages);
        ctx.insert(
            "tools".to_string(),
            options
                .tools
                .map_or(Json::Null, |t| Json::Array(t.to_vec())),
        );
        ctx.insert("documents".to_string(), Json::Null);
        ctx.insert(
            "add_generation_prompt".to_string(),
            Json::Bool(options.add_generation_prompt),
        );
        let ctx = Json::Object(ctx);
        let template = self.env.get_template(name).map_err(|e| ChatError::Render {
            origin: self.origin_of(name),
            message: jinja_message(&e),
        })?;
        render_bounded(&template, Value::from(minijinja::value::Serde(&ctx))).map_err(|f| match f {
            RenderFailure::Limit(message) => ChatError::Limit {
                origin: self.origin_of(name),
                message,
            },
            RenderFailure::Jinja(e) => match raised_message(&e) {
                Some(message) => ChatError::Raised {
                    origin: self.origin_of(name),
                    message,
                },
                None => ChatError::Render {
                    origin: self.origin_of(name),
                    message: jinja_message(&e),
                },
            },
        })
    }
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| ChatError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// `chat_templates/<name>.jinja`, sorted by name; none when the directory is absent.
fn read_named_templates(dir: &Path) -> Result<Vec<(String, String)>> {
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    let entries = std::fs::read_dir(dir).map_err(|source| ChatError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut found = BTreeMap::new();
    for entry in entries {
        let entry = entry.map_err(|source| ChatError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("jinja") {
            continue;
        }
        if let Some(name) = path.file_stem().and_then(|s| s.to_str()) {
            found.insert(name.to_string(), read_text(&path)?);
        }
    }
    Ok(found.into_iter().collect())
}

/// The `chat_template` field: absent/null → none, a string → `default`, a list of
/// `{name, template}` → those.
fn templates_from_config(config: &TokenizerConfig) -> Result<Vec<(String, String)>> {
    let field_err = |field: String, reason: String| ChatError::Field {
        path: config.path.clone(),
        field,
        reason,
    };
    match config.raw.get("chat_template") {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::String(s)) => Ok(vec![("default".to_string(), s.clone())]),
        Some(Json::Array(items)) => {
            let mut out: Vec<(String, String)> = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let name = item.get("name").and_then(Json::as_str);
                let template = item.get("template").and_then(Json::as_str);
                match (name, template) {
                    (Some(name), Some(template)) => {
                        // Later entries win, as with transformers' dict.
                        out.retain(|(n, _)| n != name);
                        out.push((name.to_string(), template.to_string()));
                    }
                    _ => {
                        return Err(field_err(
                            format!("chat_template[{i}]"),
                            "expected {\"name\": string, \"template\": string}".to_string(),
                        ));
                    }
                }
            }
            Ok(out)
        }
        Some(other) => Err(field_err(
            "chat_template".to_string(),
            format!(
                "expected a template string or a list of named templates, found {}",
                json_kind(other)
            ),
        )),
    }
}

fn jinja_message(e: &JinjaError) -> String {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let _ = write!(msg, ": {s}");
        source = s.source();
    }
    msg
}

fn raised_message(e: &JinjaError) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(r) = s.downcast_ref::<RaisedException>() {
            return Some(r.0.clone());
        }
        source = s.source();
    }
    None
}

/// `raise_exception(message)`: fails the render with `message`.
/// Python's `str.isspace()`: Unicode `White_Space` (Rust's `char::is_whitespace`) and the
/// four separators U+001C–U+001F, which Rust's `str::trim` keeps and Python strips.
fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.strip(chars)` (`left`/`right`: `lstrip`/`rstrip` are one side of it);
/// `chars = None` strips [`is_python_space`] characters.
fn python_strip<'a>(s: &'a str, chars: Option<&str>, left: bool, right: bool) -> &'a str {
    let strip = |c: char| chars.map_or_else(|| is_python_space(c), |set| set.contains(c));
    let s = if left { s.trim_start_matches(strip) } else { s };
    if right { s.trim_end_matches(strip) } else { s }
}

/// Python's `str.split(None, maxsplit)`: runs of whitespace separate, none at the ends;
/// after `maxsplit` splits the rest is one item, its leading whitespace dropped.
fn python_split_whitespace(s: &str, maxsplit: Option<i64>) -> Vec<Value> {
    let mut out = Vec::new();
    let mut rest = s.trim_start_matches(is_python_space);
    while !rest.is_empty() {
        if maxsplit.is_some_and(|m| m >= 0 && out.len() as i64 == m) {
            out.push(Value::from(rest));
            break;
        }
        let end = rest.find(is_python_space).unwrap_or(rest.len());
        out.push(Value::from(&rest[..end]));
        rest = rest[end..].trim_start_matches(is_python_space);
    }
    out
}

/// Jinja2's `trim` filter is Python's `str.strip(chars)`.
fn trim_filter(s: &str, chars: Option<&str>) -> String {
    python_strip(s, chars, true, true).to_string()
}

/// Python's string, dict and list methods: `minijinja-contrib`'s, except those whose idea
/// of whitespace must be Python's (`strip`, `lstrip`, `rstrip`, `split()`): a template's
/// output then matches transformers' character for character.
fn python_methods(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, JinjaError> {
    if let Some(s) = value.as_str() {
        match method {
            "strip" | "lstrip" | "rstrip" => {
                let (chars,): (Option<&str>,) = minijinja::value::from_args(args)?;
                let (left, right) = (method != "rstrip", method != "lstrip");
                return Ok(Value::from(python_strip(s, chars, left, right)));
            }
            "split" => {
                let (sep, maxsplit): (Option<&str>, Option<i64>) =
                    minijinja::value::from_args(args)?;
                if sep.is_none() {
                    return Ok(Value::from(python_split_whitespace(s, maxsplit)));
                }
            }
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

fn raise_exception(message: Value) -> std::result::Result<Value, JinjaError> {
    let text = match message.as_str() {
        Some(s) => s.to_string(),
        None => py_str(&message),
    };
    Err(
        JinjaError::new(ErrorKind::InvalidOperation, "raise_exception called")
            .with_source(RaisedException(text)),
    )
}

/// Prints values as Python's `str()` does (`True`, `None`, `1.0`, `{'a': [1, 'x']}`);
/// strings and undefined print as minijinja prints them (raw, empty).
fn python_formatter(
    out: &mut Output,
    state: &mut State,
    value: &Value,
) -> std::result::Result<(), JinjaError> {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Seq | ValueKind::Map => {
            out.write_str(&py_str(value)).map_err(|e| {
                JinjaError::new(ErrorKind::WriteFailure, "cannot write output").with_source(e)
            })
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python `str(value)`.
fn py_str(value: &Value) -> String {
    if let Some(s) = value.as_str() {
        return s.to_string();
    }
    let mut out = String::new();
    py_repr(value, &mut out);
    out
}

/// Python `repr(value)` of JSON-like values.
fn py_repr(value: &Value, out: &mut String) {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&py_number(value)),
        ValueKind::String => py_repr_str(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq => {
            out.push('[');
            if let Ok(iter) = value.try_iter() {
                for (i, item) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(&item, out);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(iter) = value.try_iter() {
                for (i, key) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(&key, out);
                    out.push_str(": ");
                    py_repr(&value.get_item(&key).unwrap_or_default(), out);
                }
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`.
fn py_repr_str(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !py_printable(c) => {
                let cp = c as u32;
                let _ = if cp <= 0xff {
                    write!(out, "\\x{cp:02x}")
                } else if cp <= 0xffff {
                    write!(out, "\\u{cp:04x}")
                } else {
                    write!(out, "\\U{cp:08x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Approximates Python's `str.isprintable` for one character: control characters, the
/// non-space separators and the common format characters are not printable.
fn py_printable(c: char) -> bool {
    let cp = c as u32;
    !(cp < 0x20
        || (0x7f..=0xa0).contains(&cp)
        || cp == 0xad
        || (0x2000..=0x200f).contains(&cp)
        || (0x2028..=0x202f).contains(&cp)
        || (0x205f..=0x206f).contains(&cp)
        || cp == 0x1680
        || cp == 0x3000
        || cp == 0xfeff
        || (0xd800..=0xdfff).contains(&cp)
        || (0xe000..=0xf8ff).contains(&cp))
}

/// A number as Python prints it (`1`, `2.5`, `2.0`, `1e-05`, `1e+16`).
fn py_number(value: &Value) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    match f64::try_from(value.clone()) {
        Ok(f) => py_float(f),
        Err(_) => value.to_string(),
    }
}

/// Python's `repr(float)`.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "nan".to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.to_string();
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{f}");
        if s.contains('.') { s } else { format!("{s}.0") }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.unsigned_abs())
    }
}

/// Python `json.dumps` options of HF's `tojson` filter.
struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// HF's `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`:
/// `json.dumps` with those options (not Jinja's HTML-escaping `tojson`).
fn tojson_filter(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, JinjaError> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.is_integer() => {
            let n = i64::try_from(v).unwrap_or(0).clamp(0, 1024) as usize;
            Some(" ".repeat(n))
        }
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ));
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v.try_iter().map(|i| i.collect()).unwrap_or_default();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => (
                    a.as_str().unwrap_or_default().to_string(),
                    b.as_str().unwrap_or_default().to_string(),
                ),
                _ => {
                    return Err(JinjaError::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ));
                }
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let style = JsonStyle {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(value, &style, 0, &mut out)?;
    Ok(Value::from(out))
}

fn write_json(
    value: &Value,
    style: &JsonStyle,
    depth: usize,
    out: &mut String,
) -> std::result::Result<(), JinjaError> {
    if depth > 512 {
        return Err(JinjaError::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                out.push_str(&value.to_string());
            } else {
                let f = f64::try_from(value.clone())?;
                if f.is_nan() {
                    out.push_str("NaN");
                } else if f.is_infinite() {
                    out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
                } else {
                    out.push_str(&py_float(f));
                }
            }
        }
        ValueKind::String => json_str(value.as_str().unwrap_or_default(), style.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(items.len(), '[', ']', style, depth, out, |i, out| {
                write_json(&items[i], style, depth + 1, out)
            })?;
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                let key = match key.as_str() {
                    Some(s) => s.to_string(),
                    None => {
                        let mut k = String::new();
                        write_json(&key, style, depth + 1, &mut k)?;
                        k.trim_matches('"').to_string()
                    }
                };
                entries.push((key, item));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(entries.len(), '{', '}', style, depth, out, |i, out| {
                json_str(&entries[i].0, style.ensure_ascii, out);
                out.push_str(&style.key_sep);
                write_json(&entries[i].1, style, depth + 1, out)
            })?;
        }
        kind => {
            return Err(JinjaError::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a {kind} value is not JSON serializable"),
            ));
        }
    }
    Ok(())
}

fn write_container(
    len: usize,
    open: char,
    close: char,
    style: &JsonStyle,
    depth: usize,
    out: &mut String,
    mut item: impl FnMut(usize, &mut String) -> std::result::Result<(), JinjaError>,
) -> std::result::Result<(), JinjaError> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        if i > 0 {
            out.push_str(&style.item_sep);
        }
        if let Some(indent) = &style.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth + 1));
        }
        item(i, out)?;
    }
    if let Some(indent) = &style.indent {
        out.push('\n');
        out.push_str(&indent.repeat(depth));
    }
    out.push(close);
    Ok(())
}

/// A JSON string as Python's `json.dumps` writes it.
fn json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) == 0x7f) => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `options` without the generation prompt: a conversation rendered as it stands.
fn closed<'a>(options: &RenderOptions<'a>) -> RenderOptions<'a> {
    RenderOptions {
        add_generation_prompt: false,
        ..*options
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render_str(source: &str, ctx: Json) -> String {
        let t = ChatTemplate::from_source(source, SpecialTokens::default()).unwrap();
        let messages = ctx.get("messages").cloned().unwrap_or_else(|| json!([]));
        let extra = ctx.as_object().cloned().unwrap_or_default();
        t.render_json(
            messages,
            &RenderOptions {
                extra: Some(&extra),
                ..RenderOptions::default()
            },
        )
        .unwrap()
    }

    #[test]
    fn python_repr_of_values() {
        let out = render_str(
            "{{ t }} {{ n }} {{ f }} {{ g }} {{ big }} {{ small }} {{ d }} {{ s }}",
            json!({"t": true, "n": null, "f": 2.0, "g": 0.1, "big": 1e16, "small": 1e-5,
                   "d": {"a": [1, "it's", "x\ny"], "b": false}, "s": "plain"}),
        );
        assert_eq!(
            out,
            "True None 2.0 0.1 1e+16 1e-05 {'a': [1, \"it's\", 'x\\ny'], 'b': False} plain"
        );
    }

    #[test]
    fn tojson_matches_json_dumps() {
        let out = render_str(
            "{{ v | tojson }}|{{ v | tojson(indent=2) }}|{{ v | tojson(separators=(',', ':'), sort_keys=true) }}|{{ u | tojson(ensure_ascii=true) }}",
            json!({"v": {"z": [1, 2.5, null], "a": {}}, "u": "é🙂<&>"}),
        );
        assert_eq!(
            out,
            "{\"z\": [1, 2.5, null], \"a\": {}}|{\n  \"z\": [\n    1,\n    2.5,\n    null\n  ],\n  \"a\": {}\n}|{\"a\":{},\"z\":[1,2.5,null]}|\"\\u00e9\\ud83d\\ude42<&>\""
        );
    }

    #[test]
    fn strftime_directives() {
        let t = CivilDateTime::new(2024, 2, 29, 0, 7, 9).unwrap();
        assert_eq!(
            t.strftime("%a %A %b %B %d %-d %e %H %I %j %m %-m %M %p %S %y %Y %% %Q"),
            "Thu Thursday Feb February 29 29 29 00 12 060 02 2 07 AM 09 24 2024 % %Q"
        );
        assert!(CivilDateTime::new(2023, 2, 29, 0, 0, 0).is_none());
        assert!(CivilDateTime::new(2024, 13, 1, 0, 0, 0).is_none());
        let (y, m, d) = civil_from_days(days_from_civil(1999, 12, 31));
        assert_eq!((y, m, d), (1999, 12, 31));
        let now = CivilDateTime::now_utc();
        assert!(now.year >= 2024);
    }

    #[test]
    fn system_message_replaced_or_inserted() {
        let mut m = vec![json!({"role": "user", "content": "q"})];
        set_system_message(&mut m, "S");
        assert_eq!(m[0], json!({"role": "system", "content": "S"}));
        set_system_message(&mut m, "T");
        assert_eq!(m.len(), 2);
        assert_eq!(m[0]["content"], "T");
    }

    #[test]
    fn raise_exception_message_is_kept() {
        let t = ChatTemplate::from_source(
            "{{ raise_exception('bad role: ' + messages[0].role) }}",
            SpecialTokens::default(),
        )
        .unwrap();
        let err = t
            .render(&[ChatMessage::new("robot", "x")], &RenderOptions::default())
            .unwrap_err();
        match &err {
            ChatError::Raised { message, .. } => assert_eq!(message, "bad role: robot"),
            other => panic!("expected Raised, got {other:?}"),
        }
    }

    #[test]
    fn syntax_error_is_reported() {
        let err = ChatTemplate::from_source("{% if %}", SpecialTokens::default()).unwrap_err();
        assert!(matches!(err, ChatError::Syntax { .. }), "{err}");
    }

    #[test]
    fn named_template_selection() {
        let cfg = TokenizerConfig::from_json(
            json!({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "other", "template": "O"}]}),
            Path::new("tokenizer_config.json"),
        )
        .unwrap();
        let t = ChatTemplate::build(
            templates_from_config(&cfg).unwrap(),
            "tokenizer_config.json".into(),
            SpecialTokens::default(),
            None,
        )
        .unwrap();
        let tools = [json!({"name": "f"})];
        let with_tools = RenderOptions {
            tools: Some(&tools),
            ..RenderOptions::default()
        };
        assert_eq!(t.render::<ChatMessage>(&[], &with_tools).unwrap(), "T");
        let err = t
            .render::<ChatMessage>(&[], &RenderOptions::default())
            .unwrap_err();
        assert!(matches!(err, ChatError::NoDefault { .. }), "{err}");
        let bad =
            TokenizerConfig::from_json(json!({"chat_template": 3}), Path::new("c.json")).unwrap();
        let err = templates_from_config(&bad).unwrap_err().to_string();
        assert!(
            err.contains("c.json") && err.contains("chat_template"),
            "{err}"
        );
    }
}
