//! Tool calls in a model's turn, in the formats the supported chat templates teach:
//!
//! - **Hermes / Qwen** (Qwen2.5, Qwen3, QwQ): each call a JSON object
//!   `{"name": …, "arguments": {…}}` between `<tool_call>` and `</tool_call>`, any number in
//!   a turn, text around them;
//! - **Llama 3.1 JSON**: the whole turn is the call, `{"name": …, "parameters": {…}}`,
//!   optionally after `<|python_tag|>`; several calls separated by `;`.
//!
//! A reasoning model's thoughts are not its calls: text up to the last `</think>` is
//! skipped, as Qwen3's template drops it from the history. A call that does not parse is
//! kept as [`ParsedCall::Malformed`] with the reason, for the model to be told — never an
//! error of the run.

use serde_json::{Map, Value};

/// How a model writes its tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// `<tool_call>{"name", "arguments"}</tool_call>` (Qwen2.5 / Qwen3, Hermes).
    Hermes,
    /// A bare `{"name", "parameters"}` turn (Llama 3.1 / 3.2 custom tools).
    Llama3Json,
}

impl ToolCallFormat {
    /// The format a chat template teaches, read from its source: Hermes when it writes
    /// `<tool_call>`, Llama 3 JSON when it writes `<|python_tag|>` or asks for
    /// `"parameters"`; `None` for a template without tools.
    pub fn of_template(source: &str) -> Option<Self> {
        if source.contains("<tool_call>") {
            Some(Self::Hermes)
        } else if source.contains("<|python_tag|>") || source.contains("\"parameters\"") {
            Some(Self::Llama3Json)
        } else {
            None
        }
    }
}

/// One call as the model wrote it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments (an object; a call without arguments has none).
    pub arguments: Map<String, Value>,
}

/// A call, or what stood in its place.
#[derive(Debug, Clone, PartialEq)]
pub enum ParsedCall {
    /// A well-formed call.
    Call(ToolCall),
    /// Text in a call's place that is not one: the text and why.
    Malformed {
        /// What the model wrote.
        text: String,
        /// Why it is not a call.
        reason: String,
    },
}

/// A model's turn split into its answer text and its calls.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Turn {
    /// The text outside the calls (and after the reasoning), trimmed.
    pub content: String,
    /// The calls, in order.
    pub calls: Vec<ParsedCall>,
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

/// Splits `text` (a decoded turn, special tokens kept or not) into content and calls.
pub fn parse_turn(text: &str, format: ToolCallFormat) -> Turn {
    let text = text
        .rsplit_once("</think>")
        .map_or(text, |(_, after)| after);
    match format {
        ToolCallFormat::Hermes => parse_hermes(text),
        ToolCallFormat::Llama3Json => parse_llama3(text),
    }
}

fn parse_hermes(text: &str) -> Turn {
    let mut turn = Turn::default();
    let mut content = String::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        content.push_str(&rest[..start]);
        let body = &rest[start + OPEN.len()..];
        match body.find(CLOSE) {
            Some(end) => {
                turn.calls
                    .push(call_from_json(body[..end].trim(), "arguments"));
                rest = &body[end + CLOSE.len()..];
            }
            None => {
                turn.calls.push(ParsedCall::Malformed {
                    text: body.trim().to_string(),
                    reason: format!("{OPEN} is never closed by {CLOSE}"),
                });
                rest = "";
            }
        }
    }
    content.push_str(rest);
    turn.content = content.trim().to_string();
    turn
}

fn parse_llama3(text: &str) -> Turn {
    let trimmed = text.trim_start();
    let body = trimmed.strip_prefix(PYTHON_TAG).unwrap_or(trimmed).trim();
    if !body.starts_with('{') {
        return Turn {
            content: text.trim().to_string(),
            calls: Vec::new(),
        };
    }
    let mut calls = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        match values.next() {
            Some(Ok(v)) => {
                let used = values.byte_offset();
                calls.push(call_from_value(&rest[..used], v, "parameters"));
                rest = rest[used..]
                    .trim_start()
                    .trim_start_matches(';')
                    .trim_start();
            }
            Some(Err(e)) => {
                calls.push(ParsedCall::Malformed {
                    text: rest.to_string(),
                    reason: format!("not JSON: {e}"),
                });
                break;
            }
            None => break,
        }
    }
    Turn {
        content: String::new(),
        calls,
    }
}

fn call_from_json(text: &str, arguments_key: &str) -> ParsedCall {
    match serde_json::from_str::<Value>(text) {
        Ok(v) => call_from_value(text, v, arguments_key),
        Err(e) => ParsedCall::Malformed {
            text: text.to_string(),
            reason: format!("not JSON: {e}"),
        },
    }
}

/// A call from a parsed object: `name` a string, the arguments (`arguments_key`, or the
/// other format's key) an object, a JSON text of one, or absent.
fn call_from_value(text: &str, value: Value, arguments_key: &str) -> ParsedCall {
    let bad = |reason: String| ParsedCall::Malformed {
        text: text.to_string(),
        reason,
    };
    let Value::Object(mut object) = value else {
        return bad("a tool call must be a JSON object with `name` and arguments".into());
    };
    let name = match object.remove("name") {
        Some(Value::String(name)) if !name.trim().is_empty() => name,
        Some(_) => return bad("`name` must be a non-empty string".into()),
        None => return bad("the call has no `name`".into()),
    };
    let other = if arguments_key == "arguments" {
        "parameters"
    } else {
        "arguments"
    };
    let arguments = match object
        .remove(arguments_key)
        .or_else(|| object.remove(other))
    {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(args)) => args,
        // some models write the arguments as a JSON string
        Some(Value::String(s)) => match serde_json::from_str::<Value>(&s) {
            Ok(Value::Object(args)) => args,
            _ => return bad(format!("`{arguments_key}` must be a JSON object")),
        },
        Some(_) => return bad(format!("`{arguments_key}` must be a JSON object")),
    };
    ParsedCall::Call(ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(name: &str, args: Value) -> ParsedCall {
        ParsedCall::Call(ToolCall {
            name: name.into(),
            arguments: args.as_object().unwrap().clone(),
        })
    }

    #[test]
    fn hermes_calls_are_found_around_text() {
        let t = parse_turn(
            "Let me compute.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": \
             {\"expression\": \"12*34\"}}\n</tool_call>",
            ToolCallFormat::Hermes,
        );
        assert_eq!(t.content, "Let me compute.");
        assert_eq!(
            t.calls,
            [call("calculator", json!({"expression": "12*34"}))]
        );
        // no call: the text is the content
        let t = parse_turn("  \\boxed{4} ", ToolCallFormat::Hermes);
        assert_eq!((t.content.as_str(), t.calls.len()), ("\\boxed{4}", 0));
    }

    #[test]
    fn several_calls_in_one_turn_keep_their_order() {
        let t = parse_turn(
            "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n\
             <tool_call>{\"name\": \"b\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>\n\
             <tool_call>{\"name\": \"c\"}</tool_call>",
            ToolCallFormat::Hermes,
        );
        assert_eq!(
            t.calls,
            [
                call("a", json!({})),
                call("b", json!({"x": 1})),
                call("c", json!({}))
            ]
        );
        assert_eq!(t.content, "");
    }

    #[test]
    fn calls_after_thinking_count_and_calls_in_it_do_not() {
        let text = "<think>\nI could write <tool_call>{\"name\": \"x\"}</tool_call> but \
                    will not.\n</think>\n\n<tool_call>{\"name\": \"calculator\", \
                    \"arguments\": {\"expression\": \"2^10\"}}</tool_call>";
        let t = parse_turn(text, ToolCallFormat::Hermes);
        assert_eq!(t.calls, [call("calculator", json!({"expression": "2^10"}))]);
        // the template opened the think block: only its end is in the output
        let t = parse_turn(
            "hmm</think><tool_call>{\"name\": \"y\"}</tool_call>",
            ToolCallFormat::Hermes,
        );
        assert_eq!(t.calls, [call("y", json!({}))]);
    }

    #[test]
    fn malformed_calls_say_why() {
        let reason = |text: &str| match &parse_turn(text, ToolCallFormat::Hermes).calls[..] {
            [ParsedCall::Malformed { reason, .. }] => reason.clone(),
            other => panic!("{other:?}"),
        };
        assert!(reason("<tool_call>{\"name\": \"a\",</tool_call>").starts_with("not JSON"));
        assert!(reason("<tool_call>[1, 2]</tool_call>").contains("JSON object"));
        assert!(reason("<tool_call>{\"arguments\": {}}</tool_call>").contains("no `name`"));
        assert!(reason("<tool_call>{\"name\": 3}</tool_call>").contains("non-empty string"));
        assert!(
            reason("<tool_call>{\"name\": \"a\", \"arguments\": [1]}</tool_call>")
                .contains("`arguments` must be a JSON object")
        );
        // cut off by the length limit
        assert!(reason("<tool_call>{\"name\": \"a\"").contains("never closed"));
    }

    /// Token boundaries do not matter: a turn is parsed whole once decoded, however its
    /// tags were split into tokens.
    #[test]
    fn calls_split_across_tokens_parse_the_same() {
        let pieces = [
            "<tool",
            "_call",
            ">\n{\"na",
            "me\": \"calc",
            "ulator\", \"argu",
            "ments\": {\"ex",
            "pression\": \"1/3+1/6\"}}\n</tool_",
            "call>",
        ];
        let t = parse_turn(&pieces.concat(), ToolCallFormat::Hermes);
        assert_eq!(
            t.calls,
            [call("calculator", json!({"expression": "1/3+1/6"}))]
        );
    }

    #[test]
    fn llama3_json_turns_are_calls() {
        let t = parse_turn(
            "<|python_tag|>{\"name\": \"calculator\", \"parameters\": {\"expression\": \"7*6\"}}",
            ToolCallFormat::Llama3Json,
        );
        assert_eq!(t.calls, [call("calculator", json!({"expression": "7*6"}))]);
        let t = parse_turn(
            "{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", \"arguments\": {}}",
            ToolCallFormat::Llama3Json,
        );
        assert_eq!(t.calls, [call("a", json!({"x": 1})), call("b", json!({}))]);
        let t = parse_turn("The answer is 42.", ToolCallFormat::Llama3Json);
        assert_eq!(
            (t.content.as_str(), t.calls.len()),
            ("The answer is 42.", 0)
        );
        let t = parse_turn(
            "{\"name\": \"a\", \"parameters\": {",
            ToolCallFormat::Llama3Json,
        );
        assert!(matches!(&t.calls[..], [ParsedCall::Malformed { .. }]));
    }

    #[test]
    fn the_format_is_read_from_the_template() {
        assert_eq!(
            ToolCallFormat::of_template("… <tool_call>\\n{\"name\": …"),
            Some(ToolCallFormat::Hermes)
        );
        assert_eq!(
            ToolCallFormat::of_template("{{- '<|python_tag|>' }}"),
            Some(ToolCallFormat::Llama3Json)
        );
        assert_eq!(ToolCallFormat::of_template("{{ messages }}"), None);
    }
}
