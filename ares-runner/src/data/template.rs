//! Prompt templates (`data.format_prompt`): a Jinja file that wraps each question with
//! instructions, like `examples/format_prompt/math.jinja`: `{{ content | trim }}`, then the
//! request for the final answer inside `\boxed{}`. The question is the variable `content`.

use std::path::Path;

use minijinja::{Environment, UndefinedBehavior};

use crate::hf::chat::{RenderFailure, limit_environment, render_bounded};

use super::error::{DataError, Result};
use super::example::Prompt;

/// Name of the one template in the environment.
const NAME: &str = "format_prompt";

/// A compiled prompt template.
///
/// Rendered as Jinja2 renders a plain `Template`: no auto-escaping, the template's final
/// newline dropped, Python string methods (`.strip()`, …) available. Unlike Jinja2's
/// default, an undefined variable is an error, so a typo such as `{{ contnet }}` fails
/// instead of silently dropping the question.
#[derive(Debug, Clone)]
pub struct PromptTemplate {
    env: Environment<'static>,
    origin: String,
}

impl PromptTemplate {
    /// Reads and compiles a template file.
    ///
    /// Errors: the file cannot be read ([`DataError::Io`]); a syntax error, or a template
    /// that does not put `content` into its output ([`DataError::Template`]).
    pub fn from_file(path: &Path) -> Result<Self> {
        let source = std::fs::read_to_string(path).map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_source(&path.display().to_string(), &source)
    }

    /// Compiles a template given as text; `origin` names it in errors.
    ///
    /// Errors: as [`from_file`](Self::from_file).
    pub fn from_source(origin: &str, source: &str) -> Result<Self> {
        let mut env = Environment::new();
        limit_environment(&mut env);
        // minijinja, like Jinja2, drops the template's final newline by default.
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_undefined_behavior(UndefinedBehavior::Strict);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_template_owned(NAME, source.to_owned())
            .map_err(|e| template_error(origin, &e))?;
        let template = Self {
            env,
            origin: origin.to_owned(),
        };
        // A template that never prints the question would train on instructions alone.
        let probe = "\u{1}ares-probe\u{1}";
        if !template.render(probe)?.contains(probe) {
            return Err(DataError::Template {
                origin: origin.to_owned(),
                message: "the template never outputs `{{ content }}` (the question)".into(),
            });
        }
        Ok(template)
    }

    /// The template with `content` set to the question.
    ///
    /// Errors ([`DataError::Template`]): rendering fails (undefined variable, bad filter, …).
    pub fn render(&self, content: &str) -> Result<String> {
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| template_error(&self.origin, &e))?;
        render_bounded(&template, minijinja::context! { content => content }).map_err(|f| match f {
            RenderFailure::Jinja(e) => template_error(&self.origin, &e),
            RenderFailure::Limit(message) => DataError::Template {
                origin: self.origin.clone(),
                message,
            },
        })
    }

    /// Applies the template to a prompt: a text prompt is rendered whole; in a chat prompt
    /// the content of the last `user` message is rendered (system and earlier turns are kept
    /// as they are). A chat prompt without a user message is returned unchanged.
    ///
    /// Errors: as [`render`](Self::render).
    pub fn apply(&self, prompt: &Prompt) -> Result<Prompt> {
        match prompt {
            Prompt::Text(t) => Ok(Prompt::Text(self.render(t)?)),
            Prompt::Messages(messages) => {
                let mut messages = messages.clone();
                if let Some(m) = messages.iter_mut().rev().find(|m| m.role == "user") {
                    m.content = self.render(&m.content)?;
                }
                Ok(Prompt::Messages(messages))
            }
        }
    }
}

fn template_error(origin: &str, e: &minijinja::Error) -> DataError {
    let mut message = e.to_string();
    if let Some(line) = e.line() {
        message = format!("line {line}: {message}");
    }
    DataError::Template {
        origin: origin.to_owned(),
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::chat::ChatMessage;

    const MATH: &str = "{{ content | trim }} Think step by step inside <think> </think>, \
                        then put the final answer in \\boxed{}.\n";

    #[test]
    fn math_template() {
        let t = PromptTemplate::from_source("math.jinja", MATH).unwrap();
        assert_eq!(
            t.render("  What is 2+2?\n").unwrap(),
            "What is 2+2? Think step by step inside <think> </think>, then put the final answer in \\boxed{}."
        );
        // no HTML escaping
        assert_eq!(
            t.render("a < b & c").unwrap(),
            "a < b & c Think step by step inside <think> </think>, then put the final answer in \\boxed{}."
        );
    }

    #[test]
    fn python_methods_and_apply() {
        let t = PromptTemplate::from_source("t", "Q: {{ content.strip() }}").unwrap();
        let p = Prompt::Messages(vec![
            ChatMessage::system("sys"),
            ChatMessage::user(" one "),
            ChatMessage::user(" two "),
        ]);
        assert_eq!(
            t.apply(&p).unwrap(),
            Prompt::Messages(vec![
                ChatMessage::system("sys"),
                ChatMessage::user(" one "),
                ChatMessage::user("Q: two"),
            ])
        );
        assert_eq!(
            t.apply(&Prompt::Text("x ".into())).unwrap(),
            Prompt::Text("Q: x".into())
        );
    }

    #[test]
    fn errors() {
        let e = PromptTemplate::from_source("bad.jinja", "{{ content ")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("prompt template bad.jinja: line 1:"), "{e}");
        let e = PromptTemplate::from_source("typo.jinja", "{{ contnet }}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("typo.jinja") && e.contains("undefined"), "{e}");
        let e = PromptTemplate::from_source("fixed.jinja", "Always the same")
            .unwrap_err()
            .to_string();
        assert!(e.contains("never outputs `{{ content }}`"), "{e}");
        let e = PromptTemplate::from_file(Path::new("/nonexistent/math.jinja"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/math.jinja: cannot read"), "{e}");
    }

    #[test]
    fn a_template_that_does_not_end_is_stopped() {
        let source = "{{ content }}{% for i in range(100000) %}{% for j in range(100000) %}\
                      {% endfor %}{% endfor %}";
        // the probe render at compile time already runs it
        let e = PromptTemplate::from_source("loop.jinja", source)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("loop.jinja") && e.contains("instructions"),
            "{e}"
        );
    }
}
