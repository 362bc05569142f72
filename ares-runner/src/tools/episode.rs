//! One multi-turn trajectory: the model answers; its tool calls run; their results are
//! appended through the chat template ([`ChatTemplate::tool_continuation`]); the model
//! answers again — until a turn without calls, `max_turns` turns, or the token budget.
//!
//! The trajectory is the model's tokens exactly as generated, with the template's and the
//! tools' tokens between its turns, and a mask that says which are the model's: only those
//! are the policy's actions (loss, entropy, KL and length count them alone).
//!
//! [`after_turn`] is the step between two turns, for every driver: [`run_episode`] (one
//! trajectory, each turn generated after the whole trajectory so far — `generate
//! --max-turns`) and the trainer's rollout (`trainer/collect/episodes.rs`: many trajectories in one
//! engine that keeps each turn's KV blocks).

use serde_json::{Map, Value as Json, json};

use super::interaction::Interaction;
use super::{ParsedCall, ToolBox, ToolCallFormat, parse_turn};
use crate::hf::chat::{ChatTemplate, RenderOptions};
use crate::hf::tokenizer::Tokenizer;
use crate::trainer::TrainError;

/// Turn text to and from ids: a tokenizer's part of an episode.
pub trait TurnText {
    /// The text of `ids`, with special tokens written (`special`) or left out.
    ///
    /// # Errors
    /// The tokenizer's.
    fn decode(&self, ids: &[u32], special: bool) -> Result<String, TrainError>;
    /// The ids of template text (special tokens in it become their ids).
    ///
    /// # Errors
    /// The tokenizer's.
    fn encode(&self, text: &str) -> Result<Vec<u32>, TrainError>;
}

impl TurnText for Tokenizer {
    fn decode(&self, ids: &[u32], special: bool) -> Result<String, TrainError> {
        Tokenizer::decode(self, ids, !special)
            .map_err(|e| TrainError::Invalid(format!("tokenizer: {e}")))
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, TrainError> {
        Tokenizer::encode(self, text, false)
            .map_err(|e| TrainError::Invalid(format!("tokenizer: {e}")))
    }
}

/// What the driver needs from a model and its tokenizer.
pub trait TurnModel: TurnText {
    /// Generates after `ids`, at most `max_new` tokens: the new tokens, and whether the
    /// last one ended the turn (an EOS id) rather than the budget.
    ///
    /// # Errors
    /// The model's.
    fn generate(&mut self, ids: &[u32], max_new: usize) -> Result<(Vec<u32>, bool), TrainError>;
}

/// How an episode's turns go on.
#[derive(Debug, Clone, Copy)]
pub struct EpisodeSettings<'a> {
    /// The chat template (it renders the tool turns).
    pub template: &'a ChatTemplate,
    /// Its tools and extra variables, as the prompt was rendered with.
    pub options: RenderOptions<'a>,
    /// How the model writes calls.
    pub format: ToolCallFormat,
    /// The tools that answer.
    pub toolbox: &'a ToolBox,
    /// Model turns at most (≥ 1): a call in the last turn is not run.
    pub max_turns: usize,
    /// The program that answers turns without calls as a user would (none: such a turn is
    /// the answer and ends the episode).
    pub interaction: Option<&'a Interaction>,
}

/// What a data row gives the tools and the interaction (verl's `extra_info` fields).
#[derive(Debug, Clone, Copy, Default)]
pub struct RowKwargs<'a> {
    /// `extra_info.tools_kwargs`: per tool name, what the tool is sent with each call.
    pub tools: Option<&'a Map<String, Json>>,
    /// `extra_info.interaction_kwargs`: what the interaction is sent each turn.
    pub interaction: Option<&'a Json>,
}

/// Why an episode ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// A turn without tool calls: the model's answer (with an interaction: the turn after
    /// which it said `done`, or failed).
    Answered,
    /// The token budget ran out (a turn cut short, or a tool turn that did not fit).
    Length,
    /// `max_turns` turns, the last one still calling tools.
    MaxTurns,
}

/// A model turn that has just been generated.
#[derive(Debug, Clone, Copy)]
pub struct TurnEnd<'t> {
    /// Its tokens.
    pub tokens: &'t [u32],
    /// Whether an EOS id ended it (else the budget cut it).
    pub ended: bool,
    /// Its number in the episode, from 1.
    pub number: usize,
    /// Tokens the episode's budget has left after it.
    pub left: usize,
}

/// What follows a model turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// The episode ends.
    Stop(Stop),
    /// The tools (or the interaction) answered: these template tokens follow (not the
    /// model's), then the model's next turn.
    Append(Vec<u32>),
}

/// What [`after_turn`] decided, and the calls it ran.
#[derive(Debug, Clone, PartialEq)]
pub struct AfterTurn {
    /// What follows.
    pub next: Next,
    /// Tool calls run.
    pub calls: usize,
    /// Of them, those that failed (malformed, unknown tool, tool error).
    pub failed_calls: usize,
    /// The interaction's score of the turn (`None`: it was not asked, or failed).
    pub reward: Option<f64>,
    /// The interaction failed (the episode ends; the error is in `error`).
    pub interaction_error: Option<String>,
}

/// The step after model turn `turn`: appends it to `messages` as the assistant's (its text
/// without special tokens); ends the episode when the budget cut it, when it calls no tool
/// and no interaction is set (the answer), or when it was the last turn allowed. A turn with
/// calls has them run (with the row's `tools_kwargs`) and their messages appended; a turn
/// without calls is sent to the interaction, whose reply ends the episode (`done`, or a
/// failure) or becomes the next user message — the last turn allowed is sent too, for its
/// score. What follows is the appended turn's tokens as the template writes it, or the end
/// of the episode when they do not fit in the budget.
///
/// # Errors
/// The tokenizer's, and a template that cannot continue the conversation
/// ([`crate::hf::chat::ChatError::Continuation`]); a tool's or the interaction's failure is
/// not an error of the run.
pub fn after_turn(
    s: &EpisodeSettings<'_>,
    text: &(impl TurnText + ?Sized),
    turn: TurnEnd<'_>,
    messages: &mut Vec<Json>,
    row: RowKwargs<'_>,
) -> Result<AfterTurn, TrainError> {
    let mut after = AfterTurn {
        next: Next::Stop(Stop::Answered),
        calls: 0,
        failed_calls: 0,
        reward: None,
        interaction_error: None,
    };
    let said = text.decode(turn.tokens, false)?;
    messages.push(json!({"role": "assistant", "content": said}));
    if !turn.ended {
        after.next = Next::Stop(Stop::Length);
        return Ok(after);
    }
    let last_turn = turn.number >= s.max_turns;
    let calls = parse_turn(&said, s.format).calls;
    if calls.is_empty() && s.interaction.is_none() {
        return Ok(after); // the answer
    }
    // a turn ended by an end-of-sequence token the template does not close turns with
    // (Qwen's <|endoftext|> under ChatML) is the episode's last: the model stopped
    // writing, and no turn can follow it in the template
    let last = &turn.tokens[turn.tokens.len().saturating_sub(1)..];
    let end_of_turn = text.decode(last, true)?;
    let template_err = |err: crate::hf::chat::ChatError| TrainError::Invalid(err.to_string());
    let Some(before) = s
        .template
        .closed_turn(messages, &end_of_turn, &s.options)
        .map_err(template_err)?
    else {
        return Ok(after);
    };
    let appended: Vec<Json> = if calls.is_empty() {
        let Some(env) = s.interaction else {
            return Ok(after);
        };
        match env.respond(messages, row.interaction, turn.number) {
            Err(e) => {
                after.interaction_error = Some(e);
                return Ok(after);
            }
            Ok(reply) => {
                after.reward = Some(reply.reward);
                if reply.done {
                    return Ok(after);
                }
                if last_turn {
                    after.next = Next::Stop(Stop::MaxTurns);
                    return Ok(after);
                }
                vec![json!({"role": "user", "content": reply.content})]
            }
        }
    } else {
        if last_turn {
            after.next = Next::Stop(Stop::MaxTurns);
            return Ok(after);
        }
        calls
            .iter()
            .map(|call| {
                let r = s.toolbox.run(call, row.tools);
                after.calls += 1;
                after.failed_calls += usize::from(!r.ok);
                match call {
                    ParsedCall::Call(c) => {
                        json!({"role": "tool", "name": c.name, "content": r.content})
                    }
                    ParsedCall::Malformed { .. } => json!({"role": "tool", "content": r.content}),
                }
            })
            .collect()
    };
    let rendered = s
        .template
        .continuation_after(&before, messages, &appended, &end_of_turn, &s.options)
        .map_err(template_err)?;
    let ids = text.encode(&rendered)?;
    messages.extend(appended);
    after.next = if ids.len() >= turn.left {
        Next::Stop(Stop::Length)
    } else {
        Next::Append(ids)
    };
    Ok(after)
}

/// A recorded trace's tokens as a rollout holds them (for supervised warm starts on worked
/// multi-turn traces): each assistant message's `content` encoded and ended with `eos`
/// (the model's tokens), the messages between two assistant turns appended through the
/// template's [`ChatTemplate::tool_continuation`] as [`after_turn`] appends a tool's
/// answer (not the model's). `conversation` is the prompt's messages; `turns` starts and
/// ends with an assistant message. Returns the tokens and, per token, whether it is the
/// model's.
///
/// # Errors
/// A message without string `content`, a trace that does not start and end with the
/// assistant, the tokenizer's and the template's.
pub fn trace_tokens(
    template: &ChatTemplate,
    options: &RenderOptions<'_>,
    text: &(impl TurnText + ?Sized),
    mut conversation: Vec<Json>,
    turns: &[Json],
    eos: u32,
) -> Result<(Vec<u32>, Vec<bool>), TrainError> {
    fn role(m: &Json) -> &str {
        m.get("role").and_then(Json::as_str).unwrap_or_default()
    }
    if turns.first().map(role) != Some("assistant") || turns.last().map(role) != Some("assistant") {
        return Err(TrainError::Invalid(
            "a trace starts and ends with the assistant's turn".into(),
        ));
    }
    let end_of_turn = text.decode(&[eos], true)?;
    let (mut tokens, mut from_model) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < turns.len() {
        let turn = &turns[i];
        let content = turn.get("content").and_then(Json::as_str).ok_or_else(|| {
            TrainError::Invalid(format!("trace message {i} has no string `content`"))
        })?;
        let mut ids = text.encode(content)?;
        ids.push(eos);
        from_model.extend(std::iter::repeat_n(true, ids.len()));
        tokens.extend(ids);
        conversation.push(turn.clone());
        let next = turns[i + 1..]
            .iter()
            .position(|m| role(m) == "assistant")
            .map_or(turns.len(), |k| i + 1 + k);
        if next < turns.len() {
            let appended = &turns[i + 1..next];
            let rendered = template
                .tool_continuation(&conversation, appended, &end_of_turn, options)
                .map_err(|err| TrainError::Invalid(err.to_string()))?;
            let ids = text.encode(&rendered)?;
            from_model.extend(std::iter::repeat_n(false, ids.len()));
            tokens.extend(ids);
            conversation.extend_from_slice(appended);
        }
        i = next;
    }
    Ok((tokens, from_model))
}

/// A finished trajectory.
#[derive(Debug, Clone, PartialEq)]
pub struct Episode {
    /// The tokens after the prompt, in order.
    pub tokens: Vec<u32>,
    /// Per token: written by the model (`true`) or by the template and the tools.
    pub from_model: Vec<bool>,
    /// Model turns.
    pub turns: usize,
    /// Tool calls run, and how many of them failed (malformed, unknown tool, tool error).
    pub calls: usize,
    /// Of `calls`, those that failed.
    pub failed_calls: usize,
    /// Why it ended.
    pub stop: Stop,
    /// The interaction's score of each turn it answered.
    pub turn_scores: Vec<f64>,
    /// The interaction's failure that ended the episode, if one did.
    pub interaction_error: Option<String>,
    /// The conversation: the prompt's messages, each assistant turn (its text without
    /// special tokens) and each tool message.
    pub messages: Vec<Json>,
}

/// Runs one trajectory after `prompt_ids` (the rendering of `messages` with the
/// generation prompt), at most `max_tokens` tokens after the prompt (the model's and the
/// tools' together), each turn generated after the whole trajectory so far.
///
/// # Errors
/// `max_turns` 0, the model's errors and [`after_turn`]'s.
pub fn run_episode(
    model: &mut impl TurnModel,
    prompt_ids: &[u32],
    mut messages: Vec<Json>,
    s: &EpisodeSettings<'_>,
    max_tokens: usize,
) -> Result<Episode, TrainError> {
    if s.max_turns == 0 {
        return Err(TrainError::Invalid("max_turns must be at least 1".into()));
    }
    let mut ids = prompt_ids.to_vec();
    let mut e = Episode {
        tokens: Vec::new(),
        from_model: Vec::new(),
        turns: 0,
        calls: 0,
        failed_calls: 0,
        stop: Stop::Length,
        turn_scores: Vec::new(),
        interaction_error: None,
        messages: Vec::new(),
    };
    loop {
        let left = max_tokens.saturating_sub(e.tokens.len());
        if left == 0 {
            e.stop = Stop::Length;
            break;
        }
        let (new, ended) = model.generate(&ids, left)?;
        e.turns += 1;
        push(&mut e, &mut ids, &new, true);
        let turn = TurnEnd {
            tokens: &new,
            ended,
            number: e.turns,
            left: max_tokens.saturating_sub(e.tokens.len()),
        };
        let after = after_turn(s, model, turn, &mut messages, RowKwargs::default())?;
        e.calls += after.calls;
        e.failed_calls += after.failed_calls;
        e.turn_scores.extend(after.reward);
        e.interaction_error = after.interaction_error;
        match after.next {
            Next::Stop(why) => {
                e.stop = why;
                break;
            }
            Next::Append(tool_ids) => push(&mut e, &mut ids, &tool_ids, false),
        }
    }
    e.messages = messages;
    Ok(e)
}

fn push(e: &mut Episode, ids: &mut Vec<u32>, new: &[u32], from_model: bool) {
    e.tokens.extend_from_slice(new);
    e.from_model
        .extend(std::iter::repeat_n(from_model, new.len()));
    ids.extend_from_slice(new);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::Calculator;

    /// A scripted model over a character tokenizer: id = the char's code point, and id 0 is
    /// the end-of-turn `<|im_end|>` (a special token).
    struct Scripted {
        turns: Vec<&'static str>,
        seen: Vec<Vec<u32>>,
    }

    const EOS: u32 = 0;
    /// An end-of-sequence token the template does not close turns with.
    const OTHER_EOS: u32 = 1;

    impl TurnModel for Scripted {
        fn generate(
            &mut self,
            ids: &[u32],
            max_new: usize,
        ) -> Result<(Vec<u32>, bool), TrainError> {
            self.seen.push(ids.to_vec());
            let text = self.turns.remove(0);
            let mut new: Vec<u32> = text.chars().map(u32::from).collect();
            new.push(EOS);
            let ended = new.len() <= max_new;
            new.truncate(max_new);
            Ok((new, ended))
        }
    }

    impl TurnText for Scripted {
        fn decode(&self, ids: &[u32], special: bool) -> Result<String, TrainError> {
            Ok(ids
                .iter()
                .map(|&i| match (i, special) {
                    (EOS, true) => "<|im_end|>".to_string(),
                    (OTHER_EOS, true) => "<|endoftext|>".to_string(),
                    (EOS | OTHER_EOS, false) => String::new(),
                    (i, _) => char::from_u32(i).unwrap().to_string(),
                })
                .collect())
        }

        fn encode(&self, text: &str) -> Result<Vec<u32>, TrainError> {
            let mut out = Vec::new();
            let mut rest = text;
            while !rest.is_empty() {
                if let Some(r) = rest.strip_prefix("<|im_end|>") {
                    out.push(EOS);
                    rest = r;
                } else {
                    let c = rest.chars().next().unwrap();
                    out.push(u32::from(c));
                    rest = &rest[c.len_utf8()..];
                }
            }
            Ok(out)
        }
    }

    fn template() -> ChatTemplate {
        ChatTemplate::from_source(
            "{% for m in messages %}{% if m.role == 'tool' %}[tool {{ m.content }}]\
             {% else %}<{{ m.role }}>{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}\
             {% if add_generation_prompt %}<assistant>{% endif %}",
            Default::default(),
        )
        .unwrap()
    }

    fn toolbox() -> ToolBox {
        let mut b = ToolBox::default();
        b.add(Box::new(Calculator)).unwrap();
        b
    }

    const CALL: &str = "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*34\"}}</tool_call>";

    fn run(turns: Vec<&'static str>, max_turns: usize, max_tokens: usize) -> (Episode, Scripted) {
        run_with(turns, max_turns, max_tokens, None)
    }

    fn run_with(
        turns: Vec<&'static str>,
        max_turns: usize,
        max_tokens: usize,
        interaction: Option<&Interaction>,
    ) -> (Episode, Scripted) {
        let (t, b) = (template(), toolbox());
        let s = EpisodeSettings {
            template: &t,
            options: RenderOptions::generation(),
            format: ToolCallFormat::Hermes,
            toolbox: &b,
            max_turns,
            interaction,
        };
        let mut m = Scripted {
            turns,
            seen: Vec::new(),
        };
        let prompt = m
            .encode("<user>What is 12*34?<|im_end|>\n<assistant>")
            .unwrap();
        let messages = vec![json!({"role": "user", "content": "What is 12*34?"})];
        let e = run_episode(&mut m, &prompt, messages, &s, max_tokens).unwrap();
        (e, m)
    }

    #[test]
    fn a_call_is_answered_and_the_model_goes_on() {
        let (e, m) = run(vec![CALL, "\\boxed{408}"], 4, 1000);
        assert_eq!(
            (e.stop, e.turns, e.calls, e.failed_calls),
            (Stop::Answered, 2, 1, 0)
        );
        let text = m.decode(&e.tokens, true).unwrap();
        assert_eq!(
            text,
            format!("{CALL}<|im_end|>\n[tool 408]<assistant>\\boxed{{408}}<|im_end|>")
        );
        // token by token: the model's turns (with their end-of-turn) are its actions, the
        // template's and the tool's tokens between them are not
        let n_call = CALL.chars().count() + 1;
        let n_tool = "\n[tool 408]<assistant>".chars().count();
        let expected: Vec<bool> = std::iter::repeat_n(true, n_call)
            .chain(std::iter::repeat_n(false, n_tool))
            .chain(std::iter::repeat_n(true, "\\boxed{408}".len() + 1))
            .collect();
        assert_eq!(e.from_model, expected);
        // the second turn was generated after the whole trajectory so far
        assert_eq!(m.seen[1].len(), m.seen[0].len() + n_call + n_tool);
        assert_eq!(e.messages.len(), 4);
        assert_eq!(e.messages[2]["content"], "408");
    }

    /// A turn ended by an end-of-sequence token the template does not close turns with
    /// ends the episode — its calls are not run — instead of failing the run.
    #[test]
    fn a_turn_ended_by_another_eos_token_ends_the_episode() {
        let (t, b) = (template(), toolbox());
        let s = EpisodeSettings {
            template: &t,
            options: RenderOptions::generation(),
            format: ToolCallFormat::Hermes,
            toolbox: &b,
            max_turns: 4,
            interaction: None,
        };
        let m = Scripted {
            turns: Vec::new(),
            seen: Vec::new(),
        };
        let mut tokens: Vec<u32> = CALL.chars().map(u32::from).collect();
        tokens.push(OTHER_EOS);
        let mut messages = vec![json!({"role": "user", "content": "What is 12*34?"})];
        let turn = TurnEnd {
            tokens: &tokens,
            ended: true,
            number: 1,
            left: 1000,
        };
        let after = after_turn(&s, &m, turn, &mut messages, RowKwargs::default()).unwrap();
        assert_eq!((after.next, after.calls), (Next::Stop(Stop::Answered), 0));
        // the same call ended by the template's end of turn is run
        *tokens.last_mut().unwrap() = EOS;
        let turn = TurnEnd {
            tokens: &tokens,
            ended: true,
            number: 1,
            left: 1000,
        };
        messages.truncate(1);
        let after = after_turn(&s, &m, turn, &mut messages, RowKwargs::default()).unwrap();
        assert!(matches!(after.next, Next::Append(_)) && after.calls == 1);
    }

    /// A recorded trace gives the tokens and mask of the episode in which the model
    /// wrote its turns and the tool answered them; malformed traces are refused.
    #[test]
    fn a_trace_tokenizes_as_its_episode() {
        let (e, m) = run(vec![CALL, "\\boxed{408}"], 4, 1000);
        let (t, opts) = (template(), RenderOptions::generation());
        let prompt = vec![json!({"role": "user", "content": "What is 12*34?"})];
        let trace = &e.messages[1..];
        assert_eq!(trace[1]["role"], "tool");
        let (tokens, mask) = trace_tokens(&t, &opts, &m, prompt.clone(), trace, EOS).unwrap();
        assert_eq!((tokens, mask), (e.tokens.clone(), e.from_model.clone()));
        // one turn: its tokens and end of turn, all the model's
        let (tokens, mask) = trace_tokens(&t, &opts, &m, prompt.clone(), &trace[2..], EOS).unwrap();
        assert_eq!(tokens.len(), "\\boxed{408}".len() + 1);
        assert!(mask.iter().all(|&x| x));
        for bad in [&trace[..2], &trace[1..], &[][..]] {
            let err = trace_tokens(&t, &opts, &m, prompt.clone(), bad, EOS).unwrap_err();
            assert!(err.to_string().contains("starts and ends"), "{err}");
        }
        let no_content = [json!({"role": "assistant"})];
        let err = trace_tokens(&t, &opts, &m, prompt, &no_content, EOS).unwrap_err();
        assert!(err.to_string().contains("no string `content`"), "{err}");
    }

    #[test]
    fn failures_are_messages_and_limits_stop_the_episode() {
        // a malformed call: the model is told, and answers
        let (e, m) = run(vec!["<tool_call>{oops}</tool_call>", "4"], 4, 1000);
        assert_eq!((e.stop, e.calls, e.failed_calls), (Stop::Answered, 1, 1));
        assert!(
            m.decode(&e.tokens, true)
                .unwrap()
                .contains("[tool error: the tool call")
        );
        // the last turn allowed still calls: not run
        let (e, _) = run(vec![CALL, CALL], 2, 1000);
        assert_eq!((e.stop, e.turns, e.calls), (Stop::MaxTurns, 2, 1));
        // the budget cuts the first turn
        let (e, _) = run(vec![CALL], 4, 20);
        assert_eq!((e.stop, e.turns, e.tokens.len()), (Stop::Length, 1, 20));
        assert!(e.from_model.iter().all(|&m| m));
        // the tool turn does not fit after the call
        let (e, _) = run(vec![CALL], 4, CALL.chars().count() + 5);
        assert_eq!((e.stop, e.calls), (Stop::Length, 1));
        assert_eq!(e.tokens.len(), CALL.chars().count() + 1);
    }

    /// A program that says "no" with reward 0 until the answer is 408, then ends the
    /// episode with reward 1.
    fn judge() -> Interaction {
        Interaction::new(
            r#"sh -c 'while read -r l; do case "$l" in *408*) echo "{\"done\": true, \"reward\": 1}";; *) echo "{\"content\": \"no\", \"reward\": 0}";; esac; done'"#,
            std::time::Duration::from_secs(5),
            1,
        )
        .unwrap()
    }

    #[test]
    fn an_interaction_answers_turns_without_calls() {
        let env = judge();
        // a wrong answer, told "no" as the user; a call answered by the tool (the
        // interaction is not asked); the right answer ends the episode with reward 1
        let (e, m) = run_with(vec!["407", CALL, "408"], 4, 1000, Some(&env));
        assert_eq!(
            (e.stop, e.turns, e.calls, e.turn_scores.clone()),
            (Stop::Answered, 3, 1, vec![0.0, 1.0])
        );
        assert_eq!(e.interaction_error, None);
        let text = m.decode(&e.tokens, true).unwrap();
        assert_eq!(
            text,
            format!(
                "407<|im_end|>\n<user>no<|im_end|>\n<assistant>{CALL}<|im_end|>\n[tool 408]<assistant>408<|im_end|>"
            )
        );
        assert_eq!(e.messages[2], json!({"role": "user", "content": "no"}));
        // the user's turn is not the model's
        let n = "407".len() + 1;
        assert!(e.from_model[..n].iter().all(|&x| x));
        assert!(!e.from_model[n]);
        // the last turn allowed is scored, and ends the episode
        let (e, _) = run_with(vec!["1", "2"], 2, 1000, Some(&env));
        assert_eq!((e.stop, e.turn_scores.len()), (Stop::MaxTurns, 2));
        // a broken interaction ends the episode, named
        let broken = Interaction::new(
            "sh -c 'read -r l; exit 1'",
            std::time::Duration::from_secs(5),
            1,
        )
        .unwrap();
        let (e, _) = run_with(vec!["1", "2"], 4, 1000, Some(&broken));
        assert_eq!((e.stop, e.turns), (Stop::Answered, 1));
        assert!(e.interaction_error.unwrap().contains("closed its output"));
    }
}
