#![no_main]
//! Fuzzes chat-template compilation and rendering (`ares_model::hf::chat`): the template
//! source and the messages come from the input; rendering is bounded by the instruction
//! budget and the output cap, so any input ends, in a string or an error.

use ares_model::hf::chat::{ChatMessage, ChatTemplate, RenderOptions};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (source, rest) = text.split_once('\u{0}').unwrap_or((text, "hello"));
    let Ok(template) = ChatTemplate::from_source(source, Default::default()) else {
        return;
    };
    let messages: Vec<ChatMessage> = rest
        .split('\u{1}')
        .enumerate()
        .map(|(i, content)| {
            let role = ["system", "user", "assistant", "tool"][i % 4];
            ChatMessage::new(role, content)
        })
        .collect();
    let _ = template.render(&messages, &RenderOptions::generation());
    let _ = template.render_with_system("be brief", &messages, &RenderOptions::default());
});
