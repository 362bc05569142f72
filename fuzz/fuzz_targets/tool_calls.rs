#![no_main]
//! Fuzzes what a model's turn reaches when it calls tools: the call parser in both formats
//! and the toolbox with the exact calculator. Any text is content, calls or malformed calls
//! with a reason; any expression is a value or a message — never a panic, and no power or
//! product past the calculator's bounds is computed.

use ares_runner::tools::{Calculator, ToolBox, ToolCallFormat, calculator, parse_turn};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut toolbox = ToolBox::default();
    toolbox.add(Box::new(Calculator)).expect("one calculator");
    for format in [ToolCallFormat::Hermes, ToolCallFormat::Llama3Json] {
        let turn = parse_turn(text, format);
        for call in &turn.calls {
            let r = toolbox.run(call, None);
            assert!(r.ok || r.content.starts_with("error: "));
        }
    }
    if let Ok(v) = calculator::evaluate(text) {
        assert!(!v.is_empty());
    }
});
