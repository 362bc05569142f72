//! Tools a model may call while it answers (multi-turn RL, `worker.rollout.multi_turn`): the
//! calls parsed from its turn ([`calls`]), the tools that answer them, and the message the
//! model sees back.
//!
//! Parsing in the chat templates' formats, the exact [`calculator`], programs as tools
//! ([`external`]), the [`ToolBox`] that runs a call and turns every failure — a malformed
//! call, an unknown tool, bad arguments, an error of the tool — into a `tool` message for
//! the model, never an error of the run, an [`interaction`] program that answers the
//! model's turns as a user would, and the [`episode`] step between two turns with its mask
//! of the model's tokens.

pub mod calculator;
pub mod calls;
pub mod episode;
pub mod external;
pub mod interaction;

use serde_json::{Map, Value, json};

pub use calls::{ParsedCall, ToolCall, ToolCallFormat, Turn, parse_turn};

/// A tool the model can call.
pub trait Tool: Send + Sync {
    /// The schema the chat template renders (transformers' `tools=` entry).
    fn schema(&self) -> Value;
    /// Runs the call with what the data row gives this tool (`row`: its entry of verl's
    /// `extra_info.tools_kwargs`, when the row has one); `Err` is a message the model is
    /// shown.
    ///
    /// # Errors
    /// Arguments the tool cannot use, or its own failure, as text for the model.
    fn call(&self, arguments: &Map<String, Value>, row: Option<&Value>) -> Result<String, String>;
}

/// The name a schema gives its function (`function.name`, or a top-level `name`).
pub fn schema_name(schema: &Value) -> Option<&str> {
    schema
        .pointer("/function/name")
        .or_else(|| schema.get("name"))
        .and_then(Value::as_str)
}

/// What a call gave back, as the `tool` message's content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolResult {
    /// The text the model reads.
    pub content: String,
    /// Whether the call ran and succeeded (for metrics: calls per answer, error rate).
    pub ok: bool,
}

/// The tools of a run, by name.
#[derive(Default)]
pub struct ToolBox {
    tools: Vec<(String, Box<dyn Tool>)>,
}

impl std::fmt::Debug for ToolBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.tools.iter().map(|(n, _)| n))
            .finish()
    }
}

impl ToolBox {
    /// Adds `tool` under its schema's name.
    ///
    /// # Errors
    /// A schema without a name, or a name already taken.
    pub fn add(&mut self, tool: Box<dyn Tool>) -> Result<(), String> {
        let schema = tool.schema();
        let name = schema_name(&schema)
            .ok_or_else(|| format!("a tool schema without `function.name`: {schema}"))?
            .to_string();
        if self.tools.iter().any(|(n, _)| *n == name) {
            return Err(format!("two tools are named `{name}`"));
        }
        self.tools.push((name, tool));
        Ok(())
    }

    /// The schemas, for the chat template.
    pub fn schemas(&self) -> Vec<Value> {
        self.tools.iter().map(|(_, t)| t.schema()).collect()
    }

    /// Runs a parsed call, with the data row's `tools_kwargs` (each tool is given its own
    /// entry). Every failure becomes the result's text, prefixed `error:`.
    pub fn run(&self, call: &ParsedCall, tools_kwargs: Option<&Map<String, Value>>) -> ToolResult {
        let error = |text: String| ToolResult {
            content: format!("error: {text}"),
            ok: false,
        };
        let call = match call {
            ParsedCall::Call(c) => c,
            ParsedCall::Malformed { reason, .. } => {
                return error(format!("the tool call could not be read: {reason}"));
            }
        };
        let Some((_, tool)) = self.tools.iter().find(|(n, _)| *n == call.name) else {
            let names: Vec<&str> = self.tools.iter().map(|(n, _)| n.as_str()).collect();
            return error(format!(
                "there is no tool named `{}`; the tools are: {}",
                call.name,
                names.join(", ")
            ));
        };
        match tool.call(
            &call.arguments,
            tools_kwargs.and_then(|k| k.get(&call.name)),
        ) {
            Ok(content) => ToolResult { content, ok: true },
            Err(e) => error(e),
        }
    }
}

/// The built-in `calculator`: one string argument, `expression`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Calculator;

impl Tool for Calculator {
    fn schema(&self) -> Value {
        json!({
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Exact arithmetic on integers and fractions: + - * / ^ and \
                                parentheses. Returns an integer or a fraction in lowest terms.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "expression": {
                            "type": "string",
                            "description": "The expression, e.g. (17*23 - 4)/3"
                        }
                    },
                    "required": ["expression"]
                }
            }
        })
    }

    fn call(&self, arguments: &Map<String, Value>, _row: Option<&Value>) -> Result<String, String> {
        match arguments.get("expression") {
            Some(Value::String(e)) => calculator::evaluate(e),
            // a number is an expression too
            Some(Value::Number(n)) => calculator::evaluate(&n.to_string()),
            Some(_) => Err("`expression` must be a string".into()),
            None => Err("the calculator needs an `expression` argument".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toolbox() -> ToolBox {
        let mut b = ToolBox::default();
        b.add(Box::new(Calculator)).unwrap();
        b
    }

    #[test]
    fn calls_run_and_failures_become_messages() {
        let b = toolbox();
        let run = |text: &str| {
            let turn = parse_turn(text, ToolCallFormat::Hermes);
            b.run(&turn.calls[0], None)
        };
        let r = run(
            r#"<tool_call>{"name": "calculator", "arguments": {"expression": "1/3+1/6"}}</tool_call>"#,
        );
        assert_eq!((r.content.as_str(), r.ok), ("1/2", true));
        let r = run(
            r#"<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>"#,
        );
        assert_eq!(
            (r.content.as_str(), r.ok),
            ("error: division by zero", false)
        );
        let r = run(r#"<tool_call>{"name": "search", "arguments": {}}</tool_call>"#);
        assert!(
            r.content.contains("no tool named `search`") && r.content.contains("calculator"),
            "{}",
            r.content
        );
        let r = run(r#"<tool_call>{"name": "calculator", "arguments": {}}</tool_call>"#);
        assert!(r.content.contains("needs an `expression`"), "{}", r.content);
        let r = run(r#"<tool_call>{"name": "calculator""#);
        assert!(
            r.content
                .starts_with("error: the tool call could not be read"),
            "{}",
            r.content
        );
    }

    /// Each tool is given its own entry of the row's `tools_kwargs`.
    #[test]
    fn each_tool_gets_its_entry_of_the_rows_kwargs() {
        struct Echo;
        impl Tool for Echo {
            fn schema(&self) -> Value {
                json!({"type": "function", "function": {"name": "echo"}})
            }
            fn call(&self, _: &Map<String, Value>, row: Option<&Value>) -> Result<String, String> {
                Ok(row.map_or("none".into(), Value::to_string))
            }
        }
        let mut b = toolbox();
        b.add(Box::new(Echo)).unwrap();
        let call = |name: &str| {
            ParsedCall::Call(ToolCall {
                name: name.into(),
                arguments: Map::new(),
            })
        };
        let kwargs = json!({"echo": {"ground_truth": "408"}, "other": 1});
        let kwargs = kwargs.as_object().unwrap();
        assert_eq!(
            b.run(&call("echo"), Some(kwargs)).content,
            r#"{"ground_truth":"408"}"#
        );
        assert_eq!(b.run(&call("echo"), None).content, "none");
    }

    #[test]
    fn tool_names_are_unique() {
        let mut b = toolbox();
        assert!(
            b.add(Box::new(Calculator))
                .unwrap_err()
                .contains("two tools")
        );
        assert_eq!(b.schemas().len(), 1);
        assert_eq!(schema_name(&b.schemas()[0]), Some("calculator"));
    }
}
